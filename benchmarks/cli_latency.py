"""How long the command line takes to answer: listings, --help and refusals, cache cold and warm.

    python benchmarks/cli_latency.py [--repeats 3] [--baseline REV] [--output FILE.txt]

Each command runs as a user runs it (``python -m memfit.cli ...``, output discarded) twice in a
fresh, empty cache folder (``MEMFIT_CACHE_DIR``): cold, the folder empty; warm, what the cold
run left in it. With ``--baseline REV`` the same commands also run on memfit as it was at
commit REV (its ``src`` taken with ``git archive``, first on ``PYTHONPATH``), once per round:
it has no cache to warm. Every round runs every command on every tree, so a slow phase of a
shared machine lands on all alike; a cell is the median over the rounds of the wall time, and
of the CPU time of the command's process (user + system, ``getrusage``), which a loaded
machine disturbs less. The exit status is printed beside (2: a refusal, as meant).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
_MISSING = "/nonexistent/config.json"
COMMANDS = (
    ["--help"], ["plan", "--help"], ["estimate", "--help"], ["train", "--help"],
    ["bench", "--help"], ["calibrate", "--help"], ["gpus", "--help"], ["models", "--help"],
    ["gpus"], ["gpus", "--json"], ["models"], ["models", "--json"], ["models", "--no-cache"],
    ["cache"],
    # refusals that need no trace
    ["estimate", "--model", "nope"], ["plan", "--model", "nope"],
    ["estimate", "--gpu", "nope"], ["plan", "--gpu", "1080"],
    ["estimate", "--config", _MISSING], ["plan", "--config", _MISSING],
    ["estimate", "--model", "gpt2", "--task", "masked-lm"],
    ["estimate", "--model", "gpt2", "--revision", "main"],
    ["estimate", "--checkpoint", "bogus"], ["plan", "--checkpoint", "bogus"],
    ["estimate", "--batch-size", "0"], ["plan", "--budget", "3"],
    ["estimate", "--remat"], ["bench", "seed", "--gpu", "nope"],
    # a knob combination only the API refuses (api._setup): it imports the API first
    ["estimate", "--offload-params", "all"],
)


def run_once(argv: list[str], env: dict) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the process, exit status) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memfit.cli", *argv], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, proc.returncode


def baseline_src(rev: str, into: Path) -> Path:
    """memfit's ``src`` at ``rev``, extracted under ``into`` (the repository is only read)."""
    tar = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "src"


def measure(trees: dict[str, str | None], repeats: int, scratch: Path) -> dict:
    """{(tree, cache state, command): [(wall, cpu, rc), ...]}, every tree once per round."""
    base = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base.pop("MEMFIT_CACHE_LIMIT", None)
    runs: dict = {}
    for tree, src in trees.items():          # compile each tree's .pyc first, untimed
        env = {**base, **({"PYTHONPATH": src} if src else {})}
        subprocess.run([sys.executable, "-c", "import memfit.cli, memfit.zoo, memfit.api"],
                       env=env, check=True)
    for round_ in range(repeats):
        for i, argv in enumerate(COMMANDS):
            for tree, src in trees.items():
                folder = tempfile.mkdtemp(prefix=f"cache-{round_}-{i}-", dir=scratch)
                env = {**base, "MEMFIT_CACHE_DIR": folder,
                       **({"PYTHONPATH": src} if src else {})}
                states = ("cold", "warm") if src is None else ("cold",)
                for state in states:
                    runs.setdefault((tree, state, tuple(argv)), []).append(run_once(argv, env))
        print(f"round {round_ + 1}/{repeats} done", file=sys.stderr)
    return runs


def table(runs: dict, trees: dict) -> str:
    columns = [(t, s) for t, src in trees.items() for s in (("cold", "warm") if src is None
                                                            else ("cold",))]
    heads = [f"{t} ({s})" if trees[t] is None else f"{t}" for t, s in columns]
    lines = [f"{'command':<50}" + "".join(f"{h:>22}" for h in heads),
             f"{'':<50}" + "".join(f"{'wall s  cpu s  rc':>22}" for _ in heads)]
    for argv in COMMANDS:
        cells = []
        for tree, state in columns:
            r = runs[(tree, state, tuple(argv))]
            wall = statistics.median(x[0] for x in r)
            cpu = statistics.median(x[1] for x in r)
            codes = sorted({x[2] for x in r})
            cells.append(f"{wall:>8.2f} {cpu:>6.2f} {','.join(map(str, codes)):>4}")
        lines.append(f"{'memfit ' + ' '.join(argv):<50}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also time memfit at this commit (e.g. HEAD, before a change)")
    ap.add_argument("--output", default=None, metavar="FILE.txt",
                    help="also write the record (versions, machine, table) to this file")
    args = ap.parse_args()
    env = _record.environment()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="memfit-cli-latency-") as scratch:
        trees: dict[str, str | None] = {"now": None}
        if args.baseline:
            trees = {f"at {args.baseline}": str(baseline_src(args.baseline, Path(scratch))),
                     **trees}
        runs = measure(trees, args.repeats, Path(scratch))
    load_after = os.getloadavg()
    head = [f"memfit command-line latency, median of {args.repeats} rounds "
            "(benchmarks/cli_latency.py)",
            *(f"{k}: {v}" for k, v in env.items()),
            f"baseline: {args.baseline or 'none'}; load average (1, 5, 15 min) before "
            f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
            f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}",
            "cold: memfit's cache folder empty; warm: the same folder after the cold run",
            ""]
    text = "\n".join(head) + table(runs, trees) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
