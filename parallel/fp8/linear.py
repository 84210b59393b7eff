"""Our FP8 linear: y = x W^T + b with its three GEMMs in FP8 (parallel/fp8/recipes.py), equal bit for bit to
torchao's Float8Linear (its twin: parallel/twins/fp8.py).

- What is stored: nothing new. The weight and bias stay the module's parameters in their own dtype (fp32 master
  weights: the optimizer, checkpoints and every wrapper see an nn.Linear); FP8 copies live only inside a GEMM.
- Forward casts x and W (E4M3) and saves x and W in high precision, and for tensorwise their two scalar scales.
- Backward casts dy (E5M2 tensorwise, E4M3 rowwise) and recasts W and x along the backward GEMMs' contracted
  dims: rowwise needs new amaxes (other axes), tensorwise reuses forward's scales (the same bits torchao's
  recomputation gives, without a second reduction where a layout cuts W or x).
- Under autocast the input is cast to autocast's dtype first, as F.linear's autocast rule (torchao's forward)
  does, and the GEMMs output that dtype.
- Which linears: `convert_to_fp8` swaps the Blocks' dense linears (attention's c_q, c_k, c_v, c_proj; the MLP's
  c_fc, c_proj). The embeddings and the tied head stay in the compute dtype (torchtitan's choice: the head's
  softmax is the most precision-hungry GEMM), and so do an MoE Block's router (E columns: small, and it decides
  routing) and its experts (`ExpertLinear`, one grouped GEMM over token counts that no multiple of 16 bounds).

`Reduces` is the seam for layouts: per operand, the hook that takes a rank's amax to the whole tensor's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from model.moe import compute_dtype
from parallel.fp8.recipes import RECIPES, Recipe, scaled_mm
from parallel.fp8.scaling import Reduce, to_fp8
from runtime.blocks import blocks_by_index


class Reduces(NamedTuple):
    """Per operand, how a rank's amax becomes the whole tensor's (scaling.Reduce; None: this rank holds it whole).
    One process holds every tensor whole; FSDP, TP and CP set the hooks of the operands they cut."""

    input: Reduce | None = None
    weight: Reduce | None = None
    grad_output: Reduce | None = None


WHOLE = Reduces()


def _along(recipe: Recipe, dim: int) -> int | None:
    """The dim an operand's amax is taken along: the GEMM's contracted dim (rowwise) or all of them (tensorwise)."""
    return dim if recipe.rowwise else None


def fp8_output(x2, w, recipe: Recipe, reduce: Reduces, out_dtype: torch.dtype):
    """y = x @ W^T, x (M, K) and W (N, K) in FP8 along K. Returns (y (M, N), x's scale, W's scale)."""
    r = recipe
    xd, xs = to_fp8(x2, r.input, _along(r, -1), r.pow2, reduce.input)  # xs (M, 1) or 0-d
    wd, ws = to_fp8(w, r.weight, _along(r, -1), r.pow2, reduce.weight)  # ws (N, 1) or 0-d
    return scaled_mm(xd, xs, wd.t(), ws.t(), out_dtype, r.fast_accum[0]), xs, ws


def fp8_grad_input(dy2, w, recipe: Recipe, reduce: Reduces, w_scale, out_dtype: torch.dtype):
    """dx = dy @ W, dy (M, N) and W (N, K) in FP8 along N (`w_scale`: forward's, reused when tensorwise). Returns
    (dx (M, K), dy in FP8 as (data, scale)): tensorwise, grad_weight's operand too (the same bits)."""
    r = recipe
    dyd, dys = to_fp8(dy2, r.grad_output, _along(r, -1), r.pow2, reduce.grad_output)  # dys (M, 1) or 0-d
    wd, ws = to_fp8(w, r.weight, 0, r.pow2, reduce.weight) if r.rowwise else to_fp8(w, r.weight, scale=w_scale)
    return scaled_mm(dyd, dys, wd, ws, out_dtype, r.fast_accum[1]), (dyd, dys)  # ws (1, K) or 0-d


def fp8_grad_weight(dy2, x2, recipe: Recipe, reduce: Reduces, x_scale, out_dtype: torch.dtype, dy_fp8=None):
    """dW = dy^T @ x, dy (M, N) and x (M, K) in FP8 along M, the tokens. Tensorwise reuses forward's `x_scale`
    and, where given, grad_input's `dy_fp8`."""
    r = recipe
    if r.rowwise or dy_fp8 is None:
        dy_fp8 = to_fp8(dy2, r.grad_output, _along(r, 0), r.pow2, reduce.grad_output)  # scale (1, N) or 0-d
    xd, xs = to_fp8(x2, r.input, 0, r.pow2, reduce.input) if r.rowwise else to_fp8(x2, r.input, scale=x_scale)
    dyd, dys = dy_fp8
    return scaled_mm(dyd.t(), dys.t(), xd, xs, out_dtype, r.fast_accum[2])  # (N, M) @ (M, K)


class _Fp8Matmul(torch.autograd.Function):
    """x (..., K) @ W^T with W (N, K): forward one FP8 GEMM, backward two. Gradients come out in the GEMMs' dtype
    (the compute dtype); autograd casts them to x's and W's own (fp32 master weights) as for any linear."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: Recipe, reduce: Reduces) -> torch.Tensor:
        y, xs, ws = fp8_output(x.reshape(-1, x.shape[-1]), w, recipe, reduce, compute_dtype(x))
        ctx.save_for_backward(x, w, xs, ws)
        ctx.recipe, ctx.reduce = recipe, reduce
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, xs, ws = ctx.saved_tensors
        dy2, out_dtype = dy.reshape(-1, dy.shape[-1]), compute_dtype(dy)
        dx = dw = dy_fp8 = None
        if ctx.needs_input_grad[0]:
            dx, dy_fp8 = fp8_grad_input(dy2, w, ctx.recipe, ctx.reduce, ws, out_dtype)
            dx = dx.reshape(*x.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            dw = fp8_grad_weight(dy2, x.reshape(-1, x.shape[-1]), ctx.recipe, ctx.reduce, xs, out_dtype, dy_fp8)
        return dx, dw, None, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, reduce: Reduces = WHOLE, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) with its GEMMs in FP8: x cast to the compute dtype (autocast's, where on), the
    FP8 product in that dtype, the bias added in it (torchao's Float8Linear.forward)."""
    x = x.to(compute_dtype(x))
    y = _Fp8Matmul.apply(x, weight, recipe, reduce)
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose forward is `fp8_linear`: the same parameters (names, dtype, values), so the optimizer,
    checkpoints and the data-parallel wrappers see no difference; `reduce` is set by a layout that cuts the
    operands (one process: WHOLE)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe, **kw):
        super().__init__(in_features, out_features, bias, **kw)
        self.recipe, self.reduce = recipe, WHOLE

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe) -> "Fp8Linear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameter objects
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.recipe, self.reduce, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.name}"


def fp8_linear_names(model: nn.Module) -> list[str]:
    """The linears `convert_to_fp8` swaps, by name: every plain nn.Linear inside a Block, less an MoE router."""
    return [
        f"transformer.h.{i}.{name}"
        for i, block in blocks_by_index(model)
        for name, m in block.named_modules()
        if type(m) is nn.Linear and not name.endswith("router")
    ]


def convert_to_fp8(model: nn.Module, recipe: str | Recipe, reduce: Reduces = WHOLE) -> nn.Module:
    """Swap the Blocks' dense linears (`fp8_linear_names`) for Fp8Linear, in place; returns `model`. Parameters
    are kept (the same objects): call it before any wrapper, on a built or a meta model. `reduce`: the layout's
    hooks (parallel/fp8/layouts.py), the same for every linear."""
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    for name in fp8_linear_names(model):
        owner, _, attr = name.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(parent, attr, Fp8Linear.from_linear(getattr(parent, attr), recipe))
        getattr(parent, attr).reduce = reduce
    return model
