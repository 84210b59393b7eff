"""What a layout makes FP8 sync: the `Reduces` hooks (parallel/fp8/linear.py) of the operands it cuts.

A scale is the amax of the whole operand a GEMM contracts. Per layout (docs/fp8.md's table):
- one process, DDP, ZeRO-1/2, FSDP (the weight cast after its all-gather) and pipelines hold every operand whole:
  nothing to sync (`WHOLE`);
- context parallelism cuts each sequence's tokens over the cp group: a linear's input x and output gradient dy,
  (tokens, features), are cut along dim 0, the tokens. Their amax is all-reduced MAX over the cp group wherever it
  spans the tokens (tensorwise: every cast; rowwise: grad_weight's casts along the tokens), 4 bytes a cast
  tensorwise, a float per feature rowwise; a rowwise cast along the features is a rank's own rows, whole already.
  The weight is whole on every cp rank.
- tensor parallelism: not built (its config check refuses it).
"""

from __future__ import annotations

from parallel.fp8.linear import WHOLE, Reduces
from parallel.fp8.scaling import max_over
from parallel.mesh import Mesh

TOKENS = 0  # the dim of a linear's flattened (tokens, features) input and output gradient that CP cuts


def layout_reduces(mesh: Mesh) -> Reduces:
    """The hooks of the operands `mesh`'s layout cuts: CP's token cut of x and dy, or nothing."""
    cp = mesh["cp"]
    if not cp.enabled:
        return WHOLE
    return Reduces(input=max_over(cp.group, TOKENS), grad_output=max_over(cp.group, TOKENS))
