"""The OOM guard under several gloo ranks (``memfit.runtime.oom_ranks``, oom_guard Notes 6-7):
at the optimizer step the ranks agree and re-plan together, or all raise the same error; an
out-of-memory error inside one rank's forward stops every rank, no rank hanging.

Oracles: for recovery, one process training the whole batch with the recovered plan's knobs
(tiny Llama, no dropout, SGD: the parameters move by lr x the gradient), to float tolerance
(the reduction order differs); for "unchanged", each rank's own parameter bytes (its FSDP2
shards) before and after, ``torch.equal``; for the budget, ``track(budget)``'s own
out-of-memory error on the rank that runs out. Every test has a timeout: a hang fails it.
"""

import json
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import memfit
from tests.distributed._fit_worker import full
from tests.distributed._oom_ranks_worker import run_rank
from tests.distributed.conftest import free_port
from tests.helpers import tiny

ARCH, BATCH = "llama-1b", 4


def run_job(job: dict, world: int = 2) -> tuple[dict | None, list[dict]]:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(world, free_port(), job, d), nprocs=world)
        path = os.path.join(d, "params.pt")
        params = torch.load(path) if os.path.exists(path) else None
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    return params, ranks


def rank_peak(world: int = 2) -> int:
    model, batch = tiny(ARCH, batch_size=BATCH)
    share = {k: v[:BATCH // world] for k, v in batch.items()}
    return memfit.estimate_sharded(model, share, "sgd", "cpu", world_size=world).peak_bytes


def one_process(knobs: dict, steps: int) -> dict:
    model, batch = tiny(ARCH, batch_size=BATCH)
    rest = {k: v for k, v in knobs.items() if v is not None and k not in
            ("gpus", "sharding", "reshard_after_forward", "fsdp_offload")}
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, **rest)
    for _ in range(steps):
        runner.step(batch)
    return {n: full(p).detach() for n, p in runner.model.named_parameters()}


def assert_trains_like_one_process(params: dict, knobs: dict, steps: int):
    expected = one_process(knobs, steps)
    assert params.keys() == expected.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_agree_on_one_new_plan_and_train_like_one_process():
    """Light sibling of the next test, without rank 0's planning child: rank 1's stale plan
    crosses the budget at the optimizer step; both ranks get the same (worst) excess, adopt the
    same new plan (checkpoint='all'), retry from the restored state, and two steps end where
    one process with that plan ends."""
    budget = rank_peak() * 2
    params, ranks = run_job({"case": "agree", "arch": ARCH, "batch": BATCH, "steps": 2,
                             "budget": budget, "stale_rank": 1,
                             "knobs": {"gpus": 2, "sharding": "fsdp"}})
    assert ranks[0]["calls"] == ranks[1]["calls"] and len(ranks[0]["calls"]) == 1
    assert ranks[0]["calls"][0] > 0                  # rank 1's excess, on both ranks
    for r in ranks:
        assert r["knobs"]["checkpoint"] == "all" and r["initialized_after"]
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"])
    assert_trains_like_one_process(params, {"checkpoint": "all"}, steps=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_replan_together_and_train_like_one_process():
    """Rank 1's plan predicts an optimizer step of a whole budget: its check crosses the
    budget, every rank re-plans (rank 0 plans in a child, every rank applies it) and retries
    from the restored state; two steps then end where one process ends with that plan."""
    budget = rank_peak() * 2
    params, ranks = run_job({"case": "recover", "arch": ARCH, "batch": BATCH, "steps": 2,
                             "budget": budget, "stale_rank": 1,
                             "knobs": {"gpus": 2, "sharding": "fsdp", "device": "cpu"}})
    for r in ranks:
        assert any("re-planned on every rank" in n for n in r["applied_notes"])
        assert r["initialized_after"]
    assert ranks[0]["knobs"] == ranks[1]["knobs"]             # one plan for all
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"])
    assert_trains_like_one_process(params, ranks[0]["knobs"], steps=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replan_that_cannot_fit_raises_the_same_error_on_every_rank():
    """Rank 0 holds a budget's worth of bytes through the step: what is left cannot fit, and
    every rank raises one and the same OutOfMemory, parameters and plan as before."""
    budget = rank_peak() * 2
    _, ranks = run_job({"case": "ballast", "arch": ARCH, "batch": BATCH, "budget": budget,
                        "ballast_rank": 0,
                        "knobs": {"gpus": 2, "sharding": "fsdp", "device": "cpu"}})
    errors = [r["error"] for r in ranks]
    assert errors[0] is not None and errors[0] == errors[1]    # the same error, word for word
    e = errors[0]
    assert e["type"] == "OutOfMemory" and e["op"] == "optimizer.step"
    assert e["cause"] == "BudgetTooSmall" and e["numbers"][2] == budget
    notes = "\n".join(e["notes"])
    assert "rank 0 would cross the budget" in notes and "re-planning failed" in notes
    for r in ranks:
        assert r["unchanged"] and r["grads_none"] and r["initialized_after"]
        assert r["plan_kept"] == r["first_knobs"]


def _forward_job(world: int, oom_rank: int, sharding: str) -> list[dict]:
    track_budget = int(rank_peak(world) * 0.6)
    _, ranks = run_job({"case": "forward", "arch": ARCH, "batch": BATCH, "oom_rank": oom_rank,
                        "track_budget": track_budget,
                        "knobs": {"gpus": world, "sharding": sharding}}, world)
    assert any("stops every rank with one error" in n for n in ranks[0]["notes"])
    failing = ranks[oom_rank]["error"]
    assert failing["type"] == "OutOfMemory" and failing["op"] != "optimizer.step"
    assert failing["numbers"][2] == track_budget                 # track's own error
    assert "closed its connections" in failing["notes"][-1]
    assert "did not acknowledge" not in failing["notes"][-1]    # every peer read it
    for rank, r in enumerate(ranks):
        e = r["error"]
        assert e is not None and e["type"] == "OutOfMemory", (rank, e)
        assert e["failed_ranks"] == [oom_rank]
        assert e["numbers"] == failing["numbers"] and e["op"] == failing["op"]
        assert f"rank {oom_rank} of {world} ran out of memory" in "\n".join(e["notes"])
        assert r["unchanged"] and r["grads_none"]
        assert r["initialized_after"]             # kept, its connections shut (oom_ranks Note 3)
    for rank, r in enumerate(ranks):
        if rank != oom_rank:
            assert "this rank" in r["error"]["notes"][-1]
            assert "Connection" not in r["error"]["message"]        # not gloo's error
    return ranks


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_oom_in_forward_on_the_store_host_stops_every_rank():
    """Rank 0 (it hosts the job's store) runs out inside its forward while rank 1 waits in an
    FSDP2 all-gather: both stop with rank 0's error, neither hangs."""
    _forward_job(2, 0, "fsdp")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_oom_in_forward_under_ddp_stops_every_rank():
    _forward_job(2, 1, "ddp")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_oom_in_forward_on_one_of_four_ranks_stops_every_rank():
    _forward_job(4, 2, "fsdp")
