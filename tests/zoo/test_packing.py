"""Packed batches from the zoo (``memfit.zoo._packing``): the layout transformers' collator makes,
sequences that do not see each other, the tokens per batch, the refusals.

Oracle for "packed": each sequence's logits in the packed row equal the logits of a forward on
that sequence alone (transformers' block-diagonal mask, or nothing would match).
"""

import pytest
import torch

from memfit import zoo

LLAMA = zoo.get("llama-1b")


@pytest.fixture(scope="module")
def llama():
    model = LLAMA.build("causal-lm", tiny=True).eval()
    model.config.use_cache = False
    return model


def test_layout_is_data_collator_with_flattening(llama):
    batch = zoo.packed_batch(llama, [3, 5, 2])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.shape == (1, 10) and t.dtype == torch.int64 for t in batch.values())
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    first = torch.tensor([0, 3, 8])                      # each sequence's first token: -100
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    assert (labels[first] == -100).all()
    rest = torch.ones(10, dtype=torch.bool).index_fill(0, first, False)
    assert torch.equal(labels[rest], ids[rest])


def test_make_batch_packs_batch_size_sequences_of_seq_len(llama):
    batch = LLAMA.make_batch(llama, 4, seq_len=16, packing=True)
    assert batch["input_ids"].shape == (1, 64)            # the tokens per batch: 4 x 16
    assert batch["position_ids"].tolist() == [list(range(16)) * 4]
    assert torch.equal(batch["input_ids"], LLAMA.make_batch(llama, 4, seq_len=16,
                                                           packing=True)["input_ids"])


@pytest.mark.parametrize("name", ["llama-1b", "gpt2", "qwen2.5-7b"])
def test_sequences_do_not_see_each_other(name):
    spec = zoo.get(name)
    model = spec.build("causal-lm", tiny=True).eval()
    model.config.use_cache = False
    batch = zoo.packed_batch(model, [7, 5])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        alone = [model(input_ids=batch["input_ids"][:, a:b]).logits for a, b in ((0, 7), (7, 12))]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)


def test_a_sequence_is_held_to_the_position_limit_not_the_row(llama):
    limit = llama.config.max_position_embeddings
    assert zoo.packed_batch(llama, [limit, limit])["input_ids"].shape == (1, 2 * limit)
    with pytest.raises(ValueError, match=f"at most {limit} tokens per sequence"):
        zoo.packed_batch(llama, [limit + 1])


@pytest.mark.parametrize("call, needle", [
    (lambda m: LLAMA.make_batch(m, 2, packing=True, padded=True), "not both"),
    (lambda m: zoo.packed_batch(m, []), "non-empty list"),
    (lambda m: zoo.packed_batch(m, [4, 0]), "positive ints"),
    (lambda m: zoo.packed_batch(m, [1]), "at least 2 tokens"),
    (lambda m: zoo.get("bert-base").make_batch(zoo.get("bert-base").config(tiny=True), 2,
                                               packing=True), "causal LMs"),
])
def test_refusals_name_the_fix(llama, call, needle):
    with pytest.raises(ValueError, match=needle):
        call(llama)


def test_a_model_without_position_ids_is_refused():
    class NoPositions(torch.nn.Module):
        config = LLAMA.config(tiny=True)

        def forward(self, input_ids, labels=None):
            return input_ids

    with pytest.raises(ValueError, match="takes no position_ids"):
        zoo.packed_batch(NoPositions(), [4, 4])


def test_attention_implementation_is_built_as_asked():
    for attn in ("sdpa", "eager", "flash_attention_2"):
        model = LLAMA.build(tiny=True, device="meta", attn_implementation=attn)
        assert model.config._attn_implementation == attn
    with pytest.raises(ValueError, match="has no sdpa"):
        zoo.get("gemma-2-2b").build(tiny=True, device="meta", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="unknown attn_implementation"):
        LLAMA.build(tiny=True, device="meta", attn_implementation="flash")
