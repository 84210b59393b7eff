"""FP8's two formats, and how a high-precision tensor becomes one: amax -> scale -> cast (dynamic scaling, as
torchao.float8's float8_utils and float8_training_tensor do it, step for step).

- E4M3 (torch.float8_e4m3fn): 4 exponent bits, 3 mantissa bits, largest 448, no infinities. Forward operands.
- E5M2 (torch.float8_e5m2): 5 exponent bits, 2 mantissa bits, largest 57344. Gradients, where the recipe says.

A tensor t is stored as (data, scale) with data = fp8(t * scale), t ~ data / scale. The scale maps the tensor's
largest magnitude, its amax, onto the format's largest value: scale = max_fp8 / amax. The amax is always "of the
whole tensor" (or of a whole row): where a layout cuts the tensor, `amax`'s `reduce` hook takes this rank's amax
to the whole tensor's (max over the shards, `max_over`), and everything after it is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parallel import comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor on amax: an all-zero tensor gets a finite scale (max_fp8 / 1e-12)

# (local amax, the dim it was taken along or None for the whole tensor) -> the whole tensor's amax of that shape
Reduce = Callable[[torch.Tensor, "int | None"], torch.Tensor]


def amax(x: torch.Tensor, dim: int | None = None, reduce: Reduce | None = None) -> torch.Tensor:
    """max |x| over the whole tensor (dim None: a 0-d tensor) or along `dim` (keepdim: one per row of the other
    dims). `reduce`, where x is one rank's piece of a larger tensor, turns this piece's amax into the whole
    tensor's (`max_over`); nothing else in the scaling math knows that the tensor was cut."""
    a = torch.max(torch.abs(x)) if dim is None else torch.amax(torch.abs(x), dim=dim, keepdim=True)
    return a if reduce is None else reduce(a, dim)


def max_over(group, cut: int) -> Reduce:
    """The reduce hook of a tensor cut over `group` along dim `cut`: an amax that spans the cut (the whole tensor's,
    or one taken along `cut`) is all-reduced MAX over the group (4 bytes tensorwise, a float per row rowwise),
    counted as parallel/comm's all_reduce; one taken along another dim is over this rank's own rows, whole already."""

    def reduce(a: torch.Tensor, dim: int | None) -> torch.Tensor:
        if dim is not None and dim % a.ndim != cut % a.ndim:
            return a
        a = a.float().clone()
        comm.all_reduce(a, group, op="max", unit="fp8 amax")
        return a

    return reduce


@torch.no_grad()
def amax_to_scale(a: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """scale = max_fp8 / max(amax, EPS), in float64 then float32 (torchao's amax_to_scale); `pow2`: rounded down to
    a power of two (exact to multiply and divide by: rowwise's round_scales_to_power_of_2)."""
    scale = (torch.finfo(dtype).max / torch.clamp(a.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


@torch.no_grad()
def to_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    dim: int | None = None,
    pow2: bool = False,
    reduce: Reduce | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale): data = fp8(clamp(fp32(x) * scale, +-max_fp8)), round to nearest even, saturated. The scale
    is `amax_to_scale(amax(x, dim, reduce))` unless given (a tensorwise scale kept from forward for backward's
    cast of the same tensor: the same bits, no second reduction). Shapes: scale is 0-d (dim None) or x's shape
    with `dim` of size 1."""
    if scale is None:
        scale = amax_to_scale(amax(x, dim, reduce), dtype, pow2)
    top = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype), scale
