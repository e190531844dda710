"""memfit's estimate and plan against PyTorch's own estimator, side by side in one run.

    python benchmarks/speed.py [--plan] [--no-memtracker-7b]

PyTorch's estimator is ``torch.distributed._tools.mem_tracker.MemTracker`` under
``FakeTensorMode``, run as its tutorial runs it: the model built under the fake mode, AdamW
(foreach), two iterations of forward, backward, ``step`` and ``zero_grad``, the statistics
reset after the first. memfit traces the same step for a GPU target (its CUDA models and the
caching-allocator replay included), composed from two shallow twins where the model has 16
alike blocks or more (docs/block-reuse.md), and traced whole with ``compose_blocks=False``.

Rows (each timed in this process, CPU seconds by ``time.process_time``, as the machine is
shared):

- XLM-RoBERTa-large, 8 x 256, GTX 1080 Ti (the README's model): MemTracker, memfit composed,
  memfit whole;
- Llama-2-7B, 1 x 512, bf16, A100 80GB: the same three;
- a Llama-2-70B config (80 blocks), 1 x 512, bf16, A100 80GB: memfit composed, beside the 7B;
- ``--lora``: Llama-2-7B under peft's LoRA (rank 16, every linear layer), 1 x 1024, bf16,
  RTX 4090: memfit composed and whole (LoRA steps compose since session 20);
- ``--plan``: ``memfit.plan`` of the README default (XLM-R large, batch 32 x 256, GTX 1080 Ti,
  precision "auto" as ``memfit`` runs it), and of the same job with the precision as given
  (the Python default: fp32, no low-bit state), beside MemTracker's time for one step of that
  batch;
- ``--fronts``: for Llama-2-7B (1 x 512, A100 80GB, precision auto), ``memfit plan --floor``
  (``plan(floor=True)``), ``--what-if`` (``studies.what_if``: seven estimates) and
  ``--compare-gpus`` (``compare_gpus``), each beside MemTracker's 7B step of the same run,
  each in an empty cache of its own, as the CLI runs them cold (the CLI keeps its traces in
  memfit's cache; within one run a twin traced once serves every depth,
  docs/block-reuse.md).

Issue 29's targets are printed beside each ratio; nothing here is a GPU measurement.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time

import torch
import transformers
from rich.console import Console
from rich.table import Table

import _record
import memfit
from memfit import zoo
from memfit._cache import Cache
from memfit._trace_cache_scope import using

_LLAMA_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  max_position_embeddings=4096)


def _cpu_seconds(fn):
    gc.collect()
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def memtracker_seconds(build_model, make_batch) -> tuple[float, int]:
    """(CPU seconds, peak bytes) of MemTracker's two tracked iterations, the model and batch
    built under the same fake mode first (not timed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = build_model()
        batch = make_batch(model)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        tracker = MemTracker()
        tracker.track_external(model, opt)

        def run():
            with tracker:
                for i in range(2):
                    model(**batch).loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if i == 0:
                        tracker.reset_mod_stats()
        _, seconds = _cpu_seconds(run)
        peak = tracker.get_tracker_snapshot("peak")
        total = sum(v.get("Total", 0) for v in peak.values())
    return seconds, total


def _zoo_job(name: str, batch: int, seq: int):
    spec = zoo.get(name)
    model = spec.build(device="meta")
    return spec, model, spec.make_batch(model, batch, seq_len=seq)


def _estimate_row(label: str, model, batch, device: str, memtracker=None, **knobs) -> dict:
    composed, c_s = _cpu_seconds(lambda: memfit.estimate(memfit.Job(model, batch), device=device,
                                                          **knobs))
    whole, w_s = _cpu_seconds(lambda: memfit.estimate(memfit.Job(model, batch), device=device,
                                                      compose_blocks=False, **knobs))
    row = {"job": label, "traced_as": composed.traced_as,
           "memfit_composed_cpu_s": round(c_s, 2), "memfit_whole_cpu_s": round(w_s, 2),
           "composed_equals_whole": all(getattr(composed, f) == getattr(whole, f) for f in
                                        ("peak_bytes", "reserved_bytes", "device_bytes",
                                         "breakdown", "timeline")),
           "device_bytes": composed.device_bytes}
    if memtracker is not None:
        mt_s, mt_peak = memtracker()
        row.update(memtracker_cpu_s=round(mt_s, 2), memtracker_peak_bytes=mt_peak,
                   composed_over_memtracker=round(c_s / mt_s, 3),
                   whole_over_memtracker=round(w_s / mt_s, 3))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true",
                    help="also time memfit.plan of the README default (about 2 minutes)")
    ap.add_argument("--fronts", action="store_true",
                    help="also time the floor, what-if and compare-gpus of Llama-2-7B (about "
                         "10 minutes)")
    ap.add_argument("--lora", action="store_true",
                    help="also time Llama-2-7B under LoRA, composed and whole (about a minute)")
    ap.add_argument("--no-memtracker-7b", action="store_true",
                    help="skip MemTracker on Llama-2-7B (a few minutes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console()
    rows = []
    # the process's one-time costs (imports, dispatch caches) paid before the first timed row,
    # which would carry them alone
    tiny = zoo.get("gpt2").build(tiny=True, device="meta")
    memfit.estimate(memfit.Job(tiny, zoo.get("gpt2").make_batch(tiny, 2)), device="gtx-1080-ti")

    spec, model, batch = _zoo_job("xlm-roberta-large", 8, 256)
    rows.append(_estimate_row(
        "estimate xlm-roberta-large 8x256 gtx-1080-ti", model, batch, "gtx-1080-ti",
        memtracker=lambda: memtracker_seconds(lambda: spec.build(device="cpu"),
                                              lambda m: spec.make_batch(m, 8, seq_len=256))))
    console.print(rows[-1])

    spec7, model7, batch7 = _zoo_job("llama-7b", 1, 512)
    mt7 = None if args.no_memtracker_7b else (
        lambda: memtracker_seconds(lambda: spec7.build(device="cpu"),
                                   lambda m: spec7.make_batch(m, 1, seq_len=512)))
    rows.append(_estimate_row("estimate llama-2-7b 1x512 bf16 a100-80gb", model7, batch7,
                              "a100-80gb", memtracker=mt7, precision="bf16"))
    console.print(rows[-1])

    with torch.device("meta"):
        model70 = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA_70B))
    batch70 = spec7.make_batch(model70, 1, seq_len=512)
    est70, s70 = _cpu_seconds(lambda: memfit.estimate(memfit.Job(model70, batch70),
                                                      device="a100-80gb",
                                                      precision="bf16"))
    rows.append({"job": "estimate llama-2-70b config (80 blocks) 1x512 bf16 a100-80gb",
                 "traced_as": est70.traced_as, "memfit_composed_cpu_s": round(s70, 2),
                 "over_7b_composed": round(s70 / rows[1]["memfit_composed_cpu_s"], 2),
                 "device_bytes": est70.device_bytes})
    console.print(rows[-1])

    if args.lora:
        import peft

        lora = peft.get_peft_model(spec7.build(device="meta"), peft.LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type=peft.TaskType.CAUSAL_LM))
        rows.append(_estimate_row(
            "estimate llama-2-7b LoRA r16 (peft, every linear) 1x1024 bf16 rtx-4090", lora,
            spec7.make_batch(lora.get_base_model(), 1, seq_len=1024), "rtx-4090",
            precision="bf16"))
        console.print(rows[-1])

    if args.plan:
        big = spec.make_batch(model, 32, seq_len=256)
        mt_s, _ = memtracker_seconds(lambda: spec.build(device="cpu"),
                                     lambda m: spec.make_batch(m, 32, seq_len=256))
        # the README's `memfit` plans under precision "auto" (the CLI's default: fp16, fp32
        # and the low-bit states weighed); the Python default keeps the precision as given
        for label, knobs in (("plan README default, precision auto (xlm-roberta-large "
                              "32x256 gtx-1080-ti)", dict(precision="auto")),
                             ("plan README job, precision as given (fp32)", {})):
            planned, p_s = _cpu_seconds(lambda: memfit.plan(memfit.Job(model, big),
                                                            device="gtx-1080-ti",
                                                            **knobs))
            rows.append({"job": label, "memfit_plan_cpu_s": round(p_s, 2),
                         "memtracker_cpu_s": round(mt_s, 2),
                         "plan_over_memtracker": round(p_s / mt_s, 3),
                         "target": "plan <= 0.25x",
                         "device_bytes": planned.predicted_device_bytes})
            console.print(rows[-1])

    if args.fronts:
        rows += _front_rows(spec7, model7, batch7, rows[1].get("memtracker_cpu_s"), console)

    table = Table(title="memfit vs MemTracker (CPU seconds, one process)")
    for col in ("job", "memfit composed", "memfit whole", "MemTracker", "ratio", "target"):
        table.add_column(col)
    targets = {0: "estimate <= 0.1x", 1: "", 2: "about the 7B's time"}
    for i, r in enumerate(rows):
        ratio = r.get("composed_over_memtracker", r.get("over_7b_composed",
                                                          r.get("plan_over_memtracker")))
        table.add_row(r["job"], str(r.get("memfit_composed_cpu_s", r.get("memfit_plan_cpu_s"))),
                      str(r.get("memfit_whole_cpu_s", "")), str(r.get("memtracker_cpu_s", "")),
                      f"{ratio}x" if ratio is not None else "",
                      r.get("target", targets.get(i, "")))
    console.print(table)
    path = _record.write("speed", {"torch_threads": 1, "plan": args.plan, "fronts": args.fronts,
                                   "lora": args.lora,
                                   "memtracker_7b": not args.no_memtracker_7b}, rows)
    console.print(f"recorded in {path}")


