"""benchmarks/gpu_check.py's static-plan section and its GPU worker (benchmarks/static_plan.py)
on a machine without a GPU: they import, and the dry path predicts without measuring (no GPU
figure is made up: measured columns stay empty, the replay allocator's row says why)."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture()
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_check
    import static_plan

    assert callable(static_plan.gpu_measure)
    return gpu_check


def test_the_section_imports(gpu_check):
    assert callable(gpu_check.static_plan_check) and len(gpu_check.STATIC_CASE) == 4


@pytest.mark.slow
def test_the_dry_path_predicts_and_measures_nothing(gpu_check, monkeypatch):
    import memfit
    from memfit.memplan.replay_allocator import unavailable_reason
    from rich.console import Console

    monkeypatch.setattr(gpu_check, "STATIC_CASE", ("bert-base", 2, 32, "fp32"))
    rows = gpu_check.static_plan_check(Console(file=sys.stderr), memfit.get_device("h200"),
                                       dry_run=True)
    assert rows[0]["setting"] == "default" and rows[-1]["setting"].startswith("replay")
    for r in rows:
        assert r["predicted_reserved_bytes"] >= r["lower_bound_bytes"] > 0
        assert not any(k.startswith("measured") or k.startswith("replay_") for k in r)
    if unavailable_reason():
        assert rows[-1]["error"] == unavailable_reason()
