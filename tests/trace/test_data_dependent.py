"""Data-dependent ops traced from the real batch's values: the real op beside the fake one."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


def test_an_in_place_op_on_known_values_is_mirrored_and_never_writes_the_real_batch():
    labels = LABELS.clone()
    clamped = LABELS.clamp(min=0)
    copier = FakeCopier("cpu")
    fake = copier.tensor(labels)
    values = DataValues.from_batch(copier, {"labels": labels})
    with copier.mode, FidelityMode(values):
        fake.clamp_(min=0)                    # data_dependent Note 4: run on a copy
        nonzero = fake.nonzero()
    assert torch.equal(values.real(fake), clamped)
    assert layout(nonzero) == layout(clamped.nonzero())
    assert torch.equal(labels, LABELS)


@pytest.mark.parametrize("write", ["slice", "bool_mask"])
def test_an_in_place_op_writing_a_view_of_known_values_is_mirrored(write):
    """ProphetNet's ``_shift_right`` (``shifted[:, 1:] = ids[:, :-1]``, then ``.item()`` of a
    check on it) and Longformer's ``mask[mask == 2] = max`` (a write into a view of its 4-D
    mask) failed: a write into a view forgot the base."""
    mask = MASK.clone()

    def step(m):
        shifted = m.new_zeros(m.shape)
        if write == "slice":
            shifted[:, 1:] = m[:, :-1].clone()
            shifted[:, 0] = 7
        else:
            view = shifted[:, None, :]
            view[m[:, None, :] == 1] = 5
        return shifted

    copier = FakeCopier("cpu")
    fake = copier.tensor(mask)
    values = DataValues.from_batch(copier, {"mask": mask})
    with copier.mode, FidelityMode(values):
        shifted = step(fake)
        count = int((shifted > 0).sum())      # an .item(): refused if the values were lost
    assert torch.equal(values.real(shifted), step(MASK))
    assert count == int((step(MASK) > 0).sum())
    assert torch.equal(mask, MASK)             # the batch itself is never written


def test_an_in_place_op_with_an_unknown_input_forgets_the_values():
    copier = FakeCopier("cpu")
    fake = copier.tensor(LABELS)
    unknown = copier.tensor(torch.empty(LABELS.shape, dtype=LABELS.dtype, device="meta"))
    values = DataValues.from_batch(copier, {"labels": LABELS})
    with copier.mode, FidelityMode(values):
        fake.add_(unknown)
        assert values.real(fake) is None
        with pytest.raises(DynamicOutputShapeException):
            fake.nonzero()                   # unknown now: refused as before, not guessed


def test_offer_links_only_real_integer_and_bool_tensors():
    copier = FakeCopier("cpu")
    values = DataValues()
    assert values.offer(copier.tensor(LABELS), LABELS)
    assert not values.offer(copier.tensor(HIDDEN), HIDDEN)
    meta = torch.empty(3, dtype=torch.long, device="meta")
    assert not values.offer(copier.tensor(meta), meta)
    assert len(values) == 1


# -- values the step makes, and the weights as given (data_dependent Notes 3-5) ---------------

def test_scalars_the_step_makes_are_read_like_the_real_ones():
    """ASGD's state: ``mu = ones(())`` read with ``.item()``, a step count updated in place."""
    def step_state():
        mu, step = torch.ones(()), torch.zeros(())
        for _ in range(3):
            step += 1
            mu.copy_(torch.as_tensor(1 / max(1, float(step) - 1)))
        return float(mu), int(step)

    copier = FakeCopier("cpu")
    with copier.mode, FidelityMode(copier.data):
        traced = step_state()
    assert traced == step_state() == (0.5, 3)


def test_a_random_scalar_is_drawn_from_the_real_generator():
    """LayerDrop's draw: the trace takes the branch the same generator state gives."""
    def layer_drop():
        return [bool(torch.rand([]) < 0.5) for _ in range(8)]

    torch.manual_seed(3)
    real = layer_drop()
    torch.manual_seed(3)
    copier = FakeCopier("cpu")
    with copier.mode, FidelityMode(copier.data):
        traced = layer_drop()
    assert traced == real and len(set(real)) == 2        # both branches taken


