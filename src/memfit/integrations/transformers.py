"""The Hugging Face ``Trainer``: estimate, plan and apply memfit to ``trainer.train()``.

```python
from memfit.integrations import transformers as mf_hf
est = mf_hf.estimate(trainer)                  # one steady-state optimizer step of train()
changes = mf_hf.fit(trainer, budget="11GiB")   # args / block hooks / optimizer, then:
trainer.train()
```

``estimate`` traces the Trainer's own ``training_step`` on fakes as ``train()`` runs it
(``_hf_step``: the step, what ``train()`` does to the model first, the batch; for a GPU target
transformers' checkpointing too, ``_hf_recompute``); ``fit`` plans per block with memfit's planner
over that step and applies the plan (``_hf_plan``, ``_hf_fit``; ``precision="auto"`` lets it change
the numerics, ``_hf_precision``); ``MemfitCallback`` compares the prediction with the real run
(``_hf_callback``).
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401  (the dependency itself)
except ImportError as e:      # pragma: no cover - exercised only without transformers
    raise ImportError("memfit.integrations.transformers needs Hugging Face transformers: "
                      "pip install memfit[hf]") from e

from memfit.integrations._hf_callback import MemfitCallback
from memfit.integrations._measure import StepMemory
from memfit.integrations._hf_estimate import estimate
from memfit.integrations._hf_fit import Changes, fit

__all__ = ["estimate", "fit", "Changes", "MemfitCallback", "StepMemory"]
