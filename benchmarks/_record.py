"""Benchmark records: every result carries commit, versions, machine and config."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHARED_MACHINE_NOTE = (
    "measured on a shared machine loaded by other jobs (step times swing 2-5x over seconds): "
    "the settings were timed interleaved (benchmarks/_timing.py, every setting once per round, "
    "ratios to the plain step of the same round), which is what keeps the ratios meaningful; "
    "absolute seconds are not; the control row (a second plain runner) shows the noise left; "
    "with one torch thread the cpu_time_ratio columns (process CPU time) are the steadier ones")


def environment() -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("-dirty" if dirty else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_model": _cpu_info("model name"),
        # what decides 16-bit CPU speed: without avx512_bf16 / amx, bf16 matmuls run 10-60x
        # slower than fp32
        "cpu_flags": sorted(set((_cpu_info("flags") or "").split()) & _FLAGS),
    }


_FLAGS = {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma"}


def _cpu_info(key: str) -> str | None:
    """The first ``key`` line of /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def fresh_path(name: str) -> Path:
    """``results/NAME-DATE.json``; where a record is already there (an earlier run that day,
    maybe committed) it is kept, and the new one is ``NAME-DATE-2.json``, ``-3``..."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path, n = RESULTS / f"{name}-{stamp}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / f"{name}-{stamp}-{n}.json"
    return path


def write(name: str, config: dict, rows: list[dict]) -> Path:
    """The record at ``fresh_path(name)``: environment, config and rows."""
    path = fresh_path(name)
    path.write_text(json.dumps({"environment": environment(), "config": config, "rows": rows},
                               indent=2) + "\n")
    return path
