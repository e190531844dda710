"""A user's own bitsandbytes optimizer (``optimizer=bnb.optim.AdamW8bit(...)``), estimated and
tracked (_bnb_optimizer Note 2, measure._bnb_kernels Note 1).

Oracles, independent of memfit's figures: the state bytes by hand (8-bit: one uint8 code per
value and an fp32 absmax per 256 values, per moment, and bitsandbytes' two 256-value fp32 maps
once; below ``min_8bit_size`` or overridden to 32 bits: two fp32 moments), and the CPU
allocator's own events (torch.profiler, tests/measure/test_track_oracle), which see inside
bitsandbytes' CPU kernel as no dispatch mode can."""

import math

import pytest
import torch
from torch import nn

import memfit
from memfit.step import canonical_step

bnb = pytest.importorskip("bitsandbytes")

LOSS = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])      # noqa: E731


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 64)             # 6,400 values
        self.fc1 = nn.Linear(64, 256)                # 16,384 values; bias 256
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.emb(x).mean(1))))


def _batch():
    torch.manual_seed(1)
    return (torch.randint(0, 100, (8, 5)), torch.randn(8, 64))


def _hand_state(params, min_8bit=4096, fp32=(), moments=2, bits=8):
    """Note 3 of low_bit_optimizer, by hand: per moment, one uint8 code per value and an fp32
    absmax per 256 values, and one 256-value fp32 map per moment for the optimizer; fp32
    moments below ``min_8bit`` values, overridden, or with 32 bits (Adam: 2 moments, Lion 1)."""
    total, any8 = 0, False
    for p in params:
        n = p.numel()
        if bits == 32 or n < min_8bit or any(p is q for q in fp32):
            total += moments * 4 * n
        else:
            total += moments * (n + 4 * math.ceil(n / 256))
            any8 = True
    return total + (moments * 256 * 4 if any8 else 0)


OPTIMS = {
    "AdamW8bit": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3),
    "PagedAdamW8bit": lambda ps: bnb.optim.PagedAdamW8bit(ps, lr=1e-3),
    "Adam8bit": lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3),
    # what transformers' optim="adamw_bnb_8bit" builds: the bits in args, not in the class
    "AdamW(optim_bits=8)": lambda ps: bnb.optim.AdamW(ps, lr=1e-3, optim_bits=8),
    "AdamW8bit(min_8bit_size=10000)": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3,
                                                                    min_8bit_size=10000),
}
MIN = {"AdamW8bit(min_8bit_size=10000)": 10000}
# Lion keeps one moment; bitsandbytes' 32-bit classes keep fp32 moments through the same op
OPTIMS |= {"Lion8bit": lambda ps: bnb.optim.Lion8bit(ps, lr=1e-4),
           "PagedLion8bit": lambda ps: bnb.optim.PagedLion8bit(ps, lr=1e-4),
           "PagedAdamW": lambda ps: bnb.optim.PagedAdamW(ps, lr=1e-3),
           "Lion32bit": lambda ps: bnb.optim.Lion32bit(ps, lr=1e-4)}
SHAPE = {"Lion8bit": {"moments": 1}, "PagedLion8bit": {"moments": 1},
         "PagedAdamW": {"bits": 32}, "Lion32bit": {"moments": 1, "bits": 32}}


def _allocator_checked(model, opt, batch, tmp_path):
    """Track a real step in the allocator oracle's window; returns the tracker after the
    oracle's claims hold (every block track saw born was allocated; the allocator's peak is
    track's plus only scalar-sized blocks op boundaries cannot see)."""
    from tests.measure.test_track_oracle import allocator_window, check

    step = lambda: canonical_step(model, opt, batch, LOSS)      # noqa: E731
    step()

    def tracked():
        with memfit.track(model, opt) as t:
            step()
        return t

    t, window, ops = allocator_window(step, tracked, tmp_path / "trace.json")
    over, slack = check(t, window, ops)
    assert over == slack <= 32
    return t


