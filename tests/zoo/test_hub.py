"""Models by their hub id (``memfit.zoo.from_pretrained_config``, ``--model org/name``).

This machine has no hub. The cache is a folder laid out as huggingface_hub writes it
(``models--org--name/refs/<rev>`` holding a commit hash, ``snapshots/<commit>/config.json`` a
link to ``blobs/<sha256>``), filled with real config.json files: a tiny Llama and a tiny Qwen2
written from their transformers config classes, and Llama-3.1-8B's as the hub serves it.
huggingface_hub reads ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` when it is imported, so in this
process the tests pass ``cache_dir=`` or set its ``constants``; the subprocess tests set the
environment as a user would. Where the hub's answer matters (gated, missing), it comes from an
``httpx2.MockTransport`` behind huggingface_hub's own ``set_client_factory``, so the real
``hf_hub_download`` and huggingface_hub's own status-to-exception mapping run.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.utils import hf_raise_for_status
from huggingface_hub.utils._http import default_client_factory

import memfit
from memfit import zoo
from memfit.zoo import _hub
from memfit.zoo._hub import hub_error_message, is_hub_id

MAIN = "1" * 40
V2 = "2" * 40
SRC = Path(__file__).resolve().parents[2] / "src"

# Llama-3.1-8B's config.json as https://huggingface.co/meta-llama/Llama-3.1-8B serves it
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}


def _tiny_llama(**sizes) -> transformers.LlamaConfig:
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=128)
    return transformers.LlamaConfig(**{**values, **sizes}, architectures=["LlamaForCausalLM"])


def _tiny_qwen2() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                    max_position_embeddings=128, architectures=["Qwen2ForCausalLM"])


CONFIGS = {"tiny-org/tiny-llama": _tiny_llama, "tiny-org/tiny-qwen2": _tiny_qwen2}


def _put(cache: Path, repo: str, fields: dict, *, ref: str = "main", commit: str = MAIN) -> Path:
    """Write ``fields`` as ``repo``'s config.json at ``commit``, named by ``ref``, the way
    huggingface_hub's cache holds a downloaded file."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    data = json.dumps(fields, indent=2).encode()
    blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    snapshot = folder / "snapshots" / commit / "config.json"
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    snapshot.symlink_to(os.path.relpath(blob, snapshot.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path):
    """A hub cache holding the tiny Llama and Qwen2 at main, and Llama-3.1-8B."""
    root = tmp_path / "hub"
    for repo, make in CONFIGS.items():
        _put(root, repo, make().to_dict())
    _put(root, "meta-llama/Llama-3.1-8B", LLAMA_31_8B)
    return root


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub sees it (it read the variable when imported)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def fake_hub(monkeypatch):
    """huggingface_hub online, its HTTP answered by ``handler(request)`` (set by the test);
    every URL it asked for is in ``requests``."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(_hub, "_unresolved_host", lambda: None)   # the mock is the network
    state = {"handler": None, "requests": []}

    def answer(request):
        state["requests"].append((request.method, str(request.url)))
        if "/resolve/" not in str(request.url):        # the client's own side calls
            return httpx2.Response(404, request=request)
        return state["handler"](request)

    huggingface_hub.set_client_factory(
        lambda: httpx2.Client(transport=httpx2.MockTransport(answer), follow_redirects=True))
    yield state
    huggingface_hub.set_client_factory(default_client_factory)


def _hub_error(status: int, code: str, url: str) -> Exception:
    """The exception huggingface_hub itself raises for the hub's answer ``status``/``code``."""
    request = httpx2.Request("HEAD", url)
    try:
        hf_raise_for_status(httpx2.Response(status, headers={"X-Error-Code": code}, request=request))
    except Exception as err:       # the class is what the test is about
        return err
    raise AssertionError(f"huggingface_hub raised nothing for {status} {code}")


# --- reading the config --------------------------------------------------------------------------
@pytest.mark.parametrize("repo", sorted(CONFIGS))
def test_estimate_of_a_hub_id_equals_the_same_config_built_directly(repo, cache, offline):
    """Oracle: the transformers class built by hand from the config object the JSON was
    written from; the estimate of both is the same to the byte."""
    spec = zoo.from_pretrained_config(repo, cache_dir=cache)
    assert (spec.name, spec.source, spec.default_task) == (repo, f"{repo}@{MAIN}", "causal-lm")
    model = spec.build(device="meta")
    config = CONFIGS[repo]()
    direct = getattr(transformers, config.architectures[0])._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32).train()
    assert [(n, p.shape) for n, p in model.named_parameters()] == \
        [(n, p.shape) for n, p in direct.named_parameters()]
    batch = spec.make_batch(model, 1, seq_len=16)
    ours = memfit.estimate(model, batch, device="cpu")
    theirs = memfit.estimate(direct, batch, device="cpu")
    assert ours.peak_bytes == theirs.peak_bytes > 0


