"""The floor and ``BudgetTooSmall`` count every lever memfit has and name only what is beyond
it (issue 15 item 5): sharding when one GPU is planned, shorter sequences with the longest
that fits; memfit's own levers appear only where the caller's settings kept them out.

Oracles: the planner's own exact CPU re-trace at the reported length (a plan there must fit)
and a real run of that plan measured by ``memfit.track`` under the budget.
"""

from types import SimpleNamespace

import pytest

import memfit
from memfit.api._floor import longest_sequence
from memfit.api._plan_words import counted_levers, excluded_levers, too_small
from memfit.knobs import Knobs
from memfit.units import MiB
from tests.helpers import tiny, track_runner_step


def _gpt2(b=2, seq_len=16):
    model, batch = tiny("gpt2", batch_size=b, seq_len=seq_len)
    del batch["attention_mask"]
    return model, batch


def test_the_message_names_memfits_levers_only_where_the_caller_excluded_them():
    memory = SimpleNamespace(params_bytes=4 * MiB, grads_bytes=4 * MiB,
                             optimizer_state_bytes=8 * MiB)
    auto = Knobs(precision="auto")
    e = too_small(20 * MiB, memory, "fp16, micro-batch 1 of 2", 10 * MiB,
                  excluded_levers(auto, True, False), (11, 16),
                  counted=counted_levers(auto, True, False, ["fp16", "fp32"]))
    text = str(e)
    assert e.floor_bytes == 20 * MiB and "8-bit (bitsandbytes) optimizer state" in text
    assert "longest this budget holds" in text and "11 tokens (the batch has 16)" in text
    assert "sharding (FSDP) over several GPUs: this plan is for one" in text
    assert text.count("bitsandbytes") == 1 and "left out" not in text   # the counted lever
    fixed = Knobs(precision="fp32", offload_optimizer=False)
    text = str(too_small(20 * MiB, memory, "fp32", 10 * MiB,
                         excluded_levers(fixed, False, False), None))
    assert "left out" in text and "allow_numerics_change=True" in text
    assert "precision='auto'" in text and "offload_optimizer=False" in text
    assert "shorter sequences" not in text            # no sequence dimension was given


def test_longest_sequence_bisects_the_batchs_sequence_dimension():
    import torch
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long),
             "labels": torch.zeros(2, 16, dtype=torch.long), "scale": torch.ones(2)}
    seen = []

    def fits(part):
        seen.append(part["input_ids"].shape[1])
        assert part["labels"].shape == part["input_ids"].shape and part["scale"].shape == (2,)
        return part["input_ids"].shape[1] <= 11

    assert longest_sequence(batch, fits) == (11, 16)
    assert len(seen) <= 5 and 11 in seen and 12 in seen
    assert longest_sequence(batch, lambda part: False) == (None, 16)
    assert longest_sequence({"pixel_values": torch.zeros(2, 3, 8, 8),
                             "ids": torch.zeros(2, 5)}, fits) is None


@pytest.mark.slow      # several plans with floors (~2-3 min on 2 cores); light siblings above
def test_the_longest_sequence_named_is_the_planners_own_boundary():
    model, batch = _gpt2(seq_len=32)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, floor=True)   # traced, not the bound
    floor = info.value.floor_bytes
    budget = floor - 64 * 1024
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=budget)
    text = str(info.value)
    assert "sharding (FSDP)" in text and "8-bit optimizer" in text
    longest = int(text.split("configuration is ")[1].split(" tokens")[0])
    assert 1 < longest < 32
    short = {k: v[:, :longest].clone() for k, v in batch.items()}
    p = memfit.plan(model, short, budget=budget)
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    measured = track_runner_step(model, short, "adamw", **knobs)
    assert measured.peak_bytes == p.predicted_peak_bytes <= budget
