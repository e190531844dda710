"""The card as NVML counts it: every modelled figure held to its public source, the breakdown
adding up exactly to ``Estimate.device_bytes``, and a device profile's figures used when given."""

from __future__ import annotations

import json

import pytest
import torch

import memfit
from memfit import _cuda_overhead as ov
from memfit import zoo
from memfit.devices import GPUS, DeviceSpec, get_device, with_cuda
from memfit.trace.card import LINES, ran_convolution
from memfit.units import MiB

FIXTURE = "tests/data/device_profile_a10g_fixture.json"


def test_context_figures_match_their_sources():
    # pytorch/pytorch#86509: cudaMemGetInfo total - free after one randn(20,16,50,100) tensor
    # (6.4 MB -> one 20 MiB segment): 287,047,680 B lazy, 666,632,192 B eager.
    # (no figure for that architecture and CUDA major: the generic one of the loading mode)
    assert ov.context_figure("volta", (11, 8), "lazy").bytes == 287_047_680 - 20 * MiB
    assert ov.context_figure("volta", (12, 4), "eager").bytes == 666_632_192 - 20 * MiB
    # InvokeAI#9413: 256 MiB per process on an RTX 3090, torch 2.7.1+cu128.
    f = ov.context_figure("ampere", (12, 8), "lazy")
    assert (f.bytes, f.exact) == (256 * MiB, True) and "InvokeAI/issues/9413" in f.source
    # unsloth-zoo#1053: 426 MiB, RTX 6000 Ada, torch 2.10.0+cu130.
    assert ov.context_figure("ada", (13, 0), "lazy").bytes == 426 * MiB
    # pytorch/pytorch#55277: 721 MiB (GTX 1080, cu101), 1687 MiB (RTX 3090, cu111), each with a
    # 1-element tensor in a 2 MiB segment. Before CUDA 11.7 loading is eager whatever the mode.
    assert ov.context_figure("pascal", (10, 2), "lazy").bytes == 719 * MiB
    assert ov.context_figure("ampere", (11, 1), "lazy").bytes == 1685 * MiB
    # no measurement for Hopper under CUDA 12: the largest under CUDA 12 lazy, flagged inexact
    h = ov.context_figure("hopper", (12, 4), "lazy")
    assert (h.bytes, h.exact) == (256 * MiB, False)
    # transformers' single-GPU guide (v4.21): 1343 MB by pynvml after torch.ones((1, 1)) on a
    # V100-SXM2-16GB, CUDA 11.2, less its 2 MiB segment. CUDA 11.0: eager whatever the mode.
    v = ov.context_figure("volta", (11, 2), "lazy")
    assert (v.bytes, v.exact) == (1341 * MiB, True) and "perf_train_gpu_one" in v.source
    # no Turing figure under CUDA 11: the largest one of CUDA 11 (the 3090's), flagged inexact
    t = ov.context_figure("turing", (11, 0), "lazy")
    assert (t.bytes, t.exact) == (1685 * MiB, False)
    for fig in list(ov._CONTEXT.values()) + list(ov._GENERIC.values()):
        assert "https://" in fig.source


def test_kernels_cudnn_and_nccl_figures():
    # issue 13's A10G record (620 MiB above reserved after a step) less the 256 MiB bare context
    assert ov.step_kernels_figure((12, 4), "lazy").bytes == 364 * MiB
    assert ov.step_kernels_figure((12, 4), "eager").bytes == 0
    assert ov.cudnn_figure((11, 0), "lazy").bytes == 750_000_000          # eager: forum figure
    lazy = ov.cudnn_figure((12, 4), "lazy").bytes
    assert lazy == 750_000_000 * (287_047_680 - 20 * MiB) // (666_632_192 - 20 * MiB)
    # NVIDIA/nccl#964: 544 MiB (2 ranks), 688 MiB (more), 4x A100 NVLink
    assert [ov.nccl_figure(n).bytes for n in (1, 2, 4)] == [0, 544 * MiB, 688 * MiB]


@pytest.mark.parametrize("text, expected", [("12", (12, 8)), ("12.4", (12, 4)), ("11", (11, 8)),
                                            ("13", (13, 0)), ("12.4.1", (12, 4))])
def test_cuda_version_parsing(text, expected):
    assert ov.parse_cuda_version(text) == expected


@pytest.mark.parametrize("bad", ["abc", "7", "14.0", "12.x", ""])
def test_bad_cuda_versions_are_refused(bad):
    with pytest.raises(ValueError, match="CUDA version"):
        ov.parse_cuda_version(bad)


def test_cuda_version_default_and_range():
    spec = GPUS["a10g"]
    if torch.version.cuda is None:          # a CPU wheel: the assumption is said
        assert spec.cuda_version == ov.ASSUMED_CUDA_VERSION
        assert "assume CUDA 12.8" in spec.figure_notes[0]
    else:
        assert spec.cuda_version == ov.parse_cuda_version(torch.version.cuda)
    old = get_device("a10g", cuda_version="11.6")          # before lazy loading
    assert old.cuda_context_bytes == 1685 * MiB and old.library_kernels_bytes == 0
    assert get_device("a10g", module_loading="eager").cuda_context_bytes == \
        666_632_192 - 20 * MiB
    with pytest.raises(ValueError, match="CUDA 12.8 or later"):
        get_device("b200", cuda_version="12.4")
    with pytest.raises(ValueError, match="9.0 to 12.9"):
        get_device("v100", cuda_version="13")
    with pytest.raises(ValueError, match="is for a GPU"):
        with_cuda(get_device("cpu"), "12")