@pytest.mark.parametrize("name", OPTIMS)
def test_estimate_of_a_users_bnb_optimizer_equals_the_allocator(name, tmp_path):
    """The state is the optimizer's own (its optim_bits and min_8bit_size, in ``args``), and the
    peak includes bitsandbytes' CPU kernel's temporaries: before, ``AdamW(optim_bits=8)`` was
    estimated with fp32 state, a larger ``min_8bit_size`` was lost, and every estimate and
    track missed the kernel's 20 bytes per value of the largest 8-bit weight."""
    model, batch = Net(), _batch()
    opt = OPTIMS[name](model.parameters())
    est = memfit.estimate(model, batch, optimizer=opt, loss_fn=LOSS)
    params = list(model.parameters())
    assert est.breakdown["optimizer"] == _hand_state(params, MIN.get(name, 4096),
                                                     **SHAPE.get(name, {}))
    t = _allocator_checked(model, opt, batch, tmp_path)
    assert est.peak_bytes == t.peak_bytes
    assert t.breakdown["optimizer"] == est.breakdown["optimizer"]
    if name not in MIN and SHAPE.get(name, {}).get("bits") != 32:
        assert t.breakdown["temporaries"] >= 20 * 256 * 64      # the CPU kernel's fp32 copies


def test_per_parameter_overrides_are_kept(tmp_path):
    """transformers' way (Trainer.create_optimizer): the embedding's weight overridden to 32
    bits in bitsandbytes' GlobalOptimManager, applied at the first step. Before, the rebuilt
    optimizer over the trace's parameters lost it (8-bit state for the embedding)."""
    model, batch = Net(), _batch()
    opt = bnb.optim.AdamW(model.parameters(), lr=1e-3, optim_bits=8)
    mng = bnb.optim.GlobalOptimManager.get_instance()
    triples, by_index = list(mng.module_weight_config_triple), dict(mng.index2config)
    mng.register_module_override(model.emb, "weight", {"optim_bits": 32})
    try:
        est = memfit.estimate(model, batch, optimizer=opt, loss_fn=LOSS)
        params = list(model.parameters())
        assert est.breakdown["optimizer"] == _hand_state(params, fp32=[model.emb.weight])
        t = _allocator_checked(model, opt, batch, tmp_path)
        assert opt.state[model.emb.weight]["state1"].dtype == torch.float32
        assert est.peak_bytes == t.peak_bytes
    finally:
        mng.module_weight_config_triple[:] = triples
        for p in model.parameters():
            mng.pid2config.pop(id(p), None)
        mng.index2config.clear()
        mng.index2config.update(by_index)


def test_gpu_target_steps_the_fused_kernel():
    """For a GPU the rebuilt optimizer steps bitsandbytes' op, whose fused CUDA kernel (and
    fake) allocates nothing (_bnb_optimizer Note 1): the same 8-bit state, none of the CPU
    kernel's 20 bytes per value. Before, the trace stopped in bitsandbytes' ``fill_qmap``
    (``create_dynamic_map`` reads values, which a fake has not)."""
    model, batch = Net(), _batch()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    est = memfit.estimate(model, batch, optimizer=opt, loss_fn=LOSS, device="gtx-1080-ti")
    assert est.breakdown["optimizer"] == _hand_state(list(model.parameters()))
    assert est.breakdown["temporaries"] < 20 * 256 * 64


