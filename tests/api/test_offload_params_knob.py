"""offload_params through estimate and fit: exact against track, training bitwise unchanged,
composed with optimizer offload (which it needs), checkpointing and low-bit states."""

import warnings

import pytest
import torch

import memfit
import memfit.techniques.offload
from tests.helpers import tiny, track_runner_step


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OptimizerOffload", category=UserWarning)
        yield


@pytest.mark.slow
@pytest.mark.parametrize("arch,knobs", [
    ("gpt2", {}),
    ("bert-base", {}),
    ("gpt2", {"checkpoint": "all"}),
    ("llama-1b", {"micro_batch_size": 1}),
])
def test_estimate_equals_track_to_the_byte(arch, knobs):
    model, batch = tiny(arch)
    alone = memfit.estimate(model, batch, optimizer="adamw", offload_optimizer=True, **knobs)
    knobs = dict(knobs, offload_params="all", offload_optimizer=True)
    est = memfit.estimate(model, batch, optimizer="adamw", **knobs)
    assert est.breakdown["params"] < alone.breakdown["params"]
    t = track_runner_step(model, batch, "adamw", **knobs)
    assert (est.peak_bytes, est.breakdown, est.timeline, est.host_peak_bytes) == \
        (t.peak_bytes, t.breakdown, t.timeline, t.host_peak_bytes)


@pytest.mark.parametrize("knobs", [{}, {"checkpoint": "every:2", "micro_batch_size": 1}])
def test_fitted_runner_trains_bitwise_like_the_plain_one(knobs):
    results = []
    for offload in (False, True):
        model, batch = tiny("gpt2", batch_size=2)
        model.eval()                      # no dropout: the two runs draw nothing
        extra = {"offload_params": "all", "offload_optimizer": True} if offload else {}
        runner = memfit.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch,
                            **knobs, **extra)
        if offload:
            assert any(n.startswith("offload_params:") for n in runner.applied.notes)
        losses = [runner.step(batch) for _ in range(3)]
        runner.close()                    # fetches the weights back onto the model
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def test_composes_with_low_bit_states():
    pytest.importorskip("bitsandbytes")      # optimizer_state="8bit"
    model, batch = tiny("gpt2")
    knobs = dict(offload_params="every:2", offload_optimizer=True, optimizer_state="8bit")
    est = memfit.estimate(model, batch, optimizer="adamw", **knobs)
    t = track_runner_step(model, batch, "adamw", **knobs)
    assert (est.peak_bytes, est.breakdown, est.host_peak_bytes) == \
        (t.peak_bytes, t.breakdown, t.host_peak_bytes)


def test_bad_input():
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match="needs offload_optimizer=True"):
        memfit.estimate(model, batch, offload_params="all")
    with pytest.raises(ValueError, match="offload_params='every:0'"):
        memfit.estimate(model, batch, offload_params="every:0", offload_optimizer=True)
    with pytest.raises(ValueError, match="checkpoint policy"):
        memfit.estimate(model, batch, offload_params="selective", offload_optimizer=True)
    with pytest.raises(ValueError, match="match no submodule"):
        memfit.fit(model, torch.optim.AdamW(model.parameters()), batch,
                   offload_params=("nope",), offload_optimizer=True)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_activation_offload_on_the_same_blocks_is_refused():
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match="offloads its activations too"):
        memfit.estimate(model, batch, offload="all", offload_params="all",
                        offload_optimizer=True)
    # disjoint blocks compose
    blocks = [n for n, m in memfit.techniques.offload.Offload(
        memfit.techniques.offload.Offload.Config("all")).resolve(model).items()]
    kn = dict(offload=(blocks[0],), offload_params=tuple(blocks[1:]), offload_optimizer=True)
    est = memfit.estimate(model, batch, optimizer="adamw", **kn)
    t = track_runner_step(model, batch, "adamw", **kn)
    assert (est.peak_bytes, est.breakdown, est.timeline) == (t.peak_bytes, t.breakdown, t.timeline)
