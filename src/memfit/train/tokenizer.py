"""The tokenizer of a run: a local one (``--tokenizer DIR``), or one trained on the data itself.

Note 1 (trained on the data). Without ``--tokenizer`` a byte-level BPE (Hugging Face
``tokenizers``) is trained on the training texts in seconds, with RoBERTa's special tokens at
RoBERTa's ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>`` 4, as XLM-R's config
expects them), and saved in the run folder as ``tokenizer.json``, so a resumed run encodes the
same way. Byte-level: no text is ever unknown, in any script.

Note 2 (one interface). Both kinds are used through ``Encoder``: ``encode(texts, max_len)`` ->
lists of ids with ``<s> ... </s>`` around them, cut to ``max_len``; ``pad_id``; ``vocab_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfit.train._deps import require

__all__ = ["Encoder", "train_tokenizer", "load_tokenizer", "SPECIALS"]

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]     # ids 0..4 (Note 1)


@dataclass
class Encoder:
    """A tokenizer as the run uses it (Note 2)."""

    backend: object          # tokenizers.Tokenizer or a transformers tokenizer
    pad_id: int
    vocab_size: int
    source: str              # where it came from, for the run's messages

    def encode(self, texts: list[str], max_len: int) -> list[list[int]]:
        if hasattr(self.backend, "encode_batch"):          # tokenizers.Tokenizer
            self.backend.enable_truncation(max_len)
            return [e.ids for e in self.backend.encode_batch(texts)]
        out = self.backend(texts, truncation=True, max_length=max_len)
        return [list(ids) for ids in out["input_ids"]]

    def save(self, folder: str) -> str:
        path = os.path.join(folder, "tokenizer.json")
        if hasattr(self.backend, "save"):
            self.backend.save(path)
        else:
            self.backend.save_pretrained(folder)
        return path


def train_tokenizer(texts: list[str], vocab_size: int = 8000) -> Encoder:
    """A byte-level BPE trained on ``texts`` (Note 1)."""
    tk = require("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap_raw(tok, "trained on the data")


def _wrap_raw(tok, source: str) -> Encoder:
    tk = require("tokenizers")
    ids = [tok.token_to_id(s) for s in SPECIALS[:3]]
    if None in ids:
        raise ValueError(f"the tokenizer ({source}) has no {SPECIALS[:3]} tokens; give a "
                         "RoBERTa/XLM-R tokenizer or let memfit train one")
    tok.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", ids[0]), ("</s>", ids[2])])
    tok.no_padding()
    return Encoder(tok, ids[1], tok.get_vocab_size(), source)


def load_tokenizer(path: str) -> Encoder:
    """``--tokenizer DIR``: a ``from_pretrained`` folder (or a tokenizer.json), local files only."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--tokenizer {path}: no such folder or file")
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json")) and \
            not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        tk = require("tokenizers")
        file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        try:
            return _wrap_raw(tk.Tokenizer.from_file(file), file)
        except Exception as e:        # the Rust side raises its own Exception type
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file ({e})") from e
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {path}: no tokenizer there that transformers can load "
                         f"({str(e).splitlines()[0][:200]})") from e
    if tok.pad_token_id is None:
        raise ValueError(f"--tokenizer {path}: it has no padding token; set one (pad_token) "
                         "and save it again")
    return Encoder(tok, tok.pad_token_id, len(tok), path)
