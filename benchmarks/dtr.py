"""DTR (memfit.remat) against static recompute plans, side by side in one run.

    python benchmarks/dtr.py [--repeats 2] [--quick]

Budgets: the fixed bytes of the plain step (params + grads + optimizer state at its peak) plus
80 / 60 / 40 % of its activation bytes. At each budget, three ways to make the step fit:
DTR (``memfit.remat``, evicting when ``track``'s budget would be crossed), uniform checkpointing
(``checkpoint="all"``), the best static plan of a search by measurement: the static plan of
least recompute FLOPs among "recompute the first n blocks" (n = 1..L: blocks are uniform, so
which n does not change the peak) and "selective", whose measured peak fits; and memfit's
planner (``memfit.fit(budget=...)`` with offload off: per-block keep/recompute/selective and the
micro-batch, by its time model), run under the same enforced budget. For each: the measured peak (the
budget is enforced by ``track``), the FLOPs of the step over the plain step's (``FlopCounterMode``,
exact), the step time over the plain step's (timed back to back), and DTR's FLOPs as ``estimate(remat=True)``
predicts them. Every step is timed under ``memfit.track`` (the CPU budget enforcer), so its
overhead is in every row, the plain one included. A variable-length workload (batches of
varying sequence length under the longest one's 60 % budget) shows where DTR beats any static
plan: a static plan must fit the longest batch and recomputes on every batch, DTR only where
memory runs short. The DTR paper's Transformer figures are printed as the reference line.

FLOPs are torch's FLOP formulas (matmuls, convolutions, attention): a recompute of pointwise
ops, norms and softmax costs none, so "selective" shows a FLOPs ratio of 1.000 while its time
ratio shows what it reruns. On this shared 2-core CPU, time ratios are noisy (min of
``--repeats``); the FLOPs ratios are exact.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402

# a small vocabulary, so that the blocks' activations (what recompute can save) dominate
MODELS = [("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=1024, bos_token_id=0,
                        eos_token_id=0), 4, 256),
          ("llama-1b", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0), 4, 256)]
FRACTIONS = (0.8, 0.6, 0.4)
VARIABLE_LENGTHS = (256, 64, 128, 32, 192, 256)
# DTR paper (Kirisame et al., ICLR 2021), Transformer: slowdown at a budget, of a 9.9 GB baseline
PAPER = [("8 GB", 8 / 9.9, 1.12), ("6 GB", 6 / 9.9, 1.15), ("4 GB", 4 / 9.9, 1.19)]


class Setup:
    """One model, its optimizer and a runner for one setting, re-made from the same seed."""

    def __init__(self, spec, overrides):
        self.spec, self.overrides = spec, overrides
        torch.manual_seed(0)
        self.base = spec.build(seed=0, **overrides)
        self.blocks = memfit.measure.find_blocks(self.base)

    @functools.cached_property
    def reference(self):
        """A plain runner, timed back to back with each setting (``measure``)."""
        return self.runner()

    def runner(self, checkpoint=None):
        model = copy.deepcopy(self.base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        batch = self.batch(model, 8, 32)
        return memfit.fit(model, opt, batch, checkpoint=checkpoint)

    def planned(self, budget, batch):
        """memfit's planner (``fit`` with a budget), recompute only: its plan's runner, or None.

        Offload is left out: on a CPU the host and the device are one memory, so an offloaded
        byte is saved only in memfit's accounting (DTR and the static plans recompute)."""
        model = copy.deepcopy(self.base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        try:
            return memfit.fit(model, opt, self.batch(model, *batch), budget=budget,
                              offload="none", offload_optimizer=False)
        except memfit.BudgetTooSmall:
            return None

    def batch(self, model, bs, seq, seed=0):
        return self.spec.make_batch(model, bs, seq_len=seq, seed=seed)


def _timed(runner, prepared, budget=None, dtr=False):
    """One pass over ``prepared`` under ``track`` (and ``remat``): (peak, stats, seconds)."""
    peak, stats = 0, []
    start = time.perf_counter()
    for b in prepared:
        with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
            if dtr:
                with memfit.remat(model=runner.model) as s:
                    runner.run(b)
                stats.append(s.stats)
            else:
                runner.run(b)
        peak = max(peak, t.peak_bytes)
    return peak, stats, time.perf_counter() - start


def measure(runner, batches, budget=None, dtr=False, repeats=1, plain_flops=None,
            reference=None):
    """(peak bytes, FLOPs, time ratio, remat stats) over ``batches`` (steady state: one step
    first), or None when the budget is crossed. The budgeted pass runs without a FLOP counter
    (its module tracker holds tensors DTR could evict); DTR's FLOPs are ``plain_flops`` plus
    what its recomputes ran (the same torch FLOP formulas). The time ratio is the fastest of
    ``repeats`` passes over the fastest pass of the plain ``reference`` runner, each repeat
    timing the two back to back (this machine is shared: interleaving cancels slow phases)."""
    prepared = [runner.prepare(b) for b in batches]
    runner.run(prepared[0])                                   # optimizer state exists
    try:
        peak, stats, _ = _timed(runner, prepared, budget, dtr)
        if dtr:
            flops = plain_flops + sum(s.recompute_flops for s in stats)
        else:
            with FlopCounterMode(display=False) as fc:
                for b in prepared:
                    runner.run(b)
            flops = fc.get_total_flops()
        ref = [reference.prepare(b) for b in batches] if reference is not None else None
        times, plain = [], []
        for _ in range(repeats):
            times.append(_timed(runner, prepared, budget, dtr)[2])
            if ref is not None:
                plain.append(_timed(reference, ref)[2])
    except memfit.OutOfMemory:
        return None
    finally:
        runner.close()
    return peak, flops, min(times) / min(plain) if plain else 1.0, stats


def _describe(plan) -> str:
    modes = {}
    for name, mode in plan.blocks.items():
        modes[mode] = modes.get(mode, 0) + 1
    parts = [f"{n} {m}" for m, n in sorted(modes.items()) if m != "keep"] or ["keep all"]
    if plan.knobs.micro_batch_size:
        parts.append(f"micro-batch {plan.knobs.micro_batch_size}")
    return ", ".join(parts)


def static_candidates(blocks):
    return [("plain", None)] + [(f"recompute {n}/{len(blocks)}", tuple(blocks[:n]))
                                for n in range(1, len(blocks) + 1)] + [("selective", "selective")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per setting (min kept)")
    ap.add_argument("--quick", action="store_true", help="one model")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console(width=160)
    rows = []
    paper = "; ".join(f"{r:.2f}x at {g} ({f:.0%} of baseline)" for g, f, r in PAPER)
    for name, overrides, bs, seq in MODELS[:1] if args.quick else MODELS:
        setup = Setup(zoo.get(name), overrides)
        model = setup.base
        batch = setup.batch(model, bs, seq)
        with console.status(f"{name}: static plans"):
            static = {}
            for label, policy in static_candidates(setup.blocks):
                static[label] = measure(setup.runner(policy), [batch], repeats=args.repeats,
                                        reference=setup.reference)
            probe = setup.runner()
            probe.step(batch)
            with memfit.track(probe.model, probe.optimizer) as t:
                probe.run(probe.prepare(batch))
            bd = t.breakdown
            probe.close()
        plain_peak, plain_flops, _, _ = static["plain"]
        for label, res in static.items():
            rows.append({"model": name, "static_plan": label, "peak_bytes": res[0],
                         "flops_ratio": round(res[1] / plain_flops, 4),
                         "time_ratio": round(res[2], 4)})
        console.print(f"{name} static plans (peak, FLOPs ratio, time ratio): " + "; ".join(
            f"{k}: {memfit.format_bytes(v[0])}, {v[1] / plain_flops:.3f}, {v[2]:.2f}"
            for k, v in static.items()))
        fixed = bd["params"] + bd["grads"] + bd["optimizer"]
        table = Table(title=f"{name} (6 layers, width 256), batch {bs} x {seq}, AdamW, fp32: "
                      f"plain peak {memfit.format_bytes(plain_peak)}, fixed "
                      f"{memfit.format_bytes(fixed)}, activations "
                      f"{memfit.format_bytes(bd['activations'])}")
        for col in ("budget", "method", "peak", "FLOPs ratio", "predicted", "time ratio", "note"):
            table.add_column(col, justify="right")
        for frac in FRACTIONS:
            budget = fixed + int(frac * bd["activations"])
            tag = f"{frac:.0%} act ({memfit.format_bytes(budget)})"
            fits = {k: v for k, v in static.items() if v is not None and v[0] <= budget}
            best = min(fits, key=lambda k: (fits[k][1], fits[k][2])) if fits else None
            with console.status(f"{name}: DTR and the planner at {tag}"):
                dtr = measure(setup.runner(), [batch], budget, dtr=True, repeats=args.repeats,
                              plain_flops=plain_flops, reference=setup.reference)
                est = memfit.estimate(model, batch, "adamw", budget=budget, remat=True)
                planned = setup.planned(budget, (bs, seq))
                plan_note = "no plan fits" if planned is None else _describe(planned.plan)
                by_planner = None if planned is None else \
                    measure(planned, [batch], budget, repeats=args.repeats,
                            reference=setup.reference)
            pred = plain_flops + est.remat_recompute_flops
            for method, res, note in (
                    ("planner", by_planner, plan_note),
                    ("DTR", dtr, "" if dtr is None else
                     f"{dtr[3][0].evictions} evictions, {dtr[3][0].recomputes} recomputes"),
                    ("checkpoint all", static[f"recompute {len(setup.blocks)}/{len(setup.blocks)}"],
                     ""),
                    ("best static", static.get(best), best or "none fits")):
                fit = res is not None and res[0] <= budget
                row = {"model": name, "budget_fraction": frac, "budget_bytes": budget,
                       "method": method, "plan": note, "fits": fit,
                       "peak_bytes": res[0] if res else None,
                       "flops_ratio": round(res[1] / plain_flops, 4) if res else None,
                       "time_ratio": round(res[2], 4) if res else None}
                if method == "DTR":
                    row["predicted_flops_ratio"] = round(pred / plain_flops, 4)
                    row["predicted_floor_bytes"] = est.remat_floor_bytes
                rows.append(row)
                table.add_row(tag, method,
                              memfit.format_bytes(res[0]) if fit else "does not fit",
                              f"{row['flops_ratio']:.3f}" if fit else "-",
                              f"{row['predicted_flops_ratio']:.3f}" if method == "DTR" else "",
                              f"{row['time_ratio']:.2f}" if fit else "-", note)
        console.print(table)
        console.print(f"reference (DTR paper, Transformer, time ratio): {paper}")
        rows += variable_lengths(setup, bs, bd, fixed, static, console, args.repeats, name)
    path = _record.write("dtr", {"models": MODELS, "fractions": FRACTIONS,
                                 "variable_lengths": VARIABLE_LENGTHS, "repeats": args.repeats,
                                 "paper_reference": PAPER, "quick": args.quick}, rows)
    console.print(f"recorded in {path}")


def variable_lengths(setup, bs, bd, fixed, static, console, repeats, name):
    """Batches of varying length under 60 % of the longest's activations (module docstring)."""
    budget = fixed + int(0.6 * bd["activations"])
    fits = {k: v for k, v in static.items() if v is not None and v[0] <= budget}
    best = min(fits, key=lambda k: (fits[k][1], fits[k][2])) if fits else None
    full = {k: v for k, v in fits.items() if k.startswith("recompute")}   # whole blocks rerun
    best_full = min(full, key=lambda k: (full[k][1], full[k][2])) if full else None
    policies = dict(static_candidates(setup.blocks))
    model = setup.base
    batches = [setup.batch(model, bs, n, seed=i) for i, n in enumerate(VARIABLE_LENGTHS)]
    ref = dict(repeats=repeats, reference=setup.reference)
    with console.status(f"{name}: variable lengths"):
        plain = measure(setup.runner(), batches)             # FLOPs of the plain workload
        results = [("DTR", measure(setup.runner(), batches, budget, dtr=True,
                                   plain_flops=plain[1], **ref)),
                   ("checkpoint all", measure(setup.runner(tuple(setup.blocks)), batches, budget,
                                              **ref)),
                   (f"best static ({best})", measure(setup.runner(policies[best]), batches,
                                                     budget, **ref) if best else None),
                   (f"best whole-block static ({best_full})",
                    measure(setup.runner(policies[best_full]), batches, budget, **ref)
                    if best_full else None)][:3 if best_full == best else 4]
    table = Table(title=f"{name}: lengths {VARIABLE_LENGTHS} x batch {bs}, budget "
                  f"{memfit.format_bytes(budget)} (60 % of the longest's activations)")
    for col in ("method", "peak", "FLOPs ratio", "time ratio", "evicting batches"):
        table.add_column(col, justify="right")
    rows = []
    for method, res in results:
        evicting = "" if res is None or not res[3] else \
            f"{sum(s.evictions > 0 for s in res[3])}/{len(res[3])}"
        row = {"model": name, "workload": "variable-length", "method": method,
               "budget_bytes": budget, "fits": res is not None,
               "peak_bytes": res[0] if res else None,
               "flops_ratio": round(res[1] / plain[1], 4) if res else None,
               "time_ratio": round(res[2], 4) if res else None,
               "evicting_batches": evicting}
        rows.append(row)
        table.add_row(method, memfit.format_bytes(res[0]) if res else "does not fit",
                      f"{row['flops_ratio']:.3f}" if res else "-",
                      f"{row['time_ratio']:.2f}" if res else "-", evicting)
    console.print(table)
    return rows


if __name__ == "__main__":
    main()
