"""What FP8 refuses, each as the one line a bad run prints (train.py: error: ...) before any work.

torch._scaled_mm on a GPU takes mat1 (M, K) with K % 16 == 0 and mat2 (K, N) with K and N % 16 == 0 (CPU takes any
size, so a CPU run would pass a GPU's refusal by). A linear of W (N, K) over M token rows runs three GEMMs:
output x (M, K) @ W^T (K, N), grad_input dy (M, N) @ W (N, K), grad_weight dy^T (N, M) @ x (M, K). So its in and
out features and the tokens it sees per call must all be multiples of 16 (torchao pads none of them by default).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from parallel.fp8.linear import fp8_linear_names
from parallel.fp8.recipes import RECIPES

MULTIPLE = 16


def check_fp8(
    recipe: str, dims: Mapping[str, tuple[int, int]], dtype: torch.dtype, tokens: int | None = None
) -> str | None:
    """The refusal of `--fp8 recipe` for linears `dims` (name -> (in_features, out_features): `linear_dims`) in
    compute dtype `dtype`, seeing `tokens` rows per call where known, or None when FP8 can run."""
    if recipe not in RECIPES:
        return f"--fp8 {recipe}: unknown recipe; choose one of {', '.join(RECIPES)}"
    if dtype == torch.float16:
        return (
            "--fp8 with --dtype float16: FP8's GEMMs output bf16 or fp32 (torchao's rowwise GEMM rounds an fp16 "
            "output through bf16); use --dtype bfloat16 or float32"
        )
    for name, (n_in, n_out) in dims.items():
        if n_in % MULTIPLE or n_out % MULTIPLE:
            return (
                f"--fp8: {name} is {n_in} -> {n_out} features; torch._scaled_mm takes dimensions that are multiples "
                f"of {MULTIPLE} (set n_embd, and moe_ffn_hidden where used, to multiples of {MULTIPLE})"
            )
    if tokens is not None and tokens % MULTIPLE:
        return (
            f"--fp8: each linear sees {tokens} token rows per call; the weight gradient's torch._scaled_mm contracts "
            f"them, and takes a multiple of {MULTIPLE} (micro_batch_size x seq_len, per rank of any sequence cut)"
        )
    return None


def linear_dims(model: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (in_features, out_features) of the linears `convert_to_fp8` would swap (a meta model will do)."""
    return {n: (m.in_features, m.out_features) for n in fp8_linear_names(model) for m in [model.get_submodule(n)]}
