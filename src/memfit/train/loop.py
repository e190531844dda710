"""``train``: the run itself: planned steps over length-grouped batches, evaluation, checkpoints.

Note 1 (order of a step). For each effective batch: ``runner.step`` (micro-batches, AMP and loss
scaling, clipping, the optimizer and LR scheduler steps, the OOM guard), then the metrics line, then
evaluation and a checkpoint when due. The data position saved is the batch after the one just
trained (the order is a function of ``(seed, epoch)``, so the epoch and the batches done place a
run), and the RNG states are read after the step (a resume restores them right before the next
step), so a run stopped after step k and resumed takes step k+1 exactly as an uninterrupted run.

Note 2 (Ctrl-C). While steps run, SIGINT only sets a flag: the step in flight finishes (an
optimizer step cut in half would leave the parameters half updated), a checkpoint is written,
the metrics and plots are flushed, and ``train`` returns with ``interrupted=True``. A second
Ctrl-C stops at once (the default handler is back); the checkpoints already written stay.

Note 3 (progressive length). With ``progressive=(L, f)`` the first ``f`` of the steps see rows
cut to ``L`` tokens (the seed's "90% of the steps at a shorter length"), the rest the full
rows. The plan is made for the full length, so both phases fit.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from memfit.train import checkpoint as ckpt
from memfit.train._memory import StepMemoryMeter
from memfit.train.batching import collate, epoch_batches
from memfit.train.config import TrainConfig
from memfit.train.metrics import MetricsLog, accuracy, macro_auc
from memfit.train.setup import Prepared, prepare, total_steps, write_run_files

__all__ = ["train", "RunResult", "evaluate"]


@dataclass
class RunResult:
    folder: str
    steps: int                     # steps done in all (a resumed run counts the earlier ones)
    interrupted: bool
    last_loss: float | None
    eval: dict | None              # the last evaluation
    checkpoint: str | None         # the last checkpoint written
    peak_bytes: int | None         # highest measured step peak
    predicted_peak_bytes: int | None


class _Interrupt:
    """Note 2: SIGINT sets ``requested`` while installed (main thread only)."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)   # a second one stops at once

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def evaluate(p: Prepared) -> dict:
    """Loss, ROC AUC and accuracy on the evaluation rows, in eval mode under the plan's
    precision (no gradients, no dropout: the RNG is not touched)."""
    runner, model = p.runner, p.runner.model
    order = sorted(range(len(p.eval_ids)), key=lambda i: len(p.eval_ids[i]))
    size = runner.plan.knobs.micro_batch_size or p.cfg.batch_size
    device = next(model.parameters()).device
    probs, losses, n = [], 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), size):
                rows = order[start:start + size]
                batch = {k: v.to(device) for k, v in
                         collate(p.eval_ids, p.eval.labels, rows, p.encoder.pad_id).items()}
                with runner.precision.autocast(device.type):
                    out = model(**batch)
                losses += float(out.loss.float()) * len(rows)
                n += len(rows)
                probs.append(torch.softmax(out.logits.float(), -1).cpu())
    finally:
        model.train()
    pr = torch.cat(probs).numpy()
    labels = [p.eval.labels[i] for i in order]
    return {"eval_loss": losses / n, "eval_auc": macro_auc(labels, pr),
            "eval_accuracy": accuracy(labels, pr), "eval_rows": n}


def _state(p: Prepared, step: int, epoch: int, done: int, tokens: int) -> dict:
    r = p.runner
    return {"format": 1, "step": step, "epoch": epoch, "batch_in_epoch": done, "tokens": tokens,
            "model": r.model.state_dict(), "optimizer": r.optimizer.state_dict(),
            "scheduler": r.scheduler.state_dict(),
            "scaler": r.scaler.state_dict() if r.scaler is not None else None,
            "rng": ckpt.rng_state(), "plan": r.plan.to_json(), "identity": p.identity,
            "config": p.cfg.to_json()}


