"""The layers of our tensor parallelism (parallel/tensor_parallel/apply.py swaps them in by TP_PLAN): each docstring
states the math (Y = XA with A split by columns or by rows, Megatron-LM's layers), what a rank stores and what
it communicates, through the f and g of parallel/tensor_parallel/mappings.py; under sequence parallelism (SP) the
activations outside the tensor-parallel region are split along the sequence, (B, T/p, C).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import comm
from parallel.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns, A = [A_1 ... A_p], b = [b_1 ... b_p]: rank i computes Y_i = X A_i + b_i.

    Stores `weight` (out/p, in), rows [i*out/p, (i+1)*out/p) of nn.Linear's (out, in) weight, and `bias`
    (out/p,). Communicates nothing itself: X must be the same on every rank and have entered the
    tensor-parallel region (f = copy_to_region, or gather_from_sequence under SP), which the plan's "norm"
    style does once at the LayerNorm's output, so that q, k and v share one collective. With
    gather_output, Y = [Y_1 ... Y_p] is all-gathered along its last dim (each rank's slice of dY is kept
    in backward, no communication).
    """

    linear = staticmethod(
        F.linear
    )  # the product alone: a zero-bubble schedule swaps it (parallel/pipeline/zero_bubble.py)

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, gather_output: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.gather_output = group, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight, self.bias)  # (B, T, out/p)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows and X by columns, A = [A_1; ...; A_p], X = [X_1 ... X_p]: Y = sum_i X_i A_i + b.

    Stores `weight` (out, in/p), columns [i*in/p, (i+1)*in/p) of nn.Linear's weight, and the full bias
    (replicated). Communicates g: the partial products X_i A_i are all-reduced forward (identity
    backward), or under SP reduce-scattered along T (dY all-gathered backward). b is added once, after
    the reduce; under SP it sees only this rank's T/p positions, so its gradient is all-reduced (f).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.group, self.sequence_parallel = group, sequence_parallel

    linear = staticmethod(
        F.linear
    )  # the product alone: a zero-bubble schedule swaps it (parallel/pipeline/zero_bubble.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight)  # (B, T, out), this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)  # (B, T/p, out)
        else:
            y = reduce_from_region(y, self.group)
        if self.bias is not None:
            b = copy_to_region(self.bias, self.group) if self.sequence_parallel else self.bias
            y = y + b.to(y.dtype)
        return y


class VocabParallelEmbedding(nn.Module):
    """E[idx] with the table split by vocab rows, E = [E_1; ...; E_p]: rank i holds rows [i*V/p, (i+1)*V/p).

    Each rank looks up the ids that fall in its rows (the others give zero vectors) and the partial
    lookups are summed: all-reduce forward, identity backward (g); under SP a reduce-scatter along T
    instead, leaving this rank's (B, T/p, C) (dY all-gathered backward). The weight gradient is local.
    """

    def __init__(self, weight: nn.Parameter, group, sequence_parallel: bool = False):
        super().__init__()
        self.weight = weight
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = comm.rank(group) * weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        tp = comm.world(self.group)
        if self.sequence_parallel and idx.shape[1] % tp:
            raise ValueError(
                f"sequence parallelism needs seq_len ({idx.shape[1]}) divisible by the tensor-parallel size ({tp})"
            )
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.weight.shape[0])
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C), partial
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)  # (B, T/p, C)
        return reduce_from_region(out, self.group)


class ParallelLayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, whose output then enters the tensor-parallel region.

    Stores weight and bias in full (replicated). Without SP, x is the full (B, T, C) on every rank and y
    goes through f: nothing forward, all-reduce of dL/dy backward. Under SP, x is this rank's (B, T/p, C)
    and y is all-gathered to (B, T, C) (dL/dy reduce-scattered backward); weight and bias then see only
    T/p positions, so they enter through f as well: their gradients are all-reduced over the group. Without
    `gather` (under SP, before an MoE layer, which gathers its own input: tensor_parallel.py `_moe`) y stays
    (B, T/p, C).
    """

    def __init__(self, like: nn.LayerNorm, group, sequence_parallel: bool, gather: bool = True):
        super().__init__(
            like.normalized_shape, like.eps, like.elementwise_affine, bias=like.bias is not None, device="meta"
        )
        self.weight, self.bias = like.weight, like.bias  # the same Parameters: nothing copied
        self.group, self.sequence_parallel, self.gather = group, sequence_parallel, gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_region(w, self.group) if w is not None else None
            b = copy_to_region(b, self.group) if b is not None else None
            y = F.layer_norm(x, self.normalized_shape, w, b, self.eps)
            return gather_from_sequence(y, self.group) if self.gather else y  # not: an MoE layer gathers its own
        return copy_to_region(F.layer_norm(x, self.normalized_shape, w, b, self.eps), self.group)


class SequenceParallelPositionEmbedding(nn.Embedding):
    """P[pos] for this rank's positions only: given pos = 0..T-1, returns rows [i*T/p, (i+1)*T/p) (T/p, C).

    Stores the whole table (replicated). Forward looks up all T positions and keeps this rank's slice (no
    communication); backward all-gathers dL/dP over T, so every rank gets the same full table gradient.
    Used only under SP, where the token embeddings it is added to are (B, T/p, C).
    """

    def __init__(self, like: nn.Embedding, group):
        super().__init__(like.num_embeddings, like.embedding_dim, device="meta")
        self.weight = like.weight
        self.group = group

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence(F.embedding(pos, self.weight), self.group, dim=0)  # (T/p, C)
