"""The flat-parameter unit of our sharding engine (parallel/data_parallel/fsdp.py): its layout and state-dict views,
the ZeRO ladder (what each stage keeps: `ZeroStage`) and the reduction of a unit's gradient into its shard
(`GradReduction`: reduce-scatter, and HSDP's all-reduce over the replicas).

What is sharded: a unit's parameters (one Block's, or the root's: wte = lm_head, wpe, ln_f) are concatenated
into one flat fp32 buffer, the matrices that get weight decay first, then biases and LayerNorm, then zero
padding up to a multiple of N. Each of the N ranks of the unit's shard group keeps only its slice
[rank*S, (rank+1)*S), S = padded / N: the master copy, which the optimizer steps on through plain views.
Each unit carries its shard group (its `group`, `rank`, `world`): the engine's data-parallel group, or for
parameters another dimension keeps on fewer ranks (EP's experts) those ranks' group (expert-data-parallel).

What is communicated here, and which way:
- `_FlatUnit.gather`: all-gather, over the unit's group, of every rank's slice into the unit's full `flat`
  buffer (compute dtype), which parallel/data_parallel/fsdp.py's hooks issue before each use (ZeRO-3) or once per step
  (ZeRO-1/2);
- `FlatLayout`: the sharded state dict and optimizer state are views of the slices (none; checkpoints read
  them, checkpoints/entries.py).

How parameters come and go. The GPT's nn.Parameters are removed from its modules; each name becomes a plain
attribute that is, while its unit is gathered, a view of the unit's `flat` leaf tensor (made by
`flat.split(sizes)`, so autograd sums all the unit's gradients into `flat.grad` in one SplitWithSizesBackward, with
no per-parameter copy), and otherwise a meta placeholder (no storage; using it raises). Freeing shrinks `flat`'s
storage to 0 bytes. Gathering regrows it and writes through `flat.data`, an alias with its own version counter, so
the views autograd saved in forward read the re-gathered values in backward without tripping the in-place check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import decays
from parallel import comm


class ShardPiece(NamedTuple):
    """This rank's part of one original parameter: `flat` holds elements [offset, offset + flat.numel()) of
    the parameter flattened in row-major order; `shape` is the parameter's full shape."""

    flat: torch.Tensor
    offset: int
    shape: torch.Size


@dataclass
class _ParamSpec:
    names: list[str]  # every name GPT knows it by, the init / state-dict name first
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs that show it
    shape: torch.Size
    offset: int  # where it starts inside the unit's flat buffer
    placeholder: torch.Tensor  # meta tensor the owners show between uses

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _held(spec: _ParamSpec, lo: int, S: int) -> tuple[int, int, int]:
    """(a, b, start): the shard [lo, lo + S) of the flat buffer holds elements [a, b) of the flattened
    parameter (a == b == 0 when none), at [start, start + b - a) of the shard."""
    a, b = max(spec.offset, lo), min(spec.offset + spec.numel, lo + S)
    return (a - spec.offset, b - spec.offset, a - lo) if b > a else (0, 0, 0)


