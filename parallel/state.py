"""A layout-independent view of this rank's training state, for checkpoints and resharding.

Whatever the layout, every element this rank stores of an original GPT parameter (and of its AdamW
moments) is described by an `Entry`: the parameter's name and full shape, the flat indices of those
elements in the full tensor, and 1-D views of the live storage that hold them. A checkpoint writes
(name, indices, values) and a loader in any other layout fills its own entries' views from them, so
DDP x2 -> FSDP x2 -> TP x2 -> one process needs no conversion step. Indices are computed locally, with
no communication: a DTensor's come from distributing `arange(numel)` with the same placements.

`write` marks one holder of each element: replicas (DDP ranks, TP-replicated parameters) write once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Entry:
    name: str                         # original GPT parameter name, e.g. "transformer.h.0.attn.c_q.weight"
    shape: tuple[int, ...]            # full, unsharded shape
    index: torch.Tensor               # int64 (n,): flat positions in the full tensor
    tensors: dict[str, torch.Tensor]  # "param" and the optimizer moments: (n,) views of live storage
    write: bool                       # this rank writes these elements (one writer per element)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state as its first step would (zero moments, step 0) without changing any
    parameter, so a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for k in MOMENTS:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_shape(p: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape: a DTensor knows it; our TP layers' shards are 1/tp along `_tp_shard_dim`."""
    shape = list(p.shape)
    dim = getattr(p, "_tp_shard_dim", None)
    if dim is not None and not isinstance(p, DTensor):
        shape[dim] *= tp_size
    return tuple(shape)


def _global_index(p: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Flat full-tensor positions of this rank's elements of p, in local memory order."""
    shape = full_shape(p, tp_size)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.int64, device=p.device).view(shape)
    if isinstance(p, DTensor):
        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    elif hasattr(p, "_tp_shard_dim"):  # our TP: rank r holds the r-th of tp equal slices
        dim = p._tp_shard_dim
        full = full.narrow(dim, tp_rank * p.shape[dim], p.shape[dim])
    return full.reshape(-1)


def _is_writer(p: torch.Tensor, replica_rank: int, plain_replica_rank: int) -> bool:
    """One writer per element: replica 0 of the data-parallel copies, and coordinate 0 on every mesh
    dim a DTensor is replicated over; a plain tensor is written by replica 0 of those holding it."""
    if replica_rank != 0:
        return False
    if hasattr(p, "_tp_shard_dim") and not isinstance(p, DTensor):
        return True  # our TP shard: each tp rank writes its own slice
    if isinstance(p, DTensor):
        coords = p.device_mesh.get_coordinate()
        if "tp" not in (p.device_mesh.mesh_dim_names or ()) and plain_replica_rank != 0:
            return False  # e.g. a LayerNorm under FSDP2 x TP: sharded over dp, replicated over tp
        return all(c == 0 for c, pl in zip(coords, p.placements) if pl.is_replicate())
    return plain_replica_rank == 0


def entries_for(named_params: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer,
                replica_rank: int = 0, sharded_as: dict[str, DTensor] | None = None,
                plain_replica_rank: int = 0, tp_size: int = 1) -> list[Entry]:
    """Entries for parameters that are whole tensors or DTensors (one process, DDP, FSDP2, DTensor TP).

    `replica_rank` is this rank's index among identical replicas (the dp rank under DDP, else 0);
    `plain_replica_rank` is its index among the ranks that hold plain (non-DTensor) parameters whole
    (the tp rank under tensor parallelism, where such parameters are replicated). Our own TP layers'
    shards (marked `_tp_shard_dim`) are the `plain_replica_rank`-th of `tp_size` slices.
    `sharded_as` maps names of plain local tensors that are really DTensor shards (TP under torch
    DDP) to a DTensor with the right placements."""
    ensure_optimizer_state(optimizer)
    out = []
    for name, p in named_params:
        name = name.removeprefix("module.")
        layout = (sharded_as or {}).get(name, p)
        state = optimizer.state[p]
        tensors = {"param": _local(p).detach().view(-1)}
        tensors.update({k: _local(state[k]).view(-1) for k in MOMENTS})
        index = _global_index(layout, plain_replica_rank, tp_size)
        out.append(Entry(name, full_shape(layout, tp_size), index, tensors,
                         _is_writer(layout, replica_rank, plain_replica_rank)))
    return out


def entries_for_fsdp(fsdp, optimizer: torch.optim.Optimizer, tp_dims: dict[str, int], tp_rank: int,
                     tp_size: int) -> list[Entry]:
    """Entries for our FSDP: each original parameter's slice of this rank's flat shard.

    A slice covers elements [offset, offset + n) of the parameter as FSDP saw it: the whole parameter,
    or under 2D the TP rank's shard along `tp_dims[name]`, whose positions in the full tensor are mapped
    through the same rule as `_global_index`. Replicated-over-TP parameters are written by tp rank 0."""
    ensure_optimizer_state(optimizer)
    params = fsdp.sharded_state_dict()
    moments = fsdp.sharded_optimizer_state(optimizer)
    out, seen = [], set()
    for name, piece in params.items():
        if id(piece.flat) in seen or name == "lm_head.weight":  # the tied weight once, as wte
            continue
        seen.add(id(piece.flat))
        shape = list(piece.shape)
        local = torch.arange(torch.Size(shape).numel(), dtype=torch.int64, device=piece.flat.device).view(shape)
        dim = tp_dims.get(name)
        if dim is not None:
            shape[dim] *= tp_size
            full = torch.arange(torch.Size(shape).numel(), dtype=torch.int64, device=piece.flat.device).view(shape)
            local = full.narrow(dim, tp_rank * piece.shape[dim], piece.shape[dim])
        n = piece.flat.numel()
        index = local.reshape(-1)[piece.offset:piece.offset + n]
        tensors = {"param": piece.flat.view(-1), **{k: moments[name][k].flat.view(-1) for k in MOMENTS}}
        out.append(Entry(name, tuple(shape), index, tensors, n > 0 and (dim is not None or tp_rank == 0)))
    return out
