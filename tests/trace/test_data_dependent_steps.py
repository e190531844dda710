"""Whole steps whose control flow reads values (issue 26, items 7 and 9): the estimate equals the
real step to the byte.

Oracle: ``LiveBytes`` (tests/techniques/test_remat_budget.py), a dispatch mode that is not
memfit's ledger: it sums the bytes of every live storage through weak references, seeded with
what is alive before the step. The real run takes one step first (optimizer state exists), then
the counted one; random draws are seeded alike before the estimate and before the counted step.
- Optimizers that read their own state: transformers' Adafactor with its defaults
  (``relative_step``, ``scale_parameter``: ``max(eps, RMS)`` of each weight) and torch's ASGD
  (``mu.item()``), in memfit's step and in a user's step (``data_dependent`` Notes 3-5).
- Wav2Vec2 / HuBERT with a CTC head (``aten._ctc_loss``: ``fake_kernels`` Note 1), LayerDrop
  (``torch.rand([])`` read in an ``if``) and SpecAugment (numpy's generator), and Bart's
  LayerDrop, at tiny sizes with random weights (none is in ``memfit.zoo``).
"""

import numpy as np
import pytest
import torch

import memfit
from memfit.step import canonical_step, prepare_batch
from tests.helpers import tiny
from tests.techniques.test_remat_budget import LiveBytes, roots

transformers = pytest.importorskip("transformers")


def hf_adafactor(params):
    """transformers' Adafactor as its docs and the Trainer's ``adafactor`` build it."""
    return transformers.optimization.Adafactor(params, lr=None, relative_step=True,
                                               scale_parameter=True, warmup_init=False)


OPTIMIZERS = {"adafactor-defaults": hf_adafactor, "asgd": lambda ps: torch.optim.ASGD(ps)}


def plain_step(model, batch, optimizer):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def memfit_step(model, batch, optimizer):
    """memfit's own step (``memfit.step.canonical_step``), in a user step's argument order."""
    return canonical_step(model, optimizer, batch)


def real_second_step(model, batch, optimizer, fn, seed=None, first=None):
    """The oracle: one real step (``first``, default ``fn``), then the live-bytes peak of the
    next, the generators seeded with ``seed`` before it."""
    (first or fn)(model, batch, optimizer)
    if seed is not None:
        torch.manual_seed(seed)
        np.random.seed(seed)
    live = LiveBytes(roots(model, optimizer, batch))
    with live:
        fn(model, batch, optimizer)
    return live.peak_bytes


@pytest.mark.parametrize("name,user_step", [
    ("adafactor-defaults", False), ("asgd", True),
    pytest.param("adafactor-defaults", True, marks=pytest.mark.slow),
    pytest.param("asgd", False, marks=pytest.mark.slow)])
def test_an_optimizer_that_reads_its_state_is_traced(name, user_step):
    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    est = memfit.estimate(model, batch, optimizer=OPTIMIZERS[name],
                          step=plain_step if user_step else None)
    real = real_second_step(model, batch, OPTIMIZERS[name](model.parameters()),
                            plain_step if user_step else memfit_step)
    assert est.peak_bytes == real


def test_a_read_the_trace_cannot_answer_names_the_optimizer_line():
    """A model on the meta device has no weights to read: the warm-up step's read is a
    TraceError naming transformers' line, not a raw DataDependentOutputException."""
    model, batch = tiny("gpt2")
    meta = model.to("meta")
    with pytest.raises(memfit.TraceError, match=r"warm-up.*transformers/optimization\.py:\d+ "
                                                r"in _get_lr.*meta device"):
        memfit.estimate(meta, prepare_batch(batch), optimizer=hf_adafactor)


def ctc_model(arch: str, layerdrop: float):
    cls = {"wav2vec2": (transformers.Wav2Vec2Config, transformers.Wav2Vec2ForCTC),
           "hubert": (transformers.HubertConfig, transformers.HubertForCTC)}[arch]
    config = cls[0](hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=12,
                    pad_token_id=0, layerdrop=layerdrop, mask_time_prob=0.3, mask_time_length=2,
                    hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    feat_proj_dropout=0.0, final_dropout=0.0)
    torch.manual_seed(0)
    model = cls[1](config).train()
    labels = torch.randint(1, 12, (2, 10))
    labels[1, 7:] = -100                                     # a shorter target
    return model, {"input_values": torch.randn(2, 1600), "labels": labels}


