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
An in-place op on a known tensor makes it unknown (the real values are never written), and so
are the known tensors that share its storage (views of it, its base). This is the all-ones-mask
rule of ``memfit.step.prepare_batch`` carried through the step: where the real step's control
flow or sizes depend on the data, the trace reads the same data.

Note 3 (values made in the step). A factory op whose values are fixed by its arguments alone
(``ones``, ``zeros``, ``full``, ``arange``, ``scalar_tensor`` and their ``_like`` / ``new_``
forms) makes a known tensor, of any dtype, within the same size limit: Bart's decoder makes
the all-ones mask it was not given (``torch.ones(batch, length)``) and transformers reads it
(``trace.known_values``), as the real step does. Nothing with a symbolic size (a shared trace's
batch, ``trace.symbolic``) is made known or mirrored: that would fix the size it stands for.

Note 2 (what is resolved). When the fake mode refuses an op for want of values, ``resolve``
runs it on the real values and returns fakes of the real outputs' sizes, strides and dtypes
(which are what the real kernel allocates, so the counter counts the real bytes), and links
them. ``masked_select`` needs only its mask known, boolean indexing only its boolean indices
(they are replaced by their ``nonzero`` columns, as the real ``index`` kernel does), ``.item()``
returns the real number. Anything else unknown is left to fail as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["DataValues", "MAX_KNOWN_ELEMENTS"]

MAX_KNOWN_ELEMENTS = 1 << 22
"""Ops on more elements (inputs plus outputs) than this are not mirrored on real values."""

_aten = torch.ops.aten


class DataValues:
    """Fake tensor -> the real CPU tensor it stands for (Note 1)."""

    def __init__(self):
        self._real = WeakIdKeyDictionary()

    @classmethod
    def from_batch(cls, copier, batch) -> DataValues:
        """The integer and bool tensors of the real ``batch``, linked to their fakes in ``copier``
        (a ``memfit.trace.fake.FakeCopier``; ``copier.tensor`` returns a tensor's one fake)."""
        values = cls()
        leaves = batch.values() if isinstance(batch, Mapping) else tree_flatten(batch)[0]
        for t in leaves:
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

    def real(self, fake: torch.Tensor) -> torch.Tensor | None:
        """The real values of ``fake``, or ``None`` when they are not known."""
        return self._real.get(fake)

    def __len__(self) -> int:
        return len(self._real)

    def propagate(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on fakes: mirror it on real values where every input is known (Note 1),
        or where its values are fixed by its arguments (Note 3)."""
        if func in _FIXED_VALUES:
            self._made(func, args, kwargs, out)
            return
        if not self._real:
            return
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = [t in self._real for t in inputs]
        if not any(known):
            return
        if func._schema.is_mutable:
            self._forget(inputs)
            return
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if (not all(known) or not outputs or _any_symbolic((args, kwargs, outputs))
                or _elements(inputs + outputs) > MAX_KNOWN_ELEMENTS):
            return
        real_out = self._run_real(func, args, kwargs)
        for fake, real in zip(outputs, [t for t in tree_flatten(real_out)[0] if isinstance(t, torch.Tensor)]):
            if tuple(fake.shape) == tuple(real.shape) and fake.dtype == real.dtype:
                self._real[fake] = real

    def resolve(self, func, args, kwargs):
        """The outputs of a data-dependent ``func`` that the fake mode refused (Note 2), or ``None``."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if inputs and all(t in self._real for t in inputs) and not _any_symbolic((args, kwargs)):
            if _elements(inputs) > MAX_KNOWN_ELEMENTS:
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
                or out.numel() > MAX_KNOWN_ELEMENTS):        # symbolic sizes: no guard is added
            return
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map(lambda t: torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype) if isinstance(t, torch.Tensor) else t, (args, kwargs))
            real = func(*real_args, **{**real_kwargs, "device": "cpu"})
        if tuple(real.shape) == tuple(out.shape) and real.dtype == out.dtype:
            self._real[out] = real

    def _forget(self, inputs) -> None:
        """An in-place op touched ``inputs``: they, and known tensors on their storages, are unknown
        (Note 1)."""
        storages = {t.untyped_storage()._cdata for t in inputs}
        for t in [t for t in self._real.keys() if t.untyped_storage()._cdata in storages]:
            self._real.pop(t, None)
        for t in inputs:
            self._real.pop(t, None)

    def _run_real(self, func, args, kwargs):
        real_args, real_kwargs = tree_map(lambda t: self._real[t] if isinstance(t, torch.Tensor)
                                          else t, (args, kwargs))
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

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
        with unset_fake_temporarily():
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
            with unset_fake_temporarily():
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


def _any_symbolic(tree) -> bool:
    """Whether ``tree`` holds a symbolic number or a tensor of symbolic sizes or strides."""
    for x in tree_flatten(tree)[0]:
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
