"""memfit's plan against the recipes people use today, at each budget, side by side in one run
on CPU (issue 6). The GPU part is ``planner_check`` in benchmarks/gpu_check.py.

    python benchmarks/planner_vs_recipes.py [--quick] [--json] [--rounds 5] [--no-compile]

Wall time on the shared 2-core CPU box (load 3-5): full ~11 min (compiles cached: inductor's
cold compiles add ~1 min per level), --quick ~4 min (with issue 15's levers, at load ~8: 37
min for --quick --no-compile). Step times there swing 2-5x from other
jobs; interleaving (Note 2) shares that noise but medians of 5 still move by ~10-20 %.

Budgets: the plain fp32 step's peak x 1.0 / 0.75 / 0.5 / 0.3, and memfit's floor + 10 % (the
floor: ``BudgetTooSmall.floor_bytes`` of a plan at a 1-byte budget). Methods:

- plain: the canonical fp32 step (zero_grad, forward, loss, backward, AdamW step); the baseline
  of every time ratio.
- hf-recipe: the Hugging Face recipe, 16-bit autocast + ``gradient_checkpointing_enable()`` (every
  layer, non-reentrant). bf16 by default: fp16 autocast runs on this CPU but ~6x slower than
  fp32 (no AVX512-FP16 kernels), a CPU artefact, not the recipe's cost on a GPU
  (``--hf-dtype fp16`` to measure it anyway; GradScaler then as the Trainer uses it).
- uniform: ``checkpoint="every:K"``; at each budget the largest K whose measured peak fits
  (least recompute), else every:1 (= every layer) marked as not fitting.
- compile: ``torch.compile`` (inductor) with ``torch._functorch.config.activation_memory_budget``
  = each of a few levels; at each budget the largest level whose measured peak fits.
- memfit: ``plan(model, batch, budget)`` applied with ``memfit.fit``; and memfit no-offload, the
  same with ``offload="none", offload_optimizer=False``: on a CPU, host offload moves bytes to the
  same RAM (a CPU budget excludes memfit's host pool, DESIGN "Budgets"), so this row is what
  memfit does with the levers the recipes have.
- memfit every lever: ``plan(..., allow_numerics_change=True, offload="none",
  offload_optimizer=False)``: the planner may also take a low-bit optimizer state (issue 15),
  with host offload kept out for the reason above (parameter offload needs it).
- torchao 8-bit: torchao's AdamW8bit alone (``optimizer_state="8bit"``, memfit's eager step of
  torchao's functions, bitwise torchao's eager step: techniques.low_bit_optimizer Note 2).
- param offload: FSDP/ZeRO-3-style full parameter offload alone (``offload_params="all"`` with
  the optimizer state on the host: every block's weights fetched per forward and backward).
- DTR: ``memfit.fit(..., budget=budget, remat=True)`` alone (no planning: evictions at run time).

Recipes that do not depend on the budget (plain, hf-recipe) are measured once and compared
against every budget. Each method is measured in its own model (same seed, same weights).

Note 1 (peaks). Eager steps are measured with ``memfit.track`` (live tensor bytes at op
boundaries, exact on CPU: what the planner's budget caps). A dispatch-mode tracker cannot see
inductor's buffers, so compiled steps (and, to compare like with like, the plain eager step)
are also measured from the CPU allocator's own events: ``torch.profiler.profile(
profile_memory=True)`` records one ``[memory]`` event per allocation (+bytes) and free (-bytes)
(``prof.profiler.kineto_results.events()``, ``e.nbytes()``). Frees of blocks allocated before
the profiler started carry no event (the allocator warns "unknown size"), so two steps are
profiled and only the second one (inside a ``record_function`` marker) is read: every block it
frees was allocated under the profiler. The running sum of the events is then exact up to a
constant, fixed at the marker's start where the live bytes are the steady state's: params,
buffers, grads, optimizer state and the batch (unique storages). Peak = that state + max over
the second step of (running sum - running sum at the marker). The profiler's figure includes
blocks a kernel allocates and frees inside itself, so it is >= track's by at most the largest
such block; both are printed for the plain step.

Note 2 (times). Every method's step is timed in rounds (benchmarks/_timing.py): one step per
method per round, in a balanced order, so all methods share the machine's noise (this machine
is shared); each ratio is the median over rounds of the method's time over the plain step's in
the same round, with the quartiles as the spread. A second plain step (its own model) is timed
as the control: its ratio should read 1.00x. Compilation happens before the rounds and is not
timed.

Note 3 (compile levels). ``activation_memory_budget`` is read when AOTAutograd partitions the
joint graph. Setting it around the first call of ``torch.compile(model)`` is not enough: every
instance of a model class shares dynamo's cache entry for ``forward`` (modules are inlined, not
guarded by identity), so a second instance reuses the first's graphs whatever the setting (all
levels measured the same bytes). Each level therefore gets its own backend, inductor's
``compile_fx`` called under ``config.patch``: dynamo guards on the backend, so each level
compiles, partitions under its own budget, and keeps its graphs for the interleaved timing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.api.plan import plan  # noqa: E402
from memfit.step import canonical_step, prepare_batch  # noqa: E402

import _record  # noqa: E402
from _timing import CONTROL, Ratio, interleave  # noqa: E402

# small vocabularies, so that the blocks' activations (what the levers act on) dominate
MODELS = {
    "gpt2": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, bos_token_id=0,
                  eos_token_id=0), 8, 128),
    "bert-base": (dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                       intermediate_size=1024, vocab_size=2048), 8, 128),
}
FRACTIONS = (1.0, 0.75, 0.5, 0.3)
QUICK_FRACTIONS = (0.5,)
QUICK_SEQ_LEN = 64
FLOOR_MARGIN = 1.10
COMPILE_LEVELS = (1.0, 0.5, 0.0)       # activation_memory_budget values, most memory first
QUICK_COMPILE_LEVELS = (1.0,)
_MARK = "planner_vs_recipes.measured_step"


@dataclass
class Method:
    """One way to run the step: a closure of one step, its measured bytes and its times."""

    label: str
    setting: str                                  # knobs or recipe, in words
    step: object                                  # () -> None, one steady-state step
    peak_bytes: int                               # device peak (Note 1)
    how: str                                      # "track" or "profiler"
    host_bytes: int = 0                           # memfit's host pool peak (offload)
    predicted_peak_bytes: int | None = None
    predicted_ratio: float | None = None
    times_s: list[float] = field(default_factory=list)
    ratio: Ratio | None = None                    # to the plain step, round by round (Note 2)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def state_bytes(model, optimizer, batch) -> int:
    """Unique storage bytes of params, buffers, grads, optimizer state and the batch."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    tensors += [v for v in batch.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def profiler_peak(step, model, optimizer, batch) -> int:
    """The step's peak from the CPU allocator's events (Note 1)."""
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
            base = state_bytes(model, optimizer, batch)
            with record_function(_MARK):
                step()
    finally:
        gc.enable()
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == _MARK)
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = list(itertools.accumulate(e.nbytes() for e in memory))
    inside = [i for i, e in enumerate(memory) if mark.start_ns() <= e.start_ns() <= mark.end_ns()]
    at_mark = live[inside[0] - 1] if inside and inside[0] > 0 else 0
    return base + max((live[i] for i in inside), default=at_mark) - at_mark


