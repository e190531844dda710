"""The Trainer integration for a GPU target. transformers' own checkpointing recomputes in
backward, outside the CUDA kernel models the forward ran under; ``_hf_recompute`` re-enters them
through checkpoint's ``context_fn``, so it traces, and it holds exactly what memfit's own
checkpoint of the same blocks holds (which re-enters the models the same way, and equals
transformers' checkpointing to the byte on a CPU target, where both are exact)."""

import pytest

pytest.importorskip("accelerate")

from memfit.integrations import transformers as mf_hf  # noqa: E402
from tests.integrations.hf_helpers import tiny_trainer  # noqa: E402

GPU = "rtx-3090"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama-1b"])
@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_transformers_checkpointing_for_a_gpu_equals_memfits_checkpoint_of_the_blocks(
        name, precision):
    ours = mf_hf.estimate(tiny_trainer(name, **precision), device="cpu", checkpoint="all")
    theirs = mf_hf.estimate(tiny_trainer(name, gradient_checkpointing=True, **precision),
                            device="cpu")
    assert theirs.peak_bytes == ours.peak_bytes          # the CPU-exact path: the same recompute
    gpu_ours = mf_hf.estimate(tiny_trainer(name, **precision), device=GPU, checkpoint="all")
    gpu = mf_hf.estimate(tiny_trainer(name, gradient_checkpointing=True, **precision),
                         device=GPU)
    assert gpu.basis == "cuda-model"
    assert (gpu.peak_bytes, gpu.reserved_bytes, gpu.device_bytes) == \
        (gpu_ours.peak_bytes, gpu_ours.reserved_bytes, gpu_ours.device_bytes)
    assert gpu.peak_bytes < mf_hf.estimate(tiny_trainer(name, **precision), device=GPU).peak_bytes


def test_reentrant_checkpointing_for_a_gpu_is_refused_with_the_way_out():
    trainer = tiny_trainer("gpt2", gradient_checkpointing=True,
                           gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant=False"):
        mf_hf.estimate(trainer, device=GPU)
    assert mf_hf.estimate(trainer, device="cpu").peak_bytes > 0      # a CPU target traces it


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_fit_for_a_gpu_keeps_the_users_checkpointing():
    trainer = tiny_trainer("gpt2", gradient_checkpointing=True, per_device_train_batch_size=4,
                           samples=48)
    plain = mf_hf.estimate(trainer, device=GPU)
    changes = mf_hf.fit(trainer, plain.device_bytes - 1, device=GPU, verbose=False)
    assert changes.candidate.checkpointing and trainer.args.activation_checkpointing
    assert all(m == "keep" for m in changes.blocks.values())     # no memfit hooks on top
    assert changes.predicted_device_bytes < plain.device_bytes
    assert mf_hf.estimate(trainer, device=GPU).device_bytes == changes.predicted_device_bytes


def test_memfit_checkpointing_for_a_gpu_traces_and_lowers_the_peak():
    trainer = tiny_trainer("gpt2")
    plain = mf_hf.estimate(trainer, device=GPU)
    recomputed = mf_hf.estimate(trainer, device=GPU, checkpoint="all")
    assert recomputed.basis == "cuda-model"
    assert recomputed.peak_bytes < plain.peak_bytes
