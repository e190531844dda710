"""DTR (memfit.remat) against static recompute plans, side by side in one run.

    python benchmarks/dtr.py [--rounds 3] [--quick]

Budgets: the fixed bytes of the plain step (params + grads + optimizer state at its peak) plus
80 / 60 / 40 % of its activation bytes. At each budget, three ways to make the step fit:
DTR (``memfit.remat``, evicting when ``track``'s budget would be crossed), uniform checkpointing
(``checkpoint="all"``), the best static plan of a search by measurement: the static plan of
least recompute FLOPs among "recompute the first n blocks" (n = 1..L: blocks are uniform, so
which n does not change the peak) and "selective", whose measured peak fits; and memfit's
planner (``memfit.fit(budget=...)`` with offload off: per-block keep/recompute/selective and the
micro-batch, by its time model), run under the same enforced budget. For each: the measured peak (the
budget is enforced by ``track``), the FLOPs of the step over the plain step's (``FlopCounterMode``,
exact), the step time over the plain step's (Note 1), and DTR's FLOPs as ``estimate(remat=True)``
predicts them. Every step is timed under ``memfit.track`` (the CPU budget enforcer), so its
overhead is in every row, the plain one included. A variable-length workload (batches of
varying sequence length under the longest one's 60 % budget) shows where DTR beats any static
plan: a static plan must fit the longest batch and recomputes on every batch, DTR only where
memory runs short. The DTR paper's Transformer figures are printed as the reference line.

FLOPs are torch's FLOP formulas (matmuls, convolutions, attention): a recompute of pointwise
ops, norms and softmax costs none, so "selective" shows a FLOPs ratio of 1.000 while its time
ratio shows what it reruns. The FLOPs ratios are exact.

Note 1 (times). Every runner is built and measured (peak, FLOPs) first and kept; then all of a
model's steps are timed interleaved (benchmarks/_timing.py: every setting once per round,
balanced order, each ratio against the plain reference runner's time in the same round, median
over rounds, quartiles as the spread). The static "plain" candidate is a second plain runner:
its ratio is the control (1.00x up to the noise left on this shared 2-core machine); the
variable-length workload has its own plain reference and control over the same batches. One
torch thread: the CPU-time ratios (process CPU time per pass) leave out the waits for a core
that other jobs hold, and are the steadier figure on a loaded machine. The best static plan at
a budget is the one of least FLOPs that fits (ties: the candidates' order, plain before
selective), so it is chosen before any timing.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

# a small vocabulary, so that the blocks' activations (what recompute can save) dominate
MODELS = [("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=1024, bos_token_id=0,
                        eos_token_id=0), 4, 256),
          ("llama-1b", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0), 4, 256)]
FRACTIONS = (0.8, 0.6, 0.4)
QUICK_FRACTIONS = (0.6,)
QUICK_SCALE = 2                      # --quick: sequences (and the variable lengths) halved
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


def _pass(runner, prepared, budget=None, dtr=False):
    """One pass over ``prepared`` under ``track`` (and ``remat``): (peak, remat stats)."""
    peak, stats = 0, []
    for b in prepared:
        with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
            if dtr:
                with memfit.remat(model=runner.model) as s:
                    runner.run(b)
                stats.append(s.stats)
            else:
                runner.run(b)
        peak = max(peak, t.peak_bytes)
    return peak, stats


@dataclass
class Measured:
    """A setting's peak and FLOPs over its batches, and its pass, kept for the timing (Note 1)."""

    peak: int
    flops: int
    stats: list
    runner: object
    step: object = field(repr=False)             # () -> None: one pass, as measured
    time_ratio: float | None = None              # filled in after the interleaved timing
    cpu_time_ratio: float | None = None          # the same from process CPU time


