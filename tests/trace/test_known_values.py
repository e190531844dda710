"""transformers reads the caller's mask in the trace as in the real step (trace.known_values).

An all-ones mask means no padding: on real tensors transformers builds no 4-D mask for it (SDPA
runs ``is_causal``); under a fake trace ``is_tracing(mask)`` used to send it down the traced
branch, which builds one. Oracle: ``LiveBytes`` (tests/techniques/test_remat_budget.py), a
live-storage counter that is not memfit's ledger, around the real step 2. Models: transformers'
Bart and OPT at tiny sizes with random weights (not in ``memfit.zoo``).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfit
from memfit.step import canonical_step, prepare_batch
from memfit.trace.data_dependent import DataValues
from memfit.trace.known_values import known_values_readable
from tests.techniques.test_remat_budget import LiveBytes, roots

transformers = pytest.importorskip("transformers")
from transformers.utils import import_utils  # noqa: E402


def bart(padded=False):
    cfg = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    return _job(transformers.BartForConditionalGeneration, cfg, padded)


def opt(padded=False):
    cfg = transformers.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                 num_attention_heads=2, max_position_embeddings=64,
                                 word_embed_proj_dim=32)
    return _job(transformers.OPTForCausalLM, cfg, padded)


def _job(cls, cfg, padded):
    torch.manual_seed(0)
    model = cls(cfg)
    ids = torch.randint(4, 128, (2, 32))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 24:] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def user_step(model, batch, optimizer):
    """A hand-written step that passes the mask itself (so memfit cannot drop it)."""
    optimizer.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                labels=batch["labels"])
    out.loss.backward()
    optimizer.step()
    return out.loss


def own_step(model, batch, optimizer):
    canonical_step(model, optimizer, batch)


def real_peak(model, batch, step) -> int:
    opt = torch.optim.AdamW(model.parameters())
    step(model, batch, opt)
    with LiveBytes(roots(model, opt, batch)) as live:
        step(model, batch, opt)
    return live.peak_bytes


MODELS = {"bart": bart, "opt": opt}


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones", "padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_user_step_with_the_mask_is_estimated_to_the_byte(name, padded):
    """The issue's case: +262,144 B on a tiny Bart, +196,608 B on a tiny OPT under a user step
    (the 4-D mask and SDPA with it); padded, both steps build the mask."""
    model, batch = MODELS[name](padded)
    est = memfit.estimate(model, batch, optimizer=lambda p: torch.optim.AdamW(p), step=user_step)
    assert est.peak_bytes == real_peak(model, batch, user_step)
    assert not any("all ones" in n for n in est.notes)


@pytest.mark.parametrize("name", list(MODELS))
def test_memfits_own_step_is_estimated_to_the_byte(name):
    """memfit drops the all-ones mask; Bart's decoder then makes its own (``torch.ones``), which
    the real step reads and the trace used not to."""
    model, batch = MODELS[name]()
    est = memfit.estimate(model, batch, optimizer="adamw")
    assert est.peak_bytes == real_peak(model, prepare_batch(batch), own_step)


def test_is_tracing_is_false_only_for_fakes_whose_values_the_trace_holds():
    original = import_utils.is_fake_tensor
    mode = FakeTensorMode()
    known, unknown = mode.from_tensor(torch.ones(2, 3)), mode.from_tensor(torch.ones(2, 3))
    data = DataValues()
    data.link(known, torch.ones(2, 3))
    with known_values_readable(data):
        assert import_utils.is_fake_tensor is not original
        assert not import_utils.is_tracing(known) and import_utils.is_tracing(unknown)
        with known_values_readable(DataValues()):                 # nested traces share it
            assert not import_utils.is_tracing(known)
        assert not import_utils.is_tracing(known)
    assert import_utils.is_fake_tensor is original and import_utils.is_tracing(known)
    with pytest.raises(RuntimeError), known_values_readable(data):
        raise RuntimeError("the trace failed")
    assert import_utils.is_fake_tensor is original                # restored on an error too


def test_factory_values_are_known_mirrored_through_a_view_and_forgotten_by_unknown_writes():
    """DataValues Notes 1, 3 and 4: ``ones`` is known; a write of known values through a view
    is mirrored on a copy of the base; one of an unknown value makes the base unknown."""
    from memfit.trace.fidelity import FidelityMode

    data = DataValues()
    with FakeTensorMode(), FidelityMode(data):
        mask = torch.ones(2, 4, dtype=torch.long)
        made = data.real(mask)
        assert bool(mask.all())                                    # read, as the real step reads
        mask[:, 2:].zero_()
        mirrored = data.real(mask)
        assert not bool(mask.all())
        weight = torch.nn.Parameter(torch.empty(4, 4))
        mask[:, :1].copy_(weight[:2, :1].long())                  # a weight's value: unknown
        assert data.real(mask) is None
        with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
            bool(mask.all())
        assert data.real(torch.zeros_like(weight)) is None        # optimizer state: no real copy
    assert torch.equal(made, torch.ones(2, 4, dtype=torch.long))
    assert torch.equal(mirrored, torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]]))


def test_a_budget_at_the_real_need_is_planned_with_no_lever():
    """The excess used to carry into plans: a budget at the real step's need was short of the
    traced one."""
    model, batch = opt()
    peak = real_peak(model, batch, user_step)
    model, batch = opt()
    plan = memfit.plan(model, batch, budget=peak, optimizer=lambda p: torch.optim.AdamW(p),
                       step=user_step, device="cpu")
    assert plan.predicted_peak_bytes == peak
    assert set(plan.blocks.values()) == {"keep"} and plan.knobs.offload_optimizer is not True
