"""memfit's predicted bytes per rank under ZeRO stages 0-3, beside DeepSpeed's own model-state
estimators and real gloo runs, side by side in one run.

    .venv/bin/python benchmarks/deepspeed_zero.py [--world-size 2] [--archs gpt2,llama-1b]

Per model (tiny configs, random weights) and rank batch: memfit's ``zero_per_rank_bytes``
(stages 0 and 3 traced as DDP / FSDP2 over a fake group; 1 and 2 modelled from the DDP trace:
planner._export_deepspeed Note 3); DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (the functions behind the ``..._all_live`` printers;
no CPU offload, ``additional_buffer_factor`` 1.5, their default), which count model states
only, for DeepSpeed's bf16-weights engine (2 B weights + 2 B gradients + 12 B fp32 master and
Adam per parameter), not activations; and each rank's ``memfit.track`` peak of a real
N-process gloo run of the same step under DDP (stage 0) and FSDP2 (stage 3)
(tests/distributed's worker; its Note 1: FSDP2's reduce-scatter in place under gloo). The
ratios printed are memfit / measured and DeepSpeed / measured. DeepSpeed itself is not run:
the gloo runs are memfit's Runner on PyTorch's DDP and FSDP2, the engines memfit plans.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))      # tests.distributed's worker

import _record  # noqa: E402


def deepspeed_estimates(model, world: int) -> dict:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from memfit.measure import find_blocks

    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in model.get_submodule(b).parameters())
                  for b in find_blocks(model))
    _, z2 = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=world,
                                                  cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world,
                                                     cpu_offload=False, cpu_offload_params=False)
    return {"deepspeed_zero2_bytes": z2, "deepspeed_zero3_bytes": z3, "parameters": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks (default: 2)")
    ap.add_argument("--archs", default="gpt2,llama-1b", help="tiny zoo models, comma-separated")
    args = ap.parse_args()
    from memfit.api._sharded import zero_per_rank_bytes
    from tests.distributed.conftest import real_ranks
    from tests.helpers import tiny

    archs = args.archs.split(",")
    world = args.world_size
    jobs = [(a, c, {}, "adamw") for a in archs for c in ({"kind": "ddp"}, {"kind": "fsdp"})]
    measured = real_ranks(world, jobs)
    rows = []
    for i, arch in enumerate(archs):
        model, batch = tiny(arch)              # the worker's model and batch (3 x 16 tokens)
        ours = zero_per_rank_bytes(model, batch, world)
        ds = deepspeed_estimates(model, world)
        m0 = max(r[2 * i]["peak_bytes"] for r in measured)
        m3 = max(r[2 * i + 1]["peak_bytes"] for r in measured)
        row = {"arch": arch, "world_size": world, "rank_batch": 3,
               **{f"memfit_zero{s}_bytes": b for s, b in ours.items()}, **ds,
               "measured_ddp_bytes": m0, "measured_fsdp_bytes": m3,
               "memfit_vs_measured_zero0": ours[0] / m0, "memfit_vs_measured_zero3": ours[3] / m3,
               "deepspeed_zero3_vs_measured": ds["deepspeed_zero3_bytes"] / m3}
        rows.append(row)
        print(f"{arch} x{world}: ZeRO-0 memfit {ours[0]:,} / measured {m0:,} "
              f"({ours[0] / m0:.3f}); ZeRO-1 memfit {ours[1]:,}; ZeRO-2 memfit {ours[2]:,} vs "
              f"DeepSpeed {ds['deepspeed_zero2_bytes']:,}; ZeRO-3 memfit {ours[3]:,} / "
              f"measured {m3:,} ({ours[3] / m3:.3f}) vs DeepSpeed "
              f"{ds['deepspeed_zero3_bytes']:,} ({ds['deepspeed_zero3_bytes'] / m3:.3f})")
    import deepspeed
    path = _record.write("deepspeed_zero", {"world_size": world, "archs": archs,
                                            "rank_batch": 3, "optimizer": "adamw",
                                            "precision": "fp32", "deepspeed": deepspeed.__version__,
                                            "additional_buffer_factor": 1.5}, rows)
    print(f"written {path}")


if __name__ == "__main__":
    main()
