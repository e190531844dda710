"""``memfit.plan(gpus="auto" | N, sharding=...)``: the layout and per-rank plan, verified.

Oracles: ``memfit.estimate(gpus=N, sharding=...)`` of the plan's own knobs on one rank's batch
(estimate_sharded, itself equal to real gloo ranks to the byte: tests/distributed) must give
the plan's predicted bytes, under the budget; the budget is set below what one device's state
alone needs (parameters + gradients + AdamW state, counted by hand from the parameter count),
so one GPU cannot be the answer.
"""

import dataclasses

import pytest

import memfit
from memfit.api._compare_gpus import NO_BF16_AUTO, compare_gpus
from memfit.api._plan_sharded import plan_sharded_traced
from memfit.api.plan import plan_traced
from memfit.devices import get_device
from tests.helpers import tiny


@pytest.fixture(scope="module")
def gpt2():
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    state = sum(p.numel() for p in model.parameters()) * 4 * 4   # fp32 param, grad, 2 moments
    return model, batch, state


@pytest.fixture(scope="module")
def auto(gpt2):
    model, batch, state = gpt2
    budget = int(state * 0.9)
    return plan_sharded_traced(model, batch, budget, "adamw", "cpu", gpus="auto",
                               offload_optimizer=False, plan_one=memfit.plan), budget


@pytest.mark.slow          # 2 traces + 1-3 sharded re-traces; light siblings: test_refusals,
def test_auto_shards_and_the_retrace_is_the_answer(gpt2, auto):
    model, batch, _ = gpt2
    planned, budget = auto
    p = planned.plan
    assert p.knobs.gpus >= 2 and p.knobs.sharding == "fsdp"     # DDP holds the whole state
    assert p.predicted_device_bytes <= budget
    n = p.batch_size
    assert n == -(-4 // p.knobs.gpus)
    rank = {k: v[:n] for k, v in batch.items()}
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    knobs.pop("offload_optimizer", None)
    again = memfit.estimate(model, rank, "adamw", device="cpu", **knobs)
    assert again.peak_bytes == p.predicted_peak_bytes


@pytest.mark.slow          # test_sharding_export.py, tests/cli/test_plan_sharding.py
def test_the_plan_says_why(auto):
    planned, _ = auto
    text = " ".join(planned.plan.reasons)
    assert "each rank runs" in text and "collectives over" in text
    assert planned.step_s > 0


@pytest.mark.slow
def test_fixed_ddp_is_kept(gpt2):
    model, batch, state = gpt2
    p = memfit.plan(model, batch, state * 4, "adamw", "cpu", gpus=2, sharding="ddp")
    assert (p.knobs.gpus, p.knobs.sharding) == (2, "ddp")
    rank = {k: v[:2] for k, v in batch.items()}
    est = memfit.estimate(model, rank, "adamw", device="cpu", gpus=2, sharding="ddp")
    assert p.predicted_peak_bytes == est.peak_bytes


def test_refusals(gpt2):
    model, batch, state = gpt2
    with pytest.raises(ValueError, match="gpus <= 4"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=8)
    with pytest.raises(ValueError, match="not weighed with sharding"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, offload_optimizer=True)
    with pytest.raises(ValueError, match="use memfit.plan"):
        plan_traced(model, batch, state, "adamw", "cpu", gpus=2)


@pytest.mark.slow
def test_compare_gpus_orders_by_gpu_seconds(gpt2):
    model, batch, state = gpt2
    big = get_device("a100-40gb")
    card = big.cuda_context_bytes + big.cublas_workspace_bytes + big.autograd_workspace_bytes
    small = dataclasses.replace(big, name="a100-small", usable_bytes=card + int(state * 0.9))
    rows = compare_gpus(model, batch, "adamw", specs=[small, big], offload_optimizer=False)
    by = {r.gpu: r for r in rows}
    assert by["a100-40gb"].gpus == 1 and by["a100-small"].gpus >= 2
    seconds = [r.gpu_seconds for r in rows if r.gpu_seconds is not None]
    assert seconds == sorted(seconds)
    for r in rows:
        assert r.rank_bytes <= (small if r.gpu == "a100-small" else big).usable_bytes


@pytest.mark.slow          # 2 traces + a sharded re-trace; light sibling: test_mp_policy_refusals
def test_fsdp_mixed_precision_plan_is_its_own_retrace(gpt2):
    """FSDP2's MixedPrecisionPolicy is weighed against autocast where the precision is bf16
    (api._plan_sharded Note 6); fixed by the caller, the plan's bytes are
    estimate(mp_policy="bf16")'s of one rank's batch (itself exact against gloo ranks:
    tests/distributed/test_sharded_exact.py)."""
    model, batch, state = gpt2
    p = memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, mp_policy="bf16")
    assert (p.knobs.sharding, p.knobs.mp_policy, p.knobs.precision) == ("fsdp", "bf16", "fp32")
    rank = {k: v[:2] for k, v in batch.items()}
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    knobs.pop("offload_optimizer", None)
    again = memfit.estimate(model, rank, "adamw", device="cpu", **knobs)
    assert again.peak_bytes == p.predicted_peak_bytes <= state
    assert "MixedPrecisionPolicy" in p.explain()


