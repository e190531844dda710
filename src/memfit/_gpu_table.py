"""The GPU table's rows: what each card's datasheet says, with the source in a comment.

Plain data (no imports from memfit), built into ``DeviceSpec``s by ``memfit._device_table``. The
columns: ``mem`` the memory as sold, NVIDIA's "GB" read as GiB; ``usable`` the MiB torch
reports as ``total_memory`` where a public log gives it, else None (then ``smi``, the nvidia-smi
total in MiB where known, else ``mem``, less ``_device_table._DRIVER_RESERVE_FRACTION``); ``fp32`` /
``fp16`` / ``bf16`` in FLOP/s, dense (a datasheet's 2:4 sparse rate halved), fp32 accumulate;
``bw`` in B/s; ``link`` the host link, one of "pcie3", "pcie4", "pcie4x8", "pcie5", "c2c"; ``cc``
the compute capability.
Oldest first within each group; the first group is the original table.
"""

ROWS = (
    # NVIDIA GeForce GTX 1080 Ti spec page (3584 cores x 1582 MHz boost); Pascal GP102 runs fp16
    # at 1/64 of fp32 and has no tensor cores. CUDA total 11,178 MiB ("10.92 GiB total capacity").
    dict(name="gtx-1080-ti", display="NVIDIA GeForce GTX 1080 Ti", mem=11, usable=11_178,
         fp32=11.34e12, fp16=11.34e12 / 64, bf16=0.0, bw=484e9, link="pcie3", cc=(6, 1)),
    # NVIDIA Turing architecture whitepaper, RTX 2080 Ti reference clocks (GeForce: fp32 accumulate
    # at half rate). CUDA total 11,019 MiB.
    dict(name="rtx-2080-ti", display="NVIDIA GeForce RTX 2080 Ti", mem=11, usable=11_019,
         fp32=13.45e12, fp16=53.8e12, bf16=0.0, bw=616e9, link="pcie3", cc=(7, 5)),
    # NVIDIA T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS mixed fp16/fp32, 320 GB/s. ECC on by default
    # (nvidia-smi 15,360 MiB = 15/16 of 16 GiB); CUDA total 15,095-15,109 MiB across drivers.
    dict(name="t4", display="NVIDIA Tesla T4", mem=16, usable=15_095,
         fp32=8.1e12, fp16=65e12, bf16=0.0, bw=320e9, link="pcie3", cc=(7, 5)),
    # NVIDIA Tesla V100 datasheet, SXM2: 15.7 TFLOPS fp32, 125 TFLOPS tensor, 900 GB/s (PCIe part:
    # 14 / 112). CUDA total 16,160 MiB.
    dict(name="v100-16gb", display="NVIDIA Tesla V100-SXM2-16GB", mem=16, usable=16_160,
         fp32=15.7e12, fp16=125e12, bf16=0.0, bw=900e9, link="pcie3", cc=(7, 0)),
    # NVIDIA Tesla V100 datasheet, SXM2 32 GB. CUDA total 32,510 MiB.
    dict(name="v100-32gb", display="NVIDIA Tesla V100-SXM2-32GB", mem=32, usable=32_510,
         fp32=15.7e12, fp16=125e12, bf16=0.0, bw=900e9, link="pcie3", cc=(7, 0)),
    # NVIDIA Quadro RTX 6000 datasheet: 16.3 TFLOPS fp32, 130.5 TFLOPS tensor, 672 GB/s, PCIe 3.0.
    # CUDA total 24,220 MiB with ECC off (its default); with ECC on about 22,698 MiB.
    dict(name="rtx-6000", display="NVIDIA Quadro RTX 6000", mem=24, usable=24_220,
         fp32=16.3e12, fp16=130.5e12, bf16=0.0, bw=672e9, link="pcie3", cc=(7, 5)),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: 35.6 TFLOPS fp32, 71 TFLOPS fp16/bf16 tensor with
    # fp32 accumulate, 936 GB/s. CUDA total 24,259-24,268 MiB.
    dict(name="rtx-3090", display="NVIDIA GeForce RTX 3090", mem=24, usable=24_259,
         fp32=35.6e12, fp16=71e12, bf16=71e12, bw=936e9, link="pcie4", cc=(8, 6)),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 82.6 TFLOPS fp32, 165.2 TFLOPS fp16/bf16 tensor with
    # fp32 accumulate, 1008 GB/s. CUDA total 24,563 MiB on a recent driver (some report less).
    dict(name="rtx-4090", display="NVIDIA GeForce RTX 4090", mem=24, usable=24_563,
         fp32=82.6e12, fp16=165.2e12, bf16=165.2e12, bw=1008e9, link="pcie4", cc=(8, 9)),
    # NVIDIA RTX A6000 datasheet: 38.7 TFLOPS fp32, 309.7 TFLOPS tensor with sparsity, 768 GB/s.
    # CUDA total 48,676 MiB (ECC off).
    dict(name="rtx-a6000", display="NVIDIA RTX A6000", mem=48, usable=48_676,
         fp32=38.7e12, fp16=309.7e12 / 2, bf16=309.7e12 / 2, bw=768e9, link="pcie4", cc=(8, 6)),
    # NVIDIA L4 datasheet: 30.3 TFLOPS fp32, 242 TFLOPS fp16/bf16 with sparsity, 300 GB/s. ECC on:
    # nvidia-smi 23,034 MiB. No measured CUDA total found.
    dict(name="l4", display="NVIDIA L4", mem=24, usable=None, smi=23_034,
         fp32=30.3e12, fp16=242e12 / 2, bf16=242e12 / 2, bw=300e9, link="pcie4", cc=(8, 9)),
    # NVIDIA A100 datasheet, SXM 40 GB: 19.5 TFLOPS fp32, 312 TFLOPS fp16/bf16 dense, 1555 GB/s.
    # CUDA total 40,536 MiB.
    dict(name="a100-40gb", display="NVIDIA A100-SXM4-40GB", mem=40, usable=40_536,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bw=1555e9, link="pcie4", cc=(8, 0)),
    # NVIDIA A100 datasheet, SXM 80 GB: 2039 GB/s. CUDA total about 81,251 MiB (OOM messages:
    # "79.35 GiB total capacity").
    dict(name="a100-80gb", display="NVIDIA A100-SXM4-80GB", mem=80, usable=81_251,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bw=2039e9, link="pcie4", cc=(8, 0)),
    # NVIDIA H100 datasheet, SXM5: 67 TFLOPS fp32, 1979 TFLOPS fp16/bf16 with sparsity, 3.35 TB/s.
    # CUDA total 81,082-81,090 MiB.
    dict(name="h100-80gb", display="NVIDIA H100 80GB HBM3", mem=80, usable=81_089,
         fp32=67e12, fp16=1979e12 / 2, bf16=1979e12 / 2, bw=3.35e12, link="pcie5", cc=(9, 0)),
    # NVIDIA H200 datasheet, SXM: 141 GB HBM3e (read as GiB), 4.8 TB/s, 67 TFLOPS
    # fp32, 1979 TFLOPS fp16/bf16 with sparsity. CUDA total 143,156 MiB (139.8 GiB).
    dict(name="h200", display="NVIDIA H200", mem=141, usable=143_156,
         fp32=67e12, fp16=1979e12 / 2, bf16=1979e12 / 2, bw=4.8e12, link="pcie5", cc=(9, 0)),

    # --- issue 13: the wider table. nvidia-smi totals (MiB) of A10, L40S, L4, T4, A100, H100,
    # H200 from https://thundergolfer.com/blog/nvidia-gpu-memory-capacity (NVML, Modal's fleet).
    # NVIDIA Tesla P100 PCIe datasheet (16 GB, the Kaggle notebook GPU): 9.3 TFLOPS fp32, 18.7
    # TFLOPS fp16 (GP100 runs fp16 at twice fp32, no tensor cores), 732 GB/s. No CUDA total found.
    dict(name="p100", display="NVIDIA Tesla P100-PCIE-16GB", mem=16, usable=None,
         fp32=9.3e12, fp16=18.7e12, bf16=0.0, bw=732e9, link="pcie3", cc=(6, 0)),
    # NVIDIA A10 datasheet: 31.2 TFLOPS fp32, 125 TFLOPS fp16/bf16 dense (250 with sparsity),
    # 600 GB/s, 24 GB GDDR6 with ECC: nvidia-smi 23,028 MiB (thundergolfer, above).
    dict(name="a10", display="NVIDIA A10", mem=24, usable=None, smi=23_028,
         fp32=31.2e12, fp16=125e12, bf16=125e12, bw=600e9, link="pcie4", cc=(8, 6)),
    # A10G (AWS G5): NVIDIA publishes no datasheet; AWS gives 24 GB. Rates and nvidia-smi total
    # are the A10's (same GA102 board memory); not published for the A10G itself.
    dict(name="a10g", display="NVIDIA A10G", mem=24, usable=None, smi=23_028,
         fp32=31.2e12, fp16=125e12, bf16=125e12, bw=600e9, link="pcie4", cc=(8, 6)),
    # NVIDIA GeForce RTX 3060 spec page: 3584 cores, 1.78 GHz boost -> 12.7 TFLOPS fp32, 12 GB,
    # 360 GB/s. Tensor fp16/bf16 with fp32 accumulate not published: 2x fp32, the GeForce Ampere
    # ratio of the GA102 whitepaper (3090: 35.6 -> 71). No CUDA total found.
    dict(name="rtx-3060", display="NVIDIA GeForce RTX 3060", mem=12, usable=None,
         fp32=12.74e12, fp16=25.5e12, bf16=25.5e12, bw=360e9, link="pcie4", cc=(8, 6)),
    # NVIDIA Ampere GA102 whitepaper, RTX 3080 (10 GB): 29.8 TFLOPS fp32, 59.5 TFLOPS fp16 tensor
    # with fp32 accumulate, 760 GB/s. No CUDA total found.
    dict(name="rtx-3080", display="NVIDIA GeForce RTX 3080", mem=10, usable=None,
         fp32=29.8e12, fp16=59.5e12, bf16=59.5e12, bw=760e9, link="pcie4", cc=(8, 6)),
    # NVIDIA GeForce RTX 3080 family page, 12 GB: 8960 cores, 1.71 GHz -> 30.6 TFLOPS fp32,
    # 912 GB/s; tensor rate not published: 2x fp32 as above. No CUDA total found.
    dict(name="rtx-3080-12gb", display="NVIDIA GeForce RTX 3080 12GB", mem=12, usable=None,
         fp32=30.6e12, fp16=61.2e12, bf16=61.2e12, bw=912e9, link="pcie4", cc=(8, 6)),
    # NVIDIA GeForce RTX 4060 Ti spec page, 16 GB: 4352 cores, 2.54 GHz -> 22.1 TFLOPS fp32,
    # 288 GB/s, PCIe 4.0 x8; tensor rate not published: 2x fp32 (the Ada whitepaper's 4090 ratio).
    dict(name="rtx-4060-ti-16gb", display="NVIDIA GeForce RTX 4060 Ti 16GB", mem=16, usable=None,
         fp32=22.06e12, fp16=44.1e12, bf16=44.1e12, bw=288e9, link="pcie4x8", cc=(8, 9)),
    # NVIDIA Ada Lovelace whitepaper, RTX 4080 (16 GB): 48.7 TFLOPS fp32, 97.5 TFLOPS fp16/bf16
    # tensor with fp32 accumulate, 716.8 GB/s. No CUDA total found.
    dict(name="rtx-4080", display="NVIDIA GeForce RTX 4080", mem=16, usable=None,
         fp32=48.7e12, fp16=97.5e12, bf16=97.5e12, bw=716.8e9, link="pcie4", cc=(8, 9)),
    # NVIDIA RTX Blackwell whitepaper, RTX 5090: 104.8 TFLOPS fp32, 32 GB GDDR7, 1792 GB/s, PCIe
    # 5.0; fp16 tensor 838 TFLOPS with sparsity and fp16 accumulate (also in
    # https://www.spheron.network/blog/nvidia-rtx-5090-specs/): dense 419, and with fp32
    # accumulate half of that on GeForce, 209.5. No CUDA total found.
    dict(name="rtx-5090", display="NVIDIA GeForce RTX 5090", mem=32, usable=None,
         fp32=104.8e12, fp16=209.5e12, bf16=209.5e12, bw=1792e9, link="pcie5", cc=(12, 0)),
    # NVIDIA RTX A4000 datasheet: 19.2 TFLOPS fp32, 153.4 TFLOPS tensor with sparsity, 16 GB,
    # 448 GB/s. No CUDA total found.
    dict(name="rtx-a4000", display="NVIDIA RTX A4000", mem=16, usable=None,
         fp32=19.2e12, fp16=153.4e12 / 2, bf16=153.4e12 / 2, bw=448e9, link="pcie4", cc=(8, 6)),
    # NVIDIA RTX A5000 datasheet: 27.8 TFLOPS fp32, 222.2 TFLOPS tensor with sparsity, 24 GB,
    # 768 GB/s. No CUDA total found.
    dict(name="rtx-a5000", display="NVIDIA RTX A5000", mem=24, usable=None,
         fp32=27.8e12, fp16=222.2e12 / 2, bf16=222.2e12 / 2, bw=768e9, link="pcie4", cc=(8, 6)),
    # NVIDIA L40 datasheet: 90.5 TFLOPS fp32, 181.05 TFLOPS fp16/bf16 dense (362.1 with sparsity),
    # 48 GB GDDR6 with ECC, 864 GB/s. nvidia-smi total not found: the L40S's (same memory).
    dict(name="l40", display="NVIDIA L40", mem=48, usable=None, smi=46_068,
         fp32=90.5e12, fp16=181.05e12, bf16=181.05e12, bw=864e9, link="pcie4", cc=(8, 9)),
    # NVIDIA L40S datasheet: 91.6 TFLOPS fp32, 362.05 TFLOPS fp16/bf16 dense (733 with sparsity),
    # 864 GB/s; nvidia-smi 46,068 MiB (thundergolfer, above).
    dict(name="l40s", display="NVIDIA L40S", mem=48, usable=None, smi=46_068,
         fp32=91.6e12, fp16=362.05e12, bf16=362.05e12, bw=864e9, link="pcie4", cc=(8, 9)),
    # NVIDIA A100 datasheet, PCIe 40 GB: the SXM rates, 1555 GB/s. No CUDA total found.
    dict(name="a100-pcie-40gb", display="NVIDIA A100-PCIE-40GB", mem=40, usable=None,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bw=1555e9, link="pcie4", cc=(8, 0)),
    # NVIDIA A100 datasheet, PCIe 80 GB: 1935 GB/s. No CUDA total found.
    dict(name="a100-pcie-80gb", display="NVIDIA A100 80GB PCIe", mem=80, usable=None,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bw=1935e9, link="pcie4", cc=(8, 0)),
    # NVIDIA H100 datasheet, PCIe: 51 TFLOPS fp32, 1513 TFLOPS fp16/bf16 with sparsity, 80 GB,
    # 2 TB/s. No CUDA total found.
    dict(name="h100-pcie", display="NVIDIA H100 PCIe", mem=80, usable=None,
         fp32=51e12, fp16=1513e12 / 2, bf16=1513e12 / 2, bw=2.0e12, link="pcie5", cc=(9, 0)),
    # NVIDIA H100 datasheet, NVL: 60 TFLOPS fp32, 1671 TFLOPS fp16/bf16 with sparsity, 94 GB,
    # 3.9 TB/s. No CUDA total found.
    dict(name="h100-nvl", display="NVIDIA H100 NVL", mem=94, usable=None,
         fp32=60e12, fp16=1671e12 / 2, bf16=1671e12 / 2, bw=3.9e12, link="pcie5", cc=(9, 0)),
    # NVIDIA GH200 Grace Hopper datasheet, 96 GB HBM3: 67 TFLOPS fp32, 1979 TFLOPS fp16/bf16 with
    # sparsity, 4 TB/s; host link NVLink-C2C 900 GB/s total (450 GB/s each way, the raw rate: no
    # public pinned-copy measurement found). No CUDA total found.
    dict(name="gh200", display="NVIDIA GH200 480GB", mem=96, usable=None,
         fp32=67e12, fp16=1979e12 / 2, bf16=1979e12 / 2, bw=4.0e12, link="c2c", cc=(9, 0)),
    # NVIDIA Blackwell datasheet, HGX B200 at 1000 W (per GPU, as tabulated in
    # https://glennklockwood.com/garden/processors/B200): 80 TFLOPS fp32, 2250 TFLOPS fp16/bf16
    # dense (4500 with sparsity), 8 TB/s; HGX B200 sells 180 GB of its 192 GB HBM3e (nvidia-smi
    # "179 GB" in https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview,
    # not in MiB). PCIe 5.0 to an x86 host taken. No CUDA total found.
    dict(name="b200", display="NVIDIA B200", mem=180, usable=None,
         fp32=80e12, fp16=2.25e15, bf16=2.25e15, bw=8.0e12, link="pcie5", cc=(10, 0)),
)

