"""An export says what memory its own settings need (issue 11 item 6).

The Trainer cannot keep the optimizer state on the host, and clips by default: a plan that
offloads the optimizer, exported to TrainingArguments, runs a different step. The oracle is
``estimate`` of that step, written out here by hand (fp32, micro-batch 2, every layer
recomputed, optimizer on the device, clipping at the Trainer's 1.0).
"""

import pytest

import memfit
from memfit.api._export import export_traced
from tests.helpers import tiny


@pytest.mark.slow
def test_export_predicts_the_bytes_of_what_it_exports():
    model, batch = tiny("gpt2", batch_size=4, seq_len=32)
    del batch["attention_mask"]     # all ones: the plan would count it held (api._planner Note 3)
    fixed = dict(micro_batch_size=2, checkpoint="all", offload_optimizer=True)
    planned = memfit.estimate(model, batch, **fixed).device_bytes
    p = memfit.plan(model, batch, budget=planned, **fixed)
    e = export_traced(p, "transformers", model, batch)
    trainer = memfit.estimate(model, batch, micro_batch_size=2, checkpoint="all",
                              offload_optimizer=False, max_grad_norm=1.0).device_bytes
    assert e.predicted_device_bytes == trainer > p.budget_bytes
    assert any("over the plan's budget" in n and "optimizer state on the host" in n
               for n in e.notes)
    d = export_traced(p, "deepspeed", model, batch)       # ZeRO offload keeps the plan's memory
    ds = memfit.estimate(model, batch, max_grad_norm=1.0, **fixed).device_bytes
    assert d.predicted_device_bytes == ds
    assert any("within the plan's budget" in n for n in d.notes) == (ds <= p.budget_bytes)