def test_the_8bit_lever_ignores_overrides_left_in_the_process_wide_manager():
    """bitsandbytes' GlobalOptimManager keeps overrides by position ``(group, index)`` for the
    life of the process (transformers' Trainer with ``adamw_bnb_8bit`` leaves its embedding's
    ``optim_bits=32`` there). The ``optimizer_state="8bit"`` lever builds its own optimizer: its
    state must be what ``state_bytes`` (the planner's weight) says, whatever an earlier
    optimizer left. Before, the first weight took fp32 moments (the CI's order-dependent
    failures of test_low_bit_optimizer)."""
    from memfit.techniques.low_bit_optimizer import state_bytes

    model, batch = Net(), _batch()
    mng = bnb.optim.GlobalOptimManager.get_instance()
    mng.index2config[(0, 0)] = {"optim_bits": 32}          # as check_overrides leaves it
    mng.index2config[(0, 1)] = {"optim_bits": 32}
    est = memfit.estimate(model, batch, optimizer="adamw", optimizer_state="8bit", loss_fn=LOSS)
    assert est.breakdown["optimizer"] == state_bytes(list(model.parameters()), "8bit")
    assert est.breakdown["optimizer"] == _hand_state(list(model.parameters()))
    assert mng.index2config == {(0, 0): {"optim_bits": 32}, (0, 1): {"optim_bits": 32}}


def test_an_offloaded_users_bnb_optimizer_keeps_its_args():
    """``offload_optimizer=True`` rebuilds the user's optimizer over host twins; a bitsandbytes
    one kept its class but lost ``args`` (``min_8bit_size=10000``: the 16,384-value weights
    8-bit, the 6,400-value embedding fp32) and overrides. Oracle: the state the real step made."""
    model, batch = Net(), _batch()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=10000)
    runner = memfit.fit(model, opt, batch, budget="1GiB", loss_fn=LOSS, offload_optimizer=True)
    runner.step(batch)
    inner = runner.optimizer.inner
    assert inner.args.min_8bit_size == 10000
    dtypes = {tuple(p.shape): inner.state[p]["state1"].dtype
              for g in inner.param_groups for p in g["params"]}
    assert dtypes[(100, 64)] == torch.float32 and dtypes[(256, 64)] == torch.uint8


class Wide(nn.Module):
    """One weight above bitsandbytes' paging threshold (262,144 values >= 100,000), the rest
    below it (512, 8,192, 16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("paged, plain", [("PagedAdamW8bit", "AdamW8bit"),
                                          ("PagedAdamW", "AdamW"),
                                          ("PagedLion8bit", "Lion8bit")])
def test_paged_state_is_unified_memory_on_a_gpu(paged, plain):
    """_bnb_optimizer Note 3, trace.card Note 5: on a GPU the moments of ``a.weight`` live in
    cudaMallocManaged memory, outside the caching allocator. Oracle, by hand from bitsandbytes'
    rule (get_state_buffer: 1e5 values or more) and layout: the unified line is those moments'
    bytes; with the allocator's own state it makes the non-paged optimizer's state; the device
    bytes count it once, on its own line. Before, a paged optimizer's state was counted inside
    the allocator as any other tensor's."""
    model, batch = Wide(), (torch.randn(8, 512), torch.randn(8, 16))
    shape = {"PagedAdamW": {"bits": 32}, "PagedLion8bit": {"moments": 1}}.get(paged, {})
    est = {name: memfit.estimate(model, batch, optimizer=getattr(bnb.optim, name)(
        model.parameters(), lr=1e-4), loss_fn=LOSS, device="rtx-4090") for name in (paged, plain)}
    moments, bits = shape.get("moments", 2), shape.get("bits", 8)
    unified = moments * 512 * 512 * bits // 8
    card = est[paged].card
    assert card.unified_memory_bytes == unified
    assert est[plain].card.unified_memory_bytes == 0
    whole = _hand_state(list(model.parameters()), **shape)
    assert est[plain].breakdown["optimizer"] == whole
    assert est[paged].breakdown["optimizer"] == whole - unified
    assert card.device_bytes == sum(card.lines.values())
    assert est[paged].device_bytes == card.reserved_bytes + card.outside_allocator_bytes
    assert card.reserved_bytes <= est[plain].card.reserved_bytes
    assert any("unified memory" in n for n in est[paged].notes)
