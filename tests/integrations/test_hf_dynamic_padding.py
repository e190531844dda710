"""``estimate(trainer)`` under dynamic padding (issue 26 item 14): the samples differ in length,
the collator pads each micro-batch to its longest sample and the sampler shuffles, so steps
differ. The estimate is of the longest step the dataloader can produce (``_hf_step`` Note 3),
and says so. Oracle: the peak of a real ``train()`` over a whole shuffled epoch, counted by
the live-storage counter of ``test_hf_fit_whole_run`` (not ``memfit.track``); the dataset
begins with its shortest samples, which the old estimate traced.
"""

import gc

import torch
from transformers import set_seed

from memfit.integrations import transformers as mf_hf
from tests.integrations.hf_helpers import tiny_trainer
from tests.integrations.test_hf_fit_whole_run import LiveBytes

B, STEPS = 2, 2


def pad(rows):
    """A padding collator: each batch padded to its longest row (mask 0, label -100)."""
    n = max(len(r["input_ids"]) for r in rows)
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"]))
                                       for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) +
                                            [0] * (n - len(r["input_ids"])) for r in rows]),
            "labels": torch.tensor([r["input_ids"] + [-100] * (n - len(r["input_ids"]))
                                    for r in rows])}


def trainer():
    g = torch.Generator().manual_seed(0)
    lengths = [8] * 12 + [12, 16, 20, 24, 28, 32]           # the first samples are the shortest
    rows = [{"input_ids": torch.randint(0, 100, (n,), generator=g).tolist()} for n in lengths]
    t = tiny_trainer("gpt2", per_device_train_batch_size=B, gradient_accumulation_steps=STEPS,
                     num_train_epochs=1, max_steps=-1, seed=0)
    t.train_dataset, t.data_collator = rows, pad
    return t


def test_the_longest_step_is_estimated_and_said():
    est = mf_hf.estimate(trainer())
    gc.collect()
    set_seed(0)
    t = trainer()
    with LiveBytes() as live:
        t.train()                          # a whole shuffled epoch
    assert est.peak_bytes >= live.peak_bytes
    note = [n for n in est.notes if n.startswith("batch:")]
    assert note and "longest step" in note[0] and "32" in note[0]


def test_equal_lengths_trace_the_first_samples_and_say_so():
    t = tiny_trainer("gpt2", samples=8)
    assert any(n.startswith("batch: the first") for n in mf_hf.estimate(t).notes)