def test_mp_policy_refusals(gpt2):
    model, batch, state = gpt2
    with pytest.raises(ValueError, match="FSDP2's"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, sharding="ddp",
                    mp_policy="bf16")
    with pytest.raises(ValueError, match="pick one"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, precision="bf16",
                    mp_policy="bf16")
    with pytest.raises(ValueError, match="mp_policy='fp16' is not one of bf16"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, mp_policy="fp16")


def test_mixed_precision_halves_the_unsharded_weights(gpt2):
    """planner.sharding Note 5 against Note 4: the same bf16 trace, one rank of FSDP2 with and
    without the policy differ by the autocast copies and half the unsharded weights."""
    from memfit.planner.sharding import Candidate, _sizes, shard_estimate
    model, batch, _ = gpt2
    est = memfit.estimate(model, batch, "adamw", device="cpu", precision="bf16")
    auto = shard_estimate(est, Candidate(2, "fsdp", True))
    mp = shard_estimate(est, Candidate(2, "fsdp", True, "bf16"))
    s = _sizes(est)
    fw, bw = est.phases["forward"], est.phases["backward"]
    diff = [a - b for a, b in zip(auto.timeline_by_category["params"],
                                  mp.timeline_by_category["params"])]
    unsharded = s.root + 2 * s.max_block
    assert diff[fw] == pytest.approx(unsharded / 2 + s.blocks / 2, abs=1)
    assert diff[bw] == pytest.approx(unsharded / 2, abs=1)
    assert diff[0] == 0


@pytest.mark.parametrize("fits_from", [1, 2, 3, 5, 8, 9, None])
def test_fewest_bisects_to_the_linear_scan(fits_from):
    """api._plan_sharded.fewest against a scan of every count, counting the probes."""
    from memfit.api._sharded_models import fewest
    counts = [1, 2, 3, 4, 5, 6, 7, 8]
    probes = []

    def fits(n):
        probes.append(n)
        return fits_from is not None and n >= fits_from

    scan = next((n for n in counts if fits_from is not None and n >= fits_from), None)
    assert fewest(counts, fits) == scan
    assert len(probes) <= 4                       # 1 + log2(8), not 8
    assert fewest([], fits) is None


@pytest.mark.parametrize("op_log", [["aten.mm.default"], ["aten.convolution.default"]])
def test_the_layout_search_counts_the_card_a_rank_counts(op_log):
    """The layout models' bytes outside the allocator are a rank's card's (trace.card): with a
    convolution, cuDNN's kernels too (left out, the layout search found one GPU fitting under
    a conv model's one-device floor, and the refusal said both)."""
    from memfit.trace.card import card_breakdown, fixed_bytes

    spec = get_device("rtx-4090")
    _, outside = fixed_bytes(spec, op_log)
    card = card_breakdown(spec, 1 << 30, op_log)
    assert outside == card.cuda_context_bytes + card.library_kernels_bytes + card.cudnn_bytes


