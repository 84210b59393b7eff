"""Every collective our own wrappers issue goes through here, so the bytes they move can be counted.

The counter records payload bytes per kind, per call:
- all_reduce: the tensor's bytes;
- all_gather: the bytes of the gathered (full) output;
- reduce_scatter: the bytes of the (full) input;
- broadcast: the tensor's bytes;
- p2p: the bytes of each tensor sent point-to-point (`send`; `recv` adds nothing, so summed over ranks
  every message counts once).
Each wrapper's theory is written in these sizes, beside its code: `ddp_comm_bytes_per_step` (parallel/ddp.py),
the FSDP formula in parallel/fsdp.py (2 all-gathers of each Block and 1 of the root, and 1 reduce-scatter
of everything, per micro-step), `tp_comm_bytes_per_micro_step` (parallel/tensor_parallel.py). Backend
overheads (ring 2(N-1)/N factors, gloo emulating reduce-scatter through all-reduce) are deliberately not
counted: they are properties of the transport, not of the algorithm.

Averages are computed as SUM followed by a division by the group size, which every backend supports
(gloo has no ReduceOp.AVG in older torch versions, and some backends none for integer tensors).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


class CommCounter:
    """Payload bytes per collective kind since the last `reset()`."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.bytes = defaultdict(int)

    def snapshot(self) -> dict[str, int]:
        """{kind: bytes} for all_reduce, all_gather and reduce_scatter (and broadcast, p2p if any)."""
        out = {k: int(self.bytes.get(k, 0)) for k in KINDS[:3]}
        for k in KINDS[3:]:
            if self.bytes.get(k):
                out[k] = int(self.bytes[k])
        return out


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the old names.
# Looked up on torch.distributed at each call (so a test can record what torch receives).
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

COUNTER = CommCounter()  # one per process: every wrapper's traffic adds up in the same place


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def world(group: dist.ProcessGroup | None) -> int:
    """Size of `group`; 1 when torch.distributed is not initialised (single process)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within `group`; 0 when the group has one rank (or there is no process group)."""
    return dist.get_rank(group) if world(group) > 1 else 0


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: str = "sum",
               async_op: bool = False):
    """In-place all-reduce of `tensor` over `group`. op: "sum", "avg" (sum then divide), or "max".

    With async_op the division for "avg" is left to the caller, after wait().
    """
    if world(group) == 1:
        return None
    COUNTER.add("all_reduce", _nbytes(tensor))
    red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    work = dist.all_reduce(tensor, op=red, group=group, async_op=async_op)
    if op == "avg" and not async_op:
        tensor.div_(world(group))
    return work


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None,
                           async_op: bool = False):
    """Gather every rank's equal-sized `shard` into `output` (rank order, along dim 0)."""
    if world(group) == 1:
        output.copy_(shard.view_as(output))
        return None
    COUNTER.add("all_gather", _nbytes(output))
    return getattr(dist, ALL_GATHER)(output, shard, group=group, async_op=async_op)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def reduce_scatter_tensor(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None,
                          async_op: bool = False):
    """Sum `full` over ranks and leave this rank's 1/N slice (along dim 0) in `output`."""
    if world(group) == 1:
        output.copy_(full.view_as(output))
        return None
    COUNTER.add("reduce_scatter", _nbytes(full))
    return getattr(dist, REDUCE_SCATTER)(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (no communication), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t`: a DTensor is all-gathered over its mesh (collective), a plain tensor is itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `tensor` with global rank `src`'s copy."""
    if world(group) == 1:
        return
    COUNTER.add("broadcast", _nbytes(tensor))
    dist.broadcast(tensor, src=src, group=group)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Post a non-blocking send of `tensor` to `dst` (a rank of `group`); returns the work handle to wait.

    Plain isend, not batch_isend_irecv (which can hang on gloo). gloo matches the k-th send from a to b
    with the k-th receive on b from a, so both sides must post a pair's messages in the same order."""
    COUNTER.add("p2p", _nbytes(tensor))
    return dist.isend(tensor, dst=_global(dst, group), group=group)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Post a non-blocking receive into `tensor` from `src` (a rank of `group`); returns the work handle.
    Not counted: the sender counts the message."""
    return dist.irecv(tensor, src=_global(src, group), group=group)


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
