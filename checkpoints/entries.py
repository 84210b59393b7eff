"""A layout-independent view of this rank's training state, for checkpoints and resharding (checkpoints/checkpoint.py
writes
and loads it; `entries` builds it from what the data-parallel wrapper answers, parallel/protocol.py's parts).

Whatever the layout, every element this rank stores of an original GPT parameter (and of its optimizer
state: AdamW's two moments, or under --optimizer muon a Block matrix's momentum) is described by an `Entry`:
the parameter's name and full shape, where those elements sit in the full tensor, and 1-D views of the live
storage that hold them. A checkpoint writes (name, positions, values) and a loader in any other layout fills
its own entries' views from them, so DDP x2 -> FSDP x2 -> TP x2 -> one process needs no conversion step.

Where the elements sit is kept compact, never as one index per element: per dim of the full tensor, the
positions along it that the rank holds (a `range`, or for a strided DTensor shard a small int64 tensor),
whose row-major product is the rank's block, and the span [lo, hi) of that block the rank holds (all of
it, except under our FSDP, whose flat shards cut parameters anywhere). `Entry.runs()` turns that into
(start, length) runs of flat positions on demand, in memory proportional to the number of runs: one for a
DDP/FSDP shard, one per row for a column-sharded TP weight. Everything is computed locally, with no
communication: a DTensor's positions along a dim come from distributing `arange(size of that dim)` with
the placements that act on that dim.

`write` marks one holder of each element: replicas (DDP ranks, TP-replicated parameters) write once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from parallel.comm import local
from parallel.marks import MOMENTS, ShardMark, data_replica, shard_dim, shards_of
from parallel.protocol import Buffers, FlatShards, Params

Axis = range | torch.Tensor  # positions along one dim of the full tensor, in local order


@dataclass
class Entry:
    name: str  # original GPT parameter name, e.g. "transformer.h.0.attn.c_q.weight"
    shape: tuple[int, ...]  # full, unsharded shape
    axes: tuple[Axis, ...]  # per dim: the positions along it of this rank's block (row-major)
    span: tuple[int, int]  # this rank holds elements [lo, hi) of its block, flattened
    tensors: dict[str, torch.Tensor]  # "param" and the optimizer's state (`state_kinds`): (n,) views of live storage
    write: bool  # this rank writes these elements (one writer per element)

    @property
    def numel(self) -> int:
        return self.span[1] - self.span[0]

    def runs(self) -> torch.Tensor:
        """int64 (k, 2): this rank's elements as maximal (start, length) runs of flat positions in the full
        tensor, in local order, made in memory of the order of the block's runs, not of its elements:
        trailing dims held whole fold into the run length, the next dim in gives its segments of consecutive
        positions, and each outer position repeats them; the span then trims the list."""
        lo, hi = self.span
        if hi <= lo:
            return torch.zeros((0, 2), dtype=torch.int64)
        strides = [1] * len(self.shape)  # row-major strides of the full tensor
        for d in range(len(self.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * self.shape[d + 1]
        j, inner = len(self.shape), 1
        while j > 0 and _is_whole(self.axes[j - 1], self.shape[j - 1]):
            j -= 1
            inner *= self.shape[j]
        if j == 0:
            starts, lengths = torch.tensor([0]), torch.tensor([inner])
        else:
            first, count = _segments(self.axes[j - 1])
            starts, lengths = first * strides[j - 1], count * inner
            for d in range(j - 2, -1, -1):  # outer dims: every position repeats the runs inside it
                outer = _as_tensor(self.axes[d]) * strides[d]
                starts = (outer[:, None] + starts[None, :]).reshape(-1)
                lengths = lengths.repeat(len(outer))
        ends = torch.cumsum(lengths, 0)  # in the block's row-major order
        begins = ends - lengths
        keep = (begins < hi) & (ends > lo)
        starts, begins, ends = starts[keep], begins[keep], ends[keep]
        starts = starts + (lo - begins).clamp(min=0)
        lengths = ends.clamp(max=hi) - begins.clamp(min=lo)
        return _merge(starts, lengths)


def _as_tensor(axis: Axis) -> torch.Tensor:
    if isinstance(axis, range):
        return torch.arange(axis.start, axis.stop, axis.step, dtype=torch.int64)
    return axis


def _is_whole(axis: Axis, size: int) -> bool:
    """The axis is every position of its dim, in order."""
    if isinstance(axis, range):
        return axis == range(size)
    return len(axis) == size and bool((axis == torch.arange(size)).all())


def _segments(axis: Axis) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, length) of the axis's runs of consecutive positions."""
    if isinstance(axis, range) and axis.step == 1:
        return torch.tensor([axis.start]), torch.tensor([len(axis)])
    a = _as_tensor(axis)
    breaks = torch.nonzero(a[1:] - a[:-1] != 1).flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), breaks, torch.tensor([len(a)])])
    return a[bounds[:-1]], bounds[1:] - bounds[:-1]


