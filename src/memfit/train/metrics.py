"""ROC AUC and accuracy of a classifier's scores, and the run's metrics JSONL.

Note 1 (AUC by ranks). ROC AUC equals the Mann-Whitney U statistic over the positive-negative
pairs: with ``R`` the sum of the positives' ranks among all scores (ties get their average
rank), ``AUC = (R - n_pos (n_pos + 1) / 2) / (n_pos n_neg)`` (Hanley & McNeil 1982,
Radiology 143:29-36, eq. 2; https://en.wikipedia.org/wiki/Mann%E2%80%93Whitney_U_test
#Area-under-curve_(AUC)_statistic_for_ROC_curves). Ranks from ``scipy.stats.rankdata``. For K > 2
classes the AUC is the mean of the one-vs-rest AUCs of the classes present (macro).
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["roc_auc", "accuracy", "MetricsLog"]


def roc_auc(labels, scores) -> float:
    """Binary ROC AUC of ``scores`` (higher = positive) against 0/1 ``labels`` (Note 1)."""
    from scipy.stats import rankdata

    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")            # undefined with one class
    ranks = rankdata(s)                # average ranks for ties
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def macro_auc(labels, probs) -> float:
    """``roc_auc`` of class 1 for two classes; the mean one-vs-rest AUC for more."""
    labels, probs = np.asarray(labels), np.asarray(probs)
    if probs.shape[1] == 2:
        return roc_auc(labels == 1, probs[:, 1])
    aucs = [roc_auc(labels == k, probs[:, k]) for k in range(probs.shape[1])]
    aucs = [a for a in aucs if a == a]
    return float(np.mean(aucs)) if aucs else float("nan")


def accuracy(labels, probs) -> float:
    return float((np.asarray(probs).argmax(1) == np.asarray(labels)).mean())


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended and flushed as it happens."""

    def __init__(self, path: str):
        self.path = path

    def write(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Keep the records up to ``step`` (a resumed run writes the later ones again)."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
