"""Rank 0's plan shared with every rank of a job, and one clear error on every rank when that
fails (``memfit.fit(..., gpus=, sharding=)`` plans on rank 0 for every rank, at the start and on an
out-of-memory re-plan).

Note 1 (a broadcast that fails). Rank 0 plans while the other ranks wait for it in
``broadcast_object_list``; a ``barrier`` after it makes sure every rank got the plan (with more than
two ranks a broadcast can reach some ranks and fail on another). Under gloo (torch 2.13) a peer that
dies closes its sockets with it (the kernel does), so every collective that waits on it fails within
milliseconds ("Connection closed by peer [ip]:port", a ``RuntimeError``): measured with a rank
killed before the broadcast, the root's send and a receiver's wait for a killed root both failed in
under 0.05 s. What is left to do is to say so and to keep the others from waiting: a rank whose
broadcast or barrier fails names the rank it was waiting on (with two ranks, the other; with more,
the rank one of whose published connection endpoints (``oom_ranks`` publishes them on the store) is
the ``[ip]:port`` in gloo's text: gloo names the peer's listening address, so this finds the rank
that accepted that connection, and says "unknown" otherwise or where the store is gone with a dead
rank 0), publishes its failure on the job's store (``memfit/replan-failed/<n>/<rank>``), shuts down
its own connections to the job (as the OOM guard's stop does: a rank still waiting on this one fails
at once instead of at the group's timeout, 30 minutes by default) and raises ``ReplanError``; a rank
whose failure came from such a shutdown adds what the first rank published. Every wait here is
gloo's own (a dead peer: milliseconds) or the store's (one read per rank); nothing waits for the
group's timeout except a peer that is alive but stuck, which no socket reveals (then the group's
``timeout`` applies: pass a short one to ``init_process_group``). A failure of rank 0's planning
itself is not a broadcast failure: rank 0 broadcasts it as its result, so no rank waits. Under NCCL
(untested here, as the guard's stop of every rank) the broadcast does not run over these sockets: a
dead peer is seen by NCCL's watchdog after the group's ``timeout``, or torchrun ends the job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import torch.distributed as dist

from memfit.errors import ReplanError
from memfit.runtime import oom_ranks

__all__ = ["ReplanError", "share_from_rank0"]


_shares = [0]       # share_from_rank0 calls so far: every rank counts the same (Note 1)


def share_from_rank0(make: Callable[[], object]):
    """``make()``, called on rank 0 only, on every rank (a collective); a ``ReplanError`` on
    every surviving rank when a rank fails on the way (Note 1). ``make`` should not raise:
    rank 0 would raise alone, the others waiting for it."""
    n = _shares[0]
    _shares[0] += 1
    try:
        oom_ranks.publish_endpoints()   # so that a rank that stops can close its connections
    except RuntimeError as e:           # the store is gone: its host died
        raise _failed(e, n) from e
    box = [make() if dist.get_rank() == 0 else None]
    try:
        dist.broadcast_object_list(box, src=0)
        dist.barrier()            # every rank got it (Note 1)
    except RuntimeError as e:
        raise _failed(e, n) from e
    return box[0]


_ENDPOINT = re.compile(r"\[([^\]]+)\]:(\d+)")


def _peer_rank(store, text: str) -> int | None:
    """The rank whose published endpoint gloo's error names (Note 1), or None: gloo names the
    peer's listening address, one of its endpoints only when it accepted the connection."""
    found = _ENDPOINT.findall(text)
    if not found:
        return None
    named = {f"{ip}:{port}" for ip, port in found}
    for r in range(dist.get_world_size()):
        key = f"memfit/endpoints/{r}"
        if r != dist.get_rank() and store.check([key]) and named & set(json.loads(
                store.get(key))):
            return r
    return None


def _failed(error: RuntimeError, n: int) -> ReplanError:
    rank, world = dist.get_rank(), dist.get_world_size()
    text = str(error).splitlines()[0][:300] if str(error) else ""
    who, first, closed = None, [], False
    try:
        store = oom_ranks._store()
        who = _peer_rank(store, str(error))
        key = f"memfit/replan-failed/{n}"
        first = [(r, json.loads(store.get(f"{key}/{r}"))) for r in range(world)
                 if r != rank and store.check([f"{key}/{r}"])]
        store.set(f"{key}/{rank}", json.dumps({"waited_on": who, "error": text}))
        store.check([f"{key}/{rank}"])   # a round trip: on the server before anything closes
        oom_ranks._close_job_connections(store)
        closed = True
    except RuntimeError:          # the store is gone with its host (rank 0): nothing to read
        pass
    if who is None and world == 2:
        who = 1 - rank            # the only other rank
    on = f"rank {who}" if who is not None else "a peer (rank unknown)"
    seen = "".join(f"; rank {r} failed first, waiting on rank "
                   f"{'unknown' if p['waited_on'] is None else p['waited_on']}: {p['error']}"
                   for r, p in first)
    how = ("this rank shut its connections to the job so that none waits on it" if closed else
           "the job's store is gone too (its host died), so nothing more could be read")
    what = "share its plan" if rank == 0 else "get rank 0's plan"
    return ReplanError(
        f"memfit: rank {rank} of {world} could not {what}: sharing it "
        f"(the job's store, then broadcast_object_list and a barrier) failed while waiting on "
        f"{on}: "
        f"{type(error).__name__}: {text}{seen}. That rank most likely died: check its log for "
        f"its own error; {how}. Under torchrun the job ends, or restarts from your checkpoint "
        "with --max-restarts (memfit.runtime.replan_broadcast Note 1)", waited_on=who)