# Other spellings -> canonical name (devices: matching ignores case, separators and the words
# "nvidia", "geforce", "tesla", "quadro").
ALIASES = {
    "1080ti": "gtx-1080-ti", "1080-ti": "gtx-1080-ti",
    "2080ti": "rtx-2080-ti", "2080-ti": "rtx-2080-ti",
    "t4-16gb": "t4",
    "v100": "v100-16gb", "v100-16": "v100-16gb", "v100-32": "v100-32gb",
    "v100-sxm2-16gb": "v100-16gb", "v100-pcie-16gb": "v100-16gb",
    "v100-sxm2-32gb": "v100-32gb", "v100-pcie-32gb": "v100-32gb",
    "3090": "rtx-3090", "4090": "rtx-4090",
    "rtx6000": "rtx-6000", "quadro-rtx-6000": "rtx-6000",
    "a6000": "rtx-a6000",
    "a100": "a100-40gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb", "a100-sxm4-80gb": "a100-80gb",
    "a100-pcie": "a100-pcie-40gb", "a100-pcie-40": "a100-pcie-40gb",
    "a100-80gb-pcie": "a100-pcie-80gb", "a100-pcie-80": "a100-pcie-80gb",
    "h100": "h100-80gb", "h100-80": "h100-80gb", "h100-sxm": "h100-80gb", "h100-sxm5": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb", "h100-pcie-80gb": "h100-pcie", "h100-nvl-94gb": "h100-nvl",
    "h200-141gb": "h200", "h200-sxm": "h200",
    "p100-16gb": "p100", "p100-pcie-16gb": "p100",
    "a10-24gb": "a10", "a10g-24gb": "a10g",
    "3060": "rtx-3060", "rtx-3060-12gb": "rtx-3060",
    "3080": "rtx-3080", "rtx-3080-10gb": "rtx-3080", "3080-12gb": "rtx-3080-12gb",
    "4060-ti-16gb": "rtx-4060-ti-16gb", "rtx-4060-ti": "rtx-4060-ti-16gb",
    "4080": "rtx-4080", "rtx-4080-16gb": "rtx-4080", "5090": "rtx-5090",
    "a4000": "rtx-a4000", "a5000": "rtx-a5000",
    "l40s-48gb": "l40s", "gh200-96gb": "gh200", "b200-180gb": "b200",
}

