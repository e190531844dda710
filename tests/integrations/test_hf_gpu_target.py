"""The Trainer integration for a GPU target: transformers' own checkpointing is refused with the
way out (its recompute runs outside memfit's CUDA models); memfit's block hooks do the same
recompute and trace."""

import pytest

pytest.importorskip("accelerate")

from memfit.integrations import transformers as mf_hf  # noqa: E402
from tests.integrations.hf_helpers import tiny_trainer  # noqa: E402


def test_transformers_checkpointing_for_a_gpu_is_refused_with_the_way_out():
    trainer = tiny_trainer("gpt2", gradient_checkpointing=True)
    with pytest.raises(ValueError, match="checkpoint='all'"):
        mf_hf.estimate(trainer, device="rtx-3090")
    assert mf_hf.estimate(trainer, device="cpu").peak_bytes > 0      # a CPU target traces it


def test_memfit_checkpointing_for_a_gpu_traces_and_lowers_the_peak():
    trainer = tiny_trainer("gpt2")
    plain = mf_hf.estimate(trainer, device="rtx-3090")
    recomputed = mf_hf.estimate(trainer, device="rtx-3090", checkpoint="all")
    assert recomputed.basis == "cuda-model"
    assert recomputed.peak_bytes < plain.peak_bytes
