"""Built-in model specs: real configs, random-weight builders and synthetic training batches.

``memfit.zoo.get("xlm-roberta-large").build(device="meta")`` gives the full-size model without
memory; ``build(tiny=True)`` a small model of the same class for tests; ``make_batch(model)`` a
batch such that ``model(**batch).loss`` is defined. Weights are random: no weight file is read.
``from_pretrained_config("org/name")`` reads one hub model's ``config.json`` (the only file
fetched, from the local cache first); ``resolve(text)`` is the spec a ``--model`` string names.
``packed_batch(model, lengths)`` flattens sequences into one row as transformers'
``DataCollatorWithFlattening`` does (padding-free training; ``make_batch(..., packing=True)``).
"""

from memfit.zoo._config_file import from_config_file
from memfit.zoo._hub import HubConfigError, from_pretrained_config, resolve
from memfit.zoo._packing import packed_batch
from memfit.zoo._registry import get, names
from memfit.zoo._spec import FAMILIES, TASKS, ModelSpec, count_parameters

__all__ = ["ModelSpec", "get", "names", "from_config_file", "from_pretrained_config", "resolve",
           "HubConfigError", "count_parameters", "packed_batch", "FAMILIES", "TASKS"]
