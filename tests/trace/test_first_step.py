"""A GPU trace's first step made from the counted one (``trace.first_step``) is the traced one.

Oracle: the same estimate with every first step traced (``traced_first_steps``: two whole
steps, as memfit traced them before). The device events the caching allocator replays are
compared one by one (each storage numbered by first appearance: size, category, resize), then
every figure of the estimate, the storage log the static planner and the allocator settings
read (every version's birth and death), and each allocator setting's replay. A first step that
cannot be made is traced, and the test says which.
"""

import pytest

from memfit import zoo
from memfit.api._blockwise import blockwise_estimate
from memfit.api._traced import figures
from memfit.api.estimate import traced_estimate
from memfit.knobs import Knobs
from memfit.memplan import allocator_options
from memfit.trace import FakeCopier
from memfit.trace.first_step import traced_first_steps

FIGURES = ("peak_bytes", "reserved_bytes", "device_bytes", "context_bytes", "breakdown",
           "host_peak_bytes", "timeline", "timeline_by_category", "op_log", "op_costs", "phases",
           "blocks", "fw_flops", "bw_flops", "start_breakdown")
SCHEMES = ("default", "optimizer-pool", "phase-pools")


def _device_events(tracker) -> list[tuple]:
    led, names = tracker.ledger, {}
    cats = led.categories()
    return [(ev, names.setdefault(sid, len(names)), delta, resize, cats[sid])
            for ev, sid, delta, resize in led.device_events()]


def _record(r) -> dict:
    return {k: v for k, v in vars(r).items() if not k.startswith("_")}     # not storage ids


def _estimate(model, batch, device, optimizer, composed, **knobs):
    k = Knobs.from_kwargs(**knobs)
    if composed:
        t, why = blockwise_estimate(model, batch, optimizer, device, None, k, min_blocks=5)
        assert t is not None, why
        return figures(t), t.tracker
    est, tracker, _ = traced_estimate(model, batch, optimizer, device, None, k,
                                      FakeCopier("cpu"))
    return est, tracker


def assert_made_is_traced(model, batch, device, optimizer="adamw", composed=False, made=True,
                          **knobs):
    est, tracker = _estimate(model, batch, device, optimizer, composed, **knobs)
    with traced_first_steps():
        want, traced = _estimate(model, batch, device, optimizer, composed, **knobs)
    assert (tracker.ledger.first.events is not None) == made
    assert traced.ledger.first.events is None
    mine, theirs = _device_events(tracker), _device_events(traced)
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    assert first is None, f"event {first}: made {mine[first]} != traced {theirs[first]}"
    assert len(mine) == len(theirs)
    for name in FIGURES:
        assert getattr(est, name) == getattr(want, name), name
    assert list(est.modules) == list(want.modules)
    for name, rec in want.modules.items():
        assert _record(est.modules[name]) == _record(rec), name
    lives, wanted = est.lifetimes.window(), want.lifetimes.window()
    for field in ("nbytes", "category", "first_op", "last_op"):
        assert getattr(lives, field).tolist() == getattr(wanted, field).tolist(), field
    for field in ("nbytes", "category", "birth_event", "death_event"):
        assert getattr(est.lifetimes, field).tolist() == \
            getattr(want.lifetimes, field).tolist(), field
    assert allocator_options(est, SCHEMES) == allocator_options(want, SCHEMES)
    return est, tracker


def _zoo(name, layers=None, batch=2):
    spec = zoo.get(name)
    cfg = spec.config(tiny=True)
    depth = {} if layers is None else {
        key: layers for key in ("num_hidden_layers", "n_layer")
        if isinstance(getattr(cfg, key, None), int)}
    model = spec.build(tiny=True, device="meta", **depth)
    return model, spec.make_batch(model, batch_size=batch)


_SETTINGS = [(dict(precision="fp16"), "gtx-1080-ti"), (dict(precision="fp32"), "gtx-1080-ti"),
             (dict(precision="bf16", checkpoint="all"), "a100-80gb")]


