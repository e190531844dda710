"""``estimate_shapes``: one trace with symbolic batch and length, replayed in each shape, gives
exactly what ``memfit.estimate`` gives for that shape (the oracle: a trace of that shape alone),
and a shape the shared trace cannot stand for is traced alone.

The structural oracle is stronger than equal peaks: the replayed ledger (every birth and death,
with its bytes) and the op log equal those of the shape's own trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.api._shared_shapes import estimate_shapes
from memfit.api.estimate import traced_estimate
from memfit.knobs import Knobs
from memfit.trace.fake import FakeCopier
from memfit.trace.symbolic import SymbolicCopier

GPU = "rtx-6000"
FIGURES = ("peak_bytes", "reserved_bytes", "device_bytes", "limit_bytes", "fits")


def zoo_batches(name: str):
    spec = zoo.get(name)
    model = spec.build(None, tiny=True, device="meta")
    return model, lambda s: spec.make_batch(model, s["batch"], seq_len=s["seq"], image_size=None,
                                            padded=False, task=None)


def assert_each_equals_its_own_estimate(model, make, shapes, got, **kwargs):
    for shape, g in zip(shapes, got):
        est = memfit.estimate(model, make(shape), **kwargs)
        for key in FIGURES:
            assert getattr(g, key) == getattr(est, key), (shape, key)


@pytest.mark.parametrize("name,knobs", [
    pytest.param("xlm-roberta-base", dict(precision="fp16", checkpoint="all"),
                 marks=pytest.mark.slow),                 # 10 s
    ("bert-base", dict(precision="fp32")),
])
def test_one_trace_gives_every_shape_its_own_estimate(name, knobs):
    model, make = zoo_batches(name)
    shapes = [{"batch": 4, "seq": 32}, {"batch": 8, "seq": 32}, {"batch": 6, "seq": 64}]
    got = estimate_shapes(model, make, shapes, "adamw", GPU, **knobs)
    assert [g.shared for g in got] == [True] * 3          # one trace served them all
    assert len({g.peak_bytes for g in got}) == 3
    assert_each_equals_its_own_estimate(model, make, shapes, got, optimizer="adamw",
                                        device=GPU, **knobs)


def test_the_replayed_ledger_is_the_shapes_own_event_by_event():
    model, make = zoo_batches("xlm-roberta-base")
    k = Knobs.from_kwargs(precision="fp16")
    copier = SymbolicCopier("cpu", {4: "batch", 32: "seq"})
    _, shared, _ = traced_estimate(model, make({"batch": 4, "seq": 32}), "adamw", GPU, None, k,
                                   copier)
    shape = {"batch": 6, "seq": 40}
    assert copier.holds(shape)
    _, own, _ = traced_estimate(model, make(shape), "adamw", GPU, None, k, FakeCopier("cpu"))
    assert _numbered(shared.ledger.device_events(copier.sizes(shape))) == \
        _numbered(own.ledger.device_events())
    assert list(map(str, shared.window_op_log)) == list(map(str, own.window_op_log))
    # and the traced shape's own figures are the plain trace's
    _, plain, _ = traced_estimate(model, make({"batch": 4, "seq": 32}), "adamw", GPU, None, k,
                                  FakeCopier("cpu"))
    assert _numbered(shared.ledger.device_events()) == _numbered(plain.ledger.device_events())


def _numbered(events):
    """Storages numbered by first appearance: a plain trace makes its first step from the
    counted one (trace.first_step), a shared one traces it, and their ids differ."""
    names = {}
    return [(ev, names.setdefault(sid, len(names)), d, r) for ev, sid, d, r in events]


class _LengthBranch(nn.Module):
    """Takes another path for long inputs: the guard ``seq <= 40`` refuses the longer shape."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, ids):
        h = self.emb(ids)
        if ids.shape[1] > 40:
            h = torch.cat([h, h], dim=-1)[..., :16].contiguous()
        return self.out(h)


def _loss(model, batch):
    return model(batch["ids"]).float().pow(2).mean()


def _ids(shape):
    return {"ids": torch.randint(0, 100, (shape["batch"], shape["seq"]))}


def test_a_shape_the_guards_or_the_rules_refuse_is_traced_alone():
    model = _LengthBranch()
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 24}, {"batch": 4, "seq": 48},
              {"batch": 1, "seq": 32}]
    got = estimate_shapes(model, _ids, shapes, "adamw", GPU, _loss, precision="fp32")
    # the long shape fails the guard; batch 1 is outside the sizes a symbol stands for (>= 2)
    assert [g.shared for g in got] == [True, True, False, False]
    assert_each_equals_its_own_estimate(model, _ids, shapes, got, optimizer="adamw", device=GPU,
                                        loss_fn=_loss, precision="fp32")


