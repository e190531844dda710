"""Offload: saved activations live on the host between forward and backward, the math unchanged."""

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.measure import find_blocks
from memfit.step import canonical_step, prepare_batch
from memfit.techniques.checkpoint import Checkpoint
from memfit.techniques.offload import Offload, default_copy
from memfit.trace.fake import FakeCopier
from tests.helpers import equal_params, tiny, train_seeded

MODELS = ("gpt2", "bert-base", "llama-1b")
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731


@pytest.fixture(autouse=True)
def _no_sync_warning():
    # The CPU fallback warns once per apply (tested below); elsewhere it is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Offload: no pinned memory")
        yield


def _offload(model, policy="all", **config):
    return Offload(Offload.Config(policy, **config)).apply(model)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "on-demand"])
@pytest.mark.parametrize("autocast", [None, BF16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", MODELS)
def test_two_steps_bitwise_equal(name, autocast, prefetch):
    # Dropout is on (train mode): offload must not touch the RNG, nor any value or layout.
    plain, batch = tiny(name)
    wrapped, _ = tiny(name)
    handle = _offload(wrapped, prefetch=prefetch)
    train_seeded(plain, batch, autocast=autocast)
    train_seeded(wrapped, batch, autocast=autocast)
    assert handle.stats.copies > 0 and handle.stats.device_copies == handle.stats.copies
    assert (handle.stats.prefetched > 0) is prefetch
    assert equal_params(plain, wrapped)


def test_a_wrong_copy_back_is_caught():
    # Negative control: the oracle above sees a copy with the lowest bit of a few bytes flipped
    # (copies are of whole storages, as bytes: Note 3).
    plain, batch = tiny("gpt2")
    wrapped, _ = tiny("gpt2")

    def nudge(host, out):
        out.copy_(host)
        out[::4099].bitwise_xor_(1)
    Offload(Offload.Config("all"), copy_to_device=nudge).apply(wrapped)
    assert not equal_params(train_seeded(plain, batch), train_seeded(wrapped, batch))


def _deep(name, layers=6):
    # Six blocks, so that one block (plus the prefetched one) is a fraction of the activations.
    spec = zoo.get(name)
    model = spec.build(tiny=True, num_hidden_layers=layers)
    return model, spec.make_batch(model, 4, seq_len=64)


def _tracked_step(model, batch, handle=None, fake: bool = False):
    """Step 1 untracked, step 2 under track (steady state); the tracker and, with an offload
    ``handle``, the bytes step 2 copied to the host. ``fake``: count a trace's fake tensors (as
    ``estimate``'s own tracker does; a real ``track`` counts only real storages)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    canonical_step(model, opt, batch)
    before = handle.stats.offloaded_bytes if handle else 0
    torch.manual_seed(1)
    with (memfit.Tracker(model=model, optimizer=opt, fake=True) if fake
          else memfit.track(model, opt)) as t:
        canonical_step(model, opt, batch)
    return t, (handle.stats.offloaded_bytes if handle else 0) - before


@pytest.mark.parametrize("name", MODELS)
def test_device_peak_drops_and_the_host_holds_the_rest(name):
    plain, batch = _deep(name)
    wrapped, _ = _deep(name)
    handle = _offload(wrapped)
    base, _ = _tracked_step(plain, batch)
    off, offloaded = _tracked_step(wrapped, batch, handle)
    assert off.peak_bytes < 0.75 * base.peak_bytes
    assert base.host_peak_bytes == 0 and off.host_peak_bytes > 0
    # No buffer is reused within a step (nothing is released before backward), so the host
    # holds exactly what was copied out, each buffer of its tensor's size (Note 4) ...
    assert off.host_peak_bytes == offloaded == handle.stats.host_pool_peak_bytes
    # ... and after backward the pool is empty again.
    assert handle.stats.host_pool_bytes == 0


def test_prefetch_costs_one_block_of_device_memory():
    # On demand, a block's tensors come back as its backward asks; prefetch holds the next
    # block's too: a higher peak than on demand, still far under the plain step's.
    peaks = {}
    for prefetch in (True, False):
        model, batch = _deep("gpt2")
        _offload(model, prefetch=prefetch)
        peaks[prefetch] = _tracked_step(model, batch)[0].peak_bytes
    assert peaks[False] < peaks[True]


class _Block(nn.Module):
    """Saves its input (linear) and tanh's output; ``+ 1`` saves nothing, so the next block's
    input is a tensor no earlier block saved."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + 1.0


def _toy(widths=(8, 16, 24, 32, 40)):
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(a, b) for a, b in zip(widths, widths[1:])])


