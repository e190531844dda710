"""Estimates kept in memfit's disk cache (issue 29 item 2): a job traced once is read back,
equal in every figure; a change in anything a trace reads is another key; and what a key
cannot name (weights, hooks, a user's loss) is traced every time.

The oracle of "read back" is the trace itself: the estimate traced with the cache off."""

import json

import torch

import memfit
from memfit import zoo
from memfit._cache import Cache
from memfit.api._trace_cache import using
from memfit.cli import main

FIGURES = ("peak_bytes", "reserved_bytes", "device_bytes", "breakdown", "timeline", "op_log",
           "op_costs", "modules", "fw_flops", "bw_flops", "phases", "notes")


def _tiny_meta(seq_len=16):
    spec = zoo.get("llama-1b")
    model = spec.build(tiny=True, device="meta")
    return model, spec.make_batch(model, 2, seq_len=seq_len)


def test_a_job_traced_once_is_read_back_equal(tmp_path):
    model, batch = _tiny_meta()
    cache = Cache(tmp_path)
    with using(cache):
        first = memfit.estimate(model, batch, device="rtx-4090", precision="bf16")
        again = memfit.estimate(model, batch, device="rtx-4090", precision="bf16")
    fresh = memfit.estimate(model, batch, device="rtx-4090", precision="bf16")
    assert first.traced_as == "whole" and again.traced_as == "whole; read from memfit's cache"
    for name in FIGURES:
        assert getattr(again, name) == getattr(fresh, name) == getattr(first, name), name
    assert cache.info().entries == 1


def test_what_a_trace_reads_is_in_the_key(tmp_path):
    model, batch = _tiny_meta()
    cache = Cache(tmp_path)
    padded = dict(batch, attention_mask=batch["attention_mask"].clone())
    padded["attention_mask"][0, -4:] = 0                 # the same shapes, other values
    with using(cache):
        memfit.estimate(model, batch)
        memfit.estimate(model, padded)
        memfit.estimate(model, batch, checkpoint="all")
        memfit.estimate(model, batch, device="t4", precision="fp16")
        model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
        frozen = memfit.estimate(model, batch)
    assert cache.info().entries == 5 and frozen.traced_as == "whole"


def test_what_a_key_cannot_name_is_traced_every_time(tmp_path):
    spec = zoo.get("llama-1b")
    real = spec.build(tiny=True)                          # weights a router could read
    batch = spec.make_batch(real, 2, seq_len=16)
    meta, _ = _tiny_meta()
    hooked, _ = _tiny_meta()
    hooked.model.norm.register_forward_hook(lambda m, a, out: None)
    cache = Cache(tmp_path)
    with using(cache):            # nothing is kept, so each would be traced again
        memfit.estimate(real, batch)
        memfit.estimate(hooked, batch)
        memfit.estimate(meta, batch, loss_fn=lambda m, b: m(**b).logits.float().mean())
        memfit.estimate(meta, batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert cache.info().entries == 0


def test_the_cli_reads_its_second_estimate_and_no_cache_traces(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    config = zoo.get("gpt2").config(tiny=True)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path / "model")
    args = ["estimate", "--config", str(tmp_path / "model"), "--batch-size", "2", "--seq-len",
            "16", "--gpu", "t4", "--json"]

    def said(argv) -> str:
        assert main(argv) == 0
        return " ".join(capsys.readouterr().out.split())
    assert json.loads(said(args))["traced_as"] == "whole"
    text = args[:-1]          # another command line (its answer is not kept yet): a new run,
    assert "(whole; read from memfit's cache)" in said(text)      # its trace read back
    assert "read from memfit's cache" not in said(text + ["--no-cache"])
