"""fp16 on a GPU target: the GradScaler warm-up step runs under the same CUDA models as the
counted step (issue 11, item 1). Before the fix the warm-up forward ran outside them, so a
checkpointed block's recompute (which re-enters the modelled fp16 autocast) did not match its
own forward and torch.utils.checkpoint raised CheckpointError (saved float32, recomputed
float16) from every fast probe of ``largest_fitting``.

Oracle: the one-step (no replay) estimate and the two-step (replayed) estimate trace the same
ops, so their op logs over the counted step must be the same sequence.
"""

import pytest

import memfit
from memfit import zoo
from memfit.api.levers import largest_fitting

SPEC = zoo.get("llama-1b")


def _model():
    return SPEC.build("causal-lm", tiny=True, seed=0)


@pytest.mark.slow
def test_fp16_checkpoint_fast_trace_matches_the_replayed_one():
    model = _model()
    batch = SPEC.make_batch(model, 4, seq_len=16, task="causal-lm")
    knobs = dict(device="gtx-1080-ti", precision="fp16", checkpoint="all", micro_batch_size=2)
    fast = memfit.estimate(model, batch, allocator_replay=False, **knobs)
    replayed = memfit.estimate(model, batch, **knobs)
    assert fast.op_log == replayed.op_log
    plain = memfit.estimate(model, batch, allocator_replay=False,
                            **{**knobs, "checkpoint": "none"})
    assert fast.peak_bytes < plain.peak_bytes


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_largest_seq_len_on_an_fp16_gpu():
    """A budget between the floor at the shortest sequence and the plain step at the longest
    (the tiny model's own limit, 128), so that the probes plan fp16 steps that recompute."""
    model = _model()
    r = largest_fitting(SPEC, model, "seq_len", batch_size=8, seq_len=None,
                        budget=690_000_000, device="gtx-1080-ti", precision="fp16")
    assert r.knobs["precision"] == "fp16" and r.knobs["checkpoint"] not in (None, "none")
    assert 2 <= r.value and r.device_bytes <= r.limit_bytes == 690_000_000
