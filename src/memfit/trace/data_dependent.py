"""Data-dependent ops in a fake trace, resolved the way the real batch resolves them.

A fake tensor has a shape but no values, so an op whose output *size* depends on values
(``nonzero``, ``unique``, ``masked_select``, indexing with a boolean mask) or that reads a value
back (``.item()``) cannot run under ``FakeTensorMode``: DeBERTa's classification loss calls
``(labels >= 0).nonzero()``, a padded batch's mask is summed and read. The real step takes these
ops on the real batch; so does the trace, from the same values.

Note 1 (what is known). ``DataValues`` maps fake tensors to the real CPU tensors they stand
for. It starts with the batch's integer and bool tensors (ids, labels, masks: small, and what
data-dependent ops read); floating tensors (pixels, audio features, weights) are never known.
``propagate`` extends it op by op: an op all of whose tensor inputs are known, and whose inputs
and outputs hold at most ``MAX_KNOWN_ELEMENTS`` elements, is also run on the real values, and
its outputs become known (``labels >= 0`` from ``labels``, a micro-batch slice from the batch).
An in-place op on a known tensor makes it unknown (the real values are never written; Note 4
mirrors one whose inputs are all known), and so are the known tensors that share its storage
(views of it, its base). This is the all-ones-mask rule of ``memfit.step.prepare_batch``
carried through the step: where the real step's control flow or sizes depend on the data, the
trace reads the same data.
Floating weights are the exception of Note 5.

Note 2 (what is resolved). When the fake mode refuses an op for want of values, ``resolve``
runs it on the real values and returns fakes of the real outputs' sizes, strides and dtypes
(which are what the real kernel allocates, so the counter counts the real bytes), and links
them. ``masked_select`` needs only its mask known, boolean indexing only its boolean indices
(they are replaced by their ``nonzero`` columns, as the real ``index`` kernel does), ``.item()``
returns the real number. Anything else unknown is left to fail as before. ``_ctc_loss.Tensor``
(and its backward) is what the real kernel of that overload does: its lengths read back and the
``int[]`` overload called with them (its fake kernel is in ``fake_kernels``).

Note 3 (values made in the step). A factory op whose values are fixed by its arguments alone
(``ones``, ``zeros``, ``full``, ``arange``, ``scalar_tensor`` and their ``_like`` / ``new_``
forms) makes a known tensor, of any dtype, within the same size limit: Bart's decoder makes
the all-ones mask it was not given (``torch.ones(batch, length)``) and transformers reads it
(``trace.known_values``), as the real step does. Nothing with a symbolic size (a shared trace's
batch, ``trace.symbolic``) is made known or mirrored: that would fix the size it stands for. Nor
is a copy of a weight's shape (``zeros_like(param)``: optimizer state, gradients): the trace
would hold a real copy of each for nothing.

Note 4 (draws, lifted values, in-place updates). Two more kinds of tensor have values the trace
knows as well as the real step. A random draw (``rand``, ``randint``, ... and their ``_like``
forms) that is data or a scalar is drawn from torch's real CPU generator, as the real op draws it,
within Note 3's size limit (a float noise tensor stays fake): a ``torch.rand([])`` takes the branch
that draw gives (the trace restores the generator after it, ``trace.profile``); transformers'
LayerDrop, which draws so, is off in the trace (``trace._layerdrop``: every layer runs). A real
tensor lifted into the trace (``torch.tensor(...)``, ``torch.as_tensor``: ``lift_fresh``) is known
by its values (an optimizer's learning rate, a SpecAugment mask drawn with numpy). And an in-place
op whose inputs are all known is run on copies of the real values written, which are then
linked (an optimizer's step count ``+= 1``, ASGD's ``mu.copy_(...)``): the real values the trace
was given are never written. One that writes a view of a known base (a shifted copy of the ids,
``shifted[:, 1:] = ids[:, :-1]``, as ProphetNet's ``_shift_right`` does; Longformer's mask
``extended[mask == 2] = max``) runs on a copy of the base, through the same view of it; the
base and the view are linked to it (before, both were forgotten, and the step's ``.item()`` on
them failed).

Note 5 (the weights as given). A real model's parameters and buffers keep their real values too
(``link_weight``), for scalar reads only: an op with a weight among its known inputs is mirrored
only when each output is a scalar (a norm, an RMS, a comparison of it), or when it is a view of
the weight. Writing a weight leaves its given values in place. This resolves optimizers that
branch on a parameter's scale (transformers' Adafactor: ``max(eps, RMS)`` with
``scale_parameter``; torch's Adafactor: ``param.norm().item()``). A real step >= 2 reads the
weights one update later and takes the same branch unless that update carries the scale across
the threshold: Adafactor's relative step moves a parameter's RMS by at most 1% of itself (or of
eps) per step, so only a parameter within 1% of eps could differ. A model on the meta device has
no values, and such a read is refused as before.

Note 6 (the real values are the trace's own). Every op this module runs on real values (a
mirror, a resolved op, a factory's or a draw's values) runs with every dispatch mode set aside
(``real_values``), not just the fake one: a trace run inside a user's ``memfit.track`` must
count nothing there (DESIGN, "what the checks have taught"), and these small real tensors are
memfit's bookkeeping, not the user's step. Under ``unset_fake_temporarily`` alone the
enclosing real tracker counted them (112 B of arange/ones per estimate of tiny GPT-2).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from memfit.measure._leaves import leaves, tensors
from memfit.trace._known_storages import KnownOnStorages

__all__ = ["DataValues", "MAX_KNOWN_ELEMENTS", "real_values"]

MAX_KNOWN_ELEMENTS = 1 << 22
"""Ops on more elements (inputs plus outputs) than this are not mirrored on real values."""

_aten = torch.ops.aten


def real_values():
    """A context in which ops run on real tensors seen by no dispatch mode: not the trace's
    fake mode or counter, nor an enclosing real ``track`` (Note 6)."""
    return _disable_current_modes()


class DataValues:
    """Fake tensor -> the real CPU tensor it stands for (Note 1)."""

    def __init__(self):
        self._real = KnownOnStorages()
        self._weights = WeakIdKeyDictionary()     # fake weight -> its real values as given (Note 5)

    @classmethod
    def from_batch(cls, copier, batch) -> DataValues:
        """The integer and bool tensors of the real ``batch``, linked to their fakes in ``copier``
        (a ``memfit.trace.fake.FakeCopier``; ``copier.tensor`` returns a tensor's one fake)."""
        values = cls()
        items = batch.values() if isinstance(batch, Mapping) else tree_flatten(batch)[0]
        for t in items:
            if isinstance(t, torch.Tensor):
                values.offer(copier.tensor(t), t)
        return values

    def offer(self, fake: torch.Tensor, real: torch.Tensor) -> bool:
        """Link ``fake`` to ``real`` if ``real`` is data the trace may read (Note 1: a real integer or
        bool tensor); returns whether it did. A ``FakeCopier`` can offer every tensor it fakes."""
        if not _is_data(real):
            return False
        self.link(fake, real)
        return True

    def link(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Record that ``fake`` holds the values of ``real`` (same shape and dtype)."""
        if tuple(fake.shape) != tuple(real.shape) or fake.dtype != real.dtype:
            raise ValueError(f"cannot link a fake {tuple(fake.shape)} {fake.dtype} tensor to a real "
                             f"{tuple(real.shape)} {real.dtype} one: they must have one shape and dtype")
        self._real[fake] = real

    def link_weight(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Keep the real values of a parameter or buffer as given, for scalar reads (Note 5); a
        meta or fake ``real`` has none."""
        if isinstance(real, FakeTensor) or real.device.type == "meta" or fake in self._real:
            return
        if tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype:
            self._weights[fake] = real

    def real(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The real values of ``fake``, or ``None`` when they are not known."""
        return self._real.get(fake)

    def _known(self, t) -> bool:
        return t in self._real or (bool(self._weights) and t in self._weights)

    def _value(self, t) -> torch.Tensor:
        real = self._real.get(t)
        return real if real is not None else self._weights[t]

    def __len__(self) -> int:
        return len(self._real)

    def propagate(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on fakes: mirror it on real values where every input is known (Note 1),
        or where its values are fixed by its arguments (Notes 3 and 4), or by the weights as
        given (Note 5)."""
        if func in _FIXED_VALUES:
            self._made(func, args, kwargs, out)
            return
        if func.overloadpacket in _DRAWS:                       # Note 4: data or a scalar
            if isinstance(out, torch.Tensor) and (out.numel() <= 1 or not (
                    out.is_floating_point() or out.is_complex())):
                self._made(func, args, kwargs, out)
            return
        if func is _aten.lift_fresh.default:
            if not isinstance(args[0], FakeTensor) and args[0].numel() <= MAX_KNOWN_ELEMENTS:
                with real_values():
                    real = args[0].clone()
                self.link(out, real)                                    # Note 4
            return
        if not self._real and not self._weights:
            return
        inputs = tensors((args, kwargs))
        known = [self._known(t) for t in inputs]
        if not any(known):
            return
        if func._schema.is_mutable:
            self._written(func, args, kwargs, inputs, all(known))
            return
        outputs = tensors(out)
        if not all(known) or not outputs or _any_symbolic((args, kwargs, outputs)):
            return
        if any(t not in self._real for t in inputs):         # a weight among them (Note 5)
            if func.overloadpacket in _UNINITIALIZED:
                return
            if func.is_view:
                self._link_all(outputs, self._run_real(func, args, kwargs), self._weights)
            elif all(t.numel() <= 1 for t in outputs) and not _symbolic(outputs):
                self._link_all(outputs, self._run_real(func, args, kwargs), self._real)
            return
        if _elements(inputs + outputs) > MAX_KNOWN_ELEMENTS:
            return
        self._link_all(outputs, self._run_real(func, args, kwargs), self._real)

    def _written(self, func, args, kwargs, inputs, all_known: bool) -> None:
        """An in-place op on known tensors: mirrored on copies (Note 4), else forgotten (Note 1)."""
        written = _written_args(func, args, kwargs) or inputs
        storage = any(isinstance(x, torch.UntypedStorage) for x in leaves((args, kwargs)))
        if storage or not (all_known and all(t in self._real for t in written)
                           and _elements(inputs) <= MAX_KNOWN_ELEMENTS and not _symbolic(inputs)):
            self._forget(written)
            return
        if any(t._base is not None for t in written):
            self._written_view(func, args, kwargs, written)
            return
        with real_values():
            copies = {id(t): self._real[t].clone() for t in written}
        self._run_real(func, args, kwargs, instead=copies)
        self._forget(written)              # views of what was written keep the old values
        for t in written:
            self._real[t] = copies[id(t)]

    def _written_view(self, func, args, kwargs, written) -> None:
        """Note 4: an in-place op writing one view of a known base (``shifted[:, 1:] = ids``),
        run on a copy of the base's real values, through the same view of the copy; the base
        and the view are then linked to the copy (other views of it are forgotten)."""
        view = written[0]
        base = view._base
        if len(written) != 1 or base not in self._real or _symbolic([base]) or \
                _elements([base]) > MAX_KNOWN_ELEMENTS:
            self._forget(written)
            return
        with real_values():
            copy = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype)
            copy.copy_(self._real[base])
            real_view = copy.as_strided(view.shape, view.stride(),
                                        view.storage_offset() - base.storage_offset())
        self._run_real(func, args, kwargs, instead={id(view): real_view})
        self._forget([base, view])
        self._real[base] = copy
        self._real[view] = real_view

    def _link_all(self, fakes, real_out, into) -> None:
        reals = tensors(real_out)
        for fake, real in zip(fakes, reals):
            if tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype:
                into[fake] = real

    def resolve(self, func, args, kwargs):
        """The outputs of a data-dependent ``func`` that the fake mode refused (Note 2), or ``None``."""
        if func in _CTC_INT_LIST:
            return self._ctc(func, args, kwargs)
        inputs = tensors((args, kwargs))
        if inputs and all(self._known(t) for t in inputs) and not _any_symbolic((args, kwargs)):
            if _elements(inputs) > MAX_KNOWN_ELEMENTS and not all(t.numel() <= 1 for t in inputs):
                return None
            real_out = self._run_real(func, args, kwargs)
            if func is _aten._local_scalar_dense.default:
                return real_out
            return tree_map(lambda r: self._fake_like(r, inputs[0].device)
                            if isinstance(r, torch.Tensor) else r, real_out)
        if func is _aten.masked_select.default:
            return self._masked_select(*args, **kwargs)
        if func is _aten.index.Tensor:
            return self._bool_index(func, *args, **kwargs)
        return None

    def _made(self, func, args, kwargs, out) -> None:
        """Note 3: run a fixed-values factory for real; its input (a ``_like``'s) gives only a shape."""
        if (not isinstance(out, torch.Tensor) or _any_symbolic((args, kwargs, out.shape))
                or out.numel() > MAX_KNOWN_ELEMENTS        # symbolic sizes: no guard is added
                or (func in _FIXED_VALUES and _weight_like(args))):
            return
        with real_values():     # real stand-ins (made under the fake mode: fakes)
            real_args, real_kwargs = tree_map(
                lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                if isinstance(t, torch.Tensor) else t, (args, kwargs))
            real_kwargs = {**real_kwargs, "device": "cpu"} if "device" in real_kwargs else real_kwargs
            real = func(*real_args, **real_kwargs)
        if tuple(real.shape) == tuple(out.shape) and real.dtype == out.dtype:
            self._real[out] = real

    def _forget(self, inputs) -> None:
        """An in-place op touched ``inputs``: they, and known tensors on their storages, are unknown
        (Note 1)."""
        storages = {t.untyped_storage()._cdata for t in inputs}
        for t in self._real.on_storages(storages):
            self._real.pop(t, None)
        for t in inputs:
            self._real.pop(t, None)

    def _run_real(self, func, args, kwargs, instead: dict | None = None):
        """``func`` on the real values; ``instead``: a real tensor to pass for a fake, by the
        fake's id (the copy an in-place op writes, Note 4)."""
        instead = instead or {}
        real_args, real_kwargs = tree_map(
            lambda t: (instead[id(t)] if id(t) in instead else self._value(t))
            if isinstance(t, torch.Tensor) else t, (args, kwargs))
        with real_values():
            return func(*real_args, **real_kwargs)

    def _ctc(self, func, args, kwargs):
        """``_ctc_loss.Tensor`` / ``_ctc_loss_backward.Tensor`` as their real kernels run them: the
        lengths read back, the ``int[]`` overload called, whose fake kernel ``fake_kernels``
        registers (Note 2)."""
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args)) | kwargs
        for name in ("input_lengths", "target_lengths"):
            real = self._real.get(bound[name])
            if real is None:
                return None
            with real_values():
                bound[name] = real.to(torch.long).tolist()
        return _CTC_INT_LIST[func](**bound)

    def _fake_like(self, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fake (the fake mode is the current one) with ``real``'s size, strides and dtype."""
        fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        self._real[fake] = real
        return fake

    def _masked_select(self, x: torch.Tensor, mask: torch.Tensor):
        real_mask = self._real.get(mask)
        if real_mask is None:
            return None
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        with real_values():
            count = int(real_mask.broadcast_to(shape).count_nonzero())
        return torch.empty((count,), dtype=x.dtype, device=x.device)

    def _bool_index(self, func, x: torch.Tensor, indices):
        replaced = []
        for index in indices:
            if index is None or index.dtype not in (torch.bool, torch.uint8):
                replaced.append(index)
                continue
            real = self._real.get(index)
            if real is None:
                return None
            with real_values():
                columns = real.nonzero().unbind(1)
            replaced.extend(self._fake_like(c.contiguous(), index.device) for c in columns)
        out = func(x, replaced)
        self.propagate(func, (x, replaced), {}, out)
        return out


_FIXED_VALUES = {_aten.ones.default, _aten.zeros.default, _aten.full.default, _aten.arange.default,
                 _aten.arange.start, _aten.arange.start_step, _aten.scalar_tensor.default,
                 _aten.ones_like.default, _aten.zeros_like.default, _aten.full_like.default,
                 _aten.new_ones.default, _aten.new_zeros.default, _aten.new_full.default}
"""Factories whose values their arguments fix (Note 3); ``empty`` and random ones are not."""

_DRAWS = {getattr(_aten, name) for name in (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like")}
"""Random factories, drawn from torch's real generator (Note 4)."""

_UNINITIALIZED = {getattr(_aten, name) for name in (
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided")}
"""Ops whose outputs hold no values yet: a weight among their inputs gives them none."""

_CTC_INT_LIST = {_aten._ctc_loss.Tensor: _aten._ctc_loss.default,
                 _aten._ctc_loss_backward.Tensor: _aten._ctc_loss_backward.default}


def _written_args(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes, from its schema's alias annotations."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


def _symbolic(tensors) -> bool:
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape)


def _weight_like(args) -> bool:
    """Whether a ``_like`` / ``new_`` factory copies the shape of a weight (optimizer state,
    a gradient buffer: Note 3 leaves those unknown, or the trace would hold real copies)."""
    return any(t.requires_grad or isinstance(t, torch.nn.Parameter) for t in tensors(args))


def _any_symbolic(tree) -> bool:
    """Whether ``tree`` holds a symbolic number or a tensor of symbolic sizes or strides."""
    for x in leaves(tree):
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(n, torch.SymInt)
                                               for n in (*x.shape, *x.stride())):
            return True
    return False


def _is_data(t) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"
            and not t.is_floating_point() and not t.is_complex())


def _elements(tensors) -> int:
    return sum(t.numel() for t in tensors)