# GPU-to-GPU links for the sharding planner's collectives: card -> (link, one-direction B/s
# per GPU, the raw rate; the planner applies its own efficiency). Cards not listed talk over
# PCIe peer-to-peer at their host-link rate (a realistic pinned copy rate, not the raw one).
# NVLink totals are NVIDIA's datasheet figures (both directions summed), halved:
INTERCONNECT = {
    # Tesla V100 datasheet: SXM2 NVLink 300 GB/s
    "v100-16gb": ("NVLink 2 (SXM2)", 150e9), "v100-32gb": ("NVLink 2 (SXM2)", 150e9),
    # A100 datasheet: SXM NVLink 600 GB/s (the PCIe parts only with a 2-GPU bridge: not taken)
    "a100-40gb": ("NVLink 3 (SXM4)", 300e9), "a100-80gb": ("NVLink 3 (SXM4)", 300e9),
    # H100 datasheet: SXM NVLink 900 GB/s; H100 NVL: NVLink bridge 600 GB/s (pairs)
    "h100-80gb": ("NVLink 4 (SXM5)", 450e9), "h100-nvl": ("NVLink 4 bridge (pairs)", 300e9),
    # H200 datasheet: SXM NVLink 900 GB/s
    "h200": ("NVLink 4 (SXM)", 450e9),
    # HGX B200 (NVIDIA Blackwell datasheet): NVLink 5, 1.8 TB/s per GPU
    "b200": ("NVLink 5 (HGX)", 900e9),
}
# GeForce RTX 40 and 50 series have no GPU peer-to-peer (NVIDIA's driver disables it on AD102
# and later GeForce parts; NCCL then stages through host memory): half the host-link rate.
NO_P2P = frozenset({"rtx-4060-ti-16gb", "rtx-4080", "rtx-4090", "rtx-5090"})