@pytest.mark.parametrize("name, knobs, device", [
    pytest.param(name, knobs, device, marks=() if name == "gpt2" or knobs["precision"] == "fp16"
                 else pytest.mark.slow)       # each model at fp16, gpt2 at each: the default tier
    for name in ("gpt2", "bert-base", "llama-1b", "vit-base", "t5-base")
    for knobs, device in _SETTINGS])
def test_the_made_first_step_is_the_traced_one(name, knobs, device):
    model, batch = _zoo(name)
    assert_made_is_traced(model, batch, device, **knobs)


@pytest.mark.parametrize("knobs", [
    dict(precision="fp16", micro_batch_size=1, max_grad_norm=1.0),
    dict(precision="bf16", offload="all"),
    dict(precision="fp16", optimizer_impl="fused"),
    dict(precision="fp16", optimizer_impl="for-loop"),
    dict(precision="fp16", optimizer_state="8bit"),
    dict(precision="bf16-pure"),
    dict(precision="bf16", offload_optimizer=True),
    dict(precision="bf16", offload_optimizer=True, offload_gradients=True, checkpoint="all"),
])
def test_micro_batches_clipping_offload_and_each_implementation(knobs):
    model, batch = _zoo("gpt2")
    device = "a100-80gb" if knobs["precision"].startswith("bf16") else "t4"
    assert_made_is_traced(model, batch, device, **knobs)


def test_a_paged_bitsandbytes_optimizer_given_by_the_user():
    import bitsandbytes as bnb
    model, batch = _zoo("llama-1b")
    assert_made_is_traced(model, batch, "a100-80gb", optimizer=bnb.optim.PagedAdamW8bit,
                          precision="bf16", checkpoint="all")


def test_two_parameter_groups_each_make_their_state_at_their_own_init():
    """Trainer-style groups (decay, no decay): the second group's state is made after the
    first group's update, as ``_init_group`` runs per group."""
    import torch
    model, batch = _zoo("gpt2")

    def grouped(params):
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1]},
                                  {"params": [p for p in params if p.ndim <= 1],
                                   "weight_decay": 0.0}])
    est, tracker = assert_made_is_traced(model, batch, "t4", optimizer=grouped,
                                         precision="fp16")
    tags = [m[1] for m in tracker.marks if m[0] == "first"]
    assert tags == ["scaler", "optimizer group 0", "optimizer group 1"]


@pytest.mark.parametrize("name, knobs", [
    ("gpt2", dict(precision="fp16")),
    ("llama-1b", dict(precision="fp16")),
    ("bert-base", dict(precision="fp16", offload="all", optimizer_state="8bit")),
])
def test_a_composed_step_makes_the_first_step_of_the_whole(name, knobs):
    model, batch = _zoo(name, layers=7)
    est, _ = assert_made_is_traced(model, batch, "t4", composed=True, **knobs)
    assert est.traced_as.startswith("composed")


def test_an_optimizer_it_does_not_know_or_released_weights_trace_the_first_step():
    """SGD makes its momentum inside its update; parameter offload frees each block's device
    weights in the step, which a made first step would free twice."""
    model, batch = _zoo("gpt2")
    assert_made_is_traced(model, batch, "t4", optimizer="sgd", made=False, precision="fp16")
    assert_made_is_traced(model, batch, "a100-80gb", made=False, precision="bf16",
                          offload_optimizer=True, offload_params="all")


def test_a_cache_the_first_call_fills_is_traced():
    """A module that keeps what its first forward made: the counted step is no steady one."""
    import torch
    from torch import nn

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.table = None

        def forward(self, x):
            if self.table is None:
                self.table = torch.zeros(256, 64, device=x.device)
            return self.lin(x).sum() + self.table.sum()

    with torch.device("meta"):
        model = Cached()
    batch = {"x": torch.randn(8, 64, device="meta")}
    k = Knobs.from_kwargs(precision="fp32")
    est, tracker, _ = traced_estimate(model, batch, "adamw", "t4",
                                      lambda m, b: m(b["x"]), k, FakeCopier("cpu"))
    assert tracker.ledger.first.events is None      # traced twice: NotMade, then two steps