class _Logger:
    """Injected copies that log which block each host copy came from, in order."""

    def __init__(self, model):
        self.events, self.block_of, self.current = [], {}, None
        for k, block in enumerate(model):
            block.register_forward_pre_hook(lambda m, a, k=k: setattr(self, "current", k))
            block.register_full_backward_pre_hook(
                lambda m, g, k=k: self.events.append(("backward", k)))

    def to_host(self, t, out):
        self.block_of[id(out)] = (self.current, out)   # the host tensor comes back in to_device
        default_copy(t, out)

    def to_device(self, host, out):
        self.events.append(("copy", self.block_of[id(host)][0]))
        default_copy(host, out)


def _toy_backward(prefetch):
    model = _toy()
    log = _Logger(model)
    Offload(Offload.Config("all", min_bytes=0, prefetch=prefetch),
            copy_to_host=log.to_host, copy_to_device=log.to_device).apply(model)
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return log.events


def test_prefetch_brings_the_previous_block_back_before_its_backward():
    events = _toy_backward(prefetch=True)
    last = 3
    for k in range(last):
        first_copy = events.index(("copy", k))
        # requested once backward reaches block k+1, before block k's backward starts
        assert events.index(("backward", k + 1)) < first_copy < events.index(("backward", k))
    # the last block has nothing before it to overlap with: its tensors come on first use
    assert events.index(("backward", last)) < events.index(("copy", last))
    assert sum(e[0] == "copy" for e in events) == 2 * 4     # input + tanh output per block


