"""The seed table's rows traced by a pool of worker processes.

Note 1 (why processes). A row is one fake trace, bound by Python's dispatch of each op through
the tracing modes (not by arithmetic), so one process keeps one core busy and threads would
share one interpreter lock. With ``jobs`` worker processes (default: the cores this process may
use) the rows are traced side by side; each worker runs one intra-op thread, so two of them on a
2-core machine do not fight over the cores. Workers start with ``spawn`` (a fresh interpreter:
forking a process whose torch has started its thread pools can hang) and import memfit once.

Note 2 (order). Cached rows are read in this process and never reach a worker. The rest are
submitted longest first (plans, which trace several configurations, then XLM-R large, then
base), so that no long row starts last while the other workers sit idle; results come back in
the table's order, whatever order they finish in.
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


def _work(task: tuple, use_cache: bool) -> dict:
    kind, args, device = task
    if kind == "estimate":
        return st.estimate_row(args, device, use_cache=use_cache)
    model, seq_len, batch_size, tiny = args
    return st.plan_row(model, seq_len, batch_size, device, tiny, use_cache=use_cache)


def _cost(task: tuple) -> int:
    kind, args, _ = task
    model = args.model if kind == "estimate" else args[0]
    return (2 if kind == "plan" else 1) * (3 if "large" in model else 1)


def _row(task: tuple):
    kind, args, _ = task
    return args if kind == "estimate" else st.Row(args[0], args[1], "auto", "auto", args[2],
                                                  args[3])


def trace_rows(rows: list, plans: list[tuple], device, use_cache: bool = True, jobs: int = 1,
               on_done: Callable[[int, int], None] | None = None) -> tuple[list, list]:
    """(one result per row, one per plan), each as ``seed_table.estimate_row`` /
    ``plan_row`` return it. ``plans``: ``(model, seq_len, batch_size, tiny)`` tuples.
    ``on_done(done, total)`` after each result."""
    tasks = [("estimate", r, device) for r in rows] + [("plan", p, device) for p in plans]
    results: list = [None] * len(tasks)
    for i, task in enumerate(tasks):
        if use_cache:
            results[i] = st.cached_result(task[0], _row(task), device)
    todo = sorted((i for i, r in enumerate(results) if r is None), key=lambda i: -_cost(tasks[i]))
    report = on_done or (lambda done, total: None)
    done = len(tasks) - len(todo)
    report(done, len(tasks))
    jobs = max(1, min(jobs, len(todo)))
    if jobs == 1:
        for i in todo:
            results[i] = _work(tasks[i], use_cache)
            done += 1
            report(done, len(tasks))
    else:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx,
                                    initializer=_init_worker) as pool:
            futures = {pool.submit(_work, tasks[i], use_cache): i for i in todo}
            for f in cf.as_completed(futures):
                results[futures[f]] = f.result()
                done += 1
                report(done, len(tasks))
    return results[:len(rows)], results[len(rows):]