def _ids_and_half(shape):
    return {"ids": torch.randint(0, 100, (shape["batch"], shape["seq"])),
            "half": torch.randint(0, 100, (shape["batch"], shape["seq"] // 2))}


def _both_loss(model, batch):
    return _loss(model, batch) + model(batch["half"]).float().mean()


@pytest.mark.parametrize("name", ["half-length", pytest.param("t5-base", marks=pytest.mark.slow)])
def test_a_batch_dimension_that_is_not_a_symbol_is_traced_alone(name):
    """A tensor a quarter (T5's labels) or half the input's length: a dimension the shared
    trace holds fixed, so another length's batch is not the traced one (``same_batch``)."""
    if name == "t5-base":
        (model, make), loss = zoo_batches(name), None
    else:
        model, make, loss = _LengthBranch(), _ids_and_half, _both_loss
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 32}, {"batch": 4, "seq": 40}]
    got = estimate_shapes(model, make, shapes, "adamw", GPU, loss, precision="fp32")
    assert [g.shared for g in got] == [True, True, False]
    assert_each_equals_its_own_estimate(model, make, shapes, got, optimizer="adamw", device=GPU,
                                        loss_fn=loss, precision="fp32")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, ids):
        return self.emb(ids[ids > 50])       # its size is in the data


def test_a_data_dependent_step_traces_every_shape_alone():
    model = _DataDependent()
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 24}]
    torch.manual_seed(0)
    batches = {(s["batch"], s["seq"]): _ids(s) for s in shapes}
    make = lambda s: batches[(s["batch"], s["seq"])]
    got = estimate_shapes(model, make, shapes, "sgd", GPU, _loss, precision="fp32")
    assert [g.shared for g in got] == [False, False]
    assert_each_equals_its_own_estimate(model, make, shapes, got, optimizer="sgd", device=GPU,
                                        loss_fn=_loss, precision="fp32")


def test_a_cpu_target_and_a_single_shape_are_traced_alone():
    model, make = zoo_batches("bert-base")
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 32}]
    assert [g.shared for g in estimate_shapes(model, make, shapes, "sgd", "cpu")] == [False] * 2
    assert [g.shared for g in estimate_shapes(model, make, shapes[:1], "sgd", GPU)] == [False]


def test_symbolic_sizes_need_distinct_values_of_at_least_two():
    with pytest.raises(ValueError, match="distinct names and sizes >= 2"):
        SymbolicCopier("cpu", {1: "batch", 32: "seq"})


def test_batches_whose_tensors_share_or_slice_a_storage_are_traced_alone():
    """A fake of its own per batch tensor would count two views of one storage twice, and a
    slice of a longer buffer by its elements instead of the whole buffer."""
    model = _LengthBranch()
    aliased = lambda s: (lambda ids: {"ids": ids, "half": ids.detach()})(_ids(s)["ids"])
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 32}]
    got = estimate_shapes(model, aliased, shapes, "adamw", GPU, _both_loss, precision="fp32")
    assert [g.shared for g in got] == [False, False]
    assert_each_equals_its_own_estimate(model, aliased, shapes, got, optimizer="adamw",
                                        device=GPU, loss_fn=_both_loss, precision="fp32")
    # cropped from a 40-long buffer: only the full length owns its storage
    cropped = lambda s: {"ids": torch.randint(0, 100, (s["batch"], 40))[:, :s["seq"]]}
    shapes = [{"batch": 4, "seq": 40}, {"batch": 4, "seq": 24}, {"batch": 6, "seq": 40}]
    got = estimate_shapes(model, cropped, shapes, "adamw", GPU, _loss, precision="fp32")
    assert [g.shared for g in got] == [True, False, True]
    assert_each_equals_its_own_estimate(model, cropped, shapes, got, optimizer="adamw",
                                        device=GPU, loss_fn=_loss, precision="fp32")


def test_one_rank_of_a_sharded_job_is_estimated_as_estimate_does():
    model = _LengthBranch()
    shapes = [{"batch": 4, "seq": 32}, {"batch": 6, "seq": 32}]
    got = estimate_shapes(model, _ids, shapes, "adamw", GPU, _loss, precision="fp32", gpus=2,
                          sharding="ddp")
    assert [g.shared for g in got] == [False, False]
    assert_each_equals_its_own_estimate(model, _ids, shapes, got, optimizer="adamw", device=GPU,
                                        loss_fn=_loss, precision="fp32", gpus=2, sharding="ddp")
