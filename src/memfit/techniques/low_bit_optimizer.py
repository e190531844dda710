"""Low-bit optimizer states (``optimizer_state="bf16" | "8bit" | "4bit"``).

Note 1 (what is built). The user's Adam or AdamW (class, hyper-parameters, param groups) is
rebuilt over the same parameters as the low-bit optimizer users run for that state:
- "8bit": bitsandbytes' ``AdamW8bit``/``Adam8bit`` (block-wise dynamic 8-bit moments, 256
  values per fp32 absmax; Dettmers et al., https://arxiv.org/abs/2110.02861), stepped by its
  own ``step`` (what runs where: ``_bnb_optimizer``). As in bitsandbytes, tensors of fewer
  than 4096 values (``min_8bit_size``) keep fp32 moments and its 32-bit kernel.
- "4bit": torchao's ``AdamW4bit``/``Adam4bit`` (4-bit, 128 per scale; Li et al.,
  https://arxiv.org/abs/2309.01507); "bf16": torchao's ``_AdamW`` base with its moments held
  as bf16 tensors (rounded to nearest when stored) and, where the parameters themselves are
  bf16, torchao's stochastic rounding of the update (``bf16_stochastic_round``). As in
  torchao, only tensors of at least 4096 values whose size the block divides are quantized;
  the others keep fp32 moments.
Only Adam and AdamW have low-bit versions; anything else is refused, as are ``amsgrad``,
``maximize`` and ``differentiable`` (neither library's step has them), and for "8bit" torch's
Adam with ``weight_decay > 0`` (bitsandbytes' Adam kernels decay decoupled, AdamW's way). The
numerics change: the plan must say so (``NUMERICS_NOTE``).

Note 2 (torchao's step). torchao's own step runs compiled, which neither the fake trace nor
``memfit.track`` can run; the classes built here step it eagerly, with every op of its state
subclasses at the top (``_torchao_optimizer``, which says why and holds it bitwise to torchao's
eager step). ``lr`` stays a float. The eager step's temporaries (several fp32 and int64 copies
of the largest parameter) can exceed what 4-bit state saves on a model dominated by one tensor
(an embedding): the planner weighs a state by its trace (planner.variants), so it then does not
pick it.

Note 3 (accounting). torchao's states are wrapper subclasses; ``memfit.track`` counts their
inner storages (codes, scales, and one qmap per state: 64 B at 4 bits) through
``__tensor_flatten__``. bitsandbytes' states are plain tensors (uint8 codes, fp32 absmax per
block of 256, a Python int step) with two 256-value fp32 maps shared by every parameter of the
optimizer. ``state_bytes`` gives the exact state bytes of a parameter list, what a planner
should weigh (bytes per parameter of state: fp32 8, bf16 4, 8bit 2 + 8/256, 4bit 1 + 8/128,
plus a 4-byte step tensor per torch/torchao tensor).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from memfit.optimizers import OptimizerRecipe
from memfit.techniques._bnb_optimizer import BnbStep, bnb_classes, bnb_modules
from memfit.techniques._protocol import Change
from memfit.techniques._torchao_optimizer import (EagerStep, eager_class, is_torchao,
                                                   torchao_modules)

__all__ = ["LowBitOptimizer", "LowBitRecipe", "STATES", "LOW_BIT_CLASSES", "NUMERICS_NOTE",
           "state_bytes", "is_low_bit"]

STATES = ("bf16", "8bit", "4bit")
# torch class -> the torchao classes built for it, per state (Note 1)
LOW_BIT_CLASSES = {"Adam": ("bitsandbytes Adam8bit", "torchao Adam4bit",
                            "torchao _AdamW (bf16 state)"),
                   "AdamW": ("bitsandbytes AdamW8bit", "torchao AdamW4bit",
                             "torchao _AdamW (bf16 state)")}
NUMERICS_NOTE = ("changes the numerics: the optimizer's moments are stored in {what} instead "
                 "of fp32 ({lib}), so updates differ from fp32 Adam by the quantization error")
LIBRARY = {"8bit": "bitsandbytes", "4bit": "torchao", "bf16": "torchao"}
_WHAT = {"bf16": "bf16", "8bit": "8 bits (block-wise, 256 values per fp32 scale)",
         "4bit": "4 bits (block-wise, 128 values per fp32 scale)"}
_BLOCK = {"8bit": 256, "4bit": 128}
_MIN_NUMEL = 4096          # both libraries quantize tensors of at least this many values (Note 1)
_BNB_QMAP_BYTES = 2 * 256 * 4     # bitsandbytes' signed and unsigned maps, one per optimizer


def _torchao(state: str):
    return torchao_modules(f"optimizer_state={state!r}")


def _class_for(state: str, adamw: bool) -> type:
    """The optimizer class built for ``state`` (Note 1)."""
    return (bnb_classes() if state == "8bit" else _torchao_classes())[state, adamw]


@functools.cache
def _torchao_classes() -> dict[tuple[str, bool], type]:
    """(state, is_adamw) -> an eager-stepping subclass of torchao's optimizer (Note 2)."""
    ao = _torchao("4bit")[0]
    out = {}
    for adamw in (True, False):
        prefix = "AdamW" if adamw else "Adam"
        out["4bit", adamw] = eager_class(getattr(ao, prefix + "4bit"))
        out["bf16", adamw] = type(f"{prefix}Bf16State", (EagerStep, ao._AdamW),
                                  {"_decoupled": adamw, "__init__": _bf16_init,
                                   "_new_buffer": _bf16_new_buffer})
    return out