def test_llama_31_8b_is_built_on_meta_with_its_published_size(cache, offline):
    """8,030,261,248 parameters (Meta's "8B"; the model card's 8.03B): embeddings and head
    2 * 128256 * 4096, per layer q/o 2 * 4096^2, k/v 2 * 4096 * 1024, MLP 3 * 4096 * 14336,
    two norms, then the final norm. On meta: no weight is allocated."""
    spec = zoo.from_pretrained_config("meta-llama/Llama-3.1-8B", cache_dir=cache)
    model = spec.build(device="meta")
    d, kv, ff, layers, vocab = 4096, 1024, 14336, 32, 128256
    expected = 2 * vocab * d + layers * (2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d) + d
    assert zoo.count_parameters(model) == expected == 8_030_261_248
    assert all(p.is_meta for p in model.parameters())
    assert model.config.rope_parameters["rope_type"] == "llama3"    # rope_scaling kept
    assert next(model.parameters()).dtype == torch.float32          # not the file's bfloat16


def test_a_revision_reads_that_commit(cache, offline):
    _put(cache, "tiny-org/tiny-llama", _tiny_llama(num_hidden_layers=3).to_dict(), ref="v2",
         commit=V2)
    for revision, layers, commit in ((None, 2, MAIN), ("main", 2, MAIN), ("v2", 3, V2),
                                     (V2, 3, V2)):
        spec = zoo.from_pretrained_config("tiny-org/tiny-llama", revision, cache_dir=cache)
        assert (spec.config().num_hidden_layers, spec.source) == \
            (layers, f"tiny-org/tiny-llama@{commit}"), revision


def test_missing_while_offline_names_the_id_the_switch_and_the_cache(cache, offline):
    with pytest.raises(zoo.HubConfigError) as info:
        zoo.from_pretrained_config("tiny-org/absent", cache_dir=cache)
    text = str(info.value)
    assert "tiny-org/absent" in text and "HF_HUB_OFFLINE=1" in text and str(cache) in text
    with pytest.raises(zoo.HubConfigError, match=r"tiny-org/tiny-llama at revision 'v9'.*"
                                                 r"hf download tiny-org/tiny-llama config.json --revision v9"):
        zoo.from_pretrained_config("tiny-org/tiny-llama", "v9", cache_dir=cache)


def test_local_files_only_keeps_to_the_cache(cache, fake_hub):
    assert zoo.from_pretrained_config("tiny-org/tiny-llama", cache_dir=cache,
                                      local_files_only=True).name == "tiny-org/tiny-llama"
    with pytest.raises(zoo.HubConfigError, match="local_files_only=True"):
        zoo.from_pretrained_config("tiny-org/absent", cache_dir=cache, local_files_only=True)
    assert fake_hub["requests"] == []


def test_the_cache_first_then_one_download_of_config_json_only(tmp_path, fake_hub):
    """A cached config is used without asking the hub; an uncached one is the only file
    fetched, and is then in the cache for the next run, offline too."""
    body = json.dumps(_tiny_llama().to_dict()).encode()

    def serve(request):
        headers = {"X-Repo-Commit": V2, "ETag": '"e1"', "Content-Length": str(len(body))}
        return httpx2.Response(200, headers=headers, request=request,
                               content=b"" if request.method == "HEAD" else body)

    fake_hub["handler"] = serve
    spec = zoo.from_pretrained_config("tiny-org/fresh", cache_dir=tmp_path)
    assert spec.source == f"tiny-org/fresh@{V2}"
    files = {url.rsplit("/resolve/main/", 1)[1] for _, url in fake_hub["requests"] if "/resolve/" in url}
    assert files == {"config.json"}
    fake_hub["requests"].clear()
    assert zoo.from_pretrained_config("tiny-org/fresh", cache_dir=tmp_path).source == spec.source
    assert fake_hub["requests"] == []


