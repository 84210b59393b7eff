"""Tensor-parallel communication primitives: Megatron's f and g, and their sequence-parallel relatives.

Three layers of code, as in Megatron-LM's mappings.py:
- helpers that move tensors (`_all_reduce`, `_split`, and the public `all_gather_along` and
  `reduce_scatter_along`, along any dim), every collective going through parallel/comm.py so
  parallel/comm.COUNTER sees its bytes;
- autograd Functions that take the group as an argument and keep it in ctx;
- public snake_case wrappers whose docstrings give both directions.

Every Function returns its input unchanged when the group has one rank. "Region" is the tensor-parallel
region between a column-parallel and a row-parallel layer, where each rank holds its own heads (or its
slice of the MLP's hidden units, or of the vocab) and activations outside it are the same on every rank
(or, under sequence parallelism, split along the sequence dim).

Nothing here modifies its input in place: a gradient handed to backward may be shared with other
branches of the graph (a residual add passes one gradient to both of its inputs).
"""

from __future__ import annotations

import torch

from parallel import comm

SEQ_DIM = 1  # activations are (B, T, C)


# ----------------------------------------------------------------------------- helpers (no autograd)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over the group, in a new tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/p chunk of x along dim (contiguous, its own storage)."""
    world = comm.world(group)
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} over {world} tensor-parallel ranks; "
            f"it must be divisible by the tensor-parallel size (with sequence parallelism: "
            f"seq_len % tp == 0)"
        )
    return x.chunk(world, dim)[comm.rank(group)].contiguous()


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's x concatenated along dim, in rank order (no autograd)."""
    world = comm.world(group)
    dim = dim % x.dim()
    flat = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # ranks along dim 0
    comm.all_gather_into_tensor(flat, x.contiguous(), group)
    if dim == 0:
        return flat
    stacked = flat.unflatten(0, (world, x.shape[0]))  # (p, *x.shape)
    out_shape = (*x.shape[:dim], world * x.shape[dim], *x.shape[dim + 1 :])
    return stacked.movedim(0, dim).reshape(out_shape)  # (.., p, n, ..) -> (.., p*n, ..): one copy


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum of x over the group, keeping only this rank's 1/p chunk along dim (no autograd)."""
    world = comm.world(group)
    dim = dim % x.dim()
    if x.shape[dim] % world:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} tensor-parallel "
            f"ranks; with sequence parallelism seq_len must be divisible by the tensor-parallel size"
        )
    n = x.shape[dim] // world
    chunks = x.unflatten(dim, (world, n)).movedim(dim, 0).contiguous()  # (p, .., n, ..): rank r's chunk at [r]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, chunks.flatten(0, 1), group)
    return out


# ----------------------------------------------------------------------------- autograd Functions


class _CopyToRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        if comm.world(group) == 1:
            return x
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """forward all-gather along the last dim, backward split along the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if comm.world(group) == 1:
            return x
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None
        return _split(grad, -1, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    """forward all-gather along the sequence dim, backward reduce-scatter along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if comm.world(group) == 1:
            return x
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None, None
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _GatherSequenceReplicated(_GatherFromSequence):
    """forward all-gather along the sequence dim (_GatherFromSequence's), backward keep this rank's slice (the
    gradient is whole and the same on every rank: what follows runs redundantly on each)."""

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None, None
        return _split(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward reduce-scatter along the sequence dim, backward all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if comm.world(group) == 1:
            return x
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None, None
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequence(torch.autograd.Function):
    """forward split along the sequence dim, backward all-gather along it."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if comm.world(group) == 1:
            return x
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if comm.world(ctx.group) == 1:
            return grad, None, None
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


# ----------------------------------------------------------------------------- public wrappers


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """f. forward: identity (x is already the same on every rank); backward: all-reduce of the gradient.

    Enters the tensor-parallel region: each rank's column-parallel layer contributes part of dL/dx."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """g. forward: all-reduce (sum of the ranks' partial results); backward: identity.

    Leaves the tensor-parallel region after a row-parallel layer."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-gather along the last dim (rank order); backward: keep this rank's slice of the gradient."""
    return _GatherFromRegion.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """forward: all-gather along the sequence dim, (B, T/p, C) -> (B, T, C); backward: reduce-scatter.

    Sequence parallelism's entry into the tensor-parallel region (replaces f): the ranks' gradients
    are partial sums, and each keeps the summed gradient of its own T/p positions."""
    return _GatherFromSequence.apply(x, group, dim)


def gather_sequence_replicated(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """forward: all-gather along the sequence dim, (B, T/p, C) -> (B, T, C); backward: this rank's slice of the
    gradient (Megatron's gather_from_sequence_parallel_region with tensor_parallel_output_grad=False).

    For a module every rank runs whole on the same input (the MoE layers under TP): its input gradient is then
    the same, complete one on every rank, not a partial sum to reduce."""
    return _GatherSequenceReplicated.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """forward: reduce-scatter along the sequence dim, partial (B, T, C) -> summed (B, T/p, C);
    backward: all-gather of the gradient along it.

    Sequence parallelism's exit from the tensor-parallel region (replaces g)."""
    return _ReduceScatterToSequence.apply(x, group, dim)


def scatter_to_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    """forward: keep this rank's 1/p slice of the sequence dim (x is the same on every rank);
    backward: all-gather of the gradient along it, so every rank again holds the full (same) gradient."""
    return _ScatterToSequence.apply(x, group, dim)
