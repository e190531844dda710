"""The ``model`` argument of memfit's entry points: a module, or the zoo call that makes one.

Every front takes an ``nn.Module``; a user who passes a name (``memfit.estimate("gpt2", batch)``)
is told how to get the module from the zoo (random weights, on ``meta`` for nothing), instead
of an ``AttributeError`` from deep inside. ``api._setup.resolve_device`` (the first thing every
API front asks of the model) and ``measure.track`` call it.
"""

from __future__ import annotations

from torch import nn

from memfit.zoo._hub import is_hub_id
from memfit.zoo._registry import find

__all__ = ["check_model"]


def check_model(model, what: str = "model") -> None:
    """Raise ``ValueError`` naming the fix when ``model`` is not an ``nn.Module``: a name gets the
    zoo call that builds one (random weights, ``device="meta"`` allocates nothing)."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, str):
        if find(model) is not None:
            how = (f"spec = memfit.zoo.get({model!r}); model = spec.build(device='meta') (random "
                   "weights, no memory); batch = spec.make_batch(model, 8)")
        elif is_hub_id(model):
            how = (f"spec = memfit.zoo.from_pretrained_config({model!r}) (reads its config.json "
                   "only); model = spec.build(device='meta') (random weights, no memory); "
                   "batch = spec.make_batch(model, 8)")
        else:
            how = ("memfit.zoo.names() lists the built-in models (memfit.zoo.get(name).build()), "
                   "memfit.zoo.from_config_file(path) reads a Hugging Face config.json, "
                   "memfit.zoo.from_pretrained_config('org/name') a hub model's")
        raise ValueError(f"{what} must be a torch.nn.Module, got the name {model!r}: {how}")
    raise ValueError(f"{what} must be a torch.nn.Module (e.g. a transformers model), got "
                     f"{type(model).__name__}")
