"""Shared test helpers: run the real canonical step the way estimate traces it."""


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
    model, opt = tech.apply(model, OptimizerRecipe(optimizer))
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
    runner.step(batch)
    prepared = runner.prepare(batch)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.run(prepared)
    return t
