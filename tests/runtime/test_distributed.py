"""Accumulation across 2 gloo processes: one gradient reduction per effective batch, and the
same update as one process on the whole batch."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from memfit.step import canonical_step, prepare_batch
from tests.helpers import tiny
from tests.runtime import _dist_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_batch_reference():
    model, batch = tiny("gpt2", batch_size=8, seq_len=12, padded=True)
    model.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = canonical_step(model, opt, prepare_batch(batch))
    items = int((batch["labels"][:, 1:] != -100).sum())
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, loss.item(), items


def run_two_ranks(mode, tmp_path):
    mp.spawn(_dist_worker.run, args=(2, mode, free_port(), str(tmp_path)), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def assert_matches_reference(result):
    ref, loss, items = full_batch_reference()
    largest = max(v.abs().max().item() for v in ref.values())
    err = max((result["updates"][n] - ref[n]).abs().max().item() for n in ref)
    assert err / largest < 1e-5
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["items"] == items


@pytest.mark.slow
def test_ddp_reduces_once_per_effective_batch_and_matches_one_process(tmp_path):
    r0, r1 = run_two_ranks("ddp", tmp_path)
    # 2 micro-batches per rank, one bucket: no_sync on the first, one all-reduce on the last
    assert r0["grad_allreduces"] == r1["grad_allreduces"] == 1
    assert_matches_reference(r0)


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_fsdp2_reduce_scatters_once_per_effective_batch_and_matches_one_process(tmp_path):
    r0, _ = run_two_ranks("fsdp", tmp_path)
    # one reduce-scatter per FSDP group (each of the 2 blocks, and the root's own params),
    # on the last micro-batch only
    n_groups = 3
    scatters = sum(v for k, v in r0["collectives"].items() if "reduce_scatter" in k)
    assert scatters == n_groups
    assert_matches_reference(r0)