def test_compare_gpus_says_why_a_card_without_bf16_is_weighed_at_fp32(gpt2):
    """Precision "auto" on a card without bf16 is weighed at fp32 (a sharded fp16 GradScaler
    is not modelled): the row says so, a card with bf16 does not (_compare_gpus Note 2)."""
    model, batch, _ = gpt2
    pascal, ampere = get_device("gtx-1080-ti"), get_device("a100-40gb")
    rows = {r.gpu: r for r in compare_gpus(model, batch, "adamw", specs=[pascal, ampere],
                                           precision="auto", offload_optimizer=False)}
    assert (rows["gtx-1080-ti"].precision, rows["gtx-1080-ti"].note) == ("fp32", NO_BF16_AUTO)
    assert (rows["a100-40gb"].precision, rows["a100-40gb"].note) == ("bf16", "")


@pytest.fixture(scope="module")
def gpt2_short():       # a step whose peak is the optimizer's (2 samples of 2 tokens)
    return tiny("gpt2", batch_size=2, seq_len=2)


def test_a_gpu_card_is_weighed_with_the_optimizer_a_gpu_steps(gpt2_short):
    """On a GPU torch's AdamW defaults to ``foreach``, whose temporaries span every parameter;
    the CPU trace the rows are read from would take the for-loop. The rows of an AdamW left
    to its default are those of ``optimizer_impl="foreach"``, not the for-loop's (which put a
    full fine-tune of Llama-2-7B on one H200 at 109.6 GB against the estimate's 147.4)."""
    from memfit.api._sharded_models import _setup, _trace

    model, batch = gpt2_short
    card = get_device("a100-40gb")

    def row(**knobs):
        (r,) = compare_gpus(model, batch, "adamw", specs=[card], offload_optimizer=False,
                            **knobs)
        return r.gpus, r.rank_bytes

    assert row() == row(optimizer_impl="foreach")

    def traced(spec, on_card):                 # the one trace the rows are read from
        k, _, p, prepared = _setup(model, batch, "adamw", spec, None, {}, None, None)
        est = _trace(model, prepared, "adamw", None, None, k, p, lambda m: None, spec,
                     on_card=on_card)
        return est.knobs.optimizer_impl, est.peak_bytes

    on_gpu = traced(card, on_card=False)       # a CPU trace for a GPU: foreach, as there
    assert on_gpu[0] == "foreach"
    assert traced(get_device("cpu"), on_card=False)[1] < on_gpu[1]    # the CPU's for-loop


def test_a_gpu_rank_steps_foreach_as_torch_does_there(gpt2_short):
    """A rank of a GPU job steps AdamW's GPU default, ``foreach`` over its DTensor shards
    (api._traced Note 2): the trace of the default is the trace of the knob, to the byte, and
    under FSDP2's CPU offload (the shards step on the host) the for-loop's."""
    from memfit.api._sharded import estimate_sharded

    model, batch = gpt2_short

    def peak(sharding, **knobs):
        return estimate_sharded(model, batch, device="a100-40gb", world_size=2,
                                sharding=sharding, **knobs).peak_bytes

    assert peak("ddp") == peak("ddp", optimizer_impl="foreach") != \
        peak("ddp", optimizer_impl="for-loop")
    assert peak("fsdp", fsdp_offload=True) == \
        peak("fsdp", fsdp_offload=True, optimizer_impl="for-loop")


def test_the_traced_card_s_one_gpu_row_is_its_estimate(gpt2_short):
    """_compare_gpus Note 3: the rows are read off one trace made for the first card of the
    precision, as ``estimate`` traces it (CUDA models, the allocator's replay): that card's
    one-GPU row is its plain step's device bytes, to the byte; a card after it is a model."""
    model, batch = gpt2_short
    first, other = get_device("a100-40gb"), get_device("rtx-4090")
    rows = {r.gpu: r for r in compare_gpus(model, batch, "adamw", specs=[first, other],
                                           precision="bf16", offload_optimizer=False)}
    est = memfit.estimate(memfit.Job(model, batch), device=first, precision="bf16")
    assert rows["a100-40gb"].gpus == 1
    assert rows["a100-40gb"].rank_bytes == est.device_bytes
    assert rows["rtx-4090"].gpus == 1 and rows["rtx-4090"].rank_bytes > 0
