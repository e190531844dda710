"""``what_if``: peak memory of the plain step as one config lever is scaled at a time.

Note 1 (why sequence length and hidden size cut memory faster than layers). Per layer, saved
activations are about ``c * B * L * H`` bytes (every linear, norm and activation of width H or
4H over L tokens), plus, where attention runs the math path (CPU, or a GPU without a fused
kernel), ``B * heads * L^2`` attention scores and probabilities. Parameters, gradients and
optimizer state are about ``12 * H^2`` values per layer (4H^2 attention, 8H^2 feed-forward).
So halving:
- L halves the activations and quarters the scores; the weights stay;
- H halves the activations and quarters the weights, gradients and optimizer state (heads are
  kept, so the scores stay);
- the layer count halves both, but no term falls faster than by half, and the embeddings and
  the head do not shrink at all.
Sequence length and hidden size therefore reach quadratic savings in their dominant terms,
the layer count only linear ones: the rows of ``what_if`` show which term dominates a model.

Note 2 (variants). Each row builds the model again on the ``meta`` device (no memory) with
one config field changed: the hidden width (and the feed-forward width in proportion, rounded
to a multiple of ``heads * 8`` so heads still divide it and widths stay kernel-friendly), or the
layer count (at least 1). A sequence length past the model's position limit builds the model
with enough positions (random weights allow it). The 1.0 row is traced once and shared by the
three levers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._stages import Stages
from memfit.api.estimate import estimate
from memfit.knobs import Knobs
from memfit.trace._block_twin import PER_LAYER_NAMES
from memfit.zoo._batches import DEFAULT_SEQ_LEN, position_limit

__all__ = ["WhatIfRow", "what_if", "scaled_hidden", "WHAT_IF_LEVERS"]

WHAT_IF_LEVERS = ("seq_len", "hidden_size", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_FFN = ("intermediate_size", "n_inner", "d_ff")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_MORE_LAYERS = ("num_decoder_layers",)          # scaled with the layer count where present


@dataclass(frozen=True)
class WhatIfRow:
    """One variant of the step: one lever scaled by ``factor``, the others as given."""

    lever: str           # "seq_len" | "hidden_size" | "num_layers"
    factor: float        # the scale asked for (``value`` is rounded from it)
    value: int           # tokens, hidden width, or layers of this variant
    peak_bytes: int      # allocated peak of the plain step
    device_bytes: int    # what the budget caps: reserved + CUDA context
    fits: bool           # device_bytes <= the budget (or the device's usable memory)


def _field(config, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` the config stores as an int (its own field, not an alias)."""
    own = vars(config)
    return next((n for n in names if isinstance(own.get(n), int)), None)


def scaled_hidden(config, factor: float) -> dict:
    """Config overrides that scale the hidden width by ``factor`` (Note 2)."""
    name, heads = _field(config, _HIDDEN), _field(config, _HEADS)
    if name is None or heads is None:
        raise ValueError(f"this {config.model_type} config has no hidden size / head count "
                         f"among {_HIDDEN} / {_HEADS}: drop the hidden_size lever")
    hidden, n_heads = getattr(config, name), getattr(config, heads)
    step = n_heads * 8
    new = max(step, round(hidden * factor / step) * step)
    out = {name: new}
    ffn = _field(config, _FFN)
    if ffn is not None:
        out[ffn] = max(8, round(getattr(config, ffn) * new / hidden / 8) * 8)
    if isinstance(vars(config).get("head_dim"), int) and config.head_dim * n_heads == hidden:
        out["head_dim"] = new // n_heads
    return out


def _scaled_layers(config, factor: float) -> dict:
    name = _field(config, _LAYERS)
    if name is None:
        raise ValueError(f"this {config.model_type} config has no layer count among {_LAYERS}")
    depth = getattr(config, name)
    out = {name: max(1, round(depth * factor))}
    for extra in _MORE_LAYERS:
        if isinstance(vars(config).get(extra), int):
            out[extra] = max(1, round(getattr(config, extra) * factor))
    for field in PER_LAYER_NAMES:         # one value per layer (Qwen3's layer_types): the
        values = vars(config).get(field)  # pattern kept, cut or repeated to the new depth
        if isinstance(values, list) and len(values) == depth:
            out[field] = [values[i % depth] for i in range(out[name])]
    return out