@pytest.mark.parametrize("status,code,cls,needles", [
    (403, "GatedRepo", "GatedRepoError", ("is a gated model", "https://huggingface.co/org/model",
                                          "hf auth login", "HF_TOKEN")),
    (404, "RepoNotFound", "RepositoryNotFoundError", ("no model 'org/model' on the Hugging Face hub",
                                                      "private", "memfit.zoo.names()")),
])
def test_gated_and_missing_repos_say_so_through_hf_hub_download(status, code, cls, needles,
                                                                tmp_path, fake_hub):
    fake_hub["handler"] = lambda request: httpx2.Response(status, headers={"X-Error-Code": code},
                                                          request=request)
    with pytest.raises(zoo.HubConfigError) as info:
        zoo.from_pretrained_config("org/model", cache_dir=tmp_path)
    assert type(info.value.__cause__).__name__ == cls
    for needle in needles:
        assert needle in str(info.value)


def test_a_host_that_does_not_resolve_is_said_at_once(tmp_path, monkeypatch):
    """No DNS (no network) and no proxy: the download is not tried, whose retries took 27 s
    before the same error (_hub Note 3); with a proxy set it is (the proxy resolves)."""
    import socket

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    asked = []

    def download(*args, **kwargs):
        asked.append(args)
        raise LookupError("asked the hub")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(zoo.HubConfigError, match="the hub could not be reached .*Name or "
                                                 "service not known.*check the network"):
        zoo.from_pretrained_config("org/model", cache_dir=tmp_path)
    assert asked == []
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    with pytest.raises(LookupError, match="asked the hub"):
        zoo.from_pretrained_config("org/model", cache_dir=tmp_path)
    assert len(asked) == 1


def test_each_hub_error_is_said_in_the_users_words():
    """The exceptions are huggingface_hub's own, made from the hub's answers by its own
    ``hf_raise_for_status`` (revision and entry errors), or as hf_hub_download raises them
    when the hub cannot be reached (LocalEntryNotFoundError from a connection error)."""
    url = "https://huggingface.co/org/model/resolve/v2/config.json"
    revision = hub_error_message(_hub_error(404, "RevisionNotFound", url), "org/model", "v2")
    assert "org/model has no revision 'v2'" in revision and "branch, tag or commit" in revision
    entry = hub_error_message(_hub_error(404, "EntryNotFound", url), "org/model", "v2")
    assert "has no config.json" in entry and "base model" in entry
    server = hub_error_message(_hub_error(503, "", url), "org/model", None)
    assert "the hub answered 503" in server
    unreachable = LocalEntryNotFoundError("cannot find the requested files")
    unreachable.__cause__ = httpx2.ConnectError("[Errno -2] Name or service not known")
    text = hub_error_message(unreachable, "org/model", None, "/cache")
    assert "could not be reached (" in text and "Name or service not known" in text
    assert "HF_HUB_OFFLINE=1" in text and "/cache" in text