def _merge(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(k, 2) runs with each run that continues the previous one joined to it."""
    new = torch.ones(len(starts), dtype=torch.bool)
    new[1:] = starts[1:] != starts[:-1] + lengths[:-1]
    group = torch.cumsum(new, 0) - 1
    total = torch.zeros(int(new.sum()), dtype=torch.int64).index_add_(0, group, lengths)
    return torch.stack([starts[new], total], dim=1)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state as its first step would (zero moments, step 0) without changing any
    parameter, so a checkpoint can be loaded into it (an optimizer that says otherwise: its `ensure_state`)."""
    if hasattr(optimizer, "ensure_state"):
        return optimizer.ensure_state()
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # as torch's AdamW keeps it then
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                for k in MOMENTS:
                    state[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_kinds(optimizer: torch.optim.Optimizer, name: str) -> tuple[str, ...]:
    """The per-element optimizer state a checkpoint keeps of parameter `name`: AdamW's two moments, unless the
    optimizer says (optim/muon.MuonAdamW: Muon's momentum for a Block matrix)."""
    return optimizer.kinds(name) if hasattr(optimizer, "kinds") else MOMENTS


def element_state(
    optimizer: torch.optim.Optimizer, name: str, p: torch.Tensor, lo: int = 0, hi: int | None = None
) -> dict[str, torch.Tensor]:
    """{kind: 1-D view of the live state} of elements [lo, hi) of `p` flattened: AdamW's moments of p, unless the
    optimizer finds them itself (MuonAdamW: Muon's momentum, or the flat engine's views it steps)."""
    if hasattr(optimizer, "element_state"):
        return optimizer.element_state(name, p, lo, hi)
    return {k: local(optimizer.state[p][k]).view(-1)[lo:hi] for k in MOMENTS}


def full_shape(p: torch.Tensor, marks: tuple[ShardMark, ...] | None = None) -> tuple[int, ...]:
    """The unsharded shape: a DTensor knows it; our layers' slices are 1/size along each marked dim."""
    shape = list(p.shape)
    if not isinstance(p, DTensor):
        for m in shards_of(p) if marks is None else marks:
            shape[m.dim] *= m.size
    return tuple(shape)


def marked_axes(shape: tuple[int, ...], marks: tuple[ShardMark, ...]) -> tuple[list[Axis], tuple[int, ...]]:
    """(per dim of the full tensor, the positions of a local block of `shape`; the full shape) under `marks`."""
    axes: list[Axis] = [range(n) for n in shape]
    full = list(shape)
    for m in marks:  # rank r holds the r-th of `size` equal slices
        n = shape[m.dim]
        axes[m.dim] = range(m.rank * n, (m.rank + 1) * n)
        full[m.dim] *= m.size
    return axes, tuple(full)


def _axes(p: torch.Tensor) -> tuple[Axis, ...]:
    """Per dim of the full tensor, the positions along it of this rank's elements of p (local order)."""
    if not isinstance(p, DTensor):
        return tuple(marked_axes(tuple(p.shape), shards_of(p))[0])
    axes: list[Axis] = [range(n) for n in full_shape(p)]
    for d, axis in enumerate(axes):
        placements = [_on_dim(pl, d) for pl in p.placements]
        if any(not pl.is_replicate() for pl in placements):
            whole = torch.arange(len(axis), dtype=torch.int64, device=p.device)
            axes[d] = _compact(distribute_tensor(whole, p.device_mesh, placements, src_data_rank=None).to_local().cpu())
    return tuple(axes)


def _on_dim(placement, dim: int):
    """What `placement` does to dim `dim` of a tensor, as a placement of a 1-D tensor: the same split
    (Shard, or _StridedShard with its split factor) of dim 0 if it shards `dim`, else Replicate.
    Placements on different dims act independently, so each dim's positions can be found alone."""
    if getattr(placement, "dim", None) != dim:
        return Replicate()
    if hasattr(placement, "split_factor"):  # _StridedShard (FSDP2 over a TP-sharded dim)
        return type(placement)(0, split_factor=placement.split_factor)
    return Shard(0)


def _compact(positions: torch.Tensor) -> Axis:
    """A range when the positions are consecutive (every Shard placement), else the tensor itself."""
    if len(positions) == 0:
        return range(0)
    start = int(positions[0])
    if bool((positions == torch.arange(start, start + len(positions))).all()):
        return range(start, start + len(positions))
    return positions


def _is_writer(p: torch.Tensor, replica_rank: int, plain_replica_rank: int) -> bool:
    """One writer per element: replica 0 of the data-parallel copies, and coordinate 0 on every mesh
    dim a DTensor is replicated over; a plain tensor is written by replica 0 of those holding it."""
    if data_replica(p, replica_rank) != 0:
        return False
    if shard_dim(p, "tp") is not None and not isinstance(p, DTensor):
        return True  # our TP shard: each tp rank writes its own slice
    if isinstance(p, DTensor):
        coords = p.device_mesh.get_coordinate()
        if "tp" not in (p.device_mesh.mesh_dim_names or ()) and plain_replica_rank != 0:
            return False  # e.g. a LayerNorm under FSDP2 x TP: sharded over dp, replicated over tp
        return all(c == 0 for c, pl in zip(coords, p.placements) if pl.is_replicate())
    return plain_replica_rank == 0


def entries_for(
    named_params: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    replica_rank: int = 0,
    sharded_as: dict[str, DTensor] | None = None,
    plain_replica_rank: int = 0,
    owns=None,
) -> list[Entry]:
    """Entries for parameters that are whole tensors or DTensors, or our layers' marked slices (`mark_shard`: TP's,
    EP's), sitting where their marks say (the arguments: parallel/protocol.Params). Under torch's ZeRO-1 (`owns`)
    the owner writes a parameter with its moments, and a rank that does not own it loads its moments into a
    scratch buffer."""
    ensure_optimizer_state(optimizer)
    out = []
    for name, p in named_params:
        name = name.removeprefix("module.")
        layout = (sharded_as or {}).get(name, p)
        mine = owns is None or owns(p)
        tensors = {"param": local(p).detach().view(-1)}
        tensors.update(
            element_state(optimizer, name, p) if mine else {k: torch.zeros_like(local(p)).view(-1) for k in MOMENTS}
        )
        axes = _axes(layout)
        n = math.prod(len(a) for a in axes)
        if n != tensors["param"].numel():
            raise ValueError(f"{name}: {tensors['param'].numel()} local elements, but its layout says {n}")
        write = mine and _is_writer(layout, 0 if owns is not None else replica_rank, plain_replica_rank)
        out.append(Entry(name, full_shape(layout), axes, (0, n), tensors, write))
    return out


def buffer_entries(module: nn.Module, replica_rank: int = 0, plain_replica_rank: int = 0) -> list[Entry]:
    """Entries for the persistent buffers that are training state (parallel/protocol.Buffers), loaded by every
    rank. No moments."""
    out = []
    for name, b in module.named_buffers():
        short = name.rpartition(".")[2]
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if short in owner._non_persistent_buffers_set:
            continue
        out.append(
            Entry(
                name.replace("module.", ""),
                tuple(b.shape),
                tuple(range(n) for n in b.shape),
                (0, b.numel()),
                {"param": b.view(-1)},
                replica_rank == 0 and plain_replica_rank == 0,
            )
        )
    return out


def entries_for_fsdp(fsdp, optimizer: torch.optim.Optimizer, tp_rank: int, replica_rank: int = 0) -> list[Entry]:
    """Entries for our FSDP: each original parameter's slice of this rank's flat shard.

    A slice covers elements [offset, offset + n) of the parameter as FSDP saw it: the whole parameter, or
    another dimension's slice of it (`fsdp.shard_marks[name]`: TP's, EP's), whose positions in the full tensor
    are mapped through the same rule as `_axes`. Parameters replicated over TP are written by tp rank 0."""
    ensure_optimizer_state(optimizer)
    params = fsdp.sharded_state_dict()
    moments = {}  # name -> {kind: 1-D view}, of the same slices of the shards as `params`
    for unit, spec, piece, lo, hi in fsdp.layout.slices():
        state = (
            {k: unit.shard.new_empty(0) for k in state_kinds(optimizer, spec.names[0])}
            if piece is None
            else element_state(optimizer, spec.names[0], piece, lo, hi)
        )
        moments.update((name, state) for name in spec.names)
    out, seen = [], set()
    for name, piece in params.items():
        if id(piece.flat) in seen:  # the tied weight once, as wte (a pipeline stage's lm_head is a copy)
            continue
        seen.add(id(piece.flat))
        marks = fsdp.shard_marks.get(name, ())
        axes, shape = marked_axes(tuple(piece.shape), marks)
        tp_split = any(m.over == "tp" for m in marks)
        n = piece.flat.numel()
        tensors = {"param": piece.flat.view(-1), **moments[name]}
        out.append(
            Entry(
                name,
                shape,
                tuple(axes),
                (piece.offset, piece.offset + n),
                tensors,
                n > 0 and fsdp.replica_of(name, replica_rank) == 0 and (tp_split or tp_rank == 0),
            )
        )
    return out


BUILD = {Params: entries_for, Buffers: buffer_entries, FlatShards: entries_for_fsdp}


def entries(parallelized, optimizer: torch.optim.Optimizer) -> list[Entry]:
    """This rank's entries: those of each part its data-parallel wrapper answers (`parallelized.checkpoint_parts`:
    Parallelized's, or a protocol's), with the last stage's copy of the tied matrix (lm_head.weight) loaded as
    transformer.wte.weight, never written."""
    out = [e for part in parallelized.checkpoint_parts(optimizer) for e in BUILD[type(part)](*part)]
    for e in out:
        if e.name == "lm_head.weight":
            e.name, e.write = "transformer.wte.weight", False
    return out