def test_scalar_reads_of_the_weights_use_the_weights_as_given():
    """Adafactor's ``max(eps, RMS)``: a scalar of a weight resolves, a weight-sized op does not
    run for real, and writing the weight keeps its given values (Note 5)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    copier = FakeCopier("cpu")
    fake = copier.module(model)
    rms = float(model.weight.norm(2) / model.weight.numel() ** 0.5)
    with copier.mode, FidelityMode(copier.data):
        w = fake.weight
        assert float(w.norm(2) / w.numel() ** 0.5) == rms
        assert bool(max(1e-3, w.norm(2) / w.numel() ** 0.5) is not 1e-3)
        assert copier.data.real(w * 2) is None                    # not a scalar: fake only
        with torch.no_grad():
            w.add_(torch.ones_like(w))                             # an optimizer's update
        assert float(w.norm(2) / w.numel() ** 0.5) == rms         # the weights as given
    assert float(model.weight.norm(2) / model.weight.numel() ** 0.5) == rms


def test_a_meta_model_has_no_weights_to_read():
    model = torch.nn.Linear(6, 4, device="meta")
    copier = FakeCopier("cpu")
    fake = copier.module(model)
    with copier.mode, FidelityMode(copier.data):
        with pytest.raises(DataDependentOutputException):
            float(fake.weight.norm())


# -- CTC loss: the fake kernel beside the real one (fake_kernels Note 1) ------------------------

def ctc_case(targets_2d: bool, reduction: str, zero_infinity: bool):
    torch.manual_seed(0)
    log_probs = torch.randn(2, 30, 7).log_softmax(-1).transpose(0, 1)   # (T, batch, classes)
    labels = torch.tensor([[1, 2, 3, 4, 5, 6], [2, 2, 4, 0, 0, 0]])
    input_lengths, target_lengths = torch.tensor([30, 24]), torch.tensor([6, 3])
    targets = labels if targets_2d else labels.masked_select(labels > 0)
    kwargs = dict(blank=0, reduction=reduction, zero_infinity=zero_infinity)
    return log_probs, targets, input_lengths, target_lengths, kwargs


def ctc_layouts(log_probs, targets, input_lengths, target_lengths, kwargs):
    seen = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if "ctc" in str(func):
                seen.append((func.overloadpacket.__name__,
                             [layout(t) for t in tree_flatten(out)[0]]))
            return out

    log_probs = log_probs.detach().requires_grad_()
    with Outputs():
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, **kwargs)
        loss.sum().backward()
    return seen


@pytest.mark.parametrize("targets_2d", [True, False], ids=["padded-targets", "concatenated"])
@pytest.mark.parametrize("reduction,zero_infinity",
                         [("mean", False), ("sum", True), ("none", False)])
def test_ctc_loss_fake_kernel_allocates_what_the_cpu_kernel_does(targets_2d, reduction,
                                                                  zero_infinity):
    case = ctc_case(targets_2d, reduction, zero_infinity)
    real = ctc_layouts(*case)
    copier = FakeCopier("cpu")
    log_probs, targets, input_lengths, target_lengths, kwargs = case
    batch = {"targets": targets, "il": input_lengths, "tl": target_lengths}
    fakes = copier.tree(batch)
    values = DataValues.from_batch(copier, batch)
    fake_lp = copier.tensor(log_probs.detach())
    with copier.mode, FidelityMode(values):
        traced = ctc_layouts(fake_lp, fakes["targets"], fakes["il"], fakes["tl"], kwargs)
    assert [name for name, _ in real] == ["_ctc_loss", "_ctc_loss_backward"]
    assert traced == real


def test_ctc_loss_with_unknown_lengths_is_refused_as_data_dependent():
    log_probs, targets, input_lengths, target_lengths, kwargs = ctc_case(True, "mean", False)
    copier = FakeCopier("cpu")
    unknown = copier.tensor(torch.empty(2, dtype=torch.long, device="meta"))
    fakes = [copier.tensor(t) for t in (log_probs, targets, target_lengths)]
    with copier.mode, FidelityMode(copier.data):
        with pytest.raises(DataDependentOutputException):
            F.ctc_loss(fakes[0], fakes[1], unknown, fakes[2], **kwargs)
