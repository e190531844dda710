"""Chunked cross-entropy over the LM head: the (tokens x vocab) logits never exist whole.

Note 1 (what is computed). A Hugging Face causal LM's own loss (transformers'
``ForCausalLMLoss``) projects every hidden state through the head, upcasts the whole logits to
fp32, shifts the labels left by one (padding the last position with ``ignore_index``, -100) and
takes the mean cross-entropy over the tokens whose shifted label is not ignored (or the sum
divided by ``num_items_in_batch`` when the caller passes it; ``shift_labels`` when given is used
as is). Here the same hidden states and shifted labels are flattened to tokens and split into
``chunks`` pieces of near-equal size (``tensor_split``, at most one piece per token); each piece
goes through the head, is upcast to fp32 and gives the sum of its tokens' cross-entropy; the
sums are added and divided by the same count. The math is the model's: only the order of the
additions differs, so the loss and gradients equal the model's within float tolerance, not
bitwise (the tests hold fp32 to rtol 1e-6 on the loss, 1e-5 on the gradients).
This is torchtune's ``LinearCrossEntropyLoss`` (``num_output_chunks`` pieces, the head and the
fp32 upcast per piece, sum over pieces / non-ignored count) on an unmodified transformers model;
torchtune also drops the ignored tokens before the head, which makes a piece's size depend on
the data, so it is not done here (a trace has no values to count). litgpt's
``chunked_cross_entropy`` chunks logits the head already made whole, which saves only the upcast.

Note 2 (recompute, not saved). A piece's head and loss run under ``torch.utils.checkpoint``
(non-reentrant, no RNG state: neither draws random numbers): the forward keeps only the loss
sum, and backward recomputes that piece's logits, its fp32 copy and its log-softmax to take
their gradient, one piece at a time. So the logits live ``tokens / chunks`` rows at a time in
forward and in backward, at the price of a second head forward per step (2 x tokens x hidden x
vocab FLOPs); the hidden states, which the head needed anyway, are what stays saved. Liger's
fused linear cross-entropy reaches the same memory without a recompute by computing the head's
gradients during the forward (a kernel memfit does not model yet); this follows torchtune's
chunking plus torch's checkpoint. Under a modelled autocast (a trace for a GPU) the recompute
enters ``autocast_factory()``, since checkpoint replays only real ``torch.autocast``.

Note 3 (module hooks, nothing replaced). Three hooks, nothing on the model rewritten: a forward
pre-hook on the model (with kwargs) takes ``labels`` out of the call, so the model computes no
loss of its own, and arms the head; a forward pre-hook on the head
(``model.get_output_embeddings()``) keeps the hidden states it is given and hands the head an
empty slice of them (zero tokens), so the whole logits are never made; a forward hook on the
model (``always_call``: a forward that raised still disarms) computes the loss (Note 1) from
the kept hidden states and returns the model's output with it as ``loss``. ``out.logits`` is
then empty (batch x 0 x vocab). A call without ``labels`` (generation, evaluation without a
loss) runs as it always did. The head's hook does nothing while the loss itself calls the head
(the call is disarmed by then), so a recompute goes through the head's own forward and hooks.

Note 4 (what is refused). A model whose loss is not transformers' ``ForCausalLMLoss``
(``model.loss_function``), that has no output embeddings, or that changes the logits after the
head (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``) is refused at ``apply``: the chunked loss would not be the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.techniques._protocol import Change

__all__ = ["ChunkedLoss", "chunked_causal_lm_loss", "chunkable", "IGNORE_INDEX"]

IGNORE_INDEX = -100        # transformers' default, what a label to leave out is set to
# config attributes that change the logits after the head (Note 4): name -> values that don't
_AFTER_HEAD = {"final_logit_softcapping": (None,), "logit_scale": (None,),
               "logits_scaling": (None, 1, 1.0)}


def chunked_causal_lm_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None,
                           chunks: int, *, ignore_index: int = IGNORE_INDEX,
                           num_items_in_batch=None, shift_labels: torch.Tensor | None = None,
                           recompute_context: Callable | None = None) -> torch.Tensor:
    """transformers' causal-LM loss of ``head(hidden)`` computed ``chunks`` pieces of tokens at
    a time (Notes 1, 2): ``labels`` are shifted left here unless ``shift_labels`` is given.
    ``recompute_context``: () -> a context entered around each piece's recompute."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] != targets.shape[0]:
        raise ValueError(f"chunked_loss: the head gets {flat.shape[0]} hidden states but the "
                         f"labels have {targets.shape[0]} tokens")
    piece = functools.partial(_piece_sum, head, ignore_index)
    grad = torch.is_grad_enabled() and (
        flat.requires_grad or any(p.requires_grad for p in head.parameters()))
    contexts = None if recompute_context is None else \
        (lambda: (contextlib.nullcontext(), recompute_context()))
    total = None
    for h, t in zip(flat.tensor_split(max(1, min(chunks, flat.shape[0]))),
                    targets.tensor_split(max(1, min(chunks, flat.shape[0])))):
        if grad:
            part = checkpoint(piece, h, t, use_reentrant=False, preserve_rng_state=False,
                              **({} if contexts is None else {"context_fn": contexts}))
        else:
            part = piece(h, t)
        total = part if total is None else total + part
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _piece_sum(head: nn.Module, ignore_index: int, hidden: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """The summed fp32 cross-entropy of one piece of tokens (Note 1)."""
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=ignore_index,
                           reduction="sum")