class _FlatUnit:
    """One unit's parameters as a flat buffer of `padded` elements, 1/N of it stored per rank of `group`
    (N = `world`, this rank the `rank`-th; None: the default group, or one process).

    Each rank stores:
    - `shard`: its fp32 slice [rank*S, (rank+1)*S) of the flat buffer (S = padded / N), the master copy;
    - `pieces`: up to two nn.Parameters that are views of `shard` (the slice's weight-decay part and its
      no-decay part, padding excluded), which the optimizer steps on and whose `.grad` it reads;
    - `flat`: a leaf tensor of all `padded` elements in the compute dtype. With `keeps_full` (ZeRO-1/2) it
      stays allocated for the whole run and is only marked stale by an optimizer step (in fp32 the shard is
      a view of it, so the master copy costs nothing extra: params Ψ, not Ψ + Ψ/N); otherwise (ZeRO-3) its
      storage exists only while the unit is gathered. The original parameters are then views of it.
    """

    def __init__(
        self,
        name: str,
        specs: list[_ParamSpec],
        shard: torch.Tensor,
        world: int,
        rank: int,
        n_decay: int,
        compute_dtype: torch.dtype,
        keeps_full: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        self.name, self.specs = name, specs
        self.group, self.world, self.rank = group, world, rank
        self.numel = sum(s.numel for s in specs)
        self.padded = shard.numel() * world
        S, lo = shard.numel(), rank * shard.numel()
        self.keeps_full = keeps_full
        self.flat = torch.empty(self.padded, dtype=compute_dtype, device=shard.device, requires_grad=True)
        if keeps_full and compute_dtype == shard.dtype:  # in-place all-gather: the shard is a view of flat
            self.flat.data[lo : lo + S].copy_(shard)
            shard = self.flat.data[lo : lo + S]
        elif not keeps_full:
            self.flat.untyped_storage().resize_(0)
        self.shard = shard
        self.pieces: list[tuple[nn.Parameter, int, int]] = []  # (param, start, end) inside `shard`
        self.decay: list[bool] = []
        for start, end, decay in ((0, n_decay, True), (n_decay, self.numel, False)):
            a, b = max(start, lo) - lo, min(end, lo + S) - lo
            if b > a:
                self.pieces.append((nn.Parameter(shard[a:b]), a, b))
                self.decay.append(decay)
        padding = self.padded - self.numel
        self.split_sizes = [s.numel for s in specs] + ([padding] if padding else [])
        # "sharded" (no full copy; keeps_full: "stale", a full copy whose other ranks' slices are outdated)
        # -> "gathering" (all-gather issued) -> "gathered" -> back by reshard()
        self.state = "stale" if keeps_full else "sharded"
        self._work = None
        self._in_flight: tuple[torch.Tensor, ...] = ()  # all-gather input and output, alive until wait()
        self.acc_grad: torch.Tensor | None = None  # full gradient kept across micro-steps (ZeRO-1, no_sync)
        self.acc_stale = False  # ZeRO-1: acc_grad was reduced (its own slice is the shard gradient): overwrite

    def gather(self) -> None:
        """Allocate `flat` (unless kept) and start the all-gather of every rank's shard into it over the unit's
        group (async, in compute dtype; in place when the shard is a view of it)."""
        if self.state not in ("sharded", "stale"):
            return
        if not self.keeps_full:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        if self.padded == 0:  # a pipeline stage's empty root: nothing to gather
            self.state = "gathered"
            return
        src = self.shard if self.shard.dtype == self.flat.dtype else self.shard.to(self.flat.dtype)
        # Written through `.data`: a new alias with its own version counter, so autograd's saved views of
        # `flat` from forward stay valid when backward re-gathers into the same storage.
        out = self.flat.data
        self._in_flight = (src, out)
        self._work = comm.all_gather_into_tensor(out, src, self.group, async_op=True, unit=self.name)
        self.state = "gathering"

    def wait(self) -> None:
        if self.state == "gathering":
            if self._work is not None:
                self._work.wait()
            self._work, self._in_flight, self.state = None, (), "gathered"

    def show_full(self) -> None:
        """Point every original parameter attribute at its view of the gathered `flat` (autograd-tracked, also
        when shown from a backward hook, where grad mode is off: activation checkpointing's recomputation then
        runs on these views, and a view made without grad mode would take its gradient as a leaf of its own)."""
        with torch.enable_grad():
            for spec, view in zip(self.specs, self.flat.split(self.split_sizes)):
                view = view.view(spec.shape)
                for module, attr in spec.owners:
                    module.__dict__[attr] = view

    def reshard(self) -> None:
        """Attributes show meta placeholders again; `flat`'s storage shrinks to 0 (kept: stays, marked stale,
        and the next gather refreshes it in place)."""
        if self.state in ("sharded", "stale"):
            return
        self.wait()
        for spec in self.specs:
            for module, attr in spec.owners:
                module.__dict__[attr] = spec.placeholder
        if self.keeps_full:
            self.state = "stale"
            return
        self.flat.untyped_storage().resize_(0)
        self.state = "sharded"

    def release(self) -> None:
        """Done with the unit until its next use: ZeRO-3 frees it; a kept full copy stays gathered."""
        if not self.keeps_full:
            self.reshard()

    def mark_stale(self) -> None:
        """The optimizer updated the shards: a kept full copy is outdated, and the next gather refreshes it
        in place. (A unit that is not kept is gathered afresh for every use anyway.)"""
        if self.keeps_full:
            self.reshard()

    def add_grad(self, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced fp32 gradient slice (S elements) into the pieces' `.grad`."""
        for p, a, b in self.pieces:
            if p.grad is None:
                p.grad = shard_grad[a:b]
            else:
                p.grad.add_(shard_grad[a:b])


def unit_key(name: str, separate: dict[str, tuple[str, ...]] | None = None) -> str:
    """The unit parameter `name` belongs to: "transformer.h.<i>" (its Block), the `separate` unit whose module
    prefixes hold it (a pipeline stage's: parallel/data_parallel/fsdp_extensions.py), or "root" (the rest: wte =
    lm_head, wpe, ln_f)."""
    if name.startswith("transformer.h."):
        return ".".join(name.split(".")[:3])
    module = name.rpartition(".")[0]
    return next((unit for unit, prefixes in (separate or {}).items() if module in prefixes), "root")


def shard_numel(numel: int, world: int) -> int:
    """S, the elements of each rank's shard of a unit of `numel`: padded up to a multiple of N, so the last
    rank's shard ends in up to N - 1 zeros."""
    return -(-numel // world)


def flatten_unit(
    gpt: nn.Module,
    name: str,
    aliases: list[list[str]],
    world: int,
    rank: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    keeps_full: bool,
    group: dist.ProcessGroup | None = None,
) -> _FlatUnit:
    """Flatten and shard the (materialised) parameters named by `aliases`, one [init name, *tied names] list
    each, over `group` (`world` ranks, this one the `rank`-th): copy only this rank's slice into a new fp32
    shard (no full flat copy of the unit is ever made), then replace the parameters in their modules by meta
    placeholders."""
    values = {names[0]: gpt.get_parameter(names[0]) for names in aliases}
    mine = sorted(aliases, key=lambda names: not decays(names[0], values[names[0]]))  # stable: decayed ones first
    n_decay = sum(values[names[0]].numel() for names in mine if decays(names[0], values[names[0]]))

    specs, offset = [], 0
    for names in mine:
        shape = values[names[0]].shape
        owners = [(gpt.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
        specs.append(_ParamSpec(names, owners, shape, offset, torch.empty(shape, dtype=compute_dtype, device="meta")))
        offset += shape.numel()
    S = shard_numel(offset, world)
    shard = torch.zeros(S, dtype=torch.float32, device=device)
    for spec in specs:
        a, b, start = _held(spec, rank * S, S)
        shard[start : start + b - a].copy_(values[spec.names[0]].detach().reshape(-1)[a:b])
    values.clear()
    for spec in specs:
        for module, attr in spec.owners:
            module._parameters.pop(attr, None)
            module.__dict__[attr] = spec.placeholder
    return _FlatUnit(name, specs, shard, world, rank, n_decay, compute_dtype, keeps_full, group)


class FlatLayout:
    """Every unit of one model as this rank's shards, and the views that map them back to parameter names.

    `names` lists GPT.state_dict()'s names in order (the tied weight under both); every view is keyed by
    them. Sharded views are views of the live fp32 shards, with no communication: together the ranks of a
    unit's group tile each of its parameters exactly once. `group` (this rank its `rank`-th of `world`) is the
    layout's."""

    def __init__(
        self, units: list[_FlatUnit], group: dist.ProcessGroup | None, rank: int, world: int, names: list[str]
    ):
        self.units, self.group, self.rank, self.world, self.names = units, group, rank, world, names

    def held(self, unit: _FlatUnit, spec: _ParamSpec) -> tuple[int, int, int]:
        """(a, b, start): this rank's shard of `unit` holds elements [a, b) of `spec`, at shard[start:]."""
        return _held(spec, unit.rank * unit.shard.numel(), unit.shard.numel())

    def slices(self) -> Iterator[tuple[_FlatUnit, _ParamSpec, nn.Parameter | None, int, int]]:
        """(unit, spec, piece, lo, hi) for every original parameter: this rank holds its part as elements
        [lo, hi) of shard piece `piece` (a parameter's slice never straddles two pieces); piece None when
        this rank holds none of it."""
        for unit in self.units:
            for spec in unit.specs:
                a, b, start = self.held(unit, spec)
                found = None, 0, 0
                for p, pa, pb in unit.pieces:
                    if b > a and pa <= start and start + (b - a) <= pb:
                        found = p, start - pa, start - pa + (b - a)
                yield (unit, spec, *found)

    def sharded_state_dict(self) -> dict[str, ShardPiece]:
        """{original name: this rank's ShardPiece} for every name in GPT.state_dict() (pieces may be empty;
        the tied weight appears under both names). No communication."""
        out: dict[str, ShardPiece] = {}
        for unit in self.units:
            for spec in unit.specs:
                a, b, start = self.held(unit, spec)
                piece = ShardPiece(unit.shard[start : start + b - a], a, spec.shape)
                out.update((name, piece) for name in spec.names)
        return {name: out[name] for name in self.names}


# ----------------------------------------------------------------------------- ZeRO stages and the reduction


@dataclass(frozen=True)
class ZeroStage:
    """One rung of the ZeRO ladder, on the same units and 1/N shards: AdamW always steps on the shards, so
    its state is 1/N at every stage. What a stage decides is which full-size copies a rank keeps:

    - `keeps_params`: each unit's full parameters stay allocated for the whole run (in fp32 the shard is a
      view of them); an optimizer step marks them stale and the next forward all-gathers the updated
      shards into them in place: one all-gather of Ψ per step, and no resharding after forward. Otherwise
      (ZeRO-3) they are gathered before each use and freed after it.
    - `reduces_at_end`: each unit's full gradient is a buffer kept across the step's micro-steps and
      reduce-scattered once, when the last micro-step's backward ends (not overlapped), into the buffer's
      own slice. Otherwise each unit is reduce-scattered as soon as its gradient is complete (overlapped
      with backward) and the full gradient freed: one reduce-scatter of Ψ per micro-step.
    """

    stage: int
    keeps_params: bool
    reduces_at_end: bool


ZERO_LADDER = {
    1: ZeroStage(1, keeps_params=True, reduces_at_end=True),  # shards the optimizer state
    2: ZeroStage(2, keeps_params=True, reduces_at_end=False),  # + the gradients
    3: ZeroStage(3, keeps_params=False, reduces_at_end=False),
}  # + the parameters (FSDP)


class GradReduction:
    """A unit's full gradient (in `reduce_dtype`) -> this rank's fp32 shard gradient, async.

    Over the unit's shard group (`group`, S ranks, for the units on it; a unit of another dimension's copies,
    EP's experts, its own): a reduce-scatter (SUM) started by `start`; `finish` waits for every started one,
    then HSDP (`replicate_group`, R replicas of each shard) all-reduces (SUM) each reduced 1/S piece of a unit
    on `group` over the replicas, divides by S·R and adds it into the unit's shard `.grad`. Every unit is
    divided by that one total, S·R (the whole data-parallel group: an expert's gradient, summed over its
    copies, holds every rank's tokens that reached it). fp16 divides before the reduce-scatter instead (as DDP
    does), so the sum can't overflow where the mean would not; other dtypes divide after it, as FSDP2 does,
    which keeps fp32 runs bit-equal to it."""

    def __init__(
        self, group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None, reduce_dtype: torch.dtype
    ):
        self.group, self.replicate_group, self.reduce_dtype = group, replicate_group, reduce_dtype
        self.rank = comm.rank(group)
        self.replicas = comm.world(replicate_group) if replicate_group is not None else 1
        self.n = comm.world(group) * self.replicas
        self.predivide = reduce_dtype == torch.float16 and self.n > 1
        self.pending: list[tuple[_FlatUnit, object, torch.Tensor, torch.Tensor]] = []  # reduce-scatters
        self.reducing: list[tuple[_FlatUnit, object, torch.Tensor]] = []  # HSDP's replica all-reduces

    def start(self, unit: _FlatUnit, grad: torch.Tensor, in_place: bool = False) -> None:
        """Start the reduce-scatter of `grad` over the unit's shard group; `in_place`: into grad's own slice of
        this rank (ZeRO-1: the shard gradient lives in the full buffer)."""
        if self.predivide:
            grad.div_(self.n)
        S = unit.shard.numel()
        out = (
            grad[unit.rank * S : (unit.rank + 1) * S]
            if in_place
            else torch.empty(S, dtype=self.reduce_dtype, device=grad.device)
        )
        work = comm.reduce_scatter_tensor(out, grad, unit.group, async_op=True, unit=unit.name)
        self.pending.append((unit, work, out, grad))

    def finish(self, final: bool = True) -> None:
        """Wait for the started reduce-scatters. HSDP then starts each piece's all-reduce over the replicas,
        asynchronous as the reduce-scatter was: waited (and the piece added into `.grad`) at the next `finish`,
        when the next unit's reduce-scatter is started (`final=False`: one unit's all-reduce stays in flight
        behind the next unit's backward), or here when `final` (the end of backward)."""
        earlier, self.reducing = self.reducing, []
        for unit, work, out, _ in self.pending:
            if work is not None:
                work.wait()
            replicated = self.replicas > 1 and unit.group is self.group  # not a unit on its own group
            work = (
                comm.all_reduce(out, group=self.replicate_group, async_op=True, unit=unit.name) if replicated else None
            )
            self.reducing.append((unit, work, out))  # HSDP: the replicas of this shard sum their pieces
        self.pending.clear()
        self._add_reduced(earlier)  # after the new all-reduces are started: they overlap the wait
        if final:
            self._add_reduced(self.reducing)
            self.reducing = []

    def _add_reduced(self, reduced: list) -> None:
        for unit, work, out in reduced:
            if work is not None:
                work.wait()
            out = out.float()
            if self.n > 1 and not self.predivide:
                out.div_(self.n)
            unit.add_grad(out)


ZERO_STAGES = {"zero1": 1, "zero2": 2, "fsdp": 3}
