"""What a dimension records on a parameter it splits or copies, so that the global norm (the groups a parameter's
squares sum over), the sharding engine, the gradient reduction and the checkpoint entries (checkpoints/entries.py)
see it without knowing the dimension: `mark_shard` (TP's and EP's slices) and `mark_replicas` (an expert's copies).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state


class ShardMark(NamedTuple):
    """One split a dimension made of a parameter: this rank holds the `rank`-th of `size` equal slices along
    `dim`, and the others are held by the ranks of `group` (`over`: the mesh dim's name, "tp" or "ep")."""

    dim: int
    rank: int
    size: int
    group: object
    over: str


def mark_shard(p: torch.Tensor, dim: int, rank: int, size: int, group, over: str) -> None:
    """Record on `p` (this rank's slice) where it sits in the full parameter: what a dimension that splits a
    parameter does, so that checkpoints (`Entry` positions), the global norm (the groups its squares sum over)
    and the sharding engine see it without knowing the dimension."""
    p._shards = shards_of(p) + (ShardMark(dim, rank, size, group, over),)


def mark_replicas(p: torch.Tensor, group, rank: int) -> None:
    """Record on `p` that its copies are on the ranks of `group` (this rank the `rank`-th), not on all of the
    data-parallel wrapper's: its gradient is reduced over `group` and copy 0 writes it to checkpoints (an
    expert's copies, under expert parallelism)."""
    p._replica_group, p._replica = group, rank


def shards_of(p: torch.Tensor) -> tuple[ShardMark, ...]:
    """The splits `mark_shard` recorded on p (none for a whole parameter)."""
    return getattr(p, "_shards", ())


def shard_dim(p: torch.Tensor, over: str) -> int | None:
    """The dim `over` (a mesh dim's name) split p along, or None."""
    return next((m.dim for m in shards_of(p) if m.over == over), None)


def data_replica(p: torch.Tensor, replica_rank: int) -> int:
    """p's index among its data-parallel copies: `replica_rank` (the wrapper's), unless a dimension keeps p on
    fewer ranks (EP: an expert is copied over the expert-data-parallel group, `p._replica`)."""
    return getattr(p, "_replica", replica_rank)
