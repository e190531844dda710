"""Tracing one rank of an N-rank job in one process: a fake process group, and what
``track``'s counter must see under FSDP2.

Note 1 (the fake process group). As PyTorch's own FSDP2 memory-tracker tests do,
``dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)``: a group whose
collectives return at once without moving data (``FakeProcessGroup``). Under ``FakeTensorMode``
the collectives' tensors are fakes, so FSDP2 and DDP run their real code -- sharding, the
all-gather and reduce-scatter buffers they allocate, prefetch, resharding, the reducer's
buckets -- and the counter sees every one of those tensors as it does on a real rank. One rank
is traced (``rank``, default 0). Ranks differ where a dimension does not split evenly: FSDP2
chunks dim 0 with ``torch.chunk``, so the first ranks get full chunks and the last a smaller
or an empty one; every shard's storage is padded to the full chunk, but what is made *from*
the local shard (the optimizer's state, ``zeros_like`` of it) is not. Rank 0 holds the most
(tiny bert on 4 ranks: its 2-row token-type table leaves ranks 2 and 3 empty, 1,032 B less).
The group is destroyed on exit, also when the trace raises. A process
that already has a default group (inside ``torchrun``) cannot hold a second one: then
``fake_process_group`` refuses with the fix (trace before ``init_process_group``, or in a
subprocess); c10d has one default group per process and swapping it in and out would leave
the user's group's collectives half-registered.

Note 2 (what the counter must see under FSDP2). DTensor's ``__tensor_flatten__`` lists its
``device_mesh`` beside ``_local_tensor`` (the ledger's ``storages_of`` takes only inner tensors),
and FSDP2 frees and re-allocates the unsharded parameters with ``UntypedStorage.resize_``, which no
dispatch mode sees (a wrapper of the method counts it while a tracker runs,
``memfit.measure._storage_resize``). Both are ``memfit.measure``'s, so a real run under ``track``
and a trace count the same bytes with nothing more to enter.

Note 3 (DDP under the fake group). DDP's C++ reducer runs on fakes: it allocates its gradient
buckets (fakes, counted) and copies each gradient into its bucket. Two things need a hand: its
start-up check reads parameter values (``init_sync=False`` skips it and the broadcast, which
happen before any step), and its built-in all-reduce hook expects the fake group's future to
hold the reduced bucket, which ``FakeWork``'s holds None. ``trace_ddp_hook`` registers the
hook DDP's default amounts to -- divide the bucket by the world size in place, all-reduce it
in place, a future done with the bucket itself -- so the step allocates what the default does
(nothing beyond the bucket) and the reducer copies the bucket back into the gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["fake_process_group", "trace_ddp_hook"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """A fake default process group of ``world_size`` ranks (this process is ``rank``), and
    a CPU ``DeviceMesh`` over it; destroyed on exit (Note 1). Yields the mesh."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: give the number of ranks, an int >= 1")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: give a rank in 0..{world_size - 1}")
    if not dist.is_available():
        raise ValueError("this PyTorch build has no torch.distributed: a sharded estimate "
                         "needs it")
    if dist.is_initialized():
        raise ValueError("a default process group is already initialized in this process "
                         f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}): "
                         "a sharded estimate traces under a fake group of its own, and c10d "
                         "holds one default group per process. Call estimate_sharded before "
                         "init_process_group (e.g. on rank 0 before torchrun's group is made), "
                         "or run it in a subprocess")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def trace_ddp_hook(ddp) -> None:
    """DDP's default all-reduce as a Python comm hook that a fake group can complete (Note 3)."""
    def hook(group, bucket):
        buf = bucket.buffer()
        buf.div_(group.size())
        dist.all_reduce(buf, group=group)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp.register_comm_hook(ddp.process_group, hook)
