"""The two recipes (torchao's Float8LinearConfig.from_recipe_name), and the one GEMM every FP8 product runs
through (torchao's addmm_float8_unwrapped, with its operand layouts).

A linear y = x W^T (x: (M, K) tokens by inputs, W: (N, K)) runs three GEMMs, each contracting one dim:

    output       y  = x  @ W^T   contracts K     (M, K) @ (K, N)
    grad_input   dx = dy @ W     contracts N     (M, N) @ (N, K)
    grad_weight  dW = dy^T @ x   contracts M     (N, M) @ (M, K)

tensorwise: one scale per operand; x and W in E4M3, dy in E5M2 (its range: gradients span more binades).
rowwise: one scale per row of the left operand and per column of the right, that is an amax along the dim the
GEMM contracts (so each output element sees one scale per side); every operand in E4M3, scales rounded down to
powers of two. Both: the output GEMM with use_fast_accum, the backward ones without (torchao's Float8GemmConfig).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.moe import no_autocast
from parallel.fp8.scaling import E4M3, E5M2


@dataclass(frozen=True)
class Recipe:
    """How a linear's three GEMMs cast their operands: each operand's FP8 format, tensorwise or rowwise scales,
    power-of-two scales, and fast accumulation per GEMM (output, grad_input, grad_weight)."""

    name: str
    input: torch.dtype
    weight: torch.dtype
    grad_output: torch.dtype
    rowwise: bool
    pow2: bool
    fast_accum: tuple[bool, bool, bool] = (True, False, False)


RECIPES = {
    "tensorwise": Recipe("tensorwise", E4M3, E4M3, E5M2, rowwise=False, pow2=False),
    "rowwise": Recipe("rowwise", E4M3, E4M3, E4M3, rowwise=True, pow2=True),
}


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) in `out_dtype`: torch._scaled_mm on a row-major and b column-major (the
    layouts cuBLAS takes), with the scales' reciprocals. Rowwise scales ((M, 1) and (1, N)) take torchao's path:
    without fast accumulation the unscaled product comes out of the kernel and is scaled after (its rowwise
    kernel is slow without it), and the kernel's output is bf16 where fp32 or fp16 is asked, then cast."""
    a = a if _row_major(a) else a.contiguous()
    b = b.t().contiguous().t() if _row_major(b) else b
    inv_a, inv_b = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = a_scale.shape == (a.shape[0], 1) and b_scale.shape == (1, b.shape[1])
    post = None
    if rowwise and not fast_accum:
        post, inv_a, inv_b = inv_a * inv_b, inv_a.new_ones(()), inv_a.new_ones(())
    kernel_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    with no_autocast(a.device.type):
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=kernel_dtype, use_fast_accum=fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype)
