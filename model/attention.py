"""Attention's fused kernels with their log-sum-exp, forward and backward, on whatever the device has: what a
blockwise attention (the CP ring, parallel/context_parallel/ring.py) calls on one block pair and merges by its
log-sum-exp. No communication and no parallelism here (docs/context_parallel.md, Kernels: which kernel, why fp32
on the CPU)."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def kernel_of(x: torch.Tensor) -> tuple[str, torch.dtype]:
    """The fused kernel for inputs like `x`, and the dtype it runs in: CUDA runs the input's dtype, "flash" for
    bf16/fp16 and "efficient" (memory-efficient) for fp32; CPU runs "cpu" (its flash kernel) in fp32 or wider
    (docs/context_parallel.md, Kernels)."""
    if x.device.type != "cuda":
        return "cpu", torch.promote_types(x.dtype, torch.float32)
    return ("flash" if x.dtype in (torch.float16, torch.bfloat16) else "efficient"), x.dtype


def kernel_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """One fused call of q (B, H, Tq, D) over k, v (B, H, Tk, D), all one dtype, `causal` (top-left: used only
    with Tq = Tk) or not: (out like q, laid out (B, Tq, H, D); lse fp32 (B, H, Tq); the kernel's state for its
    backward: the dropout RNG's, unused at dropout 0)."""
    if kernel == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, ()
    if kernel == "flash":
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse, (seed, offset)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., : q.shape[2]], (seed, offset)  # its lse rows are padded to a multiple of 32


def kernel_backward(
    kernel: str,
    g: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    state: tuple,
):
    """The backward of `kernel_forward`'s call on (q, k, v), given the output gradient g, the output `out` and
    its log-sum-exp: (dq, dk, dv) in q's dtype. Given the merged out and lse of all keys, it is these keys'
    share of the gradients."""
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal)
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, *state
        )
    n = lse.shape[-1]  # the kernel reads lse in its forward's layout: rows padded to a multiple of 32
    padded = lse.new_zeros(*lse.shape[:-1], n + -n % 32)
    padded[..., :n] = lse
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, padded, *state, 0.0, [True, True, True, False], causal
    )
    return dq, dk, dv
