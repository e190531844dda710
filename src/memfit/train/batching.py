"""Length-grouped batches with dynamic padding, in an order that is a pure function of the epoch.

Note 1 (grouping). Each epoch the rows are shuffled with ``(seed, epoch)``, cut into windows of
``group`` batches, sorted by length inside each window, cut into batches, and the batches are
shuffled again: batches hold rows of similar length (little padding) while the order stays
random. Each batch is padded to its own longest row (dynamic padding), so most batches are
shorter than ``max_len``.

Note 2 (the data position). The order depends only on ``(seed, epoch)``, so where a run is is
two integers: the epoch and the number of its batches done. A resumed run rebuilds the epoch's
order and skips that many batches; no sampler state is saved.

Note 3 (the longest batch). ``longest`` is the batch with the most tokens after padding (rows x
its length) over every epoch's order: the plan is made for it (fit's ``max_seq_len`` extends the
example to it), so every shorter batch fits. The full batch of ``max_len`` rows is the bound
whatever the order, and it is what is planned for when ``plan_for="max"``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["epoch_batches", "collate", "longest_length"]


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int,
                  group: int = 50) -> list[list[int]]:
    """The row indices of each batch of ``epoch``, in order (Note 1). The last batch may be
    smaller; a batch of one row is kept (the loss is a mean over samples)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    window = batch_size * group
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window].tolist(), key=lambda i: (lengths[i], i))
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


def collate(ids: list[list[int]], labels: list[int], rows: list[int],
            pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` right-padded to the batch's longest row, ``attention_mask``, ``labels``."""
    length = max(len(ids[i]) for i in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, i in enumerate(rows):
        n = len(ids[i])
        input_ids[r, :n] = torch.tensor(ids[i], dtype=torch.long)
        mask[r, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask,
            "labels": torch.tensor([labels[i] for i in rows], dtype=torch.long)}


def longest_length(ids: list[list[int]]) -> int:
    return max(len(x) for x in ids)
