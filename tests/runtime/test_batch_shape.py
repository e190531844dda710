"""The batch a plan is made for (runtime.batch_shape): a larger batch warns in runner.step, and
``fit(max_seq_len=L)`` plans for the longest batch without building it."""

import warnings

import pytest
import torch

import memfit
from memfit.runtime.batch_shape import extend_batch
from memfit.step import prepare_batch
from tests.helpers import tiny


def _steps(runner, *batches):
    """The memfit warnings each ``runner.step`` raised, one list per batch."""
    out = []
    for b in batches:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            runner.step(b)
        out.append([str(x.message) for x in w if "larger than the one" in str(x.message)])
    return out


def test_a_longer_batch_warns_once_per_shape_a_shorter_one_never():
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    shorter, longer, longest = (tiny("gpt2", batch_size=4, seq_len=n)[1] for n in (8, 24, 32))
    _, more = tiny("gpt2", batch_size=6, seq_len=16)
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch)
    got = _steps(runner, batch, shorter, longer, longer, longest, more)
    assert got[:2] == [[], []]                   # the planned batch and a shorter one
    (msg,) = got[2]
    assert "input_ids [4, 24] (planned [4, 16])" in msg and "max_seq_len=24" in msg
    assert got[3] == []                          # the same shape again: warned already
    assert len(got[4]) == 1 and "max_seq_len=32" in got[4][0]
    assert len(got[5]) == 1 and "[6, 16] (planned [4, 16])" in got[5][0]
    assert "largest batch as the example" in got[5][0]


def test_max_seq_len_sets_what_warns():
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    _, long = tiny("gpt2", batch_size=4, seq_len=32)
    _, longer = tiny("gpt2", batch_size=4, seq_len=40)
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, max_seq_len=32)
    got = _steps(runner, long, longer)
    assert got[0] == [] and len(got[1]) == 1 and "(planned [4, 32])" in got[1][0]


def test_the_extended_batch_is_traced_as_the_real_long_one():
    # Oracle: the estimate of the example extended on meta equals, byte for byte, the estimate
    # of a real batch of that length (the all-ones mask dropped in both, Note 1).
    model, short = tiny("gpt2", batch_size=4, seq_len=16)
    _, long = tiny("gpt2", batch_size=4, seq_len=64)
    ext = extend_batch(prepare_batch(short), 64)
    assert {k: (v.device.type, tuple(v.shape), v.dtype) for k, v in ext.items()} == \
        {k: ("meta", (4, 64), torch.long) for k in ("input_ids", "labels")}
    a, b = memfit.estimate(model, ext, "adamw"), memfit.estimate(model, long, "adamw")
    assert (a.peak_bytes, a.breakdown) == (b.peak_bytes, b.breakdown)


def test_extension_rule():
    b = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
         "attention_mask": torch.zeros(2, 1, 5, 5), "pixel_values": torch.zeros(2, 5, 3),
         "labels": torch.zeros(2, 5, dtype=torch.long)}
    e = extend_batch(b, 9)
    assert tuple(e["attention_mask"].shape) == (2, 1, 9, 9) and e["labels"].shape == (2, 9)
    assert e["pixel_values"] is b["pixel_values"]                    # not a sequence input
    assert tuple(extend_batch({"input_ids": torch.zeros(5, 5)}, 7)["input_ids"].shape) == (5, 7)
    with pytest.raises(ValueError, match="shorter than the example batch"):
        extend_batch(b, 4)
    with pytest.raises(ValueError, match="int >= 1"):
        extend_batch(b, 0)
    with pytest.raises(ValueError, match="Mapping batch"):
        extend_batch((torch.zeros(2, 5),), 9)
    with pytest.raises(ValueError, match="sequence length is unknown"):
        extend_batch({"x": torch.zeros(2, 5)}, 9)


def test_fit_with_max_seq_len_runs_the_long_batch_in_budget():
    # Budget 15% over the short batch's plain step: the plan for the short batch alone is the
    # plain step (the fastest, and it fits), and a 4x longer batch runs out of memory under it;
    # planned with max_seq_len=64 the long batch runs within the budget (and warns nothing).
    def tracked_peak(runner, b):
        runner.step(b)
        with memfit.track(runner.model, runner.optimizer) as t:
            runner.step(b)
        return t.peak_bytes

    model, short = tiny("gpt2", batch_size=4, seq_len=16)
    _, long = tiny("gpt2", batch_size=4, seq_len=64)
    budget = int(tracked_peak(memfit.fit(model, torch.optim.AdamW(model.parameters()), short),
                              short) * 1.15)
    m2, _ = tiny("gpt2", batch_size=4, seq_len=16)
    unguarded = memfit.fit(m2, torch.optim.AdamW(m2.parameters()), short)
    with pytest.warns(UserWarning, match="larger than the one"):   # (no model: see oom_guard)
        with memfit.track(device="cpu", budget=budget):
            with pytest.raises(memfit.OutOfMemory):
                unguarded.step(long)
    m3, _ = tiny("gpt2", batch_size=4, seq_len=16)
    runner = memfit.fit(m3, torch.optim.AdamW(m3.parameters()), short, budget=budget,
                        max_seq_len=64)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*larger than the one")
        runner.step(long)
        with memfit.track(m3, runner.optimizer, budget=budget) as t:
            for _ in range(2):
                runner.step(long)
    assert t.peak_bytes <= budget and t.online_peak_bytes <= budget
    assert runner.plan.predicted_peak_bytes <= budget
