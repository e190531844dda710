"""``memfit calibrate``: measure this machine's GPU and write a device profile for --device."""

from __future__ import annotations

import argparse
import json
import os
import sys

from memfit.cli._args import positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate", help="measure this machine's GPU into a device profile (needs a GPU)",
        description="Measure, in under a minute, what this GPU holds outside PyTorch's tensors "
                    "(the CUDA context, cuBLAS/cuDNN kernels, the cuBLAS workspace), how its "
                    "caching allocator rounds, and one real training step of a small built-in "
                    "model beside memfit's estimate; write it all as a device profile (JSON) "
                    "that `memfit estimate/plan --device FILE.json` and "
                    "memfit.DeviceSpec.load(FILE) use. Run it in a fresh shell, alone on the GPU.")
    p.add_argument("--output", "-o", default=None, metavar="FILE.json",
                   help="where to write the profile (default: memfit-device-<gpu>.json here)")
    p.add_argument("--model", default="gpt2",
                   help="built-in model for the real step, as its tiny config (default: gpt2)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="samples in the real step (default: 8)")
    p.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per sample in the real step (default: 128)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON as well")
    p.set_defaults(run=run)
    return p


def _check_output(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--output {path}: that is a folder; give a file name, e.g. "
                         f"{os.path.join(path, 'gpu.json')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--output {path}: the folder {folder} does not exist")
    if not path.lower().endswith(".json"):
        raise ValueError(f"--output {path}: the file name must end in .json")


def run(args) -> int:
    if args.output:
        _check_output(args.output)
    from memfit.calibrate import calibrate, require_gpu, write_profile

    require_gpu()                          # before the zoo imports: refused at once
    from memfit import zoo

    zoo.get(args.model)                    # an unknown name is refused before measuring
    profile = calibrate(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len)
    name = profile["gpu"]["name"].lower().replace("nvidia ", "").replace(" ", "-")
    path = write_profile(profile, args.output or f"memfit-device-{name}.json")
    if args.json:
        json.dump(profile, sys.stdout, indent=2)
        print()
    m, step = profile["measured"], profile["measured"]["step"]
    mib = 1024 ** 2
    print(f"{profile['gpu']['name']}, CUDA {profile['cuda']}, torch {profile['torch']}: context "
          f"{m['context_bytes'] / mib:.0f} MiB, kernels {m['library_kernels_bytes'] / mib:.0f} MiB, "
          f"cuDNN {m['cudnn_bytes'] / mib:.0f} MiB, cuBLAS workspace "
          f"{m['cublas_workspace_bytes'] / mib:.2f} MiB", file=sys.stderr)
    print(f"{step['model']} step: reserved measured {step['measured_reserved_bytes'] / mib:.1f} "
          f"MiB, predicted {step['predicted_reserved_bytes'] / mib:.1f} MiB; on the device "
          f"{step['measured_device_used_bytes'] / mib:.0f} MiB, predicted "
          f"{step['predicted_device_bytes'] / mib:.0f} MiB (table figures)", file=sys.stderr)
    print(f"profile written to {path}: use it with --device {path}", file=sys.stderr)
    return 0
