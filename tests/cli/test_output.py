"""What the CLI prints (issue 11 items 12, 13): --reserve in the text and the JSON, the plain
step's precision named, no negative byte counts, no host line when nothing is offloaded, and
--optimizer-impl reaching the knob. Each command runs once (module fixtures): a trace is slow."""

import contextlib
import dataclasses
import io
import json

import pytest

import memfit
from memfit import zoo
from memfit.cli import main
from memfit.cli._json import byte_counts_checked, spare_and_short
from memfit.devices import get_device
from memfit.units import GiB

SHAPE = ["--seq-len", "32", "--batch-size", "2"]
T4, CPU = ["--gpu", "t4"], ["--gpu", "cpu"]      # plans on the CPU: no allocator replay, faster


def run(*args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def outputs(tiny_gpt2):
    c = ["--config", tiny_gpt2, *SHAPE]
    return {
        "estimate": json.loads(run("estimate", *c, *T4, "--reserve", "1GiB", "--json")),
        "estimate_short": json.loads(run("estimate", *c, *T4, "--reserve", "14.6GiB", "--json")),
        "estimate_text": " ".join(run("estimate", *c, *T4, "--reserve", "1GiB").split()),
        "offload_text": " ".join(run("estimate", *c, *T4, "--offload-optimizer").split()),
        "plan": json.loads(run("plan", *c, *CPU, "--reserve", "1.5GiB", "--json")),
        "plan_text": " ".join(run("plan", *c, *CPU, "--reserve", "1.5GiB").split()),
    }


def _walk_bytes(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk_bytes(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk_bytes(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and path.endswith("_bytes"):
        yield path, obj


def test_reserve_lowers_the_limit_and_is_shown(outputs):
    est, planned = outputs["estimate"], outputs["plan"]
    assert est["reserve_bytes"] == GiB
    assert est["limit_bytes"] == get_device("t4").usable_bytes - GiB
    assert planned["reserve_bytes"] == int(1.5 * GiB)
    assert planned["plan"]["budget_bytes"] == get_device("cpu").usable_bytes - int(1.5 * GiB)
    assert "less 1.00 GiB reserved" in outputs["estimate_text"]
    assert "less 1.50 GiB reserved" in outputs["plan_text"]


def test_plan_text_names_the_precision_of_each_step(outputs):
    out, text = outputs["plan"], outputs["plan_text"]
    assert f"plain step ({out['plain_precision']}, the whole batch at once)" in text
    assert f"with the plan ({out['plan']['knobs']['precision']})" in text
    assert "step time" in text and "slowdown: " not in text         # a ratio, not "slowdown 0.5x"


def test_no_negative_byte_counts_in_any_json(outputs):
    counts = [c for key in ("estimate", "estimate_short", "plan")
              for c in _walk_bytes(outputs[key])]
    assert len(counts) > 20 and [c for c in counts if c[1] < 0] == []
    short = outputs["estimate_short"]
    assert short["fits"] is False and short["spare_bytes"] == 0
    assert short["short_bytes"] == short["device_bytes"] - short["limit_bytes"] > 0


def test_json_helpers():
    assert spare_and_short({"headroom_bytes": -5}) == {"spare_bytes": 0, "short_bytes": 5}
    assert byte_counts_checked({"plan": {"predicted_optimizer_step_bytes": -4}}) == \
        {"plan": {"predicted_optimizer_step_bytes": 0}}       # an increase: nothing added
    with pytest.raises(AssertionError, match="negative byte count"):
        byte_counts_checked({"blocks": [{"saved_bytes": -1}]})


def test_host_memory_is_shown_only_when_something_is_offloaded(outputs):
    assert "host RAM" not in outputs["estimate_text"]
    assert "host RAM for offload" in outputs["offload_text"]
    planned = outputs["plan"]
    if not planned["plan"]["knobs"]["offload_optimizer"]:
        assert planned["host_peak_bytes"] == 0 and "host RAM" not in outputs["plan_text"]


def test_optimizer_impl_flag_is_the_knob(tiny_gpt2):
    if "optimizer_impl" not in {f.name for f in dataclasses.fields(memfit.Knobs)}:
        pytest.skip("this memfit has no optimizer_impl knob")
    spec = zoo.from_config_file(tiny_gpt2)
    model = spec.build(device="meta")
    batch = spec.make_batch(model, 2, seq_len=32)
    out = json.loads(run("estimate", "--config", tiny_gpt2, *SHAPE, *T4, "--optimizer-impl",
                         "for-loop", "--json"))
    api = memfit.estimate(model, batch, device="t4", optimizer_impl="for-loop")
    assert out["peak_bytes"] == api.peak_bytes and out["device_bytes"] == api.device_bytes
    assert any("for-loop" in note for note in out["notes"])     # the implementation modelled
