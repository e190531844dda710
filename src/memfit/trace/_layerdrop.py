"""LayerDrop off in the trace: the step that runs every layer, the most any step holds.

transformers' LayerDrop (``config.layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``:
wav2vec2, HuBERT, BART, Whisper, ...) skips each layer of a training forward when a draw of
``torch.rand([])`` falls under the probability. A trace draws as the real step would
(``trace.data_dependent``), so its figures were those of one random step: HuBERT's
estimate was 38% under the real peak whenever the draw skipped a layer, and the step it
described had that layer's gradients missing. A budget must hold every step, so the trace's own
copy of the model runs with each LayerDrop probability at 0 (on its configs and on the modules
that copied one at build), and the estimate says so; the user's model is not touched.
"""

from __future__ import annotations

from torch import nn

__all__ = ["without_layerdrop"]


def _drop_fields(obj) -> list[tuple[str, float]]:
    return [(k, v) for k, v in vars(obj).items()
            if k.endswith("layerdrop") and isinstance(v, (int, float))
            and not isinstance(v, bool) and v > 0]


def without_layerdrop(fake_model: nn.Module) -> tuple[str, ...]:
    """Every LayerDrop probability of ``fake_model`` (the trace's copy) set to 0; what was set,
    as ``name=value``."""
    found: dict[str, None] = {}
    configs = {}
    for m in fake_model.modules():
        for k, v in _drop_fields(m):
            setattr(m, k, 0.0)
            found[f"{k}={v}"] = None
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "__dict__"):
            configs[id(config)] = config
    for config in configs.values():
        for k, v in _drop_fields(config):
            setattr(config, k, 0.0)
            found[f"{k}={v}"] = None
    return tuple(found)