class _ScaledBlock(nn.Module):
    """Multiplies by a tensor every block is given (as llama's blocks are given the rotary
    ``cos``/``sin``): each block saves it, and offload copies it once, with block 0's saves."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, scale):
        return torch.tanh(self.lin(x)) * scale + 1.0


class _SharedScale(nn.Module):
    def __init__(self, d=8, n=4):
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock(d) for _ in range(n))

    def forward(self, x):
        scale = torch.linspace(0.5, 1.5, x.shape[-1])
        for block in self.blocks:
            x = block(x, scale)
        return x


def test_a_tensor_every_block_saves_comes_back_alone():
    """Note 5: the last block's backward first unpacks the shared ``scale``, whose one host
    copy is in block 0's group. That brings back the copy alone: the rest of block 0's group
    comes back once backward reaches block 1, not at the start of backward."""
    torch.manual_seed(0)
    model = _SharedScale()
    log = _Logger(model.blocks)
    handle = Offload(Offload.Config("all", min_bytes=0), copy_to_host=log.to_host,
                     copy_to_device=log.to_device).apply(model)
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    events = log.events
    assert handle.stats.dedup_hits == 3                  # blocks 1-3 reuse block 0's copy
    early = [e for e in events[:events.index(("backward", 1))] if e == ("copy", 0)]
    assert len(early) == 1                               # the shared copy, on demand
    assert events.index(("backward", 1)) < len(events) - events[::-1].index(("copy", 0)) - 1 \
        < events.index(("backward", 0))                  # block 0's own, prefetched at 1


def test_without_prefetch_copies_come_on_demand():
    events = _toy_backward(prefetch=False)
    for k in range(4):
        assert events.index(("backward", k)) < events.index(("copy", k))


def test_toy_grads_bitwise():
    x = torch.randn(4, 8)
    plain, wrapped = _toy(), _toy()
    handle = _offload(wrapped, min_bytes=0)
    for m in (plain, wrapped):
        m(x).square().sum().backward()
    assert handle.stats.copies == 8
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(),
                                                           wrapped.parameters(), strict=True))


class _Square(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)   # addmm saves x (and weight.t(), a parameter view: kept)
        return h * h      # mul saves h twice: one host copy


def test_a_tensor_saved_twice_is_copied_once():
    model = nn.Sequential(_Square(32), _Square(32))
    twin = nn.Sequential(_Square(32), _Square(32))
    twin.load_state_dict(model.state_dict())
    handle = _offload(model, min_bytes=0)
    x = torch.randn(8, 32)
    for m in (model, twin):
        m(x).sum().backward()
    # per block: its input x, and h (saved twice): 2 copies, 1 dedup hit; nothing of the params
    assert (handle.stats.copies, handle.stats.dedup_hits) == (4, 2)
    assert handle.stats.offloaded_bytes == 4 * 8 * 32 * 4
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                           twin.parameters(), strict=True))


def test_a_tensor_changed_in_place_is_copied_again():
    # The dedup key holds the version counter: a save after an in-place write is a new copy
    # (reusing the first one would feed cos's backward the values before the write).
    class Block(nn.Module):
        def forward(self, x):
            y = x * 1.0
            unused = y.sin()     # saves y at version 0; its graph dies unused
            y.mul_(2.0)
            del unused
            return y.cos()       # saves y at version 1

    x = torch.randn(4, 64, requires_grad=True)
    model = nn.Sequential(Block(), Block())
    handle = _offload(model, min_bytes=0)
    model(x).sum().backward()
    assert (handle.stats.copies, handle.stats.dedup_hits) == (4, 0)
    expected = x.grad.clone()
    x.grad = None
    handle.remove()
    model(x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_min_bytes():
    # Block saves per call: input (4 x d_in) and tanh output (4 x d_out), fp32; below
    # min_bytes they stay on the device.
    def copies(min_bytes):
        model = _toy()
        handle = _offload(model, min_bytes=min_bytes)
        model(torch.randn(4, 8)).sum().backward()
        return handle.stats.copies, handle.stats.offloaded_bytes
    sizes = [4 * d * 4 for d in (8, 16, 16, 24, 24, 32, 32, 40)]   # bytes of each save
    for limit in (0, 256, 384, 512, 641):
        kept = [s for s in sizes if s >= limit]
        assert copies(limit) == (len(kept), sum(kept))


def test_cpu_fallback_warns_once():
    model, batch = tiny("gpt2")
    handle = _offload(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_seeded(model, batch)
    sync = [w for w in caught if "no pinned memory or CUDA streams" in str(w.message)]
    assert len(sync) == 1 and handle.stats.copies > 1


def test_remove_restores_the_model():
    model, batch = tiny("bert-base")
    twin, _ = tiny("bert-base")
    blocks = [model.get_submodule(n) for n in find_blocks(model)]
    hooks = [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in blocks]
    handle = _offload(model)
    handle.remove()
    assert [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in blocks] == hooks
    train_seeded(model, batch)
    assert handle.stats.copies == 0
    assert equal_params(model, train_seeded(twin, batch))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    _offload(model)       # applying again is allowed after remove


def _enable_transformers_checkpointing(model):
    enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5
    (enable or model.gradient_checkpointing_enable)()


@pytest.mark.parametrize("checkpoint", ["memfit", "memfit-first", "transformers"])
@pytest.mark.parametrize("name", MODELS)
def test_checkpoint_and_offload_offload_the_checkpoint_inputs(name, checkpoint):
    # Note 1: a checkpointed block saves only its positional tensor inputs (the hidden states,
    # 3 x 16 x 64 fp32 here); with offload on the same block exactly those go to the host.
    # memfit's checkpoint hooks run inside offload's whichever is applied first ("memfit-first":
    # checkpoint, then offload); transformers' wraps the block's __call__, outside them.
    plain, batch = tiny(name)
    both, _ = tiny(name)
    if checkpoint == "memfit-first":
        Checkpoint(Checkpoint.Config("all")).apply(both)
    handle = _offload(both)
    if checkpoint == "memfit":
        Checkpoint(Checkpoint.Config("all")).apply(both)
    else:
        _enable_transformers_checkpointing(both)
        _enable_transformers_checkpointing(plain)    # it turns the KV cache off: do the same
    train_seeded(plain, batch)
    train_seeded(both, batch)
    assert equal_params(plain, both)
    assert handle.stats.offloaded_bytes == 2 * len(find_blocks(both)) * 3 * 16 * 64 * 4


def test_an_outer_checkpoint_takes_over():
    # Note 1: a checkpoint around the blocks' __call__ (here: the whole decoder) packs first and
    # keeps nothing; offload steps aside and the step is still the plain one.
    plain, batch = tiny("llama-1b")
    model, _ = tiny("llama-1b")
    handle = _offload(model)
    Checkpoint(Checkpoint.Config(("model",))).apply(model)
    train_seeded(model, batch)
    train_seeded(plain, batch)
    assert handle.stats.copies == 0
    assert equal_params(model, plain)


def test_fake_step_matches_the_real_one():
    # On fakes (what memfit.estimate traces) the same logic runs: track counts the same device
    # and host bytes as for the real step, to the byte.
    model, batch = tiny("llama-1b")
    batch = prepare_batch(batch)
    copier = FakeCopier("cpu")
    fake_model, fake_batch = copier.module(model), copier.tree(batch)
    results = []
    for m, b, mode in ((fake_model, fake_batch, copier.mode), (model, batch, None)):
        handle = _offload(m)
        with mode or contextlib.nullcontext():
            t, _ = _tracked_step(m, b, fake=mode is not None)
        results.append((t.peak_bytes, t.host_peak_bytes, handle.stats.copies))
    assert results[0][1] > 0
    assert results[0] == results[1]


def test_resolve_conventions():
    model, _ = tiny("llama-1b")
    blocks = find_blocks(model)
    resolve = lambda policy: Offload(Offload.Config(policy)).resolve(model)   # noqa: E731
    assert resolve("none") == {b: "keep" for b in blocks}
    assert resolve("every:2") == {blocks[0]: "keep", blocks[1]: "offload"}
    assert resolve("every:1") == resolve("all") == {b: "offload" for b in blocks}
    assert resolve((blocks[0],)) == {blocks[0]: "offload", blocks[1]: "keep"}
    with pytest.warns(UserWarning, match="offloads nothing"):
        assert "offload" not in resolve("every:3").values()


@pytest.mark.parametrize("config, match", [
    (dict(policy="sometimes"), "unknown"), (dict(policy="selective"), "checkpoint policy"),
    (dict(policy="every:0"), ">= 1"), (dict(policy=()), "at least one"),
    (dict(policy=["model.layers.0"]), "not a list"), (dict(min_bytes=-1), "min_bytes"),
    (dict(min_bytes=True), "min_bytes"), (dict(prefetch=1), "prefetch"),
])
def test_bad_config(config, match):
    with pytest.raises(ValueError, match=match):
        Offload.Config(**config)


def test_unknown_names_list_the_blocks():
    model, _ = tiny("llama-1b")
    with pytest.raises(ValueError, match=r"\['model.layer.0'\] match no submodule.*model.layers.0"):
        _offload(model, ("model.layer.0",))
    with pytest.raises(ValueError, match="unknown"):
        Offload(Offload.Config()).apply(model, {"model.layers.0": "recompute"})


def test_apply_twice_is_an_error():
    model, _ = tiny("gpt2")
    _offload(model)
    with pytest.raises(ValueError, match="already offloaded.*remove"):
        _offload(model, "every:1")


def test_no_repeated_blocks_then_own_names():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with pytest.raises(ValueError, match="GradientCheckpointingLayer.*tuple"):
        Offload(Offload.Config("all")).resolve(model)
    handle = _offload(model, ("1",), min_bytes=0)
    model(torch.randn(4, 8)).sum().backward()
    assert handle.stats.copies == 1         # tanh's output


@pytest.mark.requires_gpu
def test_cuda_side_stream_copies_are_exact_and_lower_the_peak():
    # Note 6 on a real GPU: pinned buffers, a side stream, events. Linear/tanh blocks (no atomics
    # in their backward) so that the plain step is deterministic and the oracle can be bitwise.
    def run(offload):
        torch.manual_seed(0)
        model = nn.Sequential(*[_Block(1024, 1024) for _ in range(8)]).cuda()
        handle = _offload(model) if offload else None
        x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).square().sum().backward()
        torch.cuda.synchronize()
        grads = [p.grad for p in model.parameters()] + [x.grad]
        return grads, torch.cuda.max_memory_allocated(), handle
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no CPU-fallback warning on CUDA
        plain, plain_peak, _ = run(False)
        grads, peak, handle = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    assert handle.stats.copies == 16 and handle.stats.prefetched > 0
    assert peak < 0.6 * plain_peak
    assert handle.stats.host_pool_bytes == 0


def test_deepcopy_of_an_offloaded_model_offloads_its_own_blocks():
    # The hooks are bound methods of the handle's runtime, which deepcopy copies with the model.
    model, batch = tiny("gpt2")
    twin, _ = tiny("gpt2")
    handle = _offload(model)
    clone = copy.deepcopy(model)
    assert equal_params(train_seeded(clone, batch), train_seeded(twin, batch))
    assert handle.stats.copies == 0          # the clone counted in its own copy of the stats
    with pytest.raises(ValueError, match="already offloaded"):
        _offload(clone)
