"""The numbers a run shows: model FLOPs utilisation, peak memory, exactly counted model state.

- MFU = (training FLOPs per token × tokens/s) ÷ (peak FLOP/s per device × devices). FLOPs per token
  are 6N for the matmuls (N = parameters, less the position embedding, which does no matmul) plus
  12·L·H·T for attention (PaLM, appendix B).
- Peak FLOP/s: the datasheet dense bf16/fp32 number for known GPUs, otherwise measured here with a
  large matmul in the training dtype (on CPU: with this process's thread count).
- Peak memory: the CUDA caching allocator's peak on GPU; the process's peak RSS on CPU.
- State bytes: this rank's parameters + gradients + optimizer state, summed over the distinct storages
  actually allocated (so views into a DDP bucket are counted once and freed FSDP parameters count 0).
"""
from __future__ import annotations

import json
import os
import resource
import time

import torch

from model import GPTConfig

# Dense (non-sparse) peak FLOP/s per device for the training dtype, from the vendors' datasheets.
DATASHEET_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A6000": 154.8e12, "L40S": 362e12,
                  "A10G": 125e12, "L4": 121e12, "4090": 165e12}


def flops_per_token(config: GPTConfig, n_params: int, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6N + 12·L·H·T."""
    return 6 * n_params + 12 * config.n_layer * config.n_embd * seq_len


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                         seconds: float = 0.5) -> float:
    """Achieved FLOP/s of an n×n×n matmul, the best of repeated timings (a stand-in for peak)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, deadline = 0.0, time.perf_counter() + seconds
    for _ in range(2):
        a @ b  # warm-up
    while best == 0.0 or time.perf_counter() < deadline:  # at least one timing, however slow the warm-up was
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Datasheet peak for a known GPU in bf16/fp16, else the measured matmul rate."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, value in DATASHEET_BF16.items():
            if key in name:
                return value
    return measure_matmul_flops(device, dtype if device.type == "cuda" else torch.float32,
                                n=4096 if device.type == "cuda" else 1024)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state, each storage counted once."""
    tensors = []
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return distinct_storage_bytes(tensors)


def distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; meta, freed and
    empty storages count 0; a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def read_jsonl(out_dir_or_file: str) -> list[dict]:
    """The records of a run's metrics.jsonl (give the run's directory or the file itself)."""
    path = out_dir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
