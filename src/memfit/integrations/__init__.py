"""memfit where people train: ``memfit.integrations.transformers`` (the Hugging Face Trainer),
``memfit.integrations.accelerate`` (an ``Accelerator`` loop) and
``memfit.integrations.lightning`` (a Lightning ``Trainer`` + ``LightningModule``).

Each integration imports its library when it is itself imported, never before; core memfit
never imports this package. ``transformers`` and ``accelerate`` need ``pip install
memfit[hf]``, ``lightning`` needs ``pip install memfit[lightning]``. Each traces the
framework's own step through ``memfit.estimate(step=fn)`` and applies plans through the model
(block hooks) and the optimizer, never by rewriting the framework's code.
"""

__all__ = ["transformers", "accelerate", "lightning"]
