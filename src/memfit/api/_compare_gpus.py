"""``compare_gpus``: for every GPU of the table, the fewest cards that fit and their step time.

Note 1 (modelled). Every card of the table at its usable memory, the fewest GPUs (1..b) whose best
layout the models of ``api._plan_sharded`` predict to fit, and its step time; modelled from one
trace per precision (state fixed, activations proportional to the batch: every point of the step a
line in the micro-batch), not re-traced per card (33 verifications would take many minutes), and
said so. The fewest are found by bisection (``api._plan_sharded.fewest``). Sorted by GPU-seconds per
step (cards x step time): what a rental costs in card-hours, before prices.

Note 2 (cards without bf16). Where the precision asked is bf16 (or FSDP2's bf16
``mp_policy``) a card without bf16 cannot run it: its row says "no bf16" rather than stopping
the comparison. Where the precision is "auto", such a card is weighed at fp32, as
``plan(gpus=...)`` weighs it: fp16 needs a GradScaler, whose sharded step is not modelled. Its
row's ``note`` says so, and that ``memfit plan --gpu NAME`` weighs fp16 on one card.

Note 3 (the trace, on a card). The one trace per precision is made for the first card of the
table at that precision, as ``estimate`` traces one GPU (its CUDA models, the caching
allocator's replay); every card's rows are read off it (``_sharded_models._Models``), so the
one-GPU row of that card is ``memfit estimate``'s plain step on it. Another card's rows keep
that trace's attention kernels and allocator ratio, with its own workspaces and context: a
model, said as such. Rows of several GPUs count a rank's allocated bytes, as ``plan --gpus``
does: the traced ratio of reserved to allocated bytes is not a rank's. (From a CPU trace, as
before session 23, the rows left out the allocator's reserve: Llama-2-7B, 1 x 512, bf16, on an
H200 said 135.5 GB against ``estimate``'s 147.40 GB; 147.41 GB now.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from memfit.api._sharded_models import Row, _Models, _search_row, _setup, _trace, fewest
from memfit.api._stages import Stages
from memfit.devices import list_devices
from memfit.knobs import Knobs
from memfit.planner.choice import Constraints
from memfit.planner.sharding import interconnect, layout_tiers
from memfit.techniques.accumulation import batch_size_of

__all__ = ["compare_gpus", "fewest_gpus", "GpuRow", "NO_BF16_AUTO"]

NO_BF16_AUTO = ("fp32: no bf16 on this card, and the layout search, one GPU or several, "
                "does not weigh fp16 (its GradScaler is not modelled sharded); "
                "`memfit plan --gpu NAME` weighs fp16 on one card")


@dataclass(frozen=True)
class GpuRow:
    """One card of ``compare_gpus``: the fewest that fit and their step."""

    gpu: str
    display_name: str
    usable_bytes: int
    gpus: int | None                 # None: nothing up to the batch size fits
    layout: str
    precision: str
    rank_bytes: int | None           # predicted device bytes per GPU
    step_s: float | None
    link: str
    why: str = ""                    # where gpus is None: why not (no bf16, nothing fits)
    note: str = ""                   # how the precision was chosen, where it is not the asked

    @property
    def gpu_seconds(self) -> float | None:
        return None if self.step_s is None else self.gpus * self.step_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "gpu_seconds": self.gpu_seconds}


def compare_gpus(model: nn.Module, batch, optimizer="adamw", loss_fn: Callable | None = None,
                 *, specs=None, count_fn: Callable | None = None,
                 on_progress: Callable[[str], None] | None = None, **knobs) -> list[GpuRow]:
    """For every GPU of the table (or ``specs``), the fewest cards whose best layout the models
    predict to fit its usable memory, cheapest (GPU-seconds per step) first (Note 1)."""
    say = Stages(on_progress)     # the traces, numbered; each card's search is quick and
    specs = list(specs) if specs is not None else list_devices()     # says which of how many
    say.expect(1)                 # a trace per precision, one at least
    asked = Knobs.from_kwargs(**knobs)
    wants_bf16 = asked.precision == "bf16" or asked.mp_policy is not None
    traced: dict = {}
    rows = []
    for i, spec in enumerate(specs, 1):
        link = interconnect(spec)[0]
        if wants_bf16 and spec.kind == "cuda" and not spec.supports_bf16:       # Note 2
            rows.append(GpuRow(spec.name, spec.display_name, spec.usable_bytes, None, "",
                               "bf16", None, None, link, "no bf16"))
            continue
        k, _, p, prepared = _setup(model, batch, optimizer, spec, loss_fn, knobs, None, None)
        if (p, spec.kind) not in traced:          # Note 3: on the first card of each precision
            traced[p, spec.kind] = _Models(
                _trace(model, prepared, optimizer, loss_fn, count_fn, k, p, say, spec,
                       on_card=True), p, batch_size_of(prepared),
                card=spec if spec.kind == "cuda" else None)
        searching = f"({i} of {len(specs)} GPUs)"
        row = _fewest_on(model, spec, spec.usable_bytes, traced[p, spec.kind], k, p, link,
                         lambda m: on_progress and on_progress(f"{m} {searching}"))
        if asked.precision == "auto" and spec.kind == "cuda" and not spec.supports_bf16:
            row = dataclasses.replace(row, note=NO_BF16_AUTO)           # Note 2
        rows.append(row)
    return sorted(rows, key=lambda r: (r.gpu_seconds is None, r.gpu_seconds or 0.0))


def _fewest_on(model, spec, budget_bytes: int, models: _Models, k: Knobs, p: str, link: str,
               say) -> GpuRow:
    """The fewest GPUs of ``spec`` whose best layout the models predict to fit ``budget_bytes``
    per GPU (Note 1), and that layout's step."""
    fixed_modes = Constraints.of(model, k, models.b).modes
    say(f"searching {spec.name}")

    def fitting(n: int, cands, probe: bool = False) -> list[Row]:
        return [r for r in (
            _search_row(models, c, spec, budget_bytes, k, fixed_modes, probe=probe)
            for c in cands if c.gpus == n) if r.choice is not None]

    n = None
    for cands in layout_tiers(k, "auto", models.b, p, spec):     # offload last
        counts = sorted({c.gpus for c in cands})
        n = fewest(counts, lambda n: bool(fitting(n, cands, probe=True)))
        if n is not None:
            break
    if n is None:
        return GpuRow(spec.name, spec.display_name, spec.usable_bytes, None, "", p, None, None,
                      link, f"none of 1-{models.b} GPUs fits")
    found = min(fitting(n, cands), key=lambda r: r.choice.step_s)
    return GpuRow(spec.name, spec.display_name, spec.usable_bytes, found.candidate.gpus,
                  found.candidate.describe(), p, found.choice.device_bytes, found.choice.step_s,
                  link)


def fewest_gpus(model: nn.Module, batch, optimizer, spec, budget_bytes: int,
                loss_fn: Callable | None = None, *, count_fn: Callable | None = None,
                on_progress: Callable[[str], None] | None = None, **knobs) -> GpuRow:
    """The fewest GPUs of ``spec`` whose best layout fits ``budget_bytes`` per GPU, from the
    layout search ``plan(gpus="auto")`` runs (modelled, Note 1): the sharding hint of a
    single-device refusal (``api.plan``)."""
    say = on_progress or (lambda message: None)
    k, _, p, prepared = _setup(model, batch, optimizer, spec, loss_fn, knobs, None, None)
    models = _Models(_trace(model, prepared, optimizer, loss_fn, count_fn, k, p, say, spec), p,
                     batch_size_of(prepared))
    return _fewest_on(model, spec, budget_bytes, models, k, p, interconnect(spec)[0], say)
