"""Quantizing a LoRA job's frozen base (QLoRA) as the planner's last lever (issue 28 item 6;
api.plan Note 2, techniques.quantized_base Note 4).

The job: a Llama (hidden 256, 2 layers, vocabulary 512) with peft's LoRA (r 4) on every linear
layer, one sequence of 16 tokens, SGD (no low-bit state can stand in), the optimizer state kept
on the device. Its frozen float weights (7.67 MiB of linear layers) put every configuration of
the float base over the budget, before any trace (the bound from the parameters alone); with the
base in NF4 the plain step fits.

Oracles that are not the planner: the same model quantized by hand (``QuantizedBase.apply`` on
the real weights, then peft's LoRA: what loading a 4-bit model and calling peft does),
estimated; the LoRA model quantized in place by hand, as the plan's run does, stepped by hand
with SGD (the adapters after two steps bitwise equal); and ``LiveBytes`` over a real ``Runner``
step (``tests/live_bytes.py``)."""

import copy

import pytest
import torch

import memfit
from memfit.techniques.quantized_base import QuantizedBase
from tests.live_bytes import LiveBytes, alive_storages, job_tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")      # bitsandbytes on a CPU

LORA = dict(r=4, target_modules="all-linear")


def _base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512))


def _batch():
    torch.manual_seed(1)
    x = torch.randint(0, 512, (1, 16))
    return {"input_ids": x, "labels": x}


def _lora(model):
    torch.manual_seed(2)
    return peft.get_peft_model(model, peft.LoraConfig(**LORA))


def _by_hand():
    """Quantized first, then LoRA: what loading a 4-bit model and calling peft does."""
    model = _base()
    model.requires_grad_(False)
    QuantizedBase(QuantizedBase.Config(kind="nf4")).apply(model)
    return _lora(model)


def _job(model, batch=None):
    return memfit.Job(model, _batch() if batch is None else batch,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_the_knob_estimates_the_model_quantized_by_hand_and_leaves_the_users_model_alone():
    model = _lora(_base())
    weights = {n: p.clone() for n, p in model.named_parameters()}
    est = memfit.estimate(_job(model), device="cpu", quantize_base="nf4")
    assert est.peak_bytes == memfit.estimate(_job(_by_hand()), device="cpu").peak_bytes
    assert est.peak_bytes < memfit.estimate(_job(model), device="cpu").peak_bytes
    assert any(n.startswith("quantized base: 14 frozen linear layers") for n in est.notes)
    for n, p in model.named_parameters():          # the user's model: float, untouched
        assert type(p) is torch.nn.Parameter and torch.equal(p, weights[n])


BUDGET = 7_187_476     # between the NF4 step and every float configuration (the slow test's)


def test_plan_quantizes_the_base_only_where_numerics_may_change():
    with pytest.raises(memfit.BudgetTooSmall, match="QLoRA"):
        memfit.plan(_job(_lora(_base())), budget=BUDGET, device="cpu", offload_optimizer=False)
    p = memfit.plan(_job(_lora(_base())), budget=BUDGET, device="cpu", offload_optimizer=False,
                    allow_numerics_change=True)
    assert p.knobs.quantize_base == "nf4" and p.reasons[0].startswith("QLoRA")
    assert p.predicted_peak_bytes <= BUDGET
    fixed = memfit.plan(_job(_lora(_base())), budget="1GiB", device="cpu", quantize_base="fp4")
    assert fixed.knobs.quantize_base == "fp4"          # the caller's own is kept


@pytest.mark.slow     # 15 s: three estimates, two plans and a real run (the test above is light)
def test_plan_quantizes_the_base_only_where_numerics_may_change_and_the_run_stays_under():
    float_step = memfit.estimate(_job(_lora(_base())), device="cpu", checkpoint="all",
                                 chunked_loss=8).peak_bytes
    qlora = memfit.estimate(_job(_by_hand()), device="cpu").peak_bytes
    budget = (qlora + float_step) // 2          # 7,187,476 B: over every float configuration
    assert budget == BUDGET
    with pytest.raises(memfit.BudgetTooSmall, match="QLoRA"):
        memfit.plan(_job(_lora(_base())), budget=budget, device="cpu", offload_optimizer=False)
    p = memfit.plan(_job(_lora(_base())), budget=budget, device="cpu", offload_optimizer=False,
                    allow_numerics_change=True)
    assert p.knobs.quantize_base == "nf4" and p.reasons[0].startswith("QLoRA")
    assert p.predicted_peak_bytes == qlora <= budget

    _by_hand()(**_batch()).loss.backward()   # bitsandbytes' tables, made once per process at
    before = alive_storages()               # their first use: not the job's (as in
    model, batch = _lora(_base()), _batch()     # tests/integrations/test_quantized_lora.py)
    runner = memfit.fit(_job(model, batch), budget=budget, device="cpu",
                        offload_optimizer=False, allow_numerics_change=True)
    assert runner.plan.knobs.quantize_base == "nf4"
    runner.step(batch)
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        runner.step(batch)
    runner.close()
    assert live.peak_bytes == runner.plan.predicted_peak_bytes <= budget

    reference = _lora(_base())      # quantized in place after LoRA, as the plan's run does
    QuantizedBase(QuantizedBase.Config(kind="nf4")).apply(reference)
    sgd = torch.optim.SGD([q for q in reference.parameters() if q.requires_grad], lr=0.1)
    for _ in range(2):
        sgd.zero_grad(set_to_none=True)
        reference(**batch).loss.backward()
        sgd.step()
    trained = dict(reference.named_parameters())
    for name, got in model.named_parameters():
        if got.requires_grad:
            assert torch.equal(got, trained[name]), name
