"""Data-dependent ops traced from the real batch's values: the real op beside the fake one."""

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from memfit.trace.data_dependent import DataValues
from memfit.trace.fake import FakeCopier
from memfit.trace.fidelity import FidelityMode


def layout(t):
    return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()


LABELS = torch.tensor([0, -100, 2, 1, -100])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
HIDDEN = torch.randn(3, 4, 6)

OPS = {  # name -> f(labels, mask, hidden): each calls a data-dependent op on the batch's integers
    "nonzero": lambda lab, m, h: (lab >= 0).nonzero(),                    # DeBERTa's loss
    "unique": lambda lab, m, h: torch.unique(lab, return_inverse=True, return_counts=True),
    "masked_select": lambda lab, m, h: h.masked_select(m.bool()[..., None]),
    "bool_index": lambda lab, m, h: h[m.bool()],                           # packing real tokens
    "item": lambda lab, m, h: torch.full((int(m.sum()),), 1.0),
    "micro_batch_slice": lambda lab, m, h: (lab[1:4] >= 0).nonzero(),
}


def trace(fn, data):
    copier = FakeCopier("cpu")
    batch = {"labels": LABELS, "mask": MASK, "hidden": HIDDEN}
    fakes = copier.tree(batch)
    values = DataValues.from_batch(copier, batch) if data else None
    with copier.mode, FidelityMode(values):
        return fn(fakes["labels"], fakes["mask"], fakes["hidden"])


def flat(out):
    return [layout(t) for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("name", list(OPS))
def test_the_trace_takes_the_shapes_the_real_batch_gives(name):
    real = OPS[name](LABELS, MASK, HIDDEN)
    assert flat(trace(OPS[name], data=True)) == flat(real)


@pytest.mark.parametrize("name", ["nonzero", "masked_select", "bool_index"])
def test_without_the_batch_values_the_fake_mode_refuses(name):
    with pytest.raises(DynamicOutputShapeException):
        trace(OPS[name], data=False)


def test_only_integer_and_bool_batch_tensors_are_known():
    copier = FakeCopier("cpu")
    batch = {"labels": LABELS, "hidden": HIDDEN}
    copier.tree(batch)
    values = DataValues.from_batch(copier, batch)
    assert len(values) == 1 and values.real(copier.tensor(LABELS)) is LABELS


def test_an_in_place_op_forgets_the_values_and_never_writes_the_real_batch():
    labels = LABELS.clone()
    copier = FakeCopier("cpu")
    fake = copier.tensor(labels)
    values = DataValues.from_batch(copier, {"labels": labels})
    with copier.mode, FidelityMode(values):
        fake.clamp_(min=0)
        assert values.real(fake) is None
        with pytest.raises(DynamicOutputShapeException):
            fake.nonzero()                   # unknown now: refused as before, not guessed
    assert torch.equal(labels, LABELS)


def test_offer_links_only_real_integer_and_bool_tensors():
    copier = FakeCopier("cpu")
    values = DataValues()
    assert values.offer(copier.tensor(LABELS), LABELS)
    assert not values.offer(copier.tensor(HIDDEN), HIDDEN)
    meta = torch.empty(3, dtype=torch.long, device="meta")
    assert not values.offer(copier.tensor(meta), meta)
    assert len(values) == 1