def _front_rows(spec, model, batch, memtracker_s: float | None, console) -> list[dict]:
    """The floor, what-if and compare-gpus of Llama-2-7B, each beside MemTracker's 7B step."""
    from memfit.api._compare_gpus import compare_gpus
    from memfit.studies import what_if

    jobs = [
        ("plan --floor llama-2-7b 1x512 a100-80gb",
         lambda: memfit.plan(memfit.Job(model, batch), device="a100-80gb", precision="auto",
                             floor=True)),
        ("plan --what-if llama-2-7b 1x512 bf16 a100-80gb (7 estimates)",
         lambda: what_if(spec, batch_size=1, seq_len=512, device="a100-80gb",
                         precision="bf16")),
        ("plan --compare-gpus llama-2-7b 1x512 (every GPU of the table)",
         lambda: compare_gpus(model, batch, "adamw", precision="auto")),
    ]
    rows = []
    for label, job in jobs:
        with tempfile.TemporaryDirectory() as folder, using(Cache(folder)):   # cold, as the
            _, seconds = _cpu_seconds(job)                                  # CLI runs it
        row = {"job": label, "memfit_plan_cpu_s": round(seconds, 2), "target": "<= 0.5x"}
        if memtracker_s:
            row.update(memtracker_cpu_s=memtracker_s,
                       plan_over_memtracker=round(seconds / memtracker_s, 3))
        rows.append(row)
        console.print(row)
    return rows


if __name__ == "__main__":
    main()