def _bf16_init(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
               amsgrad=False):
    """``_AdamW``'s constructor, with the class's own weight-decay style (Note 1)."""
    _torchao("bf16")[0]._AdamW.__init__(self, params, lr, betas, eps, weight_decay, amsgrad,
                                        bf16_stochastic_round=True)
    self.is_adamw = self._decoupled


def _bf16_new_buffer(self, p, signed):
    return torch.zeros_like(p, dtype=torch.bfloat16)     # moments as plain bf16 (Note 1)


def is_low_bit(optimizer) -> bool:
    return isinstance(optimizer, (EagerStep, BnbStep))


def state_bytes(params, state: str) -> int:
    """The exact bytes of optimizer state Adam keeps for ``params`` (tensors or shapes) under
    ``state`` ("fp32" too): a planner's weight for this lever (Note 3)."""
    total, maps = 0, 0
    for p in params:
        numel = math.prod(p.shape) if hasattr(p, "shape") else math.prod(p)
        block = _BLOCK.get(state)
        if state == "8bit":                           # bitsandbytes: the step is an int
            if numel >= _MIN_NUMEL:
                total += 2 * (numel + -(numel // -block) * 4)
                maps = _BNB_QMAP_BYTES
            else:
                total += 2 * 4 * numel
            continue
        total += 4                                   # the step counter, a 0-dim fp32 tensor
        if state == "bf16":
            total += 2 * 2 * numel
        elif block is not None and numel >= _MIN_NUMEL and numel % block == 0:
            code_bytes = numel if state == "8bit" else numel // 2
            qmap = 256 * 4 if state == "8bit" else 16 * 4
            total += 2 * (code_bytes + numel // block * 4 + qmap)
        else:
            total += 2 * 4 * numel
    return total + maps


class LowBitOptimizer:
    """Rebuild the user's Adam/AdamW with low-bit states (bitsandbytes, torchao; Notes 1-3)."""

    @dataclass(frozen=True)
    class Config:
        state: str = "8bit"      # "bf16" | "8bit" | "4bit": how the moments are stored

        def __post_init__(self):
            if self.state not in STATES:
                raise ValueError(f"LowBitOptimizer.Config.state={self.state!r} is not one of "
                                 f"{', '.join(STATES)} (fp32: leave the optimizer as it is)")

    def __init__(self, config: "LowBitOptimizer.Config"):
        self.config = config

    def apply(self, model: nn.Module, recipe: OptimizerRecipe) -> Change:
        """The ``Change``'s ``recipe`` is ``recipe`` building the low-bit optimizer instead (the
        user's optimizer is checked now when it is an instance, else when it is first built);
        its note says that the numerics change."""
        state = self.config.state
        note = (f"optimizer_state={state}: the optimizer was rebuilt as {LIBRARY[state]}'s "
                f"low-bit Adam (runner.optimizer); this "
                + NUMERICS_NOTE.format(what=_WHAT[state], lib=LIBRARY[state]))
        return Change(model, recipe=self._recipe(recipe), optimizer_rebuilt=True, notes=(note,))

    def _recipe(self, recipe: OptimizerRecipe) -> "LowBitRecipe":
        if recipe.impl is not None:
            raise ValueError(f"optimizer_impl={recipe.impl!r} has no effect with "
                             f"optimizer_state={self.config.state!r}: "
                             f"{LIBRARY[self.config.state]}'s low-bit Adam steps one parameter "
                             "at a time; leave optimizer_impl unset")
        bnb_modules() if self.config.state == "8bit" else _torchao(self.config.state)
        out = LowBitRecipe(recipe.spec, self)
        if recipe.instance is not None:
            _check_class(recipe.instance, self.config.state)
        return out

    def rebuild(self, optimizer: torch.optim.Optimizer,
                new_of: dict[int, torch.Tensor] | None = None) -> torch.optim.Optimizer:
        """``optimizer``'s groups and hyper-parameters, its params replaced by
        ``new_of[id(p)]`` (default: the same), as the low-bit optimizer. State is not copied."""
        if is_low_bit(optimizer):
            return optimizer
        adamw = _check_class(optimizer, self.config.state)
        cls = _class_for(self.config.state, adamw)
        groups = []
        for g in optimizer.param_groups:
            kept = {k: v for k, v in g.items() if k not in _TORCH_ONLY}
            kept["params"] = [p if new_of is None else new_of[id(p)] for p in g["params"]]
            groups.append(kept)
        d = optimizer.defaults
        return cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                   weight_decay=d["weight_decay"])


# torch's Adam keys torchao's step does not read (the checked ones are refused first)
_TORCH_ONLY = {"foreach", "fused", "maximize", "capturable", "differentiable",
               "decoupled_weight_decay"}


def _check_class(optimizer, state: str) -> bool:
    """True for AdamW-style (decoupled) weight decay; a ValueError for anything torchao cannot
    rebuild (Note 1)."""
    if is_low_bit(optimizer):
        return optimizer.is_adamw
    cls = type(optimizer)
    if is_torchao(optimizer):
        raise ValueError(f"optimizer_state={state!r}: the optimizer is already torchao's "
                         f"{cls.__name__}, a low-bit Adam, estimated as it is; leave "
                         "optimizer_state unset, or pass torch.optim.AdamW to have memfit "
                         "build the low-bit one")
    if not isinstance(optimizer, torch.optim.Adam):    # torch's AdamW subclasses Adam
        have = "; ".join(f"{k} -> {', '.join(v)}" for k, v in LOW_BIT_CLASSES.items())
        raise ValueError(f"optimizer_state={state!r}: {cls.__name__} has no low-bit version; "
                         f"there are low-bit versions of Adam and AdamW only ({have}). Use "
                         "torch.optim.AdamW (or Adam), or leave optimizer_state unset")
    for g in optimizer.param_groups:
        bad = [k for k in ("amsgrad", "maximize", "differentiable") if g.get(k)]
        if bad:
            raise ValueError(f"optimizer_state={state!r}: {LIBRARY[state]}'s low-bit Adam has "
                             f"no {bad[0]}=True; set {bad[0]}=False or leave optimizer_state "
                             "unset")
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay"))
    coupled = [g["weight_decay"] for g in optimizer.param_groups if g.get("weight_decay")]
    if state == "8bit" and not adamw and coupled:
        raise ValueError(f"optimizer_state='8bit': bitsandbytes' 8-bit Adam decays weights "
                         f"decoupled (as AdamW), but this {cls.__name__} adds weight_decay="
                         f"{coupled[0]:g} to the gradient; use torch.optim.AdamW, "
                         "weight_decay=0, or optimizer_state='4bit' or 'bf16' (torchao)")
    for g in optimizer.param_groups:
        if state == "8bit" and isinstance(g["lr"], torch.Tensor):
            raise ValueError("optimizer_state='8bit': bitsandbytes' kernels take lr as a "
                             "float; build the optimizer with lr=<a float>")
    return adamw


class LowBitRecipe(OptimizerRecipe):
    """An ``OptimizerRecipe`` whose ``build`` makes the low-bit optimizer (Note 1)."""

    def __init__(self, spec, technique: LowBitOptimizer):
        super().__init__(spec)
        self.technique = technique

    def with_impl(self, impl):
        if impl is not None:
            self.technique._recipe(OptimizerRecipe(self.spec, impl))     # raises
        return self

    def optimizer_class(self, params):
        adamw = _check_class(self.instance if self.instance is not None
                             else self.factory(params), self.technique.config.state)
        return _class_for(self.technique.config.state, adamw)

    def build(self, params, origin):
        if self.instance is None:
            return self.technique.rebuild(self.factory(params))
        return self.technique.rebuild(self.instance, {id(o): n for o, n in zip(origin, params)})
