"""The OOM guard across the ranks of a job: one agreement before the optimizer step, and one
clear error on every rank when a rank runs out of memory where the ranks cannot agree.

Note 1 (the agreement). ``agree`` is one ``all_reduce`` over a vector of four slots per rank,
each rank filling its own (a gather): its excess over the budget at the optimizer step, its
live bytes, the step's predicted bytes and its budget. Every rank then knows the worst rank and
its numbers, so every rank raises the same ``memfit.OutOfMemory`` (op ``optimizer.step``),
marked ``agreed``: the OOM guard may re-plan on every rank with the same excess, rank 0
planning for all.

Note 2 (stopping every rank). An out-of-memory error inside the forward or backward of one
rank leaves the others inside a collective (an FSDP2 all-gather or reduce-scatter, a DDP
bucket's all-reduce) that waits for it, by default for the group's 30-minute timeout. The rank
that ran out (``stop_here``) writes its error to the job's store (``memfit/oom/<n>/<rank>``,
c10d's default store: the rendezvous's TCPStore) and reads it back (a round trip: the key is
on the server before anything closes), then shuts down its TCP connections to the other
ranks: every peer's pending gloo collective fails within milliseconds ("Connection closed by
peer"). What torch 2.13 offers does not do it: ``ProcessGroup.abort()`` and ``shutdown()``,
the gloo backend's ``abort()`` and ``shutdown()``, ``destroy_process_group`` and
``distributed_c10d._abort_process_group`` all leave the connections open while anything holds
the group (FSDP2's mesh, DDP's reducer always do): gloo closes them only when the backend
object is freed (measured: a peer waited until the failing process exited). So each rank
publishes the local endpoints of its connected TCP sockets (``memfit/endpoints/<rank>``, at
each guarded step, when they changed), and a rank that stops shuts down (``SHUT_RDWR``) those of
its sockets whose remote end is another rank's published endpoint: its connections to the job,
nothing else (the store's port excluded), read from ``/proc/self/fd`` (Linux; elsewhere
nothing is closed and the peers wait for their timeout). When every other rank publishes its
own error within ``ALL_AT_ONCE_S`` (the same batch was too large for each), no rank waits in a
collective and nothing is closed. A peer (``stop_peer``) whose collective fails looks for such
a key (at most ``KEY_WAIT_S``); when it finds one it acknowledges
(``memfit/oom-seen/<n>/<rank>``), shuts down its own connections (a rank waiting on it fails
fast too) and raises the failing rank's error, rebuilt with its numbers, with a note naming
that rank; ``failed_ranks`` on the error lists the ranks that ran out. No key: the collective
failed for another reason and its error is raised as is. The failing rank waits for every
other rank's acknowledgement (or its own out-of-memory key) at most ``ACK_TIMEOUT_S`` seconds,
so that a store hosted by this rank (rank 0's) stays up until the peers have read it, then
raises. Every wait is bounded. ``<n>`` counts the stops so far (every rank counts the same),
so a job that trains on after a stop that closed nothing does not read an old key.

Note 3 (after a stop). The process group stays initialized but, unless all ranks ran out at
once, its connections are shut: every collective on it fails. The error ends the run, with
every rank's parameters and optimizer state as before the batch (the guard's Note 1);
``destroy_process_group()`` in the script's cleanup works as usual. Under ``torchrun`` the
failing rank exits non-zero and the agent ends the others anyway; this makes them end at once
with the failing rank's error instead of a collective's, or the group's timeout.

Note 4 (NCCL, untested here). Only gloo runs on this machine. NCCL's collectives do not run
over these TCP sockets, so closing them is not expected to wake a peer blocked in one: there
the peers stop by NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default, after
the group's ``timeout``: pass a short one to ``init_process_group(timeout=)``) or by torchrun
tearing the job down when the failing rank exits non-zero; the store key is written either
way, so a peer that catches the watchdog's error raises the failing rank's error. None of this
is tested here.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch
import torch.distributed as dist

from memfit.units import format_bytes

__all__ = ["ACK_TIMEOUT_S", "agree", "describe_worst", "is_agreed", "mark_agreed", "multi_rank",
           "publish_endpoints", "stop_here", "stop_peer"]

ACK_TIMEOUT_S = 30.0     # the failing rank's wait for its peers to read its error (Note 2)
ALL_AT_ONCE_S = 1.0      # how long the failing rank looks for the others running out too
KEY_WAIT_S = 2.0         # a peer's wait for the failing rank's key after its collective failed
_AGREED = "_memfit_agreed_by_ranks"


def multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(numbers: tuple[int, ...], device_type: str) -> tuple[tuple[int, ...], int | None]:
    """``numbers`` (this rank's excess first) of the rank with the largest excess, and that
    rank (Note 1); this rank's own (rank None) outside a job."""
    if not multi_rank():
        return numbers, None
    world, n = dist.get_world_size(), len(numbers)
    device = "cuda" if device_type == "cuda" else "cpu"
    every = torch.zeros(n * world, dtype=torch.int64, device=device)
    every[n * dist.get_rank():n * (dist.get_rank() + 1)] = torch.tensor(numbers)
    dist.all_reduce(every)                       # each rank fills its own slots: a gather
    values = every.tolist()
    rank = max(range(world), key=lambda r: values[n * r])
    return tuple(values[n * rank:n * (rank + 1)]), rank


def mark_agreed(e: BaseException) -> None:
    setattr(e, _AGREED, True)


def is_agreed(e: BaseException) -> bool:
    return getattr(e, _AGREED, False)


_incident = [0]     # stops so far in this process: every rank counts the same (Note 2)


def _key(rank: int) -> str:
    return f"memfit/oom/{_incident[0]}/{rank}"


def _seen(rank: int) -> str:
    return f"memfit/oom-seen/{_incident[0]}/{rank}"


def _store():
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()


def _store_port(store) -> int | None:
    while hasattr(store, "underlying_store"):      # PrefixStore(s) over the TCPStore
        store = store.underlying_store
    return getattr(store, "port", None)


def _connections(store) -> list[tuple[socket.socket, tuple, tuple]]:
    """This process's connected TCP sockets but the store's: (a dup, local, remote)."""
    port, out = _store_port(store), []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:                # not Linux: nothing found, nothing closed (Note 2)
        return out
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                local, remote = s.getsockname()[:2], s.getpeername()[:2]
                if port not in (local[1], remote[1]):
                    out.append((s, local, remote))
                    continue
        except OSError:            # listening or unconnected
            pass
        s.close()
    return out


_published = {}


def _endpoint(address: tuple) -> str:
    return f"{address[0]}:{address[1]}"


def publish_endpoints() -> None:
    """Put this rank's connection endpoints on the store, so that a rank that stops can close
    exactly its connections to the job's ranks (Note 2); once per new set."""
    if not multi_rank():
        return
    store = _store()
    found = _connections(store)
    mine = sorted({_endpoint(local) for _, local, _ in found})
    for s, _, _ in found:
        s.close()
    key = f"memfit/endpoints/{dist.get_rank()}"
    if _published.get(key) != mine:
        store.set(key, json.dumps(mine))
        _published[key] = mine


def _close_job_connections(store) -> int:
    """Shut down this rank's connections to the other ranks' published endpoints (Note 2)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    theirs = set()
    for r in range(world):
        key = f"memfit/endpoints/{r}"
        if r != rank and store.check([key]):
            theirs.update(json.loads(store.get(key)))
    closed = 0
    for s, _, remote in _connections(store):
        if _endpoint(remote) in theirs:
            try:
                s.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:        # another descriptor of the same socket, shut already
                pass
        s.close()
    return closed


def stop_here(e: torch.OutOfMemoryError, failure) -> None:
    """This rank ran out of memory where the ranks cannot agree (Note 2): publish ``failure``
    (the guard's ``_Failure`` of ``e``), make every peer's pending collective fail, wait for
    them to read it, and say so on ``e``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    store.set(_key(rank), json.dumps(failure.to_dict()))
    store.check([_key(rank)])      # a round trip: the key is on the server (Note 2)
    others = [r for r in range(world) if r != rank]
    together = not _wait(store, others, ALL_AT_ONCE_S, seen=False)
    waiting = []
    if not together:
        _close_job_connections(store)
        waiting = _wait(store, others, ACK_TIMEOUT_S)
    how = ("every rank ran out at once, so none waits in a collective and the process group "
           "is kept" if together else
           "it closed its connections to the other ranks, so every other rank's pending "
           "collective fails and that rank stops with this error")
    e.add_note(f"memfit: rank {rank} of {world} ran out of memory ({failure.numbers}) inside "
               f"the step, where the ranks cannot agree on a new plan; it published this error "
               f"on the job's store and {how} (memfit.runtime.oom_ranks Note 2)" +
               (f"; rank(s) {', '.join(map(str, waiting))} did not acknowledge within "
                f"{ACK_TIMEOUT_S:.0f} s" if waiting else ""))
    try:
        e.failed_ranks = sorted([rank] + _failed(store, others))
    except RuntimeError:
        e.failed_ranks = [rank]
    _incident[0] += 1


def stop_peer(error: BaseException, failure_of) -> torch.OutOfMemoryError | None:
    """This rank's collective failed (``error``): the error to raise if a peer ran out of
    memory (Note 2), else None. ``failure_of(dict)`` rebuilds a peer's published failure."""
    if not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = _store()
        others = [r for r in range(world) if r != rank]
        deadline = time.monotonic() + KEY_WAIT_S
        failed = _failed(store, others)
        while not failed and time.monotonic() < deadline:
            time.sleep(0.02)
            failed = _failed(store, others)
        if not failed:
            return None
        published = [json.loads(store.get(_key(r))) for r in failed]
        store.set(_seen(rank), "1")
        _close_job_connections(store)      # a rank waiting on this one fails fast too
    except RuntimeError:           # the store itself is gone: nothing to read
        return None
    _incident[0] += 1
    first = failure_of(published[0])
    summary = "; ".join(f"rank {r}: {failure_of(p).numbers}" for r, p in zip(failed, published))
    e = first.error(
        f"memfit: rank {failed[0]} of {world} ran out of memory ({summary}), so this rank "
        f"({rank}) stops too, its parameters and optimizer state as before the batch; its "
        f"own collective failed with {type(error).__name__}: "
        f"{str(error).splitlines()[0][:160] if str(error) else ''} "
        "(memfit.runtime.oom_ranks Note 2)")
    e.failed_ranks = failed
    return e


def _failed(store, ranks: list[int]) -> list[int]:
    return [r for r in ranks if store.check([_key(r)])]


def _wait(store, ranks: list[int], timeout_s: float, seen: bool = True) -> list[int]:
    """Wait until each of ``ranks`` ran out itself (or, with ``seen``, read the error); those
    that did not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = list(ranks)
    while left:
        try:
            left = [r for r in left if not (seen and store.check([_seen(r)])) and
                    not store.check([_key(r)])]
        except RuntimeError:       # the store's host (rank 0) read it and is gone
            return []
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return left


def describe_worst(rank: int, worst: int) -> str:
    return (f"memfit: rank {rank} would cross the budget by {format_bytes(worst)} in the "
            "optimizer step, so no rank steps: every rank raises this error here, before any "
            "parameter changes, and the ranks re-plan together where the guard can "
            "(memfit.runtime.oom_guard)")