# --- which model a --model string names ----------------------------------------------------------
def test_resolve_a_name_then_a_path_then_the_hub(cache, offline, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    # a built-in alias that is also a hub id: memfit's copy, unless a revision asks for the hub
    _put(cache, "openai-community/gpt2", _tiny_llama().to_dict())
    assert zoo.resolve("openai-community/gpt2") is zoo.get("gpt2")
    assert zoo.resolve("openai-community/gpt2", revision="main").config_class is transformers.LlamaConfig
    # an existing folder of the id's name wins over the hub
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.mkdir(parents=True)
    _tiny_llama(num_hidden_layers=5).save_pretrained(local)
    assert zoo.resolve("tiny-org/tiny-llama").config().num_hidden_layers == 5
    assert zoo.resolve("tiny-org/tiny-qwen2").name == "tiny-org/tiny-qwen2"


@pytest.mark.parametrize("text,revision,message", [
    ("bert-bas", None, r"unknown model 'bert-bas'\. Did you mean 'bert-base'.*memfit\.zoo\.names\(\)"),
    ("configs/llama.json", None, "no file or folder at 'configs/llama.json'"),
    ("a/b/c", None, "no file or folder at 'a/b/c'"),
    ("gpt2", "v2", r"'gpt2' is a built-in model: drop the revision, or give the hub id "
                   r"\(openai-community/gpt2\)"),
])
def test_resolve_refuses_what_names_nothing(text, revision, message, offline):
    with pytest.raises(ValueError, match=message):
        zoo.resolve(text, revision=revision)


def test_is_hub_id():
    assert is_hub_id("meta-llama/Llama-3.1-8B") and is_hub_id("Qwen/Qwen2.5-7B")
    for text in ("gpt2", "a/b/c", "./x", "org/na--me", "dir/config.json", "/abs"):
        assert not is_hub_id(text), text


# --- the command line ----------------------------------------------------------------------------
def _memfit(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "memfit", *args], env=env, capture_output=True,
                          text=True, timeout=600)


# 11 s: a CLI subprocess; the API's estimate of a hub id and the CLI's --revision and --help
# stay in the default tier
@pytest.mark.slow
def test_cli_estimates_a_hub_id_from_the_cache(cache):
    """A real process that finds the cache by HF_HUB_CACHE, offline; the oracle is the API's
    estimate of the config built directly (the CLI's defaults: AdamW, fp32)."""
    done = _memfit(cache, "estimate", "--model", "tiny-org/tiny-llama", "--batch-size", "1",
                   "--seq-len", "16", "--gpu", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    direct = transformers.LlamaForCausalLM._from_config(_tiny_llama(), attn_implementation="sdpa",
                                                        dtype=torch.float32).train()
    batch = zoo.get("llama-1b").make_batch(direct, 1, seq_len=16)   # the batch a causal LM of
    # this config gets: make_batch reads the model's config, not the spec's
    assert (out["model"], out["task"]) == ("tiny-org/tiny-llama", "causal-lm")
    assert out["peak_bytes"] == memfit.estimate(direct, batch, device="cpu").peak_bytes


@pytest.mark.slow      # 8 s: a CLI subprocess (the message tests stay in the default tier)
def test_cli_missing_id_offline_is_one_line_without_a_traceback(cache):
    done = _memfit(cache, "estimate", "--model", "meta-llama/Llama-3.1-70B", "--gpu", "cpu")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "memfit: error: meta-llama/Llama-3.1-70B: its config.json is not in the Hugging Face " \
           "cache" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr


def test_cli_revision_and_help(cache, offline, monkeypatch, capsys):
    from memfit.cli import main

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    _put(cache, "tiny-org/tiny-llama", _tiny_llama(num_hidden_layers=3).to_dict(), ref="v2",
         commit=V2)
    args = ["estimate", "--model", "tiny-org/tiny-llama", "--batch-size", "1", "--seq-len", "8",
            "--gpu", "cpu", "--json"]
    counts = {}
    for revision in ("main", "v2"):
        assert main([*args, "--revision", revision]) == 0
        counts[revision] = json.loads(capsys.readouterr().out)["trainable_parameters"]
    d, kv, ff = 64, 32, 128          # _tiny_llama: 2 KV heads of 64 / 4 = 16
    assert counts["v2"] - counts["main"] == 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d  # one layer
    assert main(["estimate", "--model", "gpt2", "--revision", "v2"]) == 2
    assert "give the hub id (openai-community/gpt2)" in capsys.readouterr().err
    assert main(["estimate", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "name first, then an existing path, then the hub" in help_text   # argparse wraps "built-in"
    assert "--revision REV" in help_text



def test_a_hub_id_passed_as_the_model_gets_the_zoo_call_that_reads_it():
    from memfit.zoo._model_arg import check_model

    with pytest.raises(ValueError, match=r"got the name 'meta-llama/Llama-3\.1-8B': spec = "
                                         r"memfit\.zoo\.from_pretrained_config\("):
        check_model("meta-llama/Llama-3.1-8B")