def bart_model(layerdrop: float):
    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     max_position_embeddings=32, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0,
                                     encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    ids = torch.randint(3, 64, (2, 12))
    return model, {"input_ids": ids, "labels": ids.clone()}


MODELS = {"wav2vec2": lambda p: ctc_model("wav2vec2", p),
          "hubert": lambda p: ctc_model("hubert", p), "bart": bart_model}


def layers_run(model, batch, seed) -> int:
    """How many encoder layers a real forward runs with the generators seeded with ``seed``."""
    count = []
    hooks = [m.register_forward_hook(lambda *a: count.append(1)) for name, m in
             model.named_modules() if name.count(".") == 3 and ".layers." in name]
    torch.manual_seed(seed)
    np.random.seed(seed)
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return len(count)


def _every_layer(fn):
    """``fn`` run with every LayerDrop probability of the model at 0, as they were after."""
    def run(m, b, o):
        holders = [(x, k) for x in [m.config, *m.modules()] for k in
                   ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
                   if isinstance(getattr(x, k, None), float)]
        kept = [getattr(x, k) for x, k in holders]
        for x, k in holders:
            setattr(x, k, 0.0)
        try:
            fn(m, b, o)
        finally:
            for (x, k), v in zip(holders, kept):
                setattr(x, k, v)
    return run


@pytest.mark.parametrize("arch", ["wav2vec2", pytest.param("hubert", marks=pytest.mark.slow),
                                  pytest.param("bart", marks=pytest.mark.slow)])
def test_layerdrop_is_off_in_the_trace_and_ctc_is_traced_with_the_real_draws(arch):
    """A budget must hold every step: the estimate is the real step that runs every layer
    (trace._layerdrop), whatever the generators' state; a step that drops layers holds less.
    It was the step of the trace's own draw (HuBERT: 38% under the real peak when that draw
    dropped a layer)."""
    model, batch = MODELS[arch](0.5)
    runs = {seed: layers_run(model, batch, seed) for seed in range(6)}
    fewest, most = min(runs, key=runs.get), max(runs, key=runs.get)
    assert runs[fewest] < runs[most]                 # the two seeds drop different layers
    host_scalars = 0            # what the allocator may count above the device's bytes
    if arch == "bart":
        every, host_scalars = _bart_by_the_allocator()
    else:
        every = real_second_step(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                 _every_layer(memfit_step), seed=0)
    for seed in (fewest, most):
        model, batch = MODELS[arch](0.5)
        torch.manual_seed(seed)
        np.random.seed(seed)
        est = memfit.estimate(model, batch, optimizer="adamw")
        assert 0 <= every - est.peak_bytes <= host_scalars, (seed, runs[seed])
        assert any(n.startswith("LayerDrop (") for n in est.notes)
        assert model.config.to_dict().get("layerdrop", 0.5) == 0.5 and \
            getattr(model.config, "encoder_layerdrop", 0.5) == 0.5        # the user's, as given
    dropped = real_second_step(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4),
                               memfit_step, seed=fewest, first=_every_layer(canonical_step_fn))
    assert dropped < every


def _bart_by_the_allocator() -> tuple[int, int]:
    """BART's second step, every layer run, by the CPU allocator's own events (no mode: the
    ``LiveBytes`` oracle is a dispatch mode, which sees no CPU attention kernel's scratch and
    turns the engine's in-place gradient sums off): (its peak, the bytes of the 8-byte CPU
    tensors the scaled embeddings' ``* embed_scale`` save for backward, one each: a Python
    number, kept on the host on a GPU, which the trace does not count)."""
    from tests.trace._compiled_oracle import last_step_peak

    def make():
        model, batch = bart_model(0.5)
        return model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4)

    peak = last_step_peak(make, _every_layer(memfit_step), steps=2)
    scalars = sum(type(m).__name__ == "BartScaledWordEmbedding"
                  for m in bart_model(0.5)[0].modules())
    return peak, 8 * scalars


def canonical_step_fn(m, b, o):
    canonical_step(m, o, b)


def test_an_estimate_leaves_the_generators_as_it_found_them():
    model, batch = MODELS["wav2vec2"](0.5)
    torch.manual_seed(7)
    np.random.seed(7)
    memfit.estimate(model, batch, optimizer="adamw")
    after = torch.rand(3), np.random.rand(3)
    torch.manual_seed(7)
    np.random.seed(7)
    assert torch.equal(after[0], torch.rand(3)) and np.array_equal(after[1], np.random.rand(3))
