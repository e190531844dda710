"""Shared test helpers: run the real canonical step the way estimate traces it."""

import gc

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import memfit
from memfit import zoo
from memfit.optimizers import OptimizerRecipe
from memfit.step import canonical_step, prepare_batch
from memfit.techniques.precision import Precision


def tiny(name, batch_size=3, seq_len=16, padded=False, seed=0):
    spec = zoo.get(name)
    model = spec.build(tiny=True, seed=seed)
    text = spec.family != "vision"
    batch = spec.make_batch(model, batch_size, seq_len=seq_len if text else None,
                            padded=padded and text, seed=seed)
    return model, batch


def track_real_step(model, batch, optimizer="adamw", precision="fp32", loss_fn=None):
    """Step 1 untracked (optimizer state appears), then step 2 under track."""
    tech = Precision(Precision.Config(precision))
    opt = tech.apply(model, OptimizerRecipe(optimizer)).optimizer
    batch = tech.prepare_batch(prepare_batch(batch))
    canonical_step(model, opt, batch, loss_fn, tech.autocast("cpu"))
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, batch, loss_fn, tech.autocast("cpu"))
    return t


def track_runner_step(model, batch, optimizer="adamw", loss_fn=None, **knobs):
    """A real Runner (memfit.fit): one step untracked, then ``run`` of the next under track."""
    opt = OptimizerRecipe(optimizer).build([p for p in model.parameters() if p.requires_grad],
                                           [p for p in model.parameters() if p.requires_grad])
    runner = memfit.fit(model, opt, batch, loss_fn=loss_fn, **knobs)
    t = track_next_run(runner, batch)
    runner.close()     # its hooks (and offloaded weights' host copies) leave the model
    return t


def track_next_run(runner, batch):
    """One ``runner.step`` (steady state), then the next effective batch's ``run`` under track
    (the batch prepared outside, as estimate traces it)."""
    runner.step(batch)
    prepared = runner.prepare(batch)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.run(prepared)
    return t


def train_seeded(model, batch, steps=2, autocast=None):
    """``steps`` SGD steps with ``canonical_step``, the RNG seeded with the step number before
    each (so dropout draws the same masks in two runs)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(steps):
        torch.manual_seed(k)
        canonical_step(model, opt, batch, autocast=autocast() if autocast else None)
    return model


def equal_params(a, b) -> bool:
    """Every parameter of ``a`` bitwise equal to ``b``'s, in order."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def foreign_bytes(job_tensors) -> int:
    """Bytes of CPU storages alive in this process outside the job (other tests' models,
    caches). remat's budget counts every byte on the device (its Note 8), so a session is given
    ``budget + foreign_bytes`` and the job itself, counted by the oracle, must stay under
    ``budget``: the same test alone or after a thousand others. Independent of memfit: a walk of
    the garbage collector's tensors, deduplicated by storage. A wrapper subclass (torchao's
    optimizer states) is counted by the tensors it wraps: the wrapper's own storage reports the
    wrapped size even where they are fakes that a compiled trace's guards keep alive."""
    gc.collect()
    mine = {t.untyped_storage()._cdata for t in job_tensors if t.layout is torch.strided}
    seen, total = set(), 0
    for t in gc.get_objects():
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout is not torch.strided:
            continue
        if isinstance(t, torch._subclasses.FakeTensor) or t.device.type != "cpu":
            continue
        if is_traceable_wrapper_subclass(t):     # its inner tensors are objects of their own,
            continue                             # counted where real (a trace's may be fakes)
        grad = t.grad if t.is_leaf and t.requires_grad else None
        for x in (t,) if grad is None else (t, grad):
            st = x.untyped_storage()
            if st._cdata not in mine and st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total
