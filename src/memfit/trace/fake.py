"""Fake copies of a model, a batch and tensors: same shapes, dtypes, sharing; no memory.

Note 1 (the copy). The model is deep-copied with its parameters and buffers pre-seeded in the
deepcopy memo by their fake counterparts, so the copy shares nothing with the user's model,
tied parameters stay tied (one object, one fake), hooks and config come along, and no real
tensor data is duplicated. Real tensors become fakes with ``from_tensor`` (sharing kept); the
model's own (parameters, buffers, the state they hold) then have each fake storage grown to the
real storage's size: ``from_tensor`` sizes a storage by the extent the tensor reaches, and a
weight may sit in a larger one, which it keeps alive (torchao's ``NF4Tensor`` keeps its
``quantization_factor``, one value, in a storage of 256). A batch is not grown: a slice of a
larger tensor is what reaches the device (``.to`` copies the slice). ``meta`` tensors become
fakes on ``device`` with the same shape, strides and offset, over a fake storage of the meta
storage's size, one per meta storage: views that share a storage on meta share one in the
copy, as ``from_tensor`` keeps real ones (gptqmodel's two shift tables are views of one).
The real values of the model's parameters and buffers are kept for the scalar reads an
optimizer makes of them (``DataValues.link_weight``: scalar reads only, never written).

Note 2 (a deep copy inside the step). A user's step may deep-copy the model it is handed
(``torch.optim.swa_utils.AveragedModel``, an EMA or teacher made with ``copy.deepcopy``).
torch's ``Tensor.__deepcopy__`` on a fake copies its ``__dict__``, and with it the fake's
``fake_mode``: the copy belongs to a new mode and the next op that meets both stops ("Mixing
fake modes"). While a trace runs, ``FakeDeepcopyMode`` (a ``TorchFunctionMode``) copies a fake
of the trace as the real tensor would be copied, in the trace's mode: a parameter as
``Parameter.__deepcopy__`` does (a ``clone`` in its memory format; no gradient, no attributes);
any other tensor as ``Tensor.__deepcopy__`` does (its whole storage copied once per deep copy,
views re-made on it, its gradient and attributes copied), so the counter counts the bytes the
real copy allocates.

Note 3 (a quantized weight's state). A bitsandbytes ``Params4bit`` or ``Int8Params`` keeps its
scales in attributes (``quant_state``, ``SCB``: ``memfit.measure.attached``). Its fake is a
plain ``nn.Parameter`` (a fake cannot also be that subclass) given the same attributes with
fake tensors, so bitsandbytes' own modules run on it: ``Linear4bit.forward`` finds the weight's
``quant_state`` and calls ``matmul_4bit``, whose ops have fake kernels in bitsandbytes. Tensors a
module holds outside its parameters and buffers (``Linear8bitLt.state.CB``/``SCB``) are faked
into the deep copy's memo the same way, after the weights, whose storage they may share.

Note 4 (a module's containers). ``copy.deepcopy`` copies an ``OrderedDict`` or a ``set`` by its
``__reduce_ex__``, which asks ``copyreg._slotnames`` for the class's slots; a built-in class
cannot keep the answer, so every copy walks its bases again and fails to store it. A module
holds a dozen (parameters, buffers, submodules, hooks; the non-persistent buffers' names): a
tenth of a twin's copy went there (XLM-R large's twin A: 23 ms a copy, 21 ms now). Each is copied into the memo first (the same keys in order,
each value deep-copied with the same memo), innermost modules first.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map

import memfit.trace.fake_kernels  # noqa: F401  (registers fake kernels for ops without one)
from memfit.measure.attached import attached, attached_tensors, module_tensors
from memfit.trace.data_dependent import DataValues

__all__ = ["FakeCopier", "FakeDeepcopyMode"]


class FakeCopier:
    """Turns real or meta tensors (and modules holding them) into fakes of one FakeTensorMode."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._memo: dict[int, torch.Tensor] = {}
        # meta storage -> (it, kept alive so that its address names it, its fake) (Note 1)
        self._meta_storages: dict[int, tuple] = {}
        # the real values of the integer/bool tensors faked (ids, labels, masks), for the
        # data-dependent ops of a trace, which ``DataValues`` resolves from them
        self.data = DataValues()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self._memo:
            return self._memo[id(t)]
        if t.device.type == "meta":
            fake = self._from_meta(t)
        else:
            fake = self._from_real(t.detach())
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        elif t.requires_grad:
            fake.requires_grad_(True)
        self.data.offer(fake, t)
        self._memo[id(t)] = fake
        for name, value in attached(t, self.tensor).items():      # Note 3
            setattr(fake, name, value)
        return fake

    def _from_meta(self, t: torch.Tensor) -> torch.Tensor:
        """A fake of a meta tensor over the fake of its storage (Note 1)."""
        meta = t.untyped_storage()
        with self.mode:
            _, storage = self._meta_storages.get(meta._cdata, (None, None))
            if storage is None and t.storage_offset() == 0:
                # the usual weight, the whole of its storage: made in one op, not three
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                           device=self.device)
                if fake.untyped_storage().nbytes() == meta.nbytes():
                    self._meta_storages[meta._cdata] = (meta, fake.untyped_storage())
                    return fake
            if storage is None:
                storage = torch.empty(meta.nbytes(), dtype=torch.uint8,
                                      device=self.device).untyped_storage()
                self._meta_storages[meta._cdata] = (meta, storage)
            return torch.empty(0, dtype=t.dtype, device=self.device).set_(
                storage, t.storage_offset(), t.shape, t.stride())

    def _from_real(self, t: torch.Tensor) -> torch.Tensor:
        return self.mode.from_tensor(t)

    def tree(self, obj):
        """Fake every tensor in a pytree (dicts, lists, tuples); leave other leaves alone."""
        return tree_map(lambda x: self.tensor(x) if isinstance(x, torch.Tensor) else x, obj)

    def module(self, model: nn.Module) -> nn.Module:
        """A fake deep copy of ``model`` (Note 1); the user's model is not touched."""
        memo = {}
        for m in model.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    memo[id(t)] = self._model_tensor(t)
                    self.data.link_weight(memo[id(t)], t.detach())
        for m in model.modules():             # after the weights: CB may share one (Note 3)
            for t in module_tensors(m):
                if id(t) not in memo:
                    memo[id(t)] = self._model_tensor(t)
        _module_containers(model, memo)
        return copy.deepcopy(model, memo)


    def _model_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The fake of one of the model's own tensors, its storage and those of the state it
        holds grown to their real size (Note 1)."""
        fake = self.tensor(t)
        if t.device.type != "meta":
            _whole_storages(fake, t)
            for inner in attached_tensors(t):
                if inner.device.type != "meta":
                    _whole_storages(self._memo[id(inner)], inner)
        return fake


def _module_containers(model: nn.Module, memo: dict) -> None:
    """Note 4: each module's own ``OrderedDict`` and ``set`` attributes deep-copied into
    ``memo``, innermost modules first, as ``copy.deepcopy`` copies them."""
    for m in reversed(list(model.modules())):
        for v in vars(m).values():
            if id(v) in memo:
                continue
            if type(v) is OrderedDict:
                memo[id(v)] = OrderedDict((k, copy.deepcopy(x, memo)) for k, x in v.items())
            elif type(v) is set:
                memo[id(v)] = {copy.deepcopy(x, memo) for x in v}
            else:
                continue
            memo.setdefault(id(memo), []).append(v)      # kept alive, as deepcopy keeps it


class FakeDeepcopyMode(TorchFunctionMode):
    """``copy.deepcopy`` of a fake of ``mode``, in ``mode``, as a real tensor is copied (Note 2)."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.__deepcopy__ and isinstance(args[0], FakeTensor)
                and args[0].fake_mode is self.mode and args[0].is_leaf):
            return _deepcopy(args[0], args[1])
        return func(*args, **(kwargs or {}))


