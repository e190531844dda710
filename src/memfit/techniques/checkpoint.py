"""Activation checkpointing: chosen blocks save only their inputs and recompute in backward.

Note 1 (module hooks, not a wrapper). Each chosen block gets a forward pre-hook (with kwargs)
and a forward post-hook (``always_call``, so a forward that raises still closes it). The
pre-hook starts torch's non-reentrant checkpoint generator
(``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, the engine of both
``checkpoint(fn, use_reentrant=False)`` and the composable
``torch.distributed._composable.checkpoint``): it records the RNG and autocast state, saves the
block's positional inputs and enters checkpoint's saved-tensor hooks and ``context_fn``'s forward
context; the post-hook finishes it. The recompute calls the block's ``forward`` (whatever it
is when the block runs: the class's, or the user's own instance ``forward``), not
``__call__``, so the block's other hooks do not run again on recompute. Nothing on the model is
replaced: ``'forward' not in block.__dict__``, qualified names, ``state_dict`` keys and parameter
identity are the user's, and ``remove`` takes the two hooks off. Why not the composable API
itself: it returns no handles to remove it, writes its state into the module's ``__dict__``, and
recomputes through ``__call__``, rerunning every other hook of the block. Hook order: the
pre-hook is appended (it runs after the hooks already there) and the post-hook prepended, so a
hook set present before ``apply`` (offload's, a user's) runs outside the checkpointed region,
as with a wrapper; a hook registered *after* ``apply`` that does autograd math on the inputs
would be inside it without being recomputed (then apply the checkpoint last). The generator's
positional parameters are bound by name (``_engine_args``), so torch versions that add one (e.g.
``early_stop``) still work, and a block keyword of the same name is bound into the recomputed
function instead. With ``preserve_rng_state`` the recompute replays the RNG state of the forward
(then restores the outer one), so dropout draws the same masks and gradients are bitwise those
of the plain step. Without grad mode there is no backward to recompute for, and the block runs
as is. ``copy.deepcopy`` copies the hooks with the module, so a copy recomputes its own blocks.

Note 2 (``every:K``). Blocks in execution order are counted from 1 and every K-th is recomputed:
indices K-1, 2K-1, ... (as torchtitan's ``ac_freq``), so ``every:1`` is ``all`` and a model
with fewer than K blocks recomputes nothing (a warning says so).

Note 3 (selective). The forward keeps the outputs of the ops in ``SAVED_OPS`` and the recompute
reruns every other op (pointwise ops, norms, softmax, dropout, casts, views), through the two
dispatch modes of ``_selective`` (not torch's ``create_selective_checkpoint_contexts``, which
refuses an output mutated in place, as timm's squeeze-excitation does, and a second backward, as a
gradient penalty does; a kept output that is mutated is recomputed instead, and a second backward
recomputes what the first one took). Kept: the matmuls ``mm``, ``addmm``, ``bmm``, ``baddbmm``,
``addbmm``, ``_scaled_mm``, ``_grouped_mm``, ``_scaled_grouped_mm``;
``convolution``/``_convolution``; the fused attentions ``_scaled_dot_product_{flash,
flash_attention_for_cpu, efficient, cudnn, fused_attention_overrideable}_attention`` and
``_flash_attention_forward``/``_efficient_attention_forward``. The forward mode sees aten ops below
autograd, after composite ops are decomposed: ``linear`` and ``matmul`` arrive as
``addmm``/``mm``/``bmm``, and the math SDPA path as ``bmm`` + ``softmax``, so listing them is
enough. These are the ops whose recompute costs FLOPs; what is recomputed is memory-bound.

Note 4 (autocast in the recompute). Checkpoint records the state of ``torch.autocast`` and
re-enters it for the recompute by itself. memfit's ``CudaAutocastMode`` is a torch-function
mode, not autocast state: the recompute runs in backward, outside it, so it would recompute in
fp32 and checkpoint would raise a metadata mismatch. With an ``autocast_factory`` the recompute
context enters a fresh ``autocast_factory()`` (a new autocast region, new weight cache, as real
autocast does); with ``selective`` it enters that and the selective recompute context together,
each time checkpoint enters it (``_Together``: a second backward recomputes again, Note 3).
The forward context adds no autocast: the forward already runs inside the user's mode.

Note 5 (caches). A key/value cache handed to a checkpointed block would be written twice: once
in the forward, again in the recompute (it then holds 2x the tokens, and a cross-attention
cache marked filled makes the recompute skip ops, a ``CheckpointError``). As transformers'
own gradient checkpointing does, the pre-hook passes ``None`` for the arguments named in
``CACHE_ARGS`` while it checkpoints. A training forward starts from an empty cache, which
only collects states for generation, so the loss and gradients do not change (a cache that
already holds states *would* change them; then do not checkpoint that block). A block that only
reads its cache can keep it by setting ``_can_checkpoint_with_cache = True`` (transformers').

Note 6 (recompute cost). Non-reentrant checkpoint stops the recompute ("early stop") once the
last tensor the block saved is repacked. Autograd packs an op's saved inputs before its kernel
runs, so a trailing matmul that saves only its inputs is not rerun: llama's recompute is its
block forward minus ``down_proj``; gpt2's and bert's (dropout / LayerNorm last) are the full
forward; ``selective`` reruns no matmul. The tests hold these figures exactly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import checkpoint as _torch_checkpoint

from memfit.measure import find_blocks
from memfit.modes import Mode
from memfit.techniques._blocks import check_names, resolve_policy
from memfit.techniques._protocol import Change
from memfit.techniques._selective import selective_contexts

__all__ = ["Checkpoint", "CACHE_ARGS", "MODES", "SAVED_OPS"]

MODES = (Mode.KEEP, Mode.RECOMPUTE, Mode.SELECTIVE)
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")   # Note 5
_SAVED_OP_NAMES = (   # Note 3
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm",
    "convolution", "_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward", "_efficient_attention_forward",
)
SAVED_OPS = frozenset(getattr(torch.ops.aten, n) for n in _SAVED_OP_NAMES
                      if hasattr(torch.ops.aten, n))   # those this torch build has

# torch's non-reentrant checkpoint engine and its positional parameters before ``*args`` (Note 1)
_ENGINE = _torch_checkpoint._checkpoint_without_reentrant_generator
_ENGINE_PARAMS = [p for p in inspect.signature(_ENGINE).parameters.values()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]


def _engine_args(**given) -> list:
    """The engine's positional parameters in order: ``given`` by name, the rest at defaults."""
    return [given[p.name] if p.name in given else p.default for p in _ENGINE_PARAMS]


