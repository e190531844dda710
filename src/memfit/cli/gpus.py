"""``memfit gpus``: the GPU table memfit plans for (names for --gpu, memory, throughput)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gpus", help="list the GPUs memfit knows (names for --gpu)",
                       description="The GPU table: the name to pass as --gpu, memory as sold and "
                                   "as CUDA reports it (what a plan fits), the 16-bit precision "
                                   "--precision auto takes, and peak throughput.")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(run=run)
    return p


def rows() -> list[dict]:
    from memfit.devices import ALIASES, list_devices

    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    return [{"name": d.name, "display_name": d.display_name, "architecture": d.architecture,
             "memory_bytes": d.memory_bytes, "usable_bytes": d.usable_bytes,
             "auto_precision": "bf16" if d.supports_bf16 else "fp16",
             "peak_fp32_tflops": round(d.peak_fp32_flops / 1e12, 2),
             "peak_fp16_tflops": round(d.peak_fp16_flops / 1e12, 2),
             "peak_bf16_tflops": round(d.peak_bf16_flops / 1e12, 2),
             "memory_bandwidth_gb_per_s": round(d.memory_bandwidth_bytes_per_s / 1e9),
             "aliases": aliases.get(d.name, [])} for d in list_devices()]


def run(args) -> int:
    table = rows()
    if args.json:
        json.dump(table, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    from memfit.units import format_bytes

    t = Table(title="GPUs (pass the name as --gpu; 'cpu' plans for this machine's RAM)",
              title_justify="left")
    t.add_column("name", no_wrap=True)
    t.add_column("memory", justify="right", no_wrap=True)
    t.add_column("usable", justify="right", no_wrap=True)
    t.add_column("auto", no_wrap=True)
    t.add_column("TFLOP/s 16-bit", justify="right", no_wrap=True)
    t.add_column("GB/s", justify="right", no_wrap=True)
    t.add_column("GPU")
    for r in table:
        t.add_row(r["name"], format_bytes(r["memory_bytes"], 0), format_bytes(r["usable_bytes"]),
                  r["auto_precision"], f"{max(r['peak_fp16_tflops'], r['peak_bf16_tflops']):g}",
                  str(r["memory_bandwidth_gb_per_s"]), r["display_name"].removeprefix("NVIDIA "))
    Console().print(t)
    return 0