def _whole_storages(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Give each fake storage the real one's size (Note 1); a wrapper subclass's inner ones."""
    if is_traceable_wrapper_subclass(real):
        for name in real.__tensor_flatten__()[0]:
            _whole_storages(getattr(fake, name), getattr(real, name))
        return
    need = real.untyped_storage().nbytes()
    if fake.untyped_storage().nbytes() < need:
        fake.untyped_storage().resize_(need)


def _deepcopy(t: torch.Tensor, memo: dict) -> torch.Tensor:
    """Note 2: ``Parameter.__deepcopy__`` or ``Tensor.__deepcopy__`` on a fake."""
    if id(t) in memo:
        return memo[id(t)]
    with torch.no_grad():
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(t.clone(memory_format=torch.preserve_format), t.requires_grad)
            memo[id(t)] = new
            return new
        storages = memo.setdefault("__torch_storage__", {})
        key = t.untyped_storage()._cdata
        if key not in storages:
            nbytes = t.untyped_storage().nbytes()
            storages[key] = torch.empty((nbytes,), dtype=torch.uint8,
                                        device=t.device).untyped_storage()
        new = t.new_empty([])
        new.set_(storages[key], t.storage_offset(), t.size(), t.stride())
    if t.requires_grad:
        new.requires_grad_()
    if t.grad is not None:
        new.grad = _deepcopy(t.grad, memo)
    for name, value in t.__dict__.items():        # the user's attributes, not the fake's own
        if name not in new.__dict__:
            setattr(new, name, copy.deepcopy(value, memo))
    memo[id(t)] = new
    return new