def tracked_peak(step, model, optimizer) -> tuple[int, int]:
    with memfit.track(model, optimizer) as t:
        step()
    return t.peak_bytes, t.host_peak_bytes


class Bench:
    """One zoo model at one batch; builds each method on its own copy of the same weights."""

    def __init__(self, name: str, seq_len: int | None = None):
        self.name = name
        self.overrides, self.batch_size, self.seq_len = MODELS[name]
        self.seq_len = seq_len or self.seq_len
        self.spec = zoo.get(name)
        self.base = self.spec.build(seed=0, **self.overrides)
        self.batch = prepare_batch(self.spec.make_batch(self.base, self.batch_size,
                                                        seq_len=self.seq_len))

    def fresh(self):
        model = copy.deepcopy(self.base)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    def plain(self) -> tuple[Method, int]:
        """The baseline (track's peak) and its peak from the profiler."""
        model, opt = self.fresh()
        step = lambda: canonical_step(model, opt, self.batch)       # noqa: E731
        step(), step()
        peak, _ = tracked_peak(step, model, opt)
        return Method("plain", "fp32, no checkpoint", step, peak, "track"), \
            profiler_peak(step, model, opt, self.batch)

    def hf_recipe(self, dtype: str) -> Method:
        model, opt = self.fresh()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        scaler = torch.amp.GradScaler("cpu", enabled=dtype == "fp16")

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=autocast_dtype):
                loss = model(**self.batch).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        step(), step()
        peak, _ = tracked_peak(step, model, opt)
        return Method("hf-recipe", f"{dtype} autocast + checkpoint every layer", step, peak,
                      "track")

    def runner(self, label: str, setting: str, knobs: dict) -> Method:
        model, opt = self.fresh()
        runner = memfit.fit(model, opt, self.batch, **knobs)
        runner.step(self.batch)
        prepared = runner.prepare(self.batch)
        step = lambda: runner.run(prepared)                         # noqa: E731
        peak, host = tracked_peak(step, runner.model, runner.optimizer)
        return Method(label, setting, step, peak, "track", host_bytes=host)

    def compiled(self, level: float) -> Method:
        model, opt = self.fresh()
        compiled = torch.compile(model, backend=_inductor_at(level))
        step = lambda: canonical_step(compiled, opt, self.batch)    # noqa: E731
        step(), step()
        peak = profiler_peak(step, model, opt, self.batch)
        return Method("compile", f"inductor, activation_memory_budget {level}", step, peak,
                      "profiler")

    def remat(self, budget: int) -> Method | str:
        """DTR alone under ``budget`` (its own runtime counter keeps it)."""
        from memfit.techniques.remat import RematBudgetTooSmall
        try:
            return self.runner("DTR", "remat=True under the budget",
                               dict(budget=budget, remat=True))
        except (RematBudgetTooSmall, memfit.OutOfMemory) as e:
            return f"DTR cannot keep this budget ({type(e).__name__})"

    def memfit_plan(self, budget: int, label: str, **fixed) -> Method | str:
        try:
            p = plan(self.base, self.batch, budget, **fixed)
        except memfit.BudgetTooSmall as e:
            return f"BudgetTooSmall (floor {memfit.format_bytes(e.floor_bytes)})"
        knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
        shown = dict(knobs)
        if p.knobs.remat:                      # DTR chosen: it keeps the budget at run time
            knobs["budget"] = budget
        else:
            shown.pop("remat", None)
        m = self.runner(label, _describe(shown), knobs)
        m.predicted_peak_bytes, m.predicted_ratio = p.predicted_peak_bytes, \
            p.predicted_step_time_ratio
        return m