class Bench:
    """Every runner of one model, kept open until its steps are timed together (Note 1)."""

    def __init__(self):
        self.steps: dict[str, Measured] = {}

    def measure(self, label, runner, batches, budget=None, dtr=False, plain_flops=None):
        """Peak and FLOPs over ``batches`` (steady state: one step first), or None when the
        budget is crossed. The budgeted pass runs without a FLOP counter (its module tracker
        holds tensors DTR could evict); DTR's FLOPs are ``plain_flops`` plus what its
        recomputes ran (the same torch FLOP formulas)."""
        prepared = [runner.prepare(b) for b in batches]
        runner.run(prepared[0])                               # optimizer state exists
        try:
            peak, stats = _pass(runner, prepared, budget, dtr)
        except memfit.OutOfMemory:
            runner.close()
            return None
        if dtr:
            flops = plain_flops + sum(s.recompute_flops for s in stats)
        else:
            with FlopCounterMode(display=False) as fc:
                for b in prepared:
                    runner.run(b)
            flops = fc.get_total_flops()
        m = Measured(peak, flops, stats, runner, lambda: _pass(runner, prepared, budget, dtr))
        self.steps[label] = m
        return m

    def time(self, rounds, console, name, against: dict[str, str]):
        """Time every kept step interleaved; each one's ratio against its workload's plain
        reference (``against``: label -> reference label; default the single-batch one)."""
        steps = {k: m.step for k, m in self.steps.items()}
        with console.status(f"{name}: timing {len(steps)} settings interleaved") as status:
            timings = interleave(steps, rounds, "reference", warmup=1,
                                 on_round=lambda r, n: status.update(
                                     f"{name}: timing {len(steps)} settings, round {r + 1}/{n}"))
        for label, m in self.steps.items():
            m.time_ratio = timings.ratio(label, against.get(label)).median
            m.cpu_time_ratio = timings.ratio(label, against.get(label), "cpu").median
            m.runner.close()
        return timings


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


