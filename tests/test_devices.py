"""memfit.devices: the GPU table is self-consistent, matches datasheets, and names resolve."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from memfit import _device_table
from memfit.devices import ALIASES, GPUS, DeviceSpec, cpu_spec, get_device, list_devices
from memfit.units import GiB, MiB

# Compute capability -> architecture, from NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus).
ARCH_OF_CC = {(6, 0): "pascal", (6, 1): "pascal", (7, 0): "volta", (7, 5): "turing",
              (8, 0): "ampere", (8, 6): "ampere", (8, 9): "ada", (9, 0): "hopper",
              (10, 0): "blackwell", (12, 0): "blackwell"}

REQUIRED = ["gtx-1080-ti", "rtx-2080-ti", "t4", "v100-16gb", "v100-32gb", "rtx-3090", "rtx-4090",
            "rtx-6000", "rtx-a6000", "l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200",
            # issue 13
            "a10g", "a10", "l40s", "l40", "rtx-3060", "rtx-3080", "rtx-3080-12gb",
            "rtx-4060-ti-16gb", "rtx-4080", "rtx-5090", "rtx-a4000", "rtx-a5000", "p100",
            "a100-pcie-40gb", "a100-pcie-80gb", "h100-pcie", "h100-nvl", "gh200", "b200"]
# host links that are not their generation's x16 PCIe (Note 3): the 4060 Ti is PCIe 4.0 x8;
# GH200 reaches its Grace CPU over NVLink-C2C (450 GB/s each way).
LINK_EXCEPTIONS = {"rtx-4060-ti-16gb": 12.5e9, "gh200": 450e9}


def test_table_has_every_required_card():
    assert set(REQUIRED) <= set(GPUS)
    assert list_devices() == list(GPUS.values())


@pytest.mark.parametrize("name", sorted(GPUS))
def test_entry_is_self_consistent(name):
    spec = GPUS[name]
    assert spec.name == name
    assert spec.kind == "cuda"
    assert 0 < spec.usable_bytes <= spec.memory_bytes
    # The driver keeps well under 10% (GDDR ECC alone is 1/16 = 6.25%).
    assert spec.reserved_bytes < 0.1 * spec.memory_bytes
    assert spec.memory_bytes % GiB == 0, "cards are sold in whole GiB"
    assert (spec.peak_bf16_flops > 0) == spec.supports_bf16
    assert ARCH_OF_CC[spec.compute_capability] == spec.architecture
    # bf16 tensor cores arrived with Ampere (sm_80); Pascal/Volta/Turing have none.
    assert spec.supports_bf16 == (spec.compute_capability >= (8, 0))
    # Tensor cores (Volta on) beat fp32 by 2x or more (exactly ~2x on GeForce Ampere/Ada, which
    # doubled fp32 lanes and halve fp32-accumulate); Pascal's fp16 is 1/64 of fp32.
    if spec.compute_capability >= (7, 0):
        assert spec.peak_fp16_flops > 1.9 * spec.peak_fp32_flops
    elif spec.compute_capability == (6, 0):   # GP100 (P100): fp16 at twice fp32
        assert spec.peak_fp16_flops == pytest.approx(2 * spec.peak_fp32_flops, rel=0.01)
    else:
        assert spec.peak_fp16_flops == pytest.approx(spec.peak_fp32_flops / 64)
    # Newer host links on newer cards (Note 3): Hopper PCIe 5, Ampere/Ada PCIe 4, older PCIe 3.
    expected_link = 50e9 if spec.compute_capability >= (9, 0) else (
        25e9 if spec.compute_capability >= (8, 0) else 12e9)
    assert spec.host_link_bytes_per_s == LINK_EXCEPTIONS.get(name, expected_link)
    # NVML's total (where known) lies between the CUDA total and the memory as sold
    if spec.nvml_total_bytes:
        assert spec.usable_bytes < spec.nvml_total_bytes <= spec.memory_bytes
    # no public CUDA total: the documented fallback off nvidia-smi's total, else off memory_bytes
    if not spec.usable_measured:
        total = spec.nvml_total_bytes or spec.memory_bytes
        assert spec.usable_bytes == int(total * (1 - _device_table._DRIVER_RESERVE_FRACTION)) // MiB * MiB


def test_datasheet_figures():
    # NVIDIA GeForce GTX 1080 Ti spec page: 11 GB GDDR5X, 484 GB/s, 11.3 TFLOPS fp32.
    ti = GPUS["gtx-1080-ti"]
    assert ti.memory_bytes == 11 * GiB
    assert ti.memory_bandwidth_bytes_per_s == 484e9
    assert ti.peak_fp32_flops == pytest.approx(11.3e12, rel=0.01)
    assert ti.compute_capability == (6, 1) and not ti.supports_bf16
    # nvidia-smi / torch on a 1080 Ti: 11,178 MiB ("10.92 GiB total capacity" in OOM messages).
    assert f"{ti.usable_bytes / GiB:.2f}" == "10.92"
    # NVIDIA Tesla V100 datasheet: 900 GB/s HBM2, 125 TFLOPS tensor (SXM2).
    assert GPUS["v100-16gb"].memory_bandwidth_bytes_per_s == 900e9
    assert GPUS["v100-16gb"].peak_fp16_flops == 125e12
    # NVIDIA Quadro RTX 6000 datasheet: 24 GB, 672 GB/s, 16.3 TFLOPS fp32, 130.5 TFLOPS tensor.
    q = GPUS["rtx-6000"]
    assert (q.memory_bytes, q.memory_bandwidth_bytes_per_s) == (24 * GiB, 672e9)
    assert (q.peak_fp32_flops, q.peak_fp16_flops) == (16.3e12, 130.5e12)
    # NVIDIA A100 datasheet: 312 TFLOPS dense bf16; 40 GB 1555 GB/s; 80 GB SXM 2039 GB/s.
    assert GPUS["a100-40gb"].peak_bf16_flops == 312e12
    assert GPUS["a100-40gb"].memory_bandwidth_bytes_per_s == 1555e9
    assert GPUS["a100-80gb"].memory_bandwidth_bytes_per_s == 2039e9
    # NVIDIA H100 datasheet, SXM5: 3.35 TB/s, 1979 TFLOPS bf16 with sparsity = 989.5 dense.
    assert GPUS["h100-80gb"].memory_bandwidth_bytes_per_s == 3.35e12
    assert GPUS["h100-80gb"].peak_bf16_flops == pytest.approx(989.5e12)
    # NVIDIA H200 datasheet: 141 GB, 4.8 TB/s; torch reports total_memory=143156MB (139.8 GiB).
    h200 = GPUS["h200"]
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12
    assert h200.usable_bytes == 143_156 * MiB
    assert h200.usable_bytes > 141e9, "so NVIDIA's '141 GB' must be GiB"


@pytest.mark.parametrize("alias, name", [
    ("1080ti", "gtx-1080-ti"), ("GTX 1080 Ti", "gtx-1080-ti"), ("gtx1080ti", "gtx-1080-ti"),
    ("nvidia-geforce-gtx-1080-ti", "gtx-1080-ti"), ("NVIDIA GeForce GTX 1080 Ti", "gtx-1080-ti"),
    ("GTX-1080-TI", "gtx-1080-ti"), ("  gtx_1080_ti ", "gtx-1080-ti"),
    ("a100", "a100-40gb"), ("a100-80", "a100-80gb"), ("A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("A100-PCIE-40GB", "a100-pcie-40gb"),
    ("h100", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"), ("H100 NVL", "h100-nvl"),
    ("NVIDIA A10G", "a10g"), ("A10", "a10"), ("L40S", "l40s"), ("Tesla P100-PCIE-16GB", "p100"),
    ("RTX 3060", "rtx-3060"), ("3080", "rtx-3080"), ("RTX 3080 12GB", "rtx-3080-12gb"),
    ("4060-ti-16gb", "rtx-4060-ti-16gb"), ("RTX 4080", "rtx-4080"), ("5090", "rtx-5090"),
    ("a4000", "rtx-a4000"), ("RTX A5000", "rtx-a5000"), ("NVIDIA GH200 480GB", "gh200"),
    ("B200", "b200"), ("V100-SXM2-32GB", "v100-32gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("v100", "v100-16gb"), ("Tesla V100-PCIE-32GB", "v100-32gb"),
    ("rtx6000", "rtx-6000"), ("quadro-rtx-6000", "rtx-6000"), ("Quadro RTX 6000", "rtx-6000"),
    ("a6000", "rtx-a6000"), ("NVIDIA RTX A6000", "rtx-a6000"), ("Tesla T4", "t4"),
    ("RTX 3090", "rtx-3090"), ("4090", "rtx-4090"), ("NVIDIA H200", "h200"), ("NVIDIA L4", "l4"),
])
def test_alias_resolution(alias, name):
    assert get_device(alias) is GPUS[name]


def test_every_alias_targets_a_table_entry_and_keys_do_not_collide():
    assert set(ALIASES.values()) <= set(GPUS)
    seen: dict[str, str] = {}
    keys = [(k, v) for k, v in ALIASES.items()] + [(n, n) for n in GPUS]
    keys += [(s.display_name, n) for n, s in GPUS.items()]
    for key, target in keys:
        norm = _device_table._normalize(key)
        assert seen.setdefault(norm, target) == target, f"{key!r} is ambiguous"


def test_spec_passes_through():
    spec = GPUS["t4"]
    assert get_device(spec) is spec


@pytest.mark.parametrize("bad, expected", [("gtx-1080", "gtx-1080-ti"), ("a1000", "a100-")])
def test_unknown_name_suggests_close_names(bad, expected):
    with pytest.raises(ValueError) as info:
        get_device(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert expected in message
    assert "memfit.devices.list_devices()" in message


def test_unknown_name_without_close_match_still_says_how_to_list():
    with pytest.raises(ValueError, match=r"list_devices\(\)") as info:
        get_device("zzzzzz")
    assert "did you mean" not in str(info.value)


def test_wrong_type_is_a_value_error():
    with pytest.raises(ValueError, match="int"):
        get_device(11)  # type: ignore[arg-type]


def test_cpu_spec():
    spec = cpu_spec()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (spec.kind, spec.name, spec.architecture) == ("cpu", "cpu", "cpu")
    assert spec.memory_bytes == spec.usable_bytes == ram
    assert spec.supports_bf16 and spec.compute_capability == (0, 0)
    assert spec.peak_flops(torch.bfloat16) > 0
    assert get_device("cpu") == spec == get_device(torch.device("cpu"))
    assert get_device(" CPU ") == spec


def test_peak_flops_by_dtype():
    a100 = GPUS["a100-40gb"]
    assert a100.peak_flops(torch.float32) == 19.5e12
    assert a100.peak_flops(torch.float16) == a100.peak_flops(torch.bfloat16) == 312e12
    with pytest.raises(ValueError, match="float16"):
        GPUS["gtx-1080-ti"].peak_flops(torch.bfloat16)
    with pytest.raises(ValueError, match="float64"):
        a100.peak_flops(torch.float64)


@pytest.mark.parametrize("field, value", [
    ("memory_bytes", 0), ("usable_bytes", -1), ("peak_fp32_flops", 0.0), ("peak_fp16_flops", -5.0),
    ("memory_bandwidth_bytes_per_s", 0.0), ("host_link_bytes_per_s", -1.0), ("peak_bf16_flops", -1.0),
])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(GPUS["rtx-3090"], **{field: value})


def test_validation_of_cross_field_rules():
    base = GPUS["rtx-3090"]
    with pytest.raises(ValueError, match="usable_bytes"):
        dataclasses.replace(base, usable_bytes=base.memory_bytes + 1)
    with pytest.raises(ValueError, match="supports_bf16"):
        dataclasses.replace(base, supports_bf16=False)
    with pytest.raises(ValueError, match="kind"):
        dataclasses.replace(base, kind="tpu")
    with pytest.raises(ValueError, match="compute_capability"):
        dataclasses.replace(base, compute_capability=(8,))
    with pytest.raises(ValueError, match="name"):
        dataclasses.replace(base, name="")


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["t4"].memory_bytes = 1  # type: ignore[misc]


# --- "cuda": the local GPU. Without one, an actionable error; with a stand-in, the table entry. ---

def test_cuda_without_a_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for spelling in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match="no CUDA device here; name a GPU from the table"):
            get_device(spelling)


def _fake_cuda(monkeypatch, **props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(**props))


def test_cuda_known_card_uses_table_and_measured_total(monkeypatch):
    # The figures torch prints on a 1080 Ti: total_memory=11178MB.
    _fake_cuda(monkeypatch, name="NVIDIA GeForce GTX 1080 Ti", major=6, minor=1,
               total_memory=11_178 * MiB + 327_680, multi_processor_count=28)
    spec = get_device("cuda:0")
    assert spec.usable_bytes == 11_178 * MiB + 327_680
    table = GPUS["gtx-1080-ti"]
    assert dataclasses.replace(spec, usable_bytes=table.usable_bytes) == table
    with pytest.raises(ValueError, match="cuda:0"):
        get_device("cuda:3")


def test_cuda_unknown_card_is_measured_and_warned(monkeypatch):
    _fake_cuda(monkeypatch, name="NVIDIA RTX PRO 6000 Blackwell", major=12, minor=0,
               total_memory=32_607 * MiB, multi_processor_count=170)
    with pytest.warns(UserWarning, match="rough guesses"):
        spec = get_device(torch.device("cuda"))
    assert spec.display_name == "NVIDIA RTX PRO 6000 Blackwell"
    assert spec.usable_bytes == 32_607 * MiB and spec.memory_bytes == 32 * GiB
    assert spec.supports_bf16 and spec.architecture == "blackwell"
    assert spec.compute_capability == (12, 0)


@pytest.mark.requires_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_on_a_real_gpu():
    spec = get_device("cuda")
    free, total = torch.cuda.mem_get_info()
    assert spec.usable_bytes == total
    assert isinstance(spec, DeviceSpec) and spec.kind == "cuda"


def test_cublas_workspace_follows_pytorchs_default_config():
    # getChosenWorkspaceSize: ":4096:8" from sm90, ":4096:2:16:8" before; + 1 MiB cuBLASLt
    assert get_device("h100").cublas_workspace_bytes == 4096 * 1024 * 8 + 1024**2
    assert get_device("a100").cublas_workspace_bytes == (4096 * 2 + 16 * 8) * 1024 + 1024**2
    assert get_device("gtx-1080-ti").cuda_context_bytes > 0


def test_issue13_datasheet_figures():
    # NVIDIA A10 datasheet: 31.2 TFLOPS fp32, 125 TFLOPS bf16 dense, 600 GB/s, 24 GB; NVML total
    # 23,028 MiB (thundergolfer.com/blog/nvidia-gpu-memory-capacity)
    a10 = GPUS["a10"]
    assert (a10.peak_fp32_flops, a10.peak_bf16_flops, a10.memory_bandwidth_bytes_per_s) == \
        (31.2e12, 125e12, 600e9)
    assert a10.nvml_total_bytes == 23_028 * MiB and not a10.usable_measured
    # L40S datasheet: 91.6 TFLOPS fp32, 362.05 TFLOPS bf16 dense, 864 GB/s; NVML 46,068 MiB
    l40s = GPUS["l40s"]
    assert (l40s.peak_fp32_flops, l40s.peak_bf16_flops) == (91.6e12, 362.05e12)
    assert l40s.nvml_total_bytes == 46_068 * MiB
    # Tesla P100 PCIe datasheet: 9.3 / 18.7 TFLOPS fp32 / fp16, 732 GB/s, no bf16
    p100 = GPUS["p100"]
    assert (p100.peak_fp32_flops, p100.peak_fp16_flops, p100.supports_bf16) == (9.3e12, 18.7e12,
                                                                                 False)
    # H100 PCIe: 2 TB/s, 1513 sparse -> 756.5 dense; NVL: 94 GB, 3.9 TB/s
    assert GPUS["h100-pcie"].peak_bf16_flops == pytest.approx(756.5e12)
    assert GPUS["h100-nvl"].memory_bytes == 94 * GiB
    assert GPUS["a100-pcie-80gb"].memory_bandwidth_bytes_per_s == 1935e9
    assert GPUS["b200"].compute_capability == (10, 0)
    assert GPUS["rtx-5090"].compute_capability == (12, 0) and GPUS["rtx-5090"].memory_bytes == 32 * GiB


def test_measured_cublas_workspace_on_sm86():
    # pytorch/pytorch#95668: 8,519,680 B left allocated after one nn.Linear on an A10G
    # (torch 2.0, before the 1 MiB cuBLASLt workspace)
    assert get_device("a10g").cublas_workspace_bytes - 1024**2 == 8_519_680


def test_gpus_command_lists_every_entry(capsys):
    from memfit.cli import main

    assert main(["gpus", "--json"]) == 0
    import json

    names = [r["name"] for r in json.loads(capsys.readouterr().out)]
    assert names == list(GPUS) and set(REQUIRED) <= set(names)