def _inductor_at(level: float):
    """Inductor with the partitioner's ``activation_memory_budget`` = ``level`` (Note 3)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=level):
            return compile_fx(gm, example_inputs)
    return backend


def _describe(knobs: dict) -> str:
    parts = []
    for k, v in knobs.items():
        if k == "precision" and v == "fp32" or v in ("none", False):
            continue
        if isinstance(v, tuple):
            v = f"{len(v)} blocks ({', '.join(n.rsplit('.', 1)[-1] for n in v)})"
        parts.append(f"{k}={v}")
    return ", ".join(parts) or "plain (nothing to change)"


def time_rounds(methods: list[Method], control, rounds: int, console) -> dict:
    """Note 2: every method's step (and the control's) once per round, balanced order; each
    method's times and ratio to the plain step (``methods[0]``) filled in. Returns the
    timing's summary (orders, the control's ratio)."""
    steps = {f"{i}: {m.label}, {m.setting}": m.step for i, m in enumerate(methods)}
    steps[CONTROL] = control
    base = next(iter(steps))
    with console.status("timing") as status:
        timings = interleave(steps, rounds, base, on_round=lambda r, n: status.update(
            f"timing: round {r + 1}/{n}"))
    for key, m in zip(steps, methods):
        m.times_s, m.ratio = timings.seconds[key], timings.ratio(key)
    return timings.summary()


def largest_fitting(candidates: list[Method], budget: int) -> Method:
    """Candidates ordered most memory first (least recompute): the first that fits, else the
    last (the least memory), which then does not fit."""
    return next((m for m in candidates if m.peak_bytes <= budget), candidates[-1])


def run_model(name: str, args, console) -> tuple[list[dict], dict]:
    bench = Bench(name, QUICK_SEQ_LEN if args.quick else None)
    fmt = memfit.format_bytes
    with console.status(f"{name}: plain step"):
        plain, plain_profiler = bench.plain()
    with console.status(f"{name}: memfit's floor"):
        try:
            plan(bench.base, bench.batch, 1)
            raise AssertionError("a 1-byte budget fitted")
        except memfit.BudgetTooSmall as e:
            floor = e.floor_bytes
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    budgets = [(f"plain x {f}", int(plain.peak_bytes * f)) for f in fractions]
    budgets.append((f"floor x {FLOOR_MARGIN}", int(floor * FLOOR_MARGIN)))
    budgets.sort(key=lambda b: -b[1])

    with console.status(f"{name}: hf recipe"):
        hf = bench.hf_recipe(args.hf_dtype)
    with console.status(f"{name}: torchao 8-bit AdamW alone"):
        low_bit = bench.runner("torchao 8-bit", "AdamW8bit (optimizer_state=8bit)",
                               dict(optimizer_state="8bit"))
    with console.status(f"{name}: full parameter offload alone"):
        params_off = bench.runner("param offload", "offload_params=all, optimizer on host",
                                  dict(offload_params="all", offload_optimizer=True))
    n_blocks = len(memfit.measure.find_blocks(bench.base))
    uniform = []
    for k in range(n_blocks, 0, -1):              # fewest checkpoints (most memory) first
        with console.status(f"{name}: uniform every:{k}"):
            uniform.append(bench.runner("uniform", f"checkpoint=every:{k}",
                                        dict(checkpoint=f"every:{k}")))
    compiled, compile_note = [], None
    if not args.no_compile:
        for level in (QUICK_COMPILE_LEVELS if args.quick else COMPILE_LEVELS):
            with console.status(f"{name}: torch.compile, activation_memory_budget={level}"):
                try:
                    compiled.append(bench.compiled(level))
                except Exception as e:  # noqa: BLE001 - inductor needs a working C++ toolchain
                    compile_note = f"torch.compile failed here, column skipped: {e!r:.300}"
                    break
    else:
        compile_note = "torch.compile skipped (--no-compile)"
    planned: dict[tuple[str, int], Method | str] = {}
    cache: dict[str, Method] = {}
    for label, budget in budgets:
        with console.status(f"{name}: DTR alone at {fmt(budget)}"):
            planned[("DTR", budget)] = bench.remat(budget)
        for kind, fixed in (("memfit", {}),
                            ("memfit no-offload", dict(offload="none", offload_optimizer=False)),
                            ("memfit every lever", dict(offload="none", offload_optimizer=False,
                                                        allow_numerics_change=True))):
            with console.status(f"{name}: {kind} plan at {fmt(budget)}"):
                m = bench.memfit_plan(budget, kind, **fixed)
            if isinstance(m, Method):            # the same knobs share one runner
                key = m.setting
                m = cache.setdefault(key, m)
            planned[(kind, budget)] = m

    dtr = [m for (kind, _), m in planned.items() if kind == "DTR" and isinstance(m, Method)]
    methods = [plain, hf, low_bit, params_off, *uniform, *compiled,
               *{id(m): m for m in cache.values()}.values(), *dtr]
    control_model, control_opt = bench.fresh()
    control = lambda: canonical_step(control_model, control_opt, bench.batch)   # noqa: E731
    control(), control()
    timing = time_rounds(methods, control, args.rounds, console)
    base_s = plain.median_s

    rows = []
    table = Table(title=f"{name} ({n_blocks} layers, width 256, vocab 2048), batch "
                        f"{bench.batch_size} x {bench.seq_len}, AdamW, CPU; time ratio vs plain "
                        f"fp32 ({base_s:.3f} s median; median [quartiles] of {args.rounds} "
                        "per-round ratios)")
    for col in ("budget", "method", "setting", "peak", "memfit pred. peak", "measured by", "host", "fits",
                "step s", "time ratio", "memfit pred. ratio"):
        table.add_column(col, justify="left" if col in ("method", "setting") else "right")
    for label, budget in budgets:
        table.add_section()
        chosen = [(m.label, m) for m in (plain, hf, low_bit, params_off,
                                          largest_fitting(uniform, budget))]
        if compiled:
            chosen.append(("compile", largest_fitting(compiled, budget)))
        chosen += [(k, planned[(k, budget)]) for k in ("DTR", "memfit", "memfit no-offload",
                                                        "memfit every lever")]
        for i, (kind, m) in enumerate(chosen):
            b = f"{label}\n{fmt(budget)}" if i == 0 else ""
            if isinstance(m, str):
                table.add_row(b, kind, m, "-", "", "", "", "no", "", "", "")
                rows.append({"model": name, "budget_label": label, "budget_bytes": budget,
                             "method": kind, "setting": m, "fits": False})
                continue
            fits = m.peak_bytes <= budget
            over = kind.startswith("memfit") and not fits
            row = {"model": name, "budget_label": label, "budget_bytes": budget,
                   "method": kind, "setting": m.setting, "peak_bytes": m.peak_bytes,
                   "measured_by": m.how, "host_peak_bytes": m.host_bytes, "fits": fits,
                   "step_seconds_median": round(m.median_s, 4),
                   "step_seconds": [round(t, 4) for t in m.times_s],
                   **m.ratio.to_dict(),
                   "predicted_peak_bytes": m.predicted_peak_bytes,
                   "predicted_time_ratio": None if m.predicted_ratio is None
                   else round(m.predicted_ratio, 4)}
            rows.append(row)
            pred = m.predicted_peak_bytes
            table.add_row(b, kind, m.setting, fmt(m.peak_bytes), "" if pred is None else fmt(pred),
                          m.how,
                          fmt(m.host_bytes) if m.host_bytes else "",
                          "[red]OVER[/red]" if over else ("yes" if fits else "no"),
                          f"{m.median_s:.3f}", str(m.ratio),
                          "" if m.predicted_ratio is None else f"{m.predicted_ratio:.2f}")
            if over:
                console.print(f"[red]planner: {name} at {fmt(budget)}: plan {m.setting} "
                              f"predicted {fmt(m.predicted_peak_bytes)}, measured "
                              f"{fmt(m.peak_bytes)}[/red]")
    summary = {"model": name, "overrides": bench.overrides, "batch_size": bench.batch_size,
               "seq_len": bench.seq_len, "plain_peak_track_bytes": plain.peak_bytes,
               "plain_peak_profiler_bytes": plain_profiler, "floor_bytes": floor,
               "uniform_peaks": {m.setting: m.peak_bytes for m in uniform},
               "compile_peaks_profiler": {m.setting: m.peak_bytes for m in compiled},
               "compile_note": compile_note, "plain_step_seconds_median": round(base_s, 4),
               "timing": timing}
    if not args.json:
        console.print(table)
        console.print(f"plain step peak: track {fmt(plain.peak_bytes)}, profiler allocator "
                      f"events {fmt(plain_profiler)} "
                      f"({100 * (plain_profiler / plain.peak_bytes - 1):+.2f}%: kernel-internal "
                      f"temporaries); memfit floor {fmt(floor)}")
        console.print("compiled peaks (profiler): " + ", ".join(
            f"{m.setting.rsplit(' ', 1)[-1]}: {fmt(m.peak_bytes)}" for m in compiled))
        console.print("uniform peaks (track): " + ", ".join(
            f"{m.setting.rsplit(':', 1)[-1]}: {fmt(m.peak_bytes)}" for m in uniform))
        c = timing["control"]
        console.print(f"control (a second plain step vs plain, should read 1.00x): "
                      f"{c['time_ratio']:.2f}x [{c['time_ratio_q1']:.2f}-"
                      f"{c['time_ratio_q3']:.2f}]")
        if compile_note:
            console.print(f"[yellow]{compile_note}[/yellow]")
    return rows, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2",
                    help=f"comma-separated zoo models, of {sorted(MODELS)} (default: gpt2)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed steps per method, interleaved (default 5, --quick 2)")
    ap.add_argument("--quick", action="store_true",
                    help=f"sequence {QUICK_SEQ_LEN}, budgets plain x 0.5 and the floor + 10%%, one "
                         "compile level, 2 rounds (a smoke run)")
    ap.add_argument("--hf-dtype", choices=("bf16", "fp16"), default="bf16",
                    help="autocast dtype of the Hugging Face recipe (fp16 is ~6x slower than "
                         "fp32 on CPUs without AVX512-FP16)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--json", action="store_true",
                    help="print the rows as JSON instead of the tables")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}: choose from {sorted(MODELS)}")
    console = Console(width=200, stderr=args.json)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    start = time.perf_counter()
    rows, summaries = [], []
    for name in names:
        r, s = run_model(name, args, console)
        rows += r
        summaries.append(s)
    config = {"models": summaries, "rounds": args.rounds, "quick": args.quick,
              "fractions": QUICK_FRACTIONS if args.quick else FRACTIONS,
              "floor_margin": FLOOR_MARGIN, "hf_dtype": args.hf_dtype,
              "compile_levels": [] if args.no_compile else
              (QUICK_COMPILE_LEVELS if args.quick else COMPILE_LEVELS),
              "wall_seconds": round(time.perf_counter() - start, 1)}
    path = _record.write("planner_vs_recipes" + ("-quick" if args.quick else ""), config, rows)
    if args.json:
        print(json.dumps({"config": config, "rows": rows}, indent=2))
    console.print(f"recorded in {path} ({config['wall_seconds']} s)")


if __name__ == "__main__":
    main()
