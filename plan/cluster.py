"""The cluster the planner plans for: named GPU presets (their figures cited) and which link each mesh dim uses.

Figures are per GPU. Memory in GiB as the device reports it; peak = dense bf16/fp16 tensor-core FLOP/s (no
sparsity); intra = NVLink bandwidth per direction (the datasheets quote both directions together: halved here);
inter = the node's network per GPU per direction, for the usual one NIC per GPU; latency = seconds per collective
call or p2p message, whatever its size (plan/search.py charges it per call: each wrapper's calls formula).

GPU latency: Hu et al. 2025, "Demystifying NCCL" (arXiv:2507.04786, from NCCL 2.19's source) give a per-hop latency
of ~1 us for NCCL's LL protocol, ~2 us for LL128 and ~6 us for Simple; a small all-reduce over a ring of n GPUs
takes 2(n - 1) hops, a kernel launch a few us more. We take 10 us per call on every preset: a documented small
value (an 8-GPU LL128 ring's 14 hops would be ~28 us; NVLS and tree algorithms take fewer), not a measurement.

GPU overhead = seconds per compute action (one F, B or W of one chunk on one micro-batch), whatever its FLOPs:
the host's Python, autograd and dispatch work that the GPU's queue does not hide. A chunk's kernels are queued
asynchronously, so per-kernel launch costs (~5 us each) hide behind kernels longer than that; what an action
exposes is its start: the runner's wait on the received activation, then the host's setup before the first
kernel lands (the autograd engine's start of a backward, the first launch), a few tens of us. We take 20 us on
every preset: a documented small value, not a measurement (bench/plan_rank.py measures it for CPU ranks, where
nothing hides it: there it is the whole of Python's and autograd's per-call work).

hop = seconds per hop of a collective, the sequential messages of its algorithm (plan/search.py HOPS: a ring
all-reduce over n ranks 2(n - 1), an all-gather n - 1, a p2p message 1), charged on top of `latency` per call. 0 on
every preset: NCCL's per-hop cost (~1 to 6 us, above) is inside the 10 us a call. On CPU ranks it is gloo's
(bench/plan_rank.py measures it): a hop is a message whose receiver's threads must be woken and run before it
forwards the next, 0.5 to 0.6 ms with 2 ranks on 2 cores, 1.1 to 1.2 ms with 4, whatever the bytes up to 512 KB
(docs/planner.md, "Hops").

Efficiency = the fraction of `peak_flops` a step's compute runs at (plan/search.py step_time). EFFICIENCY, 0.5, is
an assumption that nothing has measured: the "113 ms a step" the planner gives GPT-2 124M on 8 x H100 rests on it.
The GPU check measures it (scripts/gpu_check.py, the compiled recipe row: train.py --compile on GPT-2 124M in bf16
at the recipe's micro-batch 64 x 1024, whose median MFU counts the FLOPs plan/counts.step_flops counts, against
the same datasheet peak) and writes it to <report>/efficiency.json, keyed by preset; `efficiency_for` reads
results/gpu/efficiency.json when it is there, and `python -m plan` prints which number it used and where it came
from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

GiB = 2**30
EFFICIENCY = 0.5  # assumed, not measured (module docstring)
MEASURED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "gpu", "efficiency.json"
)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    memory: int  # bytes per GPU
    peak_flops: float  # dense bf16 FLOP/s per GPU
    intra_bw: float  # bytes/s per GPU per direction inside a node
    inter_bw: float  # bytes/s per GPU per direction between nodes
    name: str = "custom"
    # communication runs behind compute (NCCL's kernels and the copy engines beside the SMs); False for gloo on
    # CPU ranks, whose reductions take the cores that compute (bench/plan_rank.py's calibrated cluster)
    overlap: bool = True
    latency: float = 10e-6  # seconds per collective call / p2p message (module docstring)
    # cores the ranks share, when fewer than the ranks (CPU ranks on one machine); None: a processor per rank (GPUs).
    # A rank idle in the pipeline bubble then frees its core for the busy ones (plan/search.py step_time)
    cores: int | None = None
    overhead: float = 20e-6  # seconds per compute action (F, B or W of a chunk on a micro-batch): module docstring
    hop: float = 0.0  # seconds per hop of a collective (plan/search.py HOPS), beyond `latency` per call: docstring


PRESETS: dict[str, dict] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 40 GB HBM2 / 80 GB HBM2e, BF16 312 TFLOPS dense (624 with
    # sparsity), NVLink 600 GB/s (bidirectional). Network: DGX A100, 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    "a100-40gb": dict(memory=40 * GiB, peak_flops=312e12, intra_bw=300e9, inter_bw=25e9),
    "a100-80gb": dict(memory=80 * GiB, peak_flops=312e12, intra_bw=300e9, inter_bw=25e9),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: 80 GB HBM3, BF16 1,979 TFLOPS with sparsity = 989.4
    # dense, NVLink 900 GB/s (bidirectional). Network: DGX H100, 8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    "h100-sxm": dict(memory=80 * GiB, peak_flops=989e12, intra_bw=450e9, inter_bw=50e9),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: 141 GB HBM3e, BF16 1,979 TFLOPS with sparsity (989 dense),
    # NVLink 900 GB/s. Network as DGX H100 (DGX H200: 8 x 400 Gb/s).
    "h200": dict(memory=141 * 10**9, peak_flops=989e12, intra_bw=450e9, inter_bw=50e9),
}


def parse_memory(text: str) -> int:
    """'80GB', '40GiB', '141e9' -> bytes (GB read as GiB, as nvidia-smi and torch report a GPU's memory)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": GiB, "T": 2**40}.get(t[-1:], 1)
    value = float(t[:-1] if t[-1:] in "KMGT" else t)
    return int(value * scale)


def link_of(dim: str, sizes: dict[str, int], gpus_per_node: int) -> str:
    """ "intra" or "inter": whether a group of mesh dim `dim` spans nodes. The mesh (parallel/mesh.py) orders
    dims pp, dp_replicate, dp_shard, cp, tp, tp innermost: a group's ranks are `stride` apart, stride = the
    product of the inner dims' sizes, so it stays in a node when stride x size <= gpus_per_node."""
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    stride = 1
    for d in reversed(order[order.index(dim) + 1 :]):
        stride *= sizes[d]
    return "intra" if stride * sizes[dim] <= gpus_per_node else "inter"


def preset_of(device_name: str) -> str | None:
    """The preset a CUDA device name (torch.cuda.get_device_name) is, or None: 'NVIDIA H100 80GB HBM3' -> h100-sxm
    (the PCIe and NVL H100s are other parts: runtime/metrics.DATASHEET_BF16), 'NVIDIA H200' -> h200,
    'NVIDIA A100-SXM4-80GB' -> a100-80gb."""
    if "H100" in device_name:
        return None if "PCIe" in device_name or "NVL" in device_name else "h100-sxm"
    if "H200" in device_name:
        return "h200"
    if "A100" in device_name:
        return "a100-80gb" if "80GB" in device_name else "a100-40gb"
    return None


def efficiency_for(gpu: str, path: str = MEASURED) -> tuple[float, str]:
    """(efficiency, where it comes from) for preset `gpu`: the GPU check's measurement in `path` when it holds one
    for `gpu`, else EFFICIENCY, assumed."""
    try:
        with open(path) as f:
            got = json.load(f).get(gpu)
    except (OSError, ValueError, AttributeError):
        got = None
    if isinstance(got, dict) and isinstance(got.get("efficiency"), (int, float)) and 0 < got["efficiency"] <= 1:
        where = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
        return float(got["efficiency"]), f"measured on {got.get('device', gpu)}, {got.get('date', '?')}: {where}"
    return EFFICIENCY, "assumed, not measured: plan/cluster.py EFFICIENCY; scripts/gpu_check.py measures it"