def _estimate(name: str, device, **kw):
    s = zoo.get(name)
    meta = s.build(tiny=True, device="meta")
    batch = s.make_batch(meta, 2, seq_len=None if s.family == "vision" else 32)
    return memfit.estimate(meta, batch, device=device, **kw)


@pytest.mark.parametrize("name", ["gpt2", "resnet-50"])
def test_breakdown_adds_up_exactly_and_cudnn_only_with_convolutions(name):
    est = _estimate(name, "a10g", cuda_version="12.4")
    card = est.card
    assert list(card.lines) == list(LINES)
    assert sum(card.lines.values()) == card.device_bytes == est.device_bytes
    assert card.reserved_bytes == est.reserved_bytes
    assert card.outside_allocator_bytes == est.context_bytes
    conv = ran_convolution(est.op_log)
    assert conv == (name == "resnet-50")
    assert card.cudnn_bytes == (est.device.cudnn_bytes if conv else 0) and card.nccl_bytes == 0
    # two handles' workspaces: this thread's (with cuBLASLt's) and autograd's (_device_cuda Note 1)
    assert card.cublas_workspace_bytes == (est.device.cublas_workspace_bytes
                                           + est.device.autograd_workspace_bytes)
    # the card: NVML's total for the A10 family (thundergolfer.com: 23,028 MiB)
    assert card.card_total_bytes == 23_028 * MiB
    assert card.card_used_bytes - card.card_total_bytes == est.device_bytes - est.device.usable_bytes
    assert est.fits == (card.card_used_bytes <= card.card_total_bytes)
    assert est.to_dict()["card"]["device_bytes"] == est.device_bytes
    assert any("InvokeAI" in n for n in est.notes)


def test_cpu_estimates_have_no_card():
    est = _estimate("gpt2", "cpu")
    assert est.card is None and est.context_bytes == 0


def test_profile_loads_validates_and_is_used():
    spec = DeviceSpec.load(FIXTURE)
    data = json.load(open(FIXTURE))
    m = data["measured"]
    assert spec.name == "a10g" and spec.profile_path == FIXTURE
    assert spec.usable_bytes == data["gpu"]["total_memory_bytes"]
    assert spec.nvml_total_bytes == data["gpu"]["nvml_total_bytes"]
    assert spec.cuda_context_bytes == m["context_bytes"] + m["library_kernels_bytes"]
    assert (spec.cudnn_bytes, spec.cublas_workspace_bytes) == (m["cudnn_bytes"],
                                                                m["cublas_workspace_bytes"])
    assert spec.peak_bf16_flops == GPUS["a10g"].peak_bf16_flops      # datasheet rates kept
    assert get_device(FIXTURE) == spec
    est = _estimate("resnet-50", FIXTURE)
    assert est.card.cuda_context_bytes == m["context_bytes"]
    assert est.card.library_kernels_bytes == m["library_kernels_bytes"]
    assert est.card.cudnn_bytes == m["cudnn_bytes"]
    assert est.device_bytes == est.reserved_bytes + m["context_bytes"] + \
        m["library_kernels_bytes"] + m["cudnn_bytes"]
    assert any(FIXTURE in n for n in est.notes)
    with pytest.raises(ValueError, match="measured under CUDA 12.4"):
        with_cuda(spec, "11.8")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(memfit_device_profile=2), "memfit_device_profile must be 1"),
    (lambda d: d["gpu"].pop("name"), "gpu.name"),
    (lambda d: d["gpu"].update(compute_capability=[8]), "compute_capability"),
    (lambda d: d["gpu"].update(total_memory_bytes=-1), "total_memory_bytes"),
    (lambda d: d["gpu"].update(nvml_total_bytes=1), "nvml_total_bytes"),
    (lambda d: d.update(module_loading="sometimes"), "module_loading"),
    (lambda d: d["measured"].update(context_bytes=0), "context_bytes is 0"),
    (lambda d: d["measured"].update(cudnn_bytes="150MiB"), "measured.cudnn_bytes"),
    (lambda d: d["measured"].pop("cublas_workspace_bytes"), "cublas_workspace_bytes"),
    (lambda d: d.update(cuda="twelve"), "cuda"),
    (lambda d: d.pop("measured"), "'measured' must be an object"),
])
def test_bad_profiles_are_refused_by_field(tmp_path, edit, message):
    data = json.load(open(FIXTURE))
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as info:
        DeviceSpec.load(str(path))
    assert str(path) in str(info.value)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        DeviceSpec.load(str(tmp_path / "missing.json"))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        DeviceSpec.load(str(tmp_path / "x.json"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="JSON object"):
        DeviceSpec.load(str(tmp_path / "list.json"))
