"""The checkpoint knob through fit and estimate: exact bytes, identical training."""

import pytest
import torch

import memfit
from tests.helpers import tiny, track_next_run


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "every:2", "selective"])
@pytest.mark.parametrize("arch,precision", [("gpt2", "fp32"), ("llama-1b", "bf16"),
                                            ("t5-base", "fp32"), ("bert-base", "bf16")])
def test_estimate_equals_track_with_recompute(arch, precision, policy):
    model, batch = tiny(arch, batch_size=4, seq_len=32)
    est = memfit.estimate(model, batch, "adamw", precision=precision, checkpoint=policy)
    plain = memfit.estimate(model, batch, "adamw", precision=precision)
    opt = torch.optim.AdamW(model.parameters())
    runner = memfit.fit(model, opt, batch, precision=precision, checkpoint=policy)
    t = track_next_run(runner, batch)
    assert (est.peak_bytes, est.breakdown, est.timeline) == (t.peak_bytes, t.breakdown, t.timeline)
    assert est.breakdown["activations"] < plain.breakdown["activations"]
    assert runner.applied.blocks and set(runner.applied.blocks.values()) <= {"keep", "recompute", "selective"}
    runner.close()


def test_runner_with_recompute_trains_bitwise_like_the_plain_runner():
    results = []
    for policy in (None, "all"):
        model, batch = tiny("gpt2", batch_size=4, seq_len=16)
        model.train()                                   # dropout on: RNG must be replayed
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runner = memfit.fit(model, opt, batch, checkpoint=policy, micro_batch_size=2)
        for seed in (1, 2):
            torch.manual_seed(seed)
            runner.step(batch)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_close_restores_the_model():
    model, batch = tiny("bert-base")
    forwards = {n: m.forward for n, m in model.named_modules()}
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, checkpoint="all")
    assert any(m.forward is not forwards[n] for n, m in model.named_modules())
    runner.close()
    assert all("forward" not in vars(m) for m in model.modules())


def test_cuda_estimate_with_recompute_under_modelled_autocast():
    model, batch = tiny("gpt2", batch_size=2, seq_len=32)
    plain = memfit.estimate(model, batch, "adamw", device="a100-80gb", precision="fp16")
    ckpt = memfit.estimate(model, batch, "adamw", device="a100-80gb", precision="fp16",
                           checkpoint="all")
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"]


def test_names_matching_no_block_list_the_blocks():
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match="transformer.h.0"):
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                   checkpoint=("transformer.h.9",))


def test_estimate_reports_what_each_option_costs_per_block():
    model, batch = tiny("bert-base", batch_size=4, seq_len=32)
    plain = memfit.estimate(model, batch, "sgd")
    ckpt = memfit.estimate(model, batch, "sgd", checkpoint="all")
    for name in plain.blocks:
        p, c = plain.block_report(name), ckpt.block_report(name)
        assert p["mode"] == "keep" and c["mode"] == "recompute"
        assert c["saved_bytes"] < p["saved_bytes"]
        # bert's block ends in LayerNorm (saves its input), so the whole forward is recomputed
        # (checkpoint Note 6): backward FLOPs grow by exactly the block's forward FLOPs
        assert c["bw_flops"] - p["bw_flops"] == p["recompute_flops_max"] == p["fw_flops"]


def test_llama_recompute_reruns_its_forward_minus_the_trailing_matmul():
    """Checkpoint's early stop (checkpoint Note 6): llama's block ends in down_proj, which saves
    only its input, so the recompute stops before it: exactly 2*B*L*I*H fewer FLOPs."""
    model, batch = tiny("llama-1b", batch_size=4, seq_len=32)
    plain = memfit.estimate(model, batch, "sgd")
    ckpt = memfit.estimate(model, batch, "sgd", checkpoint="all")
    selective = memfit.estimate(model, batch, "sgd", checkpoint="selective")
    c = model.config
    down_proj = 2 * 4 * 32 * c.intermediate_size * c.hidden_size
    for name in plain.blocks:
        p = plain.block_report(name)
        assert ckpt.block_report(name)["bw_flops"] - p["bw_flops"] == p["fw_flops"] - down_proj
        assert selective.block_report(name)["bw_flops"] == p["bw_flops"]   # no matmul rerun
    assert ckpt.peak_bytes < plain.peak_bytes
