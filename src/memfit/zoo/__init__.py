"""Built-in model specs: real configs, random-weight builders and synthetic training batches.

``memfit.zoo.get("xlm-roberta-large").build(device="meta")`` gives the full-size model without
memory; ``build(tiny=True)`` a small model of the same class for tests; ``make_batch(model)`` a
batch such that ``model(**batch).loss`` is defined. Nothing is downloaded: weights are random.
"""

from memfit.zoo._config_file import from_config_file
from memfit.zoo._registry import get, names
from memfit.zoo._spec import FAMILIES, TASKS, ModelSpec, count_parameters

__all__ = ["ModelSpec", "get", "names", "from_config_file", "count_parameters", "FAMILIES", "TASKS"]
