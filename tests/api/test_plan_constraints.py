"""A knob left unset stays memfit's choice whatever else is fixed (issue 11 item 2).

``offload="none"`` fixes only the offload side: the planner may still recompute. On held-out
architectures (OPT, GPT-Neo from transformers configs, random weights), a budget 5% above what
``checkpoint="all"`` needs (traced here: the oracle) must plan with recompute; before, an unset
``checkpoint`` became "none" whenever ``offload`` was given and the budget was refused.
"""

import pytest
import torch

import memfit


def _opt():
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4,
                                    ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=32,
                                    max_position_embeddings=256))


def _neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    torch.manual_seed(0)
    return GPTNeoForCausalLM(GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=4,
                                          attention_types=[[["global", "local"], 2]],
                                          num_heads=2, max_position_embeddings=256,
                                          window_size=32))


def _batch():
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("build", [_opt, _neo], ids=["opt", "gpt-neo"])
@pytest.mark.slow      # 13-23 s each: the CI time limit (a lighter sibling stays)
def test_fixed_offload_leaves_recompute_free(build):
    model, batch = build(), _batch()
    ckpt_all = memfit.estimate(model, batch, checkpoint="all").device_bytes
    keep_least = memfit.estimate(model, batch, micro_batch_size=1,
                                 offload_optimizer=True).device_bytes
    budget = int(ckpt_all * 1.05)
    assert budget < keep_least       # the premise: keeping every block cannot fit
    p = memfit.plan(model, batch, budget=budget, offload="none", floor=True)
    assert p.knobs.offload == "none" and "offload" not in p.blocks.values()
    assert {"recompute", "selective"} & set(p.blocks.values())
    assert p.predicted_device_bytes <= budget
    # the floor is the least of the re-traced configurations without offload
    least = min(memfit.estimate(model, batch, checkpoint="all", micro_batch_size=m,
                                offload_optimizer=True).device_bytes for m in (1, 2))
    assert p.floor_bytes <= least


@pytest.mark.slow
def test_fixed_checkpoint_leaves_offload_free():
    """checkpoint="none" fixes only the recompute side: blocks may still be offloaded."""
    model, batch = _opt(), _batch()
    fixed = dict(micro_batch_size=2, offload_optimizer=False)
    offload_all = memfit.estimate(model, batch, offload="all", **fixed).device_bytes
    keep = memfit.estimate(model, batch, **fixed).device_bytes
    budget = int(offload_all * 1.05)
    assert budget < keep
    p = memfit.plan(model, batch, budget=budget, checkpoint="none", **fixed)
    assert p.knobs.checkpoint == "none"
    assert not {"recompute", "selective"} & set(p.blocks.values())
    assert "offload" in p.blocks.values() and p.predicted_device_bytes <= budget
