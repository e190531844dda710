"""``memfit gpus``: the GPU table memfit plans for (names for --gpu, memory, throughput)."""

from __future__ import annotations

from memfit.cli._listing import add_listing_parser, print_listing


def add_parser(sub):
    return add_listing_parser(
        sub, "gpus", help="list the GPUs memfit knows (names for --gpu)",
        description="The GPU table: the name to pass as --gpu, memory as sold and as CUDA reports "
                    "it (what a plan fits; '~' where no public log gives it and memfit takes 2% "
                    "off the card's total), the 16-bit precision --precision auto takes, and peak "
                    "throughput.", run=run)


def rows() -> list[dict]:
    from memfit._device_table import ALIASES, list_devices     # the table without torch

    aliases: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    return [{"name": d.name, "display_name": d.display_name, "architecture": d.architecture,
             "memory_bytes": d.memory_bytes, "usable_bytes": d.usable_bytes,
             "usable_measured": d.usable_measured, "nvml_total_bytes": d.nvml_total_bytes or None,
             "compute_capability": list(d.compute_capability),
             "cuda_context_bytes": d.cuda_context_bytes,
             "auto_precision": "bf16" if d.supports_bf16 else "fp16",
             "peak_fp32_tflops": round(d.peak_fp32_flops / 1e12, 2),
             "peak_fp16_tflops": round(d.peak_fp16_flops / 1e12, 2),
             "peak_bf16_tflops": round(d.peak_bf16_flops / 1e12, 2),
             "memory_bandwidth_gb_per_s": round(d.memory_bandwidth_bytes_per_s / 1e9),
             "aliases": aliases.get(d.name, [])} for d in list_devices()]


def run(args) -> int:
    from memfit.units import GiB

    right = {"justify": "right", "no_wrap": True}
    # one unit for both columns (issue 26): GiB, two decimals, so they compare at a glance;
    # at 80 columns the throughput's header wraps and the card's name keeps a readable width
    columns = [("name", {"no_wrap": True}), ("memory GiB", right), ("usable GiB", right),
               ("auto", {"no_wrap": True}), ("TFLOP/s 16-bit", {"justify": "right"}),
               ("GB/s", right), ("GPU", {"min_width": 12, "overflow": "fold"})]
    return print_listing(
        args, rows(), "GPUs (pass the name as --gpu; 'cpu' plans for this machine's RAM; "
                      "~: usable not published, estimated)",
        columns,
        lambda r: [r["name"], f"{r['memory_bytes'] / GiB:.2f}",
                   ("" if r["usable_measured"] else "~") + f"{r['usable_bytes'] / GiB:.2f}",
                   r["auto_precision"], f"{max(r['peak_fp16_tflops'], r['peak_bf16_tflops']):g}",
                   str(r["memory_bandwidth_gb_per_s"]), r["display_name"].removeprefix("NVIDIA ")])