class _LossHooks:
    """The three hooks of Note 3 and the calls in progress (a stack: a model may call itself)."""

    def __init__(self, head: nn.Module, chunks: int, recompute_context: Callable | None):
        self.head, self.chunks, self.recompute_context = head, chunks, recompute_context
        self._calls: list[dict | None] = []

    def model_pre(self, module: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("labels") is None:
            self._calls.append(None)
            return None
        kwargs = dict(kwargs)
        call = {"labels": kwargs.pop("labels"), "hidden": None,
                "num_items_in_batch": kwargs.get("num_items_in_batch"),
                "shift_labels": kwargs.get("shift_labels"),
                "ignore_index": kwargs.get("ignore_index", IGNORE_INDEX)}
        self._calls.append(call)
        return args, kwargs

    def head_pre(self, module: nn.Module, args: tuple):
        call = self._calls[-1] if self._calls else None
        if call is None or call["hidden"] is not None or not args:
            return None
        call["hidden"] = args[0]
        return (args[0][..., :0, :], *args[1:])

    def model_post(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if not self._calls:            # a hook before ours raised: our pre-hook never ran
            return None
        call = self._calls.pop()
        if call is None or output is None:      # no labels, or the forward raised
            return None
        if call["hidden"] is None:
            raise RuntimeError(f"chunked_loss: {type(module).__name__}'s forward never called "
                               f"its head ({type(self.head).__name__}), so there is no loss "
                               "to chunk; leave chunked_loss unset for this model")
        loss = chunked_causal_lm_loss(self.head, call["hidden"], call["labels"], self.chunks,
                                      ignore_index=call["ignore_index"],
                                      num_items_in_batch=call["num_items_in_batch"],
                                      shift_labels=call["shift_labels"],
                                      recompute_context=self.recompute_context)
        return _with_loss(output, loss)


def _with_loss(output, loss: torch.Tensor):
    """The model's ``output`` with ``loss`` as its loss (a ModelOutput, a tuple or a dict)."""
    if dataclasses.is_dataclass(output) and "loss" in {f.name for f in
                                                       dataclasses.fields(output)}:
        return dataclasses.replace(output, loss=loss)
    if isinstance(output, tuple):
        return (loss, *output)
    if isinstance(output, Mapping):
        return {"loss": loss, **output}
    raise TypeError(f"chunked_loss: cannot put the loss into a {type(output).__name__} output")


def chunkable(model: nn.Module) -> bool:
    """Whether ``apply`` takes ``model`` (Note 4): what a planner asks before weighing it."""
    try:
        _head_of(_unwrap(model))
    except ValueError:
        return False
    return True


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _head_of(model: nn.Module) -> nn.Module:
    """The model's LM head, after refusing what the chunked loss would not equal (Note 4)."""
    name = type(model).__name__
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        raise ValueError(f"chunked_loss needs a causal LM with an output head "
                         f"(model.get_output_embeddings(), as transformers' *ForCausalLM "
                         f"have); {name} has none: leave chunked_loss unset")
    loss_fn = getattr(model, "loss_function", None)
    if getattr(loss_fn, "__name__", None) != "ForCausalLMLoss":
        raise ValueError(f"chunked_loss computes transformers' causal-LM loss "
                         f"(ForCausalLMLoss), but {name}'s loss is "
                         f"{getattr(loss_fn, '__name__', loss_fn)!r}: leave chunked_loss unset")
    config = getattr(model, "config", None)
    for attr, plain in _AFTER_HEAD.items():
        value = getattr(config, attr, None)
        if value not in plain:
            raise ValueError(f"chunked_loss: {name} changes the logits after its head "
                             f"(config.{attr}={value!r}), which the chunked loss does not "
                             "model: leave chunked_loss unset")
    return head


class ChunkedLoss:
    """The causal-LM loss computed over pieces of tokens, the logits recomputed in backward."""

    @dataclass(frozen=True)
    class Config:
        # pieces the tokens of one micro-batch are split into: each piece's logits (tokens /
        # chunks x vocab) exist only while its loss or its gradient is computed (Notes 1, 2)
        chunks: int = 8

        def __post_init__(self):
            c = self.chunks
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"ChunkedLoss.Config.chunks must be an int >= 1, got {c!r}")

    def __init__(self, config: "ChunkedLoss.Config", *, autocast_factory=None):
        self.config = config
        # () -> context manager entered around each piece's recompute (Note 2); None: real
        # autocast only, which checkpoint replays by itself
        self.autocast_factory = autocast_factory

    def apply(self, model: nn.Module) -> Change:
        """Hook ``model`` and its head (Note 3); refuses a model whose loss it would not
        equal (Note 4). The ``Change``'s ``remove()`` takes the three hooks off."""
        head = _head_of(_unwrap(model))
        hooks = _LossHooks(head, self.config.chunks, self.autocast_factory)
        handles = (model.register_forward_pre_hook(hooks.model_pre, with_kwargs=True),
                   head.register_forward_pre_hook(hooks.head_pre),
                   model.register_forward_hook(hooks.model_post, with_kwargs=True,
                                               always_call=True))
        note = (f"chunked_loss={self.config.chunks}: the loss goes through the head "
                f"{self.config.chunks} pieces of tokens at a time, each piece's logits "
                "recomputed in backward; out.logits is empty (techniques.chunked_loss)")
        return Change(model, notes=(note,), hooks=handles,
                      redo=functools.partial(self.apply, model))