def best_fitting(static: dict, budget: int, prefix: str = "") -> str | None:
    """The static plan of least FLOPs whose peak fits (ties: candidate order; Note 1)."""
    order = list(static)
    fits = [k for k, v in static.items() if v is not None and v.peak <= budget
            and k.startswith(prefix)]
    return min(fits, key=lambda k: (static[k].flops, order.index(k))) if fits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds, one pass per setting each (default 3, "
                         "--quick 2)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one model, sequences / {QUICK_SCALE}, budget {100 * QUICK_FRACTIONS[0]:.0f}%% "
                         "of the activations only, 2 rounds")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    if rounds < 1:
        ap.error(f"--rounds {rounds}: needs at least 1")
    torch.set_num_threads(1)
    console = Console(width=160)
    rows, timing = [], []
    models = [(n, o, b, s // QUICK_SCALE) for n, o, b, s in MODELS[:1]] if args.quick else MODELS
    lengths = tuple(n // QUICK_SCALE for n in VARIABLE_LENGTHS) if args.quick \
        else VARIABLE_LENGTHS
    for name, overrides, bs, seq in models:
        r, t = run_model(name, overrides, bs, seq, rounds, console,
                         QUICK_FRACTIONS if args.quick else FRACTIONS, lengths)
        rows += r
        timing.append(t)
    path = _record.write("dtr" + ("-quick" if args.quick else ""),
                         {"models": models,
                          "fractions": QUICK_FRACTIONS if args.quick else FRACTIONS,
                          "variable_lengths": lengths,
                          "rounds": rounds, "paper_reference": PAPER, "quick": args.quick,
                          "timing": timing, "machine_note": _record.SHARED_MACHINE_NOTE}, rows)
    console.print(f"recorded in {path}")


def run_model(name, overrides, bs, seq, rounds, console, fractions, lengths):
    setup = Setup(zoo.get(name), overrides)
    model, bench = setup.base, Bench()
    batch = setup.batch(model, bs, seq)
    with console.status(f"{name}: static plans"):
        bench.measure("reference", setup.runner(), [batch])
        static = {label: bench.measure(CONTROL if label == "plain" else f"static {label}",
                                       setup.runner(policy), [batch])
                  for label, policy in static_candidates(setup.blocks)}
        probe = setup.runner()
        probe.step(batch)
        with memfit.track(probe.model, probe.optimizer) as t:
            probe.run(probe.prepare(batch))
        bd = t.breakdown
        probe.close()
    plain_peak, plain_flops = static["plain"].peak, static["plain"].flops
    fixed = bd["params"] + bd["grads"] + bd["optimizer"]
    budgets = []
    for frac in fractions:
        budget = fixed + int(frac * bd["activations"])
        tag = f"{frac:.0%} act ({memfit.format_bytes(budget)})"
        with console.status(f"{name}: DTR and the planner at {tag}"):
            dtr = bench.measure(f"DTR {frac}", setup.runner(), [batch], budget, dtr=True,
                                plain_flops=plain_flops)
            est = memfit.estimate(model, batch, "adamw", budget=budget, remat=True)
            planned = setup.planned(budget, (bs, seq))
            plan_note = "no plan fits" if planned is None else _describe(planned.plan)
            by_planner = None if planned is None else \
                bench.measure(f"planner {frac}", planned, [batch], budget)
        budgets.append((frac, budget, tag, dtr, est, plan_note, by_planner))
    variable = variable_lengths(setup, bench, bs, bd, fixed, static, console, name, lengths)
    against = {k: "variable reference" for k in bench.steps if k.startswith("variable")}
    timings = bench.time(rounds, console, name, against)

    rows = []
    for label, res in static.items():
        rows.append({"model": name, "static_plan": label, "peak_bytes": res.peak,
                     "flops_ratio": round(res.flops / plain_flops, 4),
                     **timings.row(CONTROL if label == "plain" else f"static {label}")})
    console.print(f"{name} static plans (peak, FLOPs ratio, time ratio): " + "; ".join(
        f"{k}: {memfit.format_bytes(v.peak)}, {v.flops / plain_flops:.3f}, {v.time_ratio:.2f}"
        for k, v in static.items()))
    console.print(f"control (a second plain runner vs the reference): {timings.ratio(CONTROL)} "
                  f"wall, {timings.ratio(CONTROL, clock='cpu')} CPU time; variable-length "
                  f"control: {timings.ratio('variable control', 'variable reference')} wall, "
                  f"{timings.ratio('variable control', 'variable reference', 'cpu')} CPU time")
    table = Table(title=f"{name} (6 layers, width 256), batch {bs} x {seq}, AdamW, fp32: "
                  f"plain peak {memfit.format_bytes(plain_peak)}, fixed "
                  f"{memfit.format_bytes(fixed)}, activations "
                  f"{memfit.format_bytes(bd['activations'])}; time: median of {rounds} "
                  "interleaved rounds")
    for col in ("budget", "method", "peak", "FLOPs ratio", "predicted", "time ratio",
                "CPU-time ratio", "note"):
        table.add_column(col, justify="right")
    paper = "; ".join(f"{r:.2f}x at {g} ({f:.0%} of baseline)" for g, f, r in PAPER)
    every = f"recompute {len(setup.blocks)}/{len(setup.blocks)}"
    for frac, budget, tag, dtr, est, plan_note, by_planner in budgets:
        best = best_fitting(static, budget)
        pred = plain_flops + est.remat_recompute_flops
        for method, res, note in (
                ("planner", by_planner, plan_note),
                ("DTR", dtr, "" if dtr is None else
                 f"{dtr.stats[0].evictions} evictions, {dtr.stats[0].recomputes} recomputes"),
                ("checkpoint all", static[every], ""),
                ("best static", static.get(best), best or "none fits")):
            fit = res is not None and res.peak <= budget
            row = {"model": name, "budget_fraction": frac, "budget_bytes": budget,
                   "method": method, "plan": note, "fits": fit,
                   "peak_bytes": res.peak if res else None,
                   "flops_ratio": round(res.flops / plain_flops, 4) if res else None,
                   "time_ratio": round(res.time_ratio, 4) if res else None,
                   "cpu_time_ratio": round(res.cpu_time_ratio, 4) if res else None}
            if method == "DTR":
                row["predicted_flops_ratio"] = round(pred / plain_flops, 4)
                row["predicted_floor_bytes"] = est.remat_floor_bytes
            rows.append(row)
            table.add_row(tag, method,
                          memfit.format_bytes(res.peak) if fit else "does not fit",
                          f"{row['flops_ratio']:.3f}" if fit else "-",
                          f"{row['predicted_flops_ratio']:.3f}" if method == "DTR" else "",
                          f"{row['time_ratio']:.2f}" if fit else "-",
                          f"{row['cpu_time_ratio']:.2f}" if fit else "-", note)
    console.print(table)
    console.print(f"reference (DTR paper, Transformer, time ratio): {paper}")
    rows += variable_rows(variable, console, name, bs, lengths)
    return rows, {"model": name, **timings.summary(),
                  "variable_control": timings.ratio("variable control",
                                                    "variable reference").to_dict()}


def variable_lengths(setup, bench, bs, bd, fixed, static, console, name, lengths):
    """Batches of varying length under 60 % of the longest's activations (module docstring):
    the runners measured and kept in ``bench``; (budget, plain FLOPs, [(method, Measured)])."""
    budget = fixed + int(0.6 * bd["activations"])
    best = best_fitting(static, budget)
    best_full = best_fitting(static, budget, prefix="recompute")    # whole blocks rerun
    policies = dict(static_candidates(setup.blocks))
    batches = [setup.batch(setup.base, bs, n, seed=i) for i, n in enumerate(lengths)]
    with console.status(f"{name}: variable lengths"):
        bench.measure("variable reference", setup.runner(), batches)
        plain = bench.measure("variable control", setup.runner(), batches)
        results = [("DTR", bench.measure("variable DTR", setup.runner(), batches, budget,
                                         dtr=True, plain_flops=plain.flops)),
                   ("checkpoint all", bench.measure("variable checkpoint all",
                                                    setup.runner(tuple(setup.blocks)), batches,
                                                    budget))]
        if best:
            results.append((f"best static ({best})", bench.measure(
                "variable best static", setup.runner(policies[best]), batches, budget)))
        if best_full and best_full != best:
            results.append((f"best whole-block static ({best_full})", bench.measure(
                "variable best whole-block", setup.runner(policies[best_full]), batches,
                budget)))
    return budget, plain.flops, results


def variable_rows(variable, console, name, bs, lengths):
    budget, plain_flops, results = variable
    table = Table(title=f"{name}: lengths {lengths} x batch {bs}, budget "
                  f"{memfit.format_bytes(budget)} (60 % of the longest's activations)")
    for col in ("method", "peak", "FLOPs ratio", "time ratio", "CPU-time ratio",
                "evicting batches"):
        table.add_column(col, justify="right")
    rows = []
    for method, res in results:
        evicting = "" if res is None or not res.stats else \
            f"{sum(s.evictions > 0 for s in res.stats)}/{len(res.stats)}"
        row = {"model": name, "workload": "variable-length", "method": method,
               "budget_bytes": budget, "fits": res is not None,
               "peak_bytes": res.peak if res else None,
               "flops_ratio": round(res.flops / plain_flops, 4) if res else None,
               "time_ratio": round(res.time_ratio, 4) if res else None,
               "cpu_time_ratio": round(res.cpu_time_ratio, 4) if res else None,
               "evicting_batches": evicting}
        rows.append(row)
        table.add_row(method, memfit.format_bytes(res.peak) if res else "does not fit",
                      f"{row['flops_ratio']:.3f}" if res else "-",
                      f"{row['time_ratio']:.2f}" if res else "-",
                      f"{row['cpu_time_ratio']:.2f}" if res else "-", evicting)
    console.print(table)
    return rows


if __name__ == "__main__":
    main()