def train(cfg: TrainConfig, *, resume: str | None = None, say=print, progress=None,
          on_step=None) -> RunResult:
    """Run ``cfg`` (or continue the run at ``resume``). ``say(text)`` hears the run's messages,
    ``progress`` is a ``memfit.train.progress.Bar`` (or None), ``on_step(step, record)`` is
    called after each step's metrics line (tests stop a run there)."""
    p = prepare(cfg, resume=resume, say=say)
    write_run_files(p)
    say(p.runner.plan.explain())
    log = MetricsLog(os.path.join(cfg.output, "metrics.jsonl"))
    state = p.state
    step, epoch, done, tokens = 0, 0, 0, 0
    if state is not None:
        step, epoch, done, tokens = (state["step"], state["epoch"], state["batch_in_epoch"],
                                     state["tokens"])
        log.truncate_after(step)
        ckpt.set_rng_state(state["rng"])
        say(f"resumed at step {step} (epoch {epoch + 1}, batch {done})")
    else:
        log.truncate_after(-1)
    total = total_steps(cfg, len(p.train_ids))
    short = _short_ids(p) if cfg.progressive else None
    short_steps = math.floor(cfg.progressive[1] * total) if cfg.progressive else 0
    meter = StepMemoryMeter(p.runner.model, p.runner.optimizer, cfg.measure_steps)
    lengths = [len(x) for x in p.train_ids]
    device = next(p.runner.model.parameters()).device
    last_loss, last_eval, last_ckpt = None, None, None
    interrupted = False
    if progress is not None:
        progress.start(total, step)
    with _Interrupt() as stop:
        while step < total and not stop.requested:
            batches = epoch_batches(lengths, cfg.batch_size, cfg.seed, epoch)
            while done < len(batches) and step < total and not stop.requested:
                ids = short if step < short_steps else p.train_ids
                batch = {k: v.to(device) for k, v in
                         collate(ids, p.train.labels, batches[done], p.encoder.pad_id).items()}
                lr = p.runner.optimizer.param_groups[0]["lr"]     # this step's
                start = time.perf_counter()
                meter.begin()
                try:
                    last_loss = p.runner.step(batch)
                except BaseException:
                    meter.abort()
                    raise
                meter.end()
                seconds = time.perf_counter() - start
                step, done = step + 1, done + 1
                n_tokens = int(batch["attention_mask"].sum())
                tokens += n_tokens
                info = p.runner.last_step
                record = {"kind": "train", "step": step, "epoch": epoch + done / len(batches),
                          "loss": last_loss, "lr": lr,
                          "seq_len": int(batch["input_ids"].shape[1]), "tokens": tokens,
                          "tokens_per_s": n_tokens / seconds, "skipped": info.skipped,
                          "loss_scale": info.loss_scale, "micro_batches": info.micro_batches,
                          "peak_bytes": meter.peak_bytes,
                          "predicted_peak_bytes": p.predicted_peak_bytes,
                          "budget_bytes": p.budget_bytes}
                log.write(record)
                if progress is not None:
                    progress.update(record)
                if on_step is not None:
                    on_step(step, record)
                position = (epoch, done) if done < len(batches) else (epoch + 1, 0)
                if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                    last_eval = _eval(p, log, step, say)
                if cfg.save_every and step % cfg.save_every == 0 and step < total:
                    last_ckpt = ckpt.save(cfg.output, step, _state(p, step, *position, tokens),
                                          cfg.keep_checkpoints)
            if done >= len(batches):
                epoch, done = epoch + 1, 0
        interrupted = stop.requested and step < total
    meter.abort()
    if progress is not None:
        progress.stop()
    if interrupted:
        say(f"interrupted: saving a checkpoint at step {step}")
    else:
        last_eval = _eval(p, log, step, say)
    last_ckpt = ckpt.save(cfg.output, step, _state(p, step, epoch, done, tokens),
                          cfg.keep_checkpoints)
    from memfit.train.plots import plot_run

    plot_run(log.read(), cfg.output, f"{cfg.model}{' (tiny)' if cfg.tiny else ''}: "
                                     f"batch {cfg.batch_size}, {p.runner.plan.knobs.precision}")
    meter.release()
    return RunResult(cfg.output, step, interrupted, last_loss, last_eval, last_ckpt,
                     meter.peak_bytes, p.predicted_peak_bytes)


def _eval(p: Prepared, log: MetricsLog, step: int, say) -> dict:
    result = evaluate(p)
    log.write({"kind": "eval", "step": step, **result})
    say(f"step {step}: eval loss {result['eval_loss']:.4f}, ROC AUC {result['eval_auc']:.4f}, "
        f"accuracy {result['eval_accuracy']:.4f} ({result['eval_rows']} rows)")
    return result


def _short_ids(p: Prepared) -> list[list[int]]:
    """Rows cut to the progressive length, ``</s>`` kept last (Note 3)."""
    length = p.cfg.progressive[0]
    return [x if len(x) <= length else x[:length - 1] + x[-1:] for x in p.train_ids]
