"""The seed table's rows traced by a pool of worker processes.

Note 1 (why processes). A row is one fake trace, bound by Python's dispatch of each op through
the tracing modes (not by arithmetic), so one process keeps one core busy and threads would
share one interpreter lock. With ``jobs`` worker processes (default: the cores this process may
use) the rows are traced side by side; each worker runs one intra-op thread, so two of them on a
2-core machine do not fight over the cores. Workers start with ``spawn`` (a fresh interpreter:
forking a process whose torch has started its thread pools can hang) and import memfit once.

Note 2 (order). Cached rows are read in this process and never reach a worker. The rest go
out as groups of one shared trace (``seed_table.group_key``, Note 2 there) and plans,
longest first (XLM-R large's plan, then its groups, then base's), so that no long task starts
last while the other workers sit idle; results come back in the table's order, whatever order
they finish in.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable

from memfit.train import seed_table as st

__all__ = ["trace_rows", "default_jobs"]


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                    # not Linux
        return max(1, os.cpu_count() or 1)


def _init_worker() -> None:
    import logging

    import torch

    torch.set_num_threads(1)
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _work(task: tuple, use_cache: bool) -> list[dict]:
    kind, args, device = task
    if kind == "group":
        return st.estimate_group(args, device, use_cache=use_cache)
    model, seq_len, batch_size, tiny = args
    return [st.plan_row(model, seq_len, batch_size, device, tiny, use_cache=use_cache)]


def _cost(task: tuple) -> int:
    """In units of a shared trace of XLM-R base: a plan traces about twice, large's layers
    are twice base's at about twice the width."""
    kind, args, _ = task
    model = args[0].model if kind == "group" else args[0]
    return (3 if kind == "plan" else 1) * (2 if "large" in model else 1)


def trace_rows(rows: list, plans: list[tuple], device, use_cache: bool = True, jobs: int = 1,
               on_done: Callable[[int, int], None] | None = None) -> tuple[list, list]:
    """(one result per row, one per plan), each as ``seed_table.estimate_row`` /
    ``plan_row`` return it. ``plans``: ``(model, seq_len, batch_size, tiny)`` tuples.
    ``on_done(done, total)`` after each result."""
    items = [("estimate", r) for r in rows] + \
        [("plan", st.Row(p[0], p[1], "auto", "auto", p[2], p[3])) for p in plans]
    results: list = [st.cached_result(kind, row, device) if use_cache else None
                     for kind, row in items]
    groups: dict[tuple, list[int]] = {}           # rows of one shared trace (by row index)
    for i, got in enumerate(results[:len(rows)]):
        if got is None:
            groups.setdefault(st.group_key(rows[i]), []).append(i)
    tasks = [("group", [rows[i] for i in g], device) for g in groups.values()]
    slots = list(groups.values())                 # where each task's results go
    for j, p in enumerate(plans):
        if results[len(rows) + j] is None:
            tasks.append(("plan", p, device))
            slots.append([len(rows) + j])
    order = sorted(range(len(tasks)), key=lambda t: -_cost(tasks[t]))
    report = on_done or (lambda done, total: None)
    done = sum(r is not None for r in results)
    report(done, len(items))

    def finished(t: int, got: list[dict]) -> None:
        nonlocal done
        for i, r in zip(slots[t], got):
            results[i] = r
        done += len(got)
        report(done, len(items))
    jobs = max(1, min(jobs, len(tasks)))
    if jobs == 1:
        for t in order:
            finished(t, _work(tasks[t], use_cache))
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                    initializer=_init_worker) as pool:
            futures = {pool.submit(_work, tasks[t], use_cache): t for t in order}
            for f in cf.as_completed(futures):
                finished(futures[f], f.result())
    return results[:len(rows)], results[len(rows):]
