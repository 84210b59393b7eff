"""The numbers a run shows and where they go: MFU, per-step peak memory, exactly counted model state,
metrics.jsonl + TensorBoard (`Logger`) and the per-step lines or progress bar (`Progress`).

- MFU = (training FLOPs per token × tokens/s) ÷ (peak FLOP/s per device × devices). FLOPs per token
  are 6N for the matmuls (N = parameters, less the position embedding, which does no matmul; with mixture of
  experts the active ones, K of each layer's E experts: `active_params`) plus 12·L·H·T for attention (PaLM,
  appendix B).
- Peak FLOP/s: the datasheet dense bf16 number for known GPUs training in bf16/fp16, otherwise measured
  here with a large matmul in the training dtype (on CPU: with this process's thread count).
- Peak memory, per step (`reset_peak_memory` at its start): on GPU the CUDA caching allocator's peak of
  allocated bytes; on CPU the process's peak resident set (Linux VmHWM, reset through
  /proc/self/clear_refs), which includes the ~0.6 GB of Python and torch every process carries.
- State bytes, saved activations and the CPU's allocated peak are measured in runtime/memory.py.
- A pipeline step's timeline, idle fraction and activations in flight: parallel/pipeline/record.py.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time

import torch
import torch.utils.checkpoint

from model.gpt import GPT, GPTConfig
from model.moe import Experts

# Dense (non-sparse) bf16/fp16 peak FLOP/s per device, from the vendors' datasheets. Matched against
# torch.cuda.get_device_name in order, so the specific variants come before the family name.
DATASHEET_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("A6000", 154.8e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
)


FORWARD_FLOPS_PER_PARAM = 2  # per token: one multiply-add per matmul weight
TRAIN_FLOPS_PER_PARAM = 6  # per token: forward 2, backward 4 (the input's gradient and the weight's)


def attention_flops_per_token(config: GPTConfig, seq_len: int, n_layer: int | None = None) -> int:
    """Training FLOPs per token of the attention scores and their weighted sum, 12·L·H·T over n_layer Blocks
    (default: config.n_layer); the causal mask's skipped half is counted, as PaLM does."""
    return 12 * (config.n_layer if n_layer is None else n_layer) * config.n_embd * seq_len


def flops_per_token(config: GPTConfig, n_params: int, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6N + 12·L·H·T (N: `active_params`)."""
    return TRAIN_FLOPS_PER_PARAM * n_params + attention_flops_per_token(config, seq_len)


@functools.lru_cache(maxsize=64)
def active_params(config: GPTConfig, non_embedding: bool = False) -> int:
    """The parameters one token's forward multiplies by, 6N's N: every parameter (the tied embedding once), but of
    each MoE layer's E experts only the top_k it is routed to, so K/E of the experts' weights and biases (the
    router, which scores every expert, counts whole). A dense model's is `GPT.num_params`. non_embedding: without
    the position embedding (a lookup, no matmul), as GPT.num_params. Cached per (frozen) config: it builds the
    model on meta (0.1 s at gpt2-xl), and the planner asks once per layout (1,570 layouts at 8 GPUs: 170 s)."""
    with torch.device("meta"):
        model = GPT(config)
    n = model.num_params(non_embedding=non_embedding)
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    if not experts:
        return n
    return n - experts + experts // config.moe_num_experts * config.moe_top_k  # every expert the same size


def expert_record(layers: list[int], tokens: list[list[int]], aux: list[float], with_aux: bool) -> dict:
    """A step's MoE numbers for metrics.jsonl, per MoE layer (its Block index): tokens per expert over the whole
    batch (integers, every layout's the same at step 1), their max over mean, the tokens whose top-k choice beat
    the next by less than moe.near_tie_margin (a routing rounding could flip between layouts), and, when the
    balancing loss is on, its value per micro-batch summed over the layers (the part of `loss` it is)."""
    out = {
        "expert_tokens": {str(i): row[:-1] for i, row in zip(layers, tokens)},
        "expert_near_ties": {str(i): row[-1] for i, row in zip(layers, tokens)},
        "expert_load_max_over_mean": {
            str(i): max(row[:-1]) * len(row[:-1]) / max(1, sum(row[:-1])) for i, row in zip(layers, tokens)
        },
    }
    if with_aux:
        out["moe_aux_loss"] = sum(aux)
    return out


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.5
) -> float:
    """Achieved FLOP/s of an n×n×n matmul, the best of repeated timings (a stand-in for peak)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:  # at least one timing, however loaded the machine
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Datasheet bf16/fp16 peak for a known GPU under bf16/fp16 training; otherwise (fp32, an unknown GPU,
    the CPU) the measured matmul rate in the training dtype."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, value in DATASHEET_BF16:
            if key in name:
                return value
    return measure_matmul_flops(
        device, dtype if device.type == "cuda" else torch.float32, n=4096 if device.type == "cuda" else 1024
    )


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (see `peak_memory_bytes`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak RSS (VmHWM) to the current RSS
    except OSError:
        pass  # not Linux: peak_memory_bytes then reports the process's lifetime peak


def peak_memory_bytes(device: torch.device) -> int:
    """Peak since the last `reset_peak_memory`: CUDA allocated bytes on GPU, resident bytes on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # lifetime peak; Linux reports KiB


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


# ----------------------------------------------------------------------------- where the numbers go


class Logger:
    """Rank 0 writes metrics.jsonl (one JSON object per line) and TensorBoard scalars under `out_dir`."""

    def __init__(self, out_dir: str, enabled: bool, append: bool = False):
        self.enabled, self.tb = enabled, None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if append else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(out_dir)
        except ImportError:
            pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
                elif isinstance(v, dict):  # one level: {"predicted": {...}}'s own dicts are not plotted
                    for kk, vv in v.items():
                        if isinstance(vv, (int, float)):
                            self.tb.add_scalar(f"{k}/{kk}", vv, record["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


class Progress:
    """Rank 0's view of the run: a tqdm bar when stdout is a terminal, else one printed line per step."""

    def __init__(self, total_steps: int, enabled: bool):
        self.enabled, self.bar = enabled, None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def step(self, m: dict) -> None:
        head = f"step {m['step']} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | norm {m['grad_norm']:.3f}"
        if self.bar is not None:
            self.bar.set_description_str(head)
            self.bar.update(1)
        elif self.enabled:
            print(
                f"{head} | dt {m['step_time_ms']:.0f}ms | tok/s {m['tokens_per_sec']:.0f} | mfu {100 * m['mfu']:.1f}%",
                flush=True,
            )

    def eval(self, step: int, val_loss: float) -> None:
        self.write(f"step {step} | val loss {val_loss:.4f}")

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_profiler(steps: int, out_dir: str, device: torch.device):
    """--profile N: a started torch.profiler trace of N steps after 2 warm-up steps (call .step() per
    training step), written to <out_dir>/profile for TensorBoard or Perfetto; None for N = 0."""
    if not steps:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=2, active=steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(os.path.join(out_dir, "profile")),
        record_shapes=True,
        with_stack=False,
    )
    prof.start()
    return prof
