"""FP8 training for the Blocks' linears: our dynamic-scaling FP8 linear, equal bit for bit to torchao's
Float8Linear on one process (docs/fp8.md).

    scaling.py  the formats, amax -> scale -> cast, and the `reduce` hook where a layout cuts a tensor
    recipes.py  tensorwise and rowwise (which format and which scale axis per GEMM), the scaled GEMM
    linear.py   the autograd Function, Fp8Linear, convert_to_fp8 (which linears)
    checks.py   the one-line refusals of a run that can't use FP8
"""

from parallel.fp8.checks import check_fp8, linear_dims
from parallel.fp8.linear import Fp8Linear, Reduces, convert_to_fp8, fp8_linear, fp8_linear_names
from parallel.fp8.recipes import RECIPES, Recipe
from parallel.fp8.scaling import amax, max_over, to_fp8

__all__ = [
    "RECIPES",
    "Fp8Linear",
    "Recipe",
    "Reduces",
    "amax",
    "check_fp8",
    "convert_to_fp8",
    "fp8_linear",
    "fp8_linear_names",
    "linear_dims",
    "max_over",
    "to_fp8",
]