def _positions_for(config, seq_len: int) -> dict:
    """Overrides that let the model take ``seq_len`` tokens (Note 2); {} when it already can."""
    limit, _ = position_limit(config)
    if limit is None or seq_len <= limit:
        return {}
    name = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    return {name: getattr(config, name) + seq_len - limit}


def what_if(spec, *, batch_size: int, seq_len: int | None, device=None, budget=None,
            optimizer="adamw", task=None, factors=(0.25, 0.5, 1.0),
            on_progress: Callable[[str], None] | None = None, tiny: bool = False,
            config_overrides: dict | None = None,
            adapt: Callable[[nn.Module], nn.Module] | None = None,
            batch_for: Callable[[nn.Module, int | None], object] | None = None,
            **knobs) -> list[WhatIfRow]:
    """Peak memory of the plain step (the given knobs) with the sequence length, the hidden
    size, and the layer count each scaled by ``factors`` alone (Notes 1-2). Rows come grouped
    by lever, factors ascending; the 1.0 row (traced once) appears in each group. ``tiny`` and
    ``config_overrides`` pick the base model as ``spec.build`` does. ``adapt(model)``: each
    row's model as the job trains it (LoRA, QLoRA, frozen layers: the CLI's flags), built
    anew at each size; ``batch_for(model, seq_len)``: its batch (default ``spec.make_batch``
    at ``batch_size``)."""
    say = Stages(on_progress)             # numbered, with their count (api._stages)
    base_overrides = dict(config_overrides or {})
    config = spec.config(tiny=tiny, **base_overrides)
    task = spec.check_task(task)
    factors = sorted(set(float(f) for f in factors) | {1.0})
    if factors[0] <= 0:
        raise ValueError(f"factors must be positive, got {factors[0]}")
    k = Knobs.from_kwargs(**knobs)
    if k.precision == "auto":
        base = spec.build(task, tiny=tiny, device="meta", **base_overrides)
        k = k.replace(precision=resolve_precision("auto", resolve_device(base, device)))
    knob_values = {n: v for n, v in k.to_dict().items() if v is not None}
    if seq_len is None and spec.family != "vision":
        limit, _ = position_limit(config)
        seq_len = DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit)

    def run(lever: str, factor: float, value: int, overrides: dict, L: int | None) -> WhatIfRow:
        say("what if: tracing the plain step" if lever == "plain" else
            f"what if: tracing {lever} x{factor:g} ({value})")
        model = spec.build(task, tiny=tiny, device="meta", **{**base_overrides, **overrides})
        model = adapt(model) if adapt is not None else model
        batch = batch_for(model, L) if batch_for is not None else \
            spec.make_batch(model, batch_size, seq_len=L, task=task)
        est = estimate(model, batch, optimizer, device, budget=budget, **knob_values)
        return WhatIfRow(lever, factor, value, est.peak_bytes, est.device_bytes, est.fits)

    hidden_name, layers_name = _field(config, _HIDDEN), _field(config, _LAYERS)
    levers = [lever for lever in WHAT_IF_LEVERS if lever != "seq_len" or seq_len is not None]
    say.expect(1 + len(levers) * (len(factors) - 1))      # each trace once
    plain = None
    rows = []
    for lever in levers:                      # an image model: no sequence length to scale
        for f in factors:
            if f == 1.0:
                plain = plain or run("plain", 1.0, 0, {}, seq_len)
                value = {"seq_len": seq_len, "hidden_size": getattr(config, hidden_name or "", 0),
                         "num_layers": getattr(config, layers_name or "", 0)}[lever]
                rows.append(WhatIfRow(lever, 1.0, value, plain.peak_bytes, plain.device_bytes,
                                      plain.fits))
            elif lever == "seq_len":
                L = max(2 if task == "causal-lm" else 1, round(seq_len * f))
                rows.append(run(lever, f, L, _positions_for(config, L), L))
            elif lever == "hidden_size":
                over = scaled_hidden(config, f)
                rows.append(run(lever, f, over[hidden_name], over, seq_len))
            else:
                over = _scaled_layers(config, f)
                rows.append(run(lever, f, over[layers_name], over, seq_len))
    return rows
