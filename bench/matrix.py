"""Which layouts the bench runs, what they share, and how many bytes each should communicate.

The communication formulas live beside the code they describe (parallel/ddp.py, parallel/fsdp.py,
parallel/tensor_parallel.py); here they are only applied to a layout's parameter shard and batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from model import GPT, GPTConfig
from parallel.ddp import ddp_comm_bytes_per_step
from parallel.fsdp import fsdp_comm_bytes_per_micro_step
from parallel.tensor_parallel import tp_comm_bytes_per_micro_step

LAYOUTS = ("single", "ddp", "fsdp", "tp", "2d-ddp", "2d-fsdp")
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Layout:
    """One cell of the matrix: a layout name, an implementation and its (dp, tp) degrees."""
    name: str            # one of LAYOUTS
    implementation: str  # "custom" | "pytorch" | "none" (single)
    dp: int = 1
    tp: int = 1

    @property
    def nproc(self) -> int:
        return self.dp * self.tp

    @property
    def dp_type(self) -> str | None:
        return None if self.dp == 1 else ("fsdp" if self.name.endswith("fsdp") else "ddp")

    @property
    def key(self) -> str:
        return self.name if self.implementation == "none" else f"{self.name}-{self.implementation}"

    def flags(self) -> list[str]:
        if self.name == "single":
            return []
        out = ["--implementation", self.implementation]
        if self.dp > 1:
            out += ["--data_parallel_size", str(self.dp), "--data_parallel_type", self.dp_type]
        if self.tp > 1:
            out += ["--tensor_parallel_size", str(self.tp), "--enable_loss_parallelism"]
        if self.dp_type == "fsdp":
            out.append("--deferred_init")  # materialise only this rank's shard, as one would at scale
        return out


def matrix(nproc: int, on_gpu: bool, include_2d: bool, wanted: list[str] | None = None) -> list[Layout]:
    """The layouts to run, in order; 2D (tp=2 x dp=N/2) needs >= 4 ranks (on CPU: 4 with --include_2d)."""
    lays = [Layout("single", "none")]
    if nproc >= 2:
        for name, dp, tp in (("ddp", nproc, 1), ("fsdp", nproc, 1), ("tp", 1, nproc)):
            lays += [Layout(name, impl, dp=dp, tp=tp) for impl in ("custom", "pytorch")]
    n2d = nproc if nproc >= 4 else (4 if include_2d and not on_gpu else 0)
    if n2d and n2d % 2 == 0:
        for name in ("2d-ddp", "2d-fsdp"):
            lays += [Layout(name, impl, dp=n2d // 2, tp=2) for impl in ("custom", "pytorch")]
    if wanted:
        lays = [lay for lay in lays if lay.name in wanted]
    return lays


@dataclass(frozen=True)
class Setup:
    """What every layout shares: model, global batch, steps, peak FLOP/s, dtype."""
    model: str
    config: GPTConfig
    seq_len: int
    rows: int               # sequences per global batch (the same for every layout)
    micro_cap: int          # largest micro-batch per rank
    warmup: int
    steps: int              # measured steps
    peak_flops: float
    device: str             # "cpu" | "cuda"
    dataset: str
    timeout: float          # seconds per job
    dtype_bytes: int = 4    # matmul outputs: 2 under bf16/fp16 autocast
    residual_bytes: int = 4  # residual stream, embeddings, LayerNorm outputs: fp32 also under autocast

    @property
    def global_batch_tokens(self) -> int:
        return self.rows * self.seq_len

    def micro_batch(self, dp: int) -> int:
        """The largest divisor of rows/dp that is <= micro_cap."""
        per_rank = self.rows // dp
        return max(d for d in range(1, min(per_rank, self.micro_cap) + 1) if per_rank % d == 0)

    def grad_accum(self, dp: int) -> int:
        return self.rows // (dp * self.micro_batch(dp))

    def train_args(self, lay: Layout, out_dir: str) -> list[str]:
        c = self.config
        return ["--model", self.model, "--n_layer", str(c.n_layer), "--n_head", str(c.n_head),
                "--n_embd", str(c.n_embd), "--dataset", self.dataset, "--seq_len", str(self.seq_len),
                "--micro_batch_size", str(self.micro_batch(lay.dp)),
                "--total_batch_size", str(self.global_batch_tokens),
                "--max_steps", str(self.warmup + self.steps), "--warmup_steps", "1",
                "--eval_interval", str(self.warmup + self.steps + 1), "--eval_iters", "1",
                "--peak_flops", repr(float(self.peak_flops)), "--timeout", str(int(self.timeout)),
                "--out_dir", out_dir, "--overwrite", *lay.flags()]


def fit_heads(config: GPTConfig, tp: int) -> GPTConfig:
    """The config with n_head raised to the nearest count that divides by tp and divides n_embd, if needed."""
    if config.n_head % tp == 0:
        return config
    for h in range(config.n_head + 1, config.n_embd + 1):
        if h % tp == 0 and config.n_embd % h == 0:
            return replace(config, n_head=h)
    raise ValueError(f"no head count divides both n_embd={config.n_embd} and tp={tp}")


# ----------------------------------------------------------------------------- theory

def param_count(config: GPTConfig, tp: int = 1, root_only: bool = False) -> int:
    """Parameters one rank holds under Megatron TP (tp=1: all of them, the tied weight counted once).

    Split over the tp ranks: the vocab (wte = lm_head), column-parallel weights and biases (c_q, c_k, c_v,
    mlp.c_fc) and row-parallel weights (attn.c_proj, mlp.c_proj). Replicated: LayerNorms, the position
    embedding and the row-parallel biases. root_only: just the parameters outside the Blocks (FSDP's root
    unit: wte = lm_head, wpe, ln_f)."""
    with torch.device("meta"):
        model = GPT(config)
    total = 0
    for name, p in model.named_parameters():  # named_parameters yields the tied weight once
        if root_only and name.startswith("transformer.h."):
            continue
        replicated = ".ln_" in name or "ln_f" in name or "wpe" in name or name.endswith("c_proj.bias")
        total += p.numel() if replicated else p.numel() // tp
    return total


def _add(out: dict[str, int], by_kind: dict[str, int], times: int = 1) -> dict[str, int]:
    for k, v in by_kind.items():
        out[k] = out.get(k, 0) + v * times
    return out


def comm_theory(lay: Layout, setup: Setup) -> dict[str, int]:
    """Payload bytes per rank per optimizer step for this layout, by kind: the DP formula on this rank's
    TP shard of the parameters (Ψ/tp, roughly) plus the TP formula, per micro-step terms times grad_accum."""
    out = dict.fromkeys(KINDS, 0)
    A = setup.grad_accum(lay.dp)
    psi = param_count(setup.config, lay.tp)
    if lay.dp_type == "ddp":
        _add(out, ddp_comm_bytes_per_step(psi, lay.dp))
    elif lay.dp_type == "fsdp":
        root = param_count(setup.config, lay.tp, root_only=True)
        _add(out, fsdp_comm_bytes_per_micro_step(root, psi - root, lay.dp), A)
    if lay.tp > 1:
        _add(out, tp_comm_bytes_per_micro_step(setup.config, setup.micro_batch(lay.dp), setup.seq_len, lay.tp,
                                               loss_parallel=True, sequence_parallel=False,
                                               dtype_bytes=setup.dtype_bytes, residual_bytes=setup.residual_bytes),
             A)
    return out


def comm_curves(setup: Setup, world: list[int]) -> dict[str, list[dict[str, int]]]:
    """Theory payload by kind per rank per optimizer step vs world size N, for DDP, FSDP and TP alone on
    the bench model and global batch (micro-batch rows/N capped as in the runs; N = 1 moves nothing)."""
    psi, root = param_count(setup.config), param_count(setup.config, root_only=True)
    B1, A1 = setup.micro_batch(1), setup.grad_accum(1)
    curves: dict[str, list[dict[str, int]]] = {"ddp": [], "fsdp": [], "tp": []}
    for n in world:
        accum = max(1, math.ceil(setup.rows / (n * setup.micro_cap)))
        tp = tp_comm_bytes_per_micro_step(setup.config, B1, setup.seq_len, n, loss_parallel=True,
                                          sequence_parallel=False, dtype_bytes=setup.dtype_bytes,
                                          residual_bytes=setup.residual_bytes)
        curves["ddp"].append(ddp_comm_bytes_per_step(psi, n))
        curves["fsdp"].append(_add({}, fsdp_comm_bytes_per_micro_step(root, psi - root, n), accum))
        curves["tp"].append(_add({}, tp, A1))
    return curves
