"""memfit where people train: ``memfit.integrations.transformers`` (the Hugging Face Trainer).

Each integration imports its library when it is itself imported, never before; core memfit
never imports this package. ``from memfit.integrations import transformers as mf_hf`` needs
``pip install memfit[hf]``.
"""

__all__ = ["transformers"]
