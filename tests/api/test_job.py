"""``memfit.Job`` and the short fronts on it (issue 27 item 1).

The oracle of each front is the old form on the same arguments: ``estimate(job)``,
``plan(job)`` and ``fit(job)`` must give what ``estimate(model, batch, ...)`` and the others
gave (the same figures, the same plan, bitwise the same parameters after two steps). The old
form must warn exactly once, with memfit's own deprecation class, at the caller's line; a Job
must refuse a bad field at construction, naming it.
"""

import ast
import copy
import pathlib
import warnings

import pytest
import torch

import memfit
from memfit.errors import MemfitDeprecationWarning
from memfit.runtime.batch_shape import extend_batch
from memfit.step import prepare_batch
from tests.helpers import tiny


def _quiet(call, *args, **kwargs):
    """``call`` with memfit's deprecation warning silenced (the old form, as the oracle)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitDeprecationWarning)
        return call(*args, **kwargs)


def _deprecations(call, *args, **kwargs):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = call(*args, **kwargs)
    return out, [w for w in seen if issubclass(w.category, DeprecationWarning)]


@pytest.fixture(scope="module")
def gpt2():
    return tiny("gpt2", batch_size=4, seq_len=16)


@pytest.mark.parametrize("device", ["cpu", "gtx-1080-ti"])
def test_estimate_on_a_job_equals_the_old_form(gpt2, device):
    model, batch = gpt2
    new = memfit.estimate(memfit.Job(model, batch, optimizer="sgd"), device=device,
                          precision="fp32", checkpoint="all")
    old = _quiet(memfit.estimate, model, batch, "sgd", device, precision="fp32",
                 checkpoint="all")
    assert (new.peak_bytes, new.reserved_bytes, new.device_bytes) == \
        (old.peak_bytes, old.reserved_bytes, old.device_bytes)
    assert new.breakdown == old.breakdown and new.knobs == old.knobs


@pytest.mark.slow      # 9 s: two plans; the estimate and fit forms stay in the default tier
def test_plan_on_a_job_equals_the_old_form(gpt2):
    model, batch = gpt2
    plain = memfit.estimate(memfit.Job(model, batch), device="cpu")
    budget = int(plain.device_bytes * 0.8)      # below the plain step: a choice is made
    new = memfit.plan(memfit.Job(model, batch), budget=budget, device="cpu")
    old = _quiet(memfit.plan, model, batch, budget, "adamw", "cpu")
    assert new.knobs == old.knobs and dict(new.blocks) == dict(old.blocks)
    assert (new.predicted_peak_bytes, new.predicted_reserved_bytes,
            new.predicted_device_bytes) == (old.predicted_peak_bytes,
                                            old.predicted_reserved_bytes,
                                            old.predicted_device_bytes)
    assert new.predicted_device_bytes <= budget < plain.device_bytes


# 17 s: the CI time limit; fit on a Job runs in the default tier in the levers' tests
# (tests/planner/test_levers_optimizer_in_backward.py, ..._gradient_offload.py)
@pytest.mark.slow
def test_fit_on_a_job_trains_bitwise_as_the_old_form(gpt2):
    model, batch = gpt2
    budget = int(memfit.estimate(memfit.Job(model, batch), device="cpu").device_bytes * 0.8)
    params = {}
    for form in ("new", "old"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        runner = memfit.fit(memfit.Job(m, batch, optimizer=opt), budget=budget) \
            if form == "new" else _quiet(memfit.fit, m, opt, batch, budget)
        for k in range(2):
            torch.manual_seed(k)            # dropout draws the same masks in both runs
            runner.step(batch)
        runner.close()
        params[form] = [p.detach().clone() for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params["new"], params["old"]))
    assert not all(torch.equal(a, b) for a, b in zip(params["new"], model.parameters()))


def test_the_old_forms_warn_once_at_the_callers_line(gpt2):
    model, batch = gpt2
    m = copy.deepcopy(model)
    calls = {"estimate": lambda: memfit.estimate(model, batch, "sgd", "cpu"),
             "plan": lambda: memfit.plan(model, batch, None, "sgd", "cpu"),
             "fit": lambda: memfit.fit(m, torch.optim.SGD(m.parameters(), lr=0.1), batch)}
    for front, call in calls.items():
        _, seen = _deprecations(call)
        assert [w.category for w in seen] == [MemfitDeprecationWarning], front
        assert seen[0].filename == __file__, front           # stacklevel: the caller's line
        assert f"memfit.{front}(memfit.Job(" in str(seen[0].message)


def test_the_job_forms_do_not_warn(gpt2):
    model, batch = gpt2
    job = memfit.Job(model, batch, optimizer="sgd")
    for call in (lambda: memfit.estimate(job, "cpu"), lambda: memfit.plan(job, device="cpu"),
                 lambda: memfit.fit(job.replace(model=copy.deepcopy(model)))):
        assert _deprecations(call)[1] == []


def test_a_job_field_given_again_is_refused(gpt2):
    job = memfit.Job(*gpt2)
    with pytest.raises(TypeError, match="optimizer.*the Job holds it.*job.replace"):
        memfit.estimate(job, optimizer="sgd")
    with pytest.raises(TypeError, match="step"):
        memfit.plan(job, step=lambda m, b, o: None)


def test_max_seq_len_traces_the_longest_batch(gpt2):
    model, batch = gpt2
    new = memfit.estimate(memfit.Job(model, batch, max_seq_len=24), device="cpu")
    old = _quiet(memfit.estimate, model, extend_batch(prepare_batch(batch), 24), device="cpu")
    plain = memfit.estimate(memfit.Job(model, batch), device="cpu")
    assert new.peak_bytes == old.peak_bytes > plain.peak_bytes


def _step(model, batch, optimizer):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("fields, error, words", [
    (dict(model="gpt2"), ValueError, "Job.model must be a torch.nn.Module.*zoo.get"),
    (dict(batch={}), ValueError, "Job.batch: .*holds no tensors"),
    (dict(batch={"x": torch.tensor(1.0)}), ValueError, "Job.batch: .*no tensor with a batch"),
    (dict(batch=(torch.zeros(2, 3),)), ValueError, "Job.batch is a tuple.*loss_fn"),
    (dict(optimizer="adamx"), ValueError, "Job.optimizer: unknown optimizer 'adamx'.*adamw"),
    (dict(optimizer=3), ValueError, "Job.optimizer: optimizer must be a name"),
    (dict(optimizer=torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)),
     ValueError, "Job.optimizer: .*not trainable parameters of the model"),
    (dict(step=_step, loss_fn=lambda m, b: m(**b).loss), ValueError,
     "Job.loss_fn with Job.step.*leave loss_fn out"),
    (dict(step=_step, max_seq_len=32), ValueError, "Job.max_seq_len with Job.step"),
    (dict(step=lambda model: None), ValueError, "Job.step: .*fn\\(model, batch, optimizer\\)"),
    (dict(step=3), ValueError, "Job.step: step must be a function"),
    (dict(loss_fn="mse"), TypeError, "Job.loss_fn must be a function"),
    (dict(count_fn=3), TypeError, "Job.count_fn must be a function"),
    (dict(scheduler=3), TypeError, "Job.scheduler must be a factory"),
    (dict(max_seq_len=0), ValueError, "Job.max_seq_len must be an int >= 1"),
    (dict(max_seq_len=True), ValueError, "Job.max_seq_len must be an int >= 1"),
])
def test_a_bad_field_is_refused_at_construction_naming_it(gpt2, fields, error, words):
    model, batch = gpt2
    with pytest.raises(error, match=words):
        memfit.Job(**{"model": model, "batch": batch, **fields})


def test_a_job_is_frozen_and_replace_checks_again(gpt2):
    job = memfit.Job(*gpt2)
    with pytest.raises(AttributeError):
        job.optimizer = "sgd"
    assert job.replace(optimizer="sgd").optimizer == "sgd" and job.optimizer == "adamw"
    with pytest.raises(ValueError, match="Job.optimizer"):
        job.replace(optimizer="nope")
    assert repr(job).startswith("Job(GPT2LMHeadModel, batch={input_ids: (4, 16)")


def test_memfit_itself_calls_the_functions_not_the_deprecated_fronts():
    """No module of memfit calls ``memfit.estimate/plan/fit(...)``: those are the user's
    (and warn on the old form); memfit's own code calls ``memfit.api.<front>`` directly."""
    src = pathlib.Path(memfit.__file__).parent
    found = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and \
                    isinstance(f.value, ast.Name) and f.value.id == "memfit" and \
                    f.attr in ("estimate", "plan", "fit"):
                found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert found == []