class _BlockHooks:
    """The forward pre-/post-hook pair that checkpoints one block (Note 1)."""

    preserve_rng_state = True   # tests switch it off to show that RNG replay is what they test

    def __init__(self, forward, selective: bool, autocast_factory, keep_cache: bool):
        self.selective = selective
        self.autocast_factory = autocast_factory
        params = inspect.signature(forward).parameters
        positional = [n for n, p in params.items() if p.kind in
                      (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._cache_args = () if keep_cache else tuple(   # (name, position or None)
            (n, positional.index(n) if n in positional else None) for n in CACHE_ARGS
            if n in params or any(p.kind is p.VAR_KEYWORD for p in params.values()))
        self._running: list = []    # one engine generator (or None) per call in progress

    def pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if not torch.is_grad_enabled():
            self._running.append(None)
            return None
        args, kwargs = self._drop_caches(list(args), dict(kwargs))
        fn, clash = module.forward, {p.name for p in _ENGINE_PARAMS} & kwargs.keys()
        inner = dict(kwargs)
        if clash:      # a block keyword named like an engine parameter: bind it (Note 1)
            fn = functools.partial(fn, **{k: inner.pop(k) for k in clash})
        engine = _ENGINE(*_engine_args(fn=fn, preserve_rng_state=self.preserve_rng_state,
                                       context_fn=self._contexts), *args, **inner)
        next(engine)
        self._running.append(engine)
        return tuple(args), kwargs

    def post(self, module: nn.Module, args: tuple, output):
        if not self._running:        # a hook before ours raised: our pre-hook never ran
            return None
        engine = self._running.pop()
        if engine is not None:
            try:
                next(engine)
            except StopIteration:
                pass
            else:
                raise AssertionError("checkpoint engine did not finish after the forward")
        return None

    def _drop_caches(self, args: list, kwargs: dict):
        for name, pos in self._cache_args:          # Note 5
            if kwargs.get(name) is not None:
                kwargs[name] = None
            if pos is not None and pos < len(args):
                args[pos] = None
        return args, kwargs

    def _contexts(self):
        """(forward context, recompute context) for one checkpointed call (Notes 3, 4)."""
        if self.selective:
            forward, recompute = selective_contexts(SAVED_OPS)
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        if self.autocast_factory is None:
            return forward, recompute
        return forward, _Together(self.autocast_factory, recompute)


class _Together:
    """The recompute context of Note 4: a fresh ``factory()`` and ``recompute`` entered together
    each time checkpoint enters it (once per backward that reaches the block)."""

    def __init__(self, factory, recompute):
        self.factory, self.recompute = factory, recompute
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self):
        with contextlib.ExitStack() as stack:      # a failed enter leaves nothing entered
            stack.enter_context(self.factory())
            stack.enter_context(self.recompute)
            self._stacks.append(stack.pop_all())
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


def _hooks_of(block: nn.Module) -> list[_BlockHooks]:
    return [h.__self__ for h in block._forward_pre_hooks.values()
            if isinstance(getattr(h, "__self__", None), _BlockHooks)]


class Checkpoint:
    """Recompute chosen blocks in backward instead of keeping their activations."""

    @dataclass(frozen=True)
    class Config:
        # "none" | "all" | "every:K" (Note 2) | "selective" (Note 3) | a tuple of the qualified
        # names of the modules to recompute (any modules of the model, not only its blocks)
        policy: str | tuple[str, ...] = "none"

        def __post_init__(self):
            p = self.policy
            if isinstance(p, tuple):
                if not p or not all(isinstance(n, str) for n in p):
                    raise ValueError(f"Checkpoint.Config.policy={p!r}: a tuple must hold at least "
                                     "one module name (str); use 'none' to recompute nothing")
            elif not isinstance(p, str):
                raise ValueError(f"Checkpoint.Config.policy={p!r} must be a str or a tuple of "
                                 "block names (not a list)")
            elif p.startswith("every:"):
                k = p[len("every:"):]
                if not k.strip().lstrip("-").isdigit() or int(k) < 1:
                    raise ValueError(f"Checkpoint.Config.policy={p!r}: K in 'every:K' must be an "
                                     "integer >= 1 (every:1 recomputes every block)")
            elif p not in ("none", "all", "selective"):
                raise ValueError(f"Checkpoint.Config.policy={p!r} is unknown: use 'none', 'all', "
                                 "'every:K', 'selective' or a tuple of block names")

    def __init__(self, config: "Checkpoint.Config", *, autocast_factory=None):
        self.config = config
        # () -> context manager re-entered around each recompute (Note 4); None: real autocast only
        self.autocast_factory = autocast_factory

    def resolve(self, model: nn.Module) -> dict[str, str]:
        """Block name -> ``Mode`` KEEP, RECOMPUTE or SELECTIVE, blocks in execution order."""
        return resolve_policy(model, self.config.policy, Mode.RECOMPUTE, "Checkpoint")

    def apply(self, model: nn.Module, per_block: dict[str, str] | None = None) -> Change:
        """Hook the blocks ``per_block`` (default: ``resolve(model)``) marks recompute/selective.

        Everything is checked before any block is touched. The ``Change`` has the blocks'
        ``modes`` (KEEP, RECOMPUTE or SELECTIVE); its ``remove()`` takes every block's hooks off
        (Note 1), its ``reapply()`` puts the same checkpoint back (same blocks, modes and
        autocast factory)."""
        modes = self.resolve(model) if per_block is None else dict(per_block)
        bad = {n: str(m) for n, m in modes.items() if m not in MODES}
        if bad:
            raise ValueError(f"per_block modes {bad} are unknown: use one of "
                             f"{tuple(m.value for m in MODES)}")
        modes = {n: Mode.parse(m) for n, m in modes.items()}
        chosen = [n for n, m in modes.items() if m != Mode.KEEP]
        check_names(model, chosen, find_blocks(model))
        nested = [(a, b) for a in chosen for b in chosen if b.startswith(a + ".")]
        if nested:
            raise ValueError(f"blocks {nested[0]} are nested: recompute the outer one only")
        for name in chosen:
            block = model.get_submodule(name)
            if _hooks_of(block):
                raise ValueError(f"block {name!r} is already checkpointed: call remove() on the "
                                 "Change the first apply returned before applying again")
            if getattr(block, "gradient_checkpointing", False) is True:
                raise ValueError(f"block {name!r} already has transformers' gradient "
                                 "checkpointing, so it would recompute twice: call "
                                 "model.activation_checkpointing_disable() first (transformers "
                                 "< 5: gradient_checkpointing_disable)")
        hooks = []
        for name in chosen:
            block = model.get_submodule(name)
            pair = _BlockHooks(block.forward, modes[name] == Mode.SELECTIVE, self.autocast_factory,
                               keep_cache=getattr(block, "_can_checkpoint_with_cache", False))
            hooks.append(block.register_forward_pre_hook(pair.pre, with_kwargs=True))
            hooks.append(block.register_forward_hook(pair.post, prepend=True, always_call=True))
        return Change(model, modes=modes, hooks=tuple(hooks),
                      redo=functools.partial(self.apply, model, modes))
