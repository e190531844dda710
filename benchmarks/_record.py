"""Benchmark records: every result carries commit, versions, machine and config."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


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
    }


def write(name: str, config: dict, rows: list[dict]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(json.dumps({"environment": environment(), "config": config, "rows": rows},
                               indent=2) + "\n")
    return path
