"""estimate() equals track() to the byte on the same CPU step (DESIGN: ground rules)."""

import itertools
from collections import Counter

import pytest
import torch

import memfit
from memfit import zoo
from tests.helpers import tiny, track_real_step, track_runner_step

ARCHS = ["bert-base", "roberta-base", "xlm-roberta-base", "gpt2", "llama-1b", "t5-base",
         "vit-base", "resnet-50"]
TEXT = [a for a in ARCHS if zoo.get(a).family != "vision"]


def assert_same(est, t, timeline=True):
    assert est.peak_bytes == t.peak_bytes
    assert est.breakdown == t.breakdown
    if timeline:     # op by op, too
        assert est.timeline == t.timeline


def test_padded_batches_ask_the_real_mask_questions_in_the_trace_too():
    """With padding, transformers asks the real mask questions (`padding_mask.all()`, is it
    right-padded?), which it skips under a trace (`is_tracing`); the trace asks them of the
    mask's real values (trace.known_values), so it runs the real step's ops, one for one."""
    model, batch = tiny("gpt2", padded=True)
    est = memfit.estimate(model, batch, optimizer="sgd")
    t = track_real_step(model, batch, "sgd")
    assert Counter(est.op_log) == Counter(map(str, t.op_log))
    assert "aten._local_scalar_dense.default" in est.op_log


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision,optimizer",
                         list(itertools.product(["fp32", "bf16"], ["sgd", "adamw"])))
def test_unpadded(arch, precision, optimizer):
    model, batch = tiny(arch)
    est = memfit.estimate(model, batch, optimizer=optimizer, precision=precision)
    assert_same(est, track_real_step(model, batch, optimizer, precision))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TEXT)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_padded(arch, precision):
    model, batch = tiny(arch, padded=True)
    assert "attention_mask" in batch and not bool(batch["attention_mask"].all())
    est = memfit.estimate(model, batch, optimizer="adamw", precision=precision)
    assert_same(est, track_real_step(model, batch, "adamw", precision))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert-base", "gpt2", "resnet-50"])
@pytest.mark.parametrize("precision", ["fp16", "bf16-pure"])
def test_fp16_and_pure_bf16(arch, precision):
    """Against the real Runner: fp16 includes the GradScaler's scale, unscale and update."""
    model, batch = tiny(arch)
    est = memfit.estimate(model, batch, optimizer="adamw", precision=precision)
    assert_same(est, track_runner_step(model, batch, "adamw", precision=precision),
                timeline=precision != "fp16")  # the real scaler reads found_inf back: 2 more ops


def test_meta_model_estimates_like_the_real_one():
    spec = zoo.get("gpt2")
    real = spec.build(tiny=True)
    meta = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(real, 2, seq_len=8)
    assert memfit.estimate(meta, batch).breakdown == memfit.estimate(real, batch).breakdown


def test_estimate_leaves_the_model_untouched():
    model, batch = tiny("bert-base")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memfit.estimate(model, batch, precision="bf16-pure")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
               for k in before)
    assert all(p.grad is None for p in model.parameters())


def test_tied_weights_are_counted_once():
    model, batch = tiny("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    est = memfit.estimate(model, batch, optimizer="sgd")
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # dedups ties
    assert est.breakdown["params"] == unique


def test_loss_fn_and_non_mapping_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    est = memfit.estimate(model, (x, y), optimizer="momentum", loss_fn=loss_fn)
    t = track_real_step(model, (x, y), "momentum", loss_fn=loss_fn)
    assert_same(est, t)


def test_per_module_records_match_track():
    model, batch = tiny("bert-base")
    est = memfit.estimate(model, batch, optimizer="sgd")
    t = track_real_step(model, batch, "sgd")
    assert est.blocks == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    for name in est.blocks:
        e, r = est.modules[name], t.modules[name]
        assert (e.saved_bytes, e.input_bytes, e.param_bytes, e.fw_flops, e.bw_flops) == \
               (r.saved_bytes, r.input_bytes, r.param_bytes, r.fw_flops, r.bw_flops)
        assert e.saved_bytes > 0 and e.fw_flops > 0
    assert est.fw_flops == t.fw_flops and est.bw_flops == t.bw_flops


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_full_size_xlmr_large_estimate_is_fast_and_plausible():
    spec = zoo.get("xlm-roberta-large")
    model = spec.build(device="meta")
    batch = spec.make_batch(model, 8, seq_len=256)
    n = zoo.count_parameters(model)
    est = memfit.estimate(model, batch, optimizer="adamw", device="cpu")
    assert est.breakdown["params"] == 4 * n
    # AdamW: exp_avg and exp_avg_sq per parameter, and a 0-d fp32 step counter per tensor
    assert est.breakdown["optimizer"] == 8 * n + 4 * len(list(model.parameters()))
    # (how long it takes is a benchmark's business: benchmarks/estimate_accuracy.py)
    gpu = memfit.estimate(model, batch, optimizer="adamw", device="gtx-1080-ti")
    assert gpu.breakdown["optimizer"] == 8 * n   # on CUDA the step counters stay on the host
    assert not gpu.fits                          # the story: it does not fit an 11 GiB card
