"""Our sharding engine: ZeRO stages 1, 2 and 3 (FSDP) and HSDP over a data-parallel group, one flat
parameter per unit (Rajbhandari et al. 2020). The module text describes ZeRO-3; `FullyShardedDataParallel`'s
docstring says what stages 1 and 2 and HSDP change.

Units are the transformer Blocks, plus the root: wte, wpe, ln_f and lm_head, whose tied weight is stored
once. A unit's parameters are concatenated into one flat fp32 buffer (the matrices that get weight decay
first, then biases and LayerNorm, then zero padding up to a multiple of N); each rank keeps only its 1/N
slice. Per micro-step, over the data-parallel group of N ranks:

    forward:   all-gather each Block before it runs, free it after it ran (root: gathered for the whole step)
    backward:  all-gather each Block again before its backward, reduce-scatter (SUM, then / N) its gradient
               after it, free the gathered parameters and gradient

so a micro-step moves 2 all-gathers and 1 reduce-scatter of the Block bytes, and 1 of each for the root
(FSDP2 also keeps the root gathered from forward to backward: freeing it would be undone at once).

How parameters come and go. The GPT's nn.Parameters are removed from its modules; each name becomes a
plain attribute that is, while its unit is gathered, a view of the unit's `flat` leaf tensor (made by
`flat.split(sizes)`, so autograd sums all the unit's gradients into `flat.grad` in one
SplitWithSizesBackward, with no per-parameter copy), and otherwise a meta placeholder (no storage; using it
raises). Freeing shrinks `flat`'s storage to 0 bytes. Gathering regrows it and writes through `flat.data`,
an alias with its own version counter, so the views autograd saved in forward read the re-gathered values
in backward without tripping the in-place check. Hooks: forward pre/post hooks on each Block; a tensor
hook on each Block's output (runs before that Block's backward); a post-accumulate-grad hook on each
`flat` (runs once all the unit's gradients are in); an autograd-engine callback at the end of backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from model import GPT, materialize_module
from parallel import comm
from parallel.ddp import GradSyncSwitch
from parallel.grads import clip_grad_norm_
from parallel.mesh import pick_device
from parallel.state import MOMENTS  # AdamW's per-element state


class ShardPiece(NamedTuple):
    """This rank's part of one original parameter: `flat` holds elements [offset, offset + flat.numel()) of
    the parameter flattened in row-major order; `shape` is the parameter's full shape."""
    flat: torch.Tensor
    offset: int
    shape: torch.Size


@dataclass
class _ParamSpec:
    names: list[str]                     # every name GPT knows it by, the init / state-dict name first
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs that show it
    shape: torch.Size
    offset: int                          # where it starts inside the unit's flat buffer
    placeholder: torch.Tensor            # meta tensor the owners show between uses

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _held(spec: _ParamSpec, lo: int, S: int) -> tuple[int, int, int]:
    """(a, b, start): the shard [lo, lo + S) of the flat buffer holds elements [a, b) of the flattened
    parameter (a == b == 0 when none), at [start, start + b - a) of the shard."""
    a, b = max(spec.offset, lo), min(spec.offset + spec.numel, lo + S)
    return (a - spec.offset, b - spec.offset, a - lo) if b > a else (0, 0, 0)


class _FlatUnit:
    """One unit's parameters as a flat buffer of `padded` elements, 1/N of it stored per rank.

    Each rank stores:
    - `shard`: its fp32 slice [rank*S, (rank+1)*S) of the flat buffer (S = padded / N), the master copy;
    - `pieces`: up to two nn.Parameters that are views of `shard` (the slice's weight-decay part and its
      no-decay part, padding excluded), which the optimizer steps on and whose `.grad` it reads;
    - `flat`: a leaf tensor of all `padded` elements in the compute dtype. Its storage is allocated only
      while the unit is gathered; the original parameters are then views of it, so autograd sums their
      gradients into `flat.grad` through a single SplitWithSizesBackward.
    """

    def __init__(self, name: str, specs: list[_ParamSpec], shard: torch.Tensor, world: int, rank: int,
                 n_decay: int, compute_dtype: torch.dtype, persistent: bool = False):
        self.name, self.specs = name, specs
        self.numel = sum(s.numel for s in specs)
        self.padded = shard.numel() * world
        S, lo = shard.numel(), rank * shard.numel()
        # ZeRO-1/2 (`persistent`): the full copy stays allocated for the whole run and is only marked stale
        # by an optimizer step. In fp32 the shard is a view of it (in-place all-gather), so the master copy
        # costs nothing extra: params Ψ, not Ψ + Ψ/N.
        self.persistent = persistent
        self.flat = torch.empty(self.padded, dtype=compute_dtype, device=shard.device, requires_grad=True)
        if persistent and compute_dtype == shard.dtype:
            self.flat.data[lo:lo + S].copy_(shard)
            shard = self.flat.data[lo:lo + S]
        elif not persistent:
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
        # "sharded" (no full copy; ZeRO-1/2: "stale", a full copy whose other ranks' slices are outdated)
        # -> "gathering" (all-gather issued) -> "gathered" -> back by reshard()
        self.state = "stale" if persistent else "sharded"
        self._work = None
        self._in_flight: tuple[torch.Tensor, ...] = ()  # all-gather input and output, alive until wait()
        self.acc_grad: torch.Tensor | None = None  # full gradient kept across micro-steps under no_sync()
        self.acc_stale = False  # ZeRO-1: acc_grad was reduced (its own slice is the shard gradient): overwrite

    def gather(self, group: dist.ProcessGroup | None) -> None:
        """Allocate `flat` (unless persistent) and start the all-gather of every rank's shard into it (async,
        in compute dtype; in place when the shard is a view of it)."""
        if self.state not in ("sharded", "stale"):
            return
        if not self.persistent:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        if self.padded == 0:  # a pipeline stage's empty root: nothing to gather
            self.state = "gathered"
            return
        src = self.shard if self.shard.dtype == self.flat.dtype else self.shard.to(self.flat.dtype)
        # Written through `.data`: a new alias with its own version counter, so autograd's saved views of
        # `flat` from forward stay valid when backward re-gathers into the same storage.
        out = self.flat.data
        self._in_flight = (src, out)
        self._work = comm.all_gather_into_tensor(out, src, group, async_op=True)
        self.state = "gathering"

    def wait(self) -> None:
        if self.state == "gathering":
            if self._work is not None:
                self._work.wait()
            self._work, self._in_flight, self.state = None, (), "gathered"

    def show_full(self) -> None:
        """Point every original parameter attribute at its view of the gathered `flat` (autograd-tracked)."""
        for spec, view in zip(self.specs, self.flat.split(self.split_sizes)):
            view = view.view(spec.shape)
            for module, attr in spec.owners:
                module.__dict__[attr] = view

    def reshard(self) -> None:
        """Free the gathered parameters: attributes show meta placeholders, `flat`'s storage shrinks to 0
        (persistent: stays, marked stale: the next gather refreshes it in place)."""
        if self.state in ("sharded", "stale"):
            return
        self.wait()
        for spec in self.specs:
            for module, attr in spec.owners:
                module.__dict__[attr] = spec.placeholder
        if self.persistent:
            self.state = "stale"
            return
        self.flat.untyped_storage().resize_(0)
        self.state = "sharded"

    def add_grad(self, shard_grad: torch.Tensor) -> None:
        """Accumulate a reduced fp32 gradient slice (S elements) into the pieces' `.grad`."""
        for p, a, b in self.pieces:
            if p.grad is None:
                p.grad = shard_grad[a:b]
            else:
                p.grad.add_(shard_grad[a:b])


class FullyShardedDataParallel(GradSyncSwitch, nn.Module):
    """ZeRO-3 data parallelism for GPT with flat parameters, one per unit (each Block, and the root).

    What each rank stores: 1/N of every unit's parameters (fp32 `shard`), their gradients, and hence 1/N of
    AdamW's state; the optimizer steps on plain views of the shards (`param_groups`). Between uses the
    GPT's original parameter attributes are meta placeholders: no storage, and a loud error if used.

    What is communicated, when and in which direction (per micro-step; N = size of `process_group`):
    - forward: each Block's flat shard is all-gathered (in `param_dtype`) in its forward pre-hook and, with
      `reshard_after_forward`, freed in its forward hook; with `prefetch`, the next Block's all-gather is
      issued before the current one runs. The root is gathered at the start of forward and kept until its
      gradient is reduced (it is used at both ends of forward and first in backward).
    - backward: a hook on each Block's output re-gathers that Block before its backward (and prefetches
      the previous Block's); a hook on the unit's flat leaf fires once all its gradients are summed and
      issues an async reduce-scatter (SUM in `reduce_dtype`, then / N; for fp16 / N first, so the sum can't
      overflow where the mean would not; accumulated in fp32 into the shard `.grad`). A callback queued on the autograd engine waits for the last reduce-scatters.
    - `clip_grad_norm_`: one all-reduce of a scalar (uncounted). State dicts: one all-gather (or broadcast) per unit.

    Gradient accumulation. By default every micro-step's backward reduce-scatters, so memory stays 1/N
    (gradients included) at the cost of one reduce-scatter of the model per micro-step. Under `no_sync()`
    each rank instead keeps the full unsharded gradient (in `reduce_dtype`) across micro-steps and the
    first backward outside the context reduce-scatters the sum: k-1 fewer reduce-scatters for k micro-steps,
    but a full-size gradient per rank, which undoes ZeRO's gradient saving. The default is the former.

    Mixed precision: `param_dtype` (None = fp32) is the dtype of the gathered compute copies, `reduce_dtype`
    that of the reduce-scatter; the master shard, its gradient and the optimizer state stay fp32.

    A GPT built on `meta` is materialised one unit at a time from `deferred_init_seed` on `device`
    (default: `pick_device()`): init a unit, keep this rank's shard, drop the unit, so peak init memory is the
    shards plus one unit, and the weights equal eager `init_weights(seed)` bit for bit (an eager GPT given a
    seed is re-initialised the same way). The wrapped GPT owns no parameters any more (`module.parameters()`
    is empty): use `num_params()` and the state-dict methods here.

    `events` lists (what, unit, phase) for the last micro-step: all-gathers and reduce-scatters as they are
    issued, and each Block's forward/backward start and end, so tests can check the prefetch order.

    The ZeRO ladder (`zero_stage`), on the same units and shards; AdamW always steps on the 1/N shards:
    - 3 (FSDP, the default): as above.
    - 2: every rank keeps the full parameters (the shard is a view of them in fp32), gathered once per step:
      `after_optimizer_step()` marks them stale and the next forward all-gathers the updated shards in place.
      Gradients as in 3: each unit's reduce-scattered as soon as it is complete, the full gradient freed.
    - 1: parameters as in 2; each unit's full gradient is kept (a persistent buffer) and accumulated over
      the step's micro-steps; the last micro-step's backward ends with one reduce-scatter of every unit
      (not overlapped). Per step: reduce-scatter Ψ + all-gather Ψ, as 2, but a full gradient per rank.
    HSDP (`replicate_group`): the sharding above within `process_group` (S ranks), and the R replicas of
    each shard kept equal: every reduce-scattered gradient shard is all-reduced (SUM) over
    `replicate_group` before the division by S·R. Parameters are gathered within the shard group only.
    """

    def __init__(self, module: GPT, process_group: dist.ProcessGroup | None = None,
                 reshard_after_forward: bool = True, prefetch: bool = True,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 deferred_init_seed: int | None = None, device: torch.device | str | None = None,
                 zero_stage: int = 3, replicate_group: dist.ProcessGroup | None = None):
        super().__init__()
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        self.module = module
        self.group = process_group
        self.world = comm.world(process_group)
        self.rank = dist.get_rank(process_group) if self.world > 1 else 0
        self.zero_stage, self.persistent = zero_stage, zero_stage < 3
        self.replicate_group = replicate_group
        self.replicas = comm.world(replicate_group) if replicate_group is not None else 1
        self.reshard_after_forward = reshard_after_forward and not self.persistent
        self.prefetch = prefetch
        self.param_dtype = param_dtype or torch.float32
        self.reduce_dtype = reduce_dtype
        # fp16 sums of N gradients can overflow where their mean would not: divide before the reduce-scatter
        # (as DDP does). Other dtypes divide after it, as FSDP2 does, which keeps fp32 runs bit-equal to it.
        self._predivide = reduce_dtype == torch.float16 and self.world * self.replicas > 1
        self.events: list[tuple[str, str, str]] = []  # (what, unit, phase) since the last forward began
        self._backward_started = False
        self._pending: list[tuple[_FlatUnit, object, torch.Tensor, torch.Tensor]] = []

        is_meta = any(p.is_meta for p in module.parameters())
        if is_meta and deferred_init_seed is None:
            raise ValueError("the model is on the meta device: pass deferred_init_seed to materialise it")
        device = torch.device(device) if device is not None else (
            pick_device("auto") if is_meta else next(module.parameters()).device)
        self._state_dict_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        # our TP shards (FSDP over TP): name -> the dim TP split, for the norm groups and checkpoints
        self.tp_shard_dims = {n: p._tp_shard_dim for n, p in module.named_parameters() if hasattr(p, "_tp_shard_dim")}
        aliases: dict[int, list[str]] = {}  # one entry per parameter object: [init name, *tied names]
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._aliases = list(aliases.values())
        h = module.transformer.h  # a GPT's ModuleList, or a pipeline stage's ModuleDict keyed by global index
        blocks = list(h.items()) if isinstance(h, nn.ModuleDict) else list(enumerate(h))
        self._position = {int(i): pos for pos, (i, _) in enumerate(blocks, start=1)}  # global Block -> unit
        self._global = [None] + [int(i) for i, _ in blocks]
        self._n_blocks = len(blocks)
        # A pipeline's first and last stages each hold the tied matrix (wte; lm_head's copy of it): it gets a
        # unit of its own, last, so both stages shard it alike and can sum its shard gradients elementwise.
        self._tied_unit = getattr(module, "pp", 1) > 1 and (module.first or module.last)
        n_units = 1 + len(blocks) + self._tied_unit
        self.units = [self._build_unit(i, deferred_init_seed, device) for i in range(n_units)]
        self.roots = [self.units[0]] + ([self.units[-1]] if self._tied_unit else [])  # gathered per forward
        self.flat_params = nn.ParameterList([p for u in self.units for p, _, _ in u.pieces])
        self._pipelined = False  # run_chunk: chunks of a pipeline stage, not one GPT forward

        for i, (_, block) in enumerate(blocks, start=1):
            block.register_forward_pre_hook(partial(self._pre_forward, i))
            block.register_forward_hook(partial(self._post_forward, i))
        for unit in self.units:
            unit.flat.register_post_accumulate_grad_hook(partial(self._post_backward, unit))

    # ------------------------------------------------------------------------------------------ setup

    def _unit_index(self, name: str) -> int:
        """0 for the root, the unit of Block i for transformer.h.i (i + 1 in a whole GPT), the last for a
        pipeline stage's tied matrix."""
        if name.startswith("transformer.h."):
            return self._position[int(name.split(".")[2])]
        if self._tied_unit and name.rpartition(".")[0] in ("transformer.wte", "lm_head"):
            return self._n_blocks + 1
        return 0

    def tied_pieces(self) -> list[nn.Parameter]:
        """This rank's shard pieces of a pipeline stage's tied matrix (empty without one). The first and the
        last stage shard it alike, so the dp rank d of each holds the same elements."""
        return [p for p, _, _ in self.units[-1].pieces] if self._tied_unit else []

    def _adjacent(self, i: int, j: int) -> bool:
        """Units i and j are neighbouring Blocks of the model (worth a prefetch): not across a pipeline
        stage's chunks, whose Blocks run at other times."""
        return 1 <= j <= self._n_blocks and abs(self._global[i] - self._global[j]) == 1

    def _build_unit(self, index: int, seed: int | None, device: torch.device) -> _FlatUnit:
        """Materialise (if asked), flatten and shard one unit, then drop its full parameters."""
        gpt = self.module
        if seed is not None:
            for prefix, sub in gpt.init_units():
                if self._unit_index(prefix + ".") == index:
                    materialize_module(sub, prefix, gpt.config, seed, device)
        mine = [names for names in self._aliases if self._unit_index(names[0]) == index]
        values = {names[0]: gpt.get_parameter(names[0]) for names in mine}  # the materialised ones
        mine.sort(key=lambda names: values[names[0]].dim() < 2)  # stable: weight-decay matrices first
        n_decay = sum(values[names[0]].numel() for names in mine if values[names[0]].dim() >= 2)

        specs, offset = [], 0
        for names in mine:
            shape = values[names[0]].shape
            owners = [(gpt.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
            specs.append(_ParamSpec(names, owners, shape, offset,
                                    torch.empty(shape, dtype=self.param_dtype, device="meta")))
            offset += shape.numel()
        S = -(-offset // self.world)  # padding: the last rank's shard ends in up to N - 1 zeros
        shard = torch.zeros(S, dtype=torch.float32, device=device)
        for spec in specs:  # copy only this rank's slice: no full flat copy of the unit is ever made
            a, b, start = _held(spec, self.rank * S, S)
            shard[start:start + b - a].copy_(values[spec.names[0]].detach().reshape(-1)[a:b])
        del values
        for spec in specs:
            for module, attr in spec.owners:
                module._parameters.pop(attr, None)
                module.__dict__[attr] = spec.placeholder
        name = "root" if index == 0 else "tied" if index > self._n_blocks else f"transformer.h.{self._global[index]}"
        return _FlatUnit(name, specs, shard, self.world, self.rank, n_decay, self.param_dtype, self.persistent)

    # ------------------------------------------------------------------------------ forward / backward

    def _gather(self, unit: _FlatUnit, phase: str) -> None:
        if unit.state in ("sharded", "stale"):
            self.events.append(("all_gather", unit.name, phase))
            unit.gather(self.group)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """GPT's forward: (logits, loss). Gathers the root (and prefetches the first Block) first."""
        return self._run(self.module, (idx, targets), prefetch_first=True)

    def run_chunk(self, chunk: int, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """A pipeline stage's `forward_chunk` under this FSDP: the root gathered around it, each Block by
        its hooks. Per micro-batch and chunk, as GPT's forward is per micro-step: units are re-gathered for
        every chunk forward and backward, and reduce-scattered after every backward, so between steps (and
        between micro-batches) each rank holds 1/N. Prefetch stays inside a chunk."""
        self._pipelined = True
        return self._run(self.module.forward_chunk, (chunk, x, targets), prefetch_first=False)

    def _run(self, fn, args: tuple, prefetch_first: bool):
        self.events.clear()
        for root in self.roots:
            if not self.persistent:
                root.reshard()  # a copy left by a forward without backward may predate an optimizer step
            self._gather(root, "forward")
        if prefetch_first and self.prefetch and self._n_blocks:
            self._gather(self.units[1], "forward")
        for root in self.roots:
            root.wait()
            root.show_full()
        out = fn(*args)
        outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None and t.requires_grad]
        for t in outputs:
            t.register_hook(self._root_pre_backward)
        if not outputs and not self.persistent:
            for root in self.roots:
                root.reshard()
        return out

    def _pre_forward(self, i: int, module: nn.Module, args) -> None:
        unit = self.units[i]
        self.events.append(("forward_start", unit.name, "forward"))
        self._gather(unit, "forward")
        if self.prefetch and self._adjacent(i, i + 1):
            self._gather(self.units[i + 1], "forward")
        unit.wait()
        unit.show_full()

    def _post_forward(self, i: int, module: nn.Module, args, output: torch.Tensor) -> None:
        unit = self.units[i]
        self.events.append(("forward_end", unit.name, "forward"))
        needs_backward = torch.is_grad_enabled() and output.requires_grad
        if not self.persistent and (self.reshard_after_forward or not needs_backward):
            unit.reshard()
        if needs_backward:
            output.register_hook(partial(self._pre_backward, i))

    def _start_backward(self) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _root_pre_backward(self, grad: torch.Tensor) -> None:
        if self._backward_started:
            return
        self._start_backward()
        for root in self.roots:
            self._gather(root, "backward")  # only if a later forward freed it
        if self.prefetch and self._n_blocks and not self._pipelined:
            self._gather(self.units[self._n_blocks], "backward")
        for root in self.roots:
            root.wait()

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        unit = self.units[i]
        self._start_backward()
        self.events.append(("backward_start", unit.name, "backward"))
        self._gather(unit, "backward")
        if self.prefetch and self._adjacent(i, i - 1):
            self._gather(self.units[i - 1], "backward")
        unit.wait()
        unit.show_full()  # activation checkpointing recomputes the Block's forward from its attributes

    def _post_backward(self, unit: _FlatUnit, flat: torch.Tensor) -> None:
        """All of the unit's gradients are in `flat.grad`: free the unit and reduce-scatter the gradient."""
        self.events.append(("backward_end", unit.name, "backward"))
        if not self.persistent:
            unit.reshard()
        grad, flat.grad = flat.grad.to(self.reduce_dtype), None
        if unit.acc_grad is not None:
            grad = unit.acc_grad.copy_(grad) if unit.acc_stale else unit.acc_grad.add_(grad)
            unit.acc_grad, unit.acc_stale = None, False
        if not self.require_backward_grad_sync or self.zero_stage == 1:  # ZeRO-1: reduced at the end
            unit.acc_grad = grad
            return
        self._finish_reduce_scatters()  # at most one in flight: full gradients are not kept around
        self._reduce_scatter(unit, grad)

    def _reduce_scatter(self, unit: _FlatUnit, grad: torch.Tensor, in_place: bool = False) -> None:
        """Start the reduce-scatter of a unit's full gradient `grad` (in reduce_dtype) over the shard group;
        `in_place`: into grad's own slice of this rank (ZeRO-1: the shard gradient lives in the full buffer)."""
        if self._predivide:
            grad.div_(self.world * self.replicas)
        S = unit.shard.numel()
        out = grad[self.rank * S:(self.rank + 1) * S] if in_place else \
            torch.empty(S, dtype=self.reduce_dtype, device=grad.device)
        self.events.append(("reduce_scatter", unit.name, "backward"))
        work = comm.reduce_scatter_tensor(out, grad, self.group, async_op=True)
        self._pending.append((unit, work, out, grad))

    def _finish_reduce_scatters(self) -> None:
        for unit, work, out, _ in self._pending:
            if work is not None:
                work.wait()
            if self.replicas > 1:  # HSDP: the replicas of this shard sum their reduce-scattered pieces
                comm.all_reduce(out, group=self.replicate_group)
            out = out.float()
            n = self.world * self.replicas
            if n > 1 and not self._predivide:
                out.div_(n)
            unit.add_grad(out)
        self._pending.clear()

    def _end_backward(self) -> None:
        """Queued on the autograd engine by the first pre-backward hook; runs after the whole backward."""
        if self.zero_stage == 1 and self.require_backward_grad_sync:
            self.reduce_accumulated()
        self._finish_reduce_scatters()
        if not self.persistent:
            for unit in self.units:
                unit.reshard()
        self._backward_started = False

    def reduce_accumulated(self) -> None:
        """Reduce-scatter every unit's accumulated full gradient (ZeRO-1 at the end of a step's backward,
        and the first syncing backward after `no_sync`), one unit in flight at a time. ZeRO-1 keeps its
        full-gradient buffers for the next step (the first accumulation overwrites them), reduce-scatters
        into each buffer's own slice, which then is the shard gradient (no separate Ψ/N), and with every
        buffer in memory anyway issues all reduce-scatters before waiting for any."""
        zero1 = self.zero_stage == 1
        for unit in self.units:
            if unit.acc_grad is None:
                continue
            if not zero1:
                self._finish_reduce_scatters()
            self._reduce_scatter(unit, unit.acc_grad, in_place=zero1 and self.reduce_dtype == torch.float32)
            if zero1:
                unit.acc_stale = True
            else:
                unit.acc_grad = None
        self._finish_reduce_scatters()

    @contextlib.contextmanager
    def reduce_on_exit(self):
        """For backward passes that run outside a syncing micro-step (a pipeline's chunks): inside, gradients
        accumulate unreduced (ZeRO-1's full buffers); on a normal exit they are reduce-scattered once."""
        with self.no_sync():
            yield
        self.reduce_accumulated()

    def after_optimizer_step(self) -> None:
        """ZeRO-1/2: the optimizer has updated this rank's shards, so every full copy is stale; the next
        forward all-gathers the updated shards into it (in place). ZeRO-3: nothing (gathered per use)."""
        if self.persistent:
            for unit in self.units:
                unit.reshard()

    # ---------------------------------------------------------------------------- optimizer helpers

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over the shard views: decay on pieces of parameters with >= 2 dims, none on the rest."""
        pieces = [(p, d) for u in self.units for (p, _, _), d in zip(u.pieces, u.decay)]
        return [{"params": [p for p, d in pieces if d], "weight_decay": weight_decay},
                {"params": [p for p, d in pieces if not d], "weight_decay": 0.0}]

    def grad_norm_items(self, groups: dict[str, tuple] | None = None) -> list[tuple]:
        """This rank's shard gradients as items for parallel.grads.clip_grad_norm_.

        Every element is sharded over this FSDP's group; `groups` ({original name: more groups}, e.g. TP's;
        names not in it have none) adds the groups a parameter is also sharded over; None marks a copy counted
        elsewhere (a pipeline's lm_head copy of wte: scaled, not measured). Without extra groups each flat piece is one item
        (param, (group,)); with them, each original parameter's slice is (piece, groups, lo, hi). The list
        starts with one empty item per pattern, the same on every rank, so every rank issues the same
        reductions even where it holds no slice of some parameter."""
        groups = {n: g for n, g in (groups or {}).items() if g != ()}
        if not groups:
            return [(p, (self.group,)) for p in self.flat_params]
        patterns = [(), *(g for g in groups.values() if g is not None)]
        items = [(torch.empty(0), (self.group,) + g) for g in dict.fromkeys(patterns)]
        for unit in self.units:
            for spec in unit.specs:
                a, b, start = self._held(unit, spec)
                for p, pa, pb in unit.pieces:
                    if b > a and pa <= start and start + (b - a) <= pb:
                        extra = groups.get(spec.names[0], ())
                        items.append((p, None if extra is None else (self.group,) + extra, start - pa,
                                      start - pa + (b - a)))
        return items

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Scale the shard gradients so the global L2 norm is at most max_norm; return the norm before.
        Communication: one all-reduce of an fp32 scalar over the group."""
        return clip_grad_norm_(self.grad_norm_items(), max_norm)

    # ----------------------------------------------------------------------------------- state dicts

    def _held(self, unit: _FlatUnit, spec: _ParamSpec) -> tuple[int, int, int]:
        return _held(spec, self.rank * unit.shard.numel(), unit.shard.numel())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded fp32 state dict, keyed like GPT.state_dict() (tied weight under both names), on
        group rank 0; None elsewhere. Every rank must call it: one all-gather per unit."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=torch.float32, device=unit.shard.device)
            comm.all_gather_into_tensor(full, unit.shard, self.group)
            if self.rank == 0:
                for spec in unit.specs:
                    value = full[spec.offset:spec.offset + spec.numel].view(spec.shape).clone()
                    out.update((name, value) for name in spec.names)
        return {name: out[name] for name in self._state_dict_names} if self.rank == 0 else None

    def sharded_state_dict(self) -> dict[str, ShardPiece]:
        """{original name: this rank's ShardPiece} for every name in GPT.state_dict() (pieces may be empty;
        the tied weight appears under both names). Pieces are views of the live fp32 shards; no
        communication. Together the ranks' pieces tile each parameter exactly once."""
        out: dict[str, ShardPiece] = {}
        for unit in self.units:
            for spec in unit.specs:
                a, b, start = self._held(unit, spec)
                piece = ShardPiece(unit.shard[start:start + b - a], a, spec.shape)
                out.update((name, piece) for name in spec.names)
        return {name: out[name] for name in self._state_dict_names}

    def sharded_optimizer_state(self, optimizer: torch.optim.Optimizer, keys: tuple[str, ...] = MOMENTS,
                                ) -> dict[str, dict[str, ShardPiece]]:
        """{original name: {key: ShardPiece}}: the same slices as `sharded_state_dict()`, of the optimizer's
        per-element state (AdamW's moments; present after the first step). No communication."""
        out: dict[str, dict[str, ShardPiece]] = {}
        for unit in self.units:
            for spec in unit.specs:
                a, b, start = self._held(unit, spec)
                entry = {}
                for p, pa, pb in unit.pieces:  # a parameter's slice never straddles two pieces
                    if b > a and pa <= start and start + b - a <= pb:
                        state = optimizer.state[p]
                        i = start - pa
                        entry = {k: ShardPiece(state[k][i:i + b - a], a, spec.shape) for k in keys}
                if not entry:
                    entry = {k: ShardPiece(unit.shard.new_empty(0), a, spec.shape) for k in keys}
                out.update((name, entry) for name in spec.names)
        return {name: out[name] for name in self._state_dict_names}

    def load_sharded_state_dict(self, sd: dict[str, ShardPiece]) -> None:
        """Copy this rank's pieces (the layout `sharded_state_dict()` gives) into the shards."""
        for unit in self.units:
            unit.reshard()
            for spec in unit.specs:
                a, b, start = self._held(unit, spec)
                piece = sd[spec.names[0]]
                if piece.offset != a or piece.flat.numel() != b - a:
                    raise ValueError(f"{spec.names[0]}: piece [{piece.offset}, +{piece.flat.numel()}) does not "
                                     f"match this rank's [{a}, {b}); use load_full_state_dict across layouts")
                unit.shard[start:start + b - a].copy_(piece.flat)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor] | None, from_rank0: bool = False) -> None:
        """Load an unsharded state dict. Every rank passes it, or with `from_rank0` only group rank 0 does
        (others pass None) and each unit's flat buffer is broadcast from it."""
        for unit in self.units:
            unit.reshard()
            if from_rank0:
                full = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard.device)
                if self.rank == 0:
                    for spec in unit.specs:
                        full[spec.offset:spec.offset + spec.numel].copy_(sd[spec.names[0]].reshape(-1))
                src = dist.get_global_rank(self.group, 0) if self.group is not None and self.world > 1 else 0
                comm.broadcast(full, src, self.group)
                S = unit.shard.numel()
                unit.shard.copy_(full[self.rank * S:(self.rank + 1) * S])
                continue
            for spec in unit.specs:
                a, b, start = self._held(unit, spec)
                unit.shard[start:start + b - a].copy_(sd[spec.names[0]].reshape(-1)[a:b])

    # --------------------------------------------------------------------------------------- metrics

    @property
    def config(self):
        return self.module.config

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters of the unsharded model, as GPT.num_params counts them."""
        n = sum(u.numel for u in self.units)
        return n - self.config.block_size * self.config.n_embd if non_embedding else n

    def state_breakdown(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds, {"params", "grads", "optimizer"}: shards and (ZeRO-1/2) the full copies;
        shard gradients and full ones (ZeRO-1's buffers, or kept under no_sync); `optimizer`'s state.
        Distinct storages, padding included; a ZeRO-3 unit gathered right now counts too."""
        from metrics import storage_bytes_by_kind
        params, grads, moments = [], [], []
        for unit in self.units:
            params += [unit.shard, unit.flat]
            grads += [p.grad for p, _, _ in unit.pieces if p.grad is not None]
            grads += [t for t in (unit.flat.grad, unit.acc_grad) if t is not None]
        if optimizer is not None:
            for p in self.flat_params:
                moments += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return storage_bytes_by_kind({"params": params, "grads": grads, "optimizer": moments})

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> int:
        """The sum of `state_breakdown`."""
        return sum(self.state_breakdown(optimizer).values())

    def comm_bytes_per_micro_step(self) -> dict[str, int]:
        """What parallel/comm.COUNTER records for one synchronised forward + backward: the padded flat
        buffers, i.e. at most N - 1 elements per unit more than the parameters themselves."""
        roots = sum(u.padded for u in self.roots)
        blocks = sum(u.padded for u in self.units[1:self._n_blocks + 1])
        p_size = torch.empty((), dtype=self.param_dtype).element_size()
        r_size = torch.empty((), dtype=self.reduce_dtype).element_size()
        return fsdp_comm_bytes_per_micro_step(roots, blocks, self.world, self.reshard_after_forward,
                                              p_size, r_size)


ZERO_STAGES = {"zero1": 1, "zero2": 2, "fsdp": 3}


def zero_comm_bytes_per_step(stage: int, root: int, blocks: int, shard: int, replicas: int = 1,
                             micro_steps: int = 1, param_bytes: int = 4, reduce_bytes: int = 4) -> dict[str, int]:
    """What parallel/comm.COUNTER records on one rank per optimizer step of `micro_steps` micro-steps, for
    the elements of the root unit and of all Blocks (padded as the units are), S = `shard` ranks per
    shard group and R = `replicas` (HSDP):
    - ZeRO-1: reduce-scatter Ψ once (the accumulated gradient, at the end of the step's backward), and
      all-gather Ψ once (the updated shards, at the next step's first forward);
    - ZeRO-2: reduce-scatter Ψ per micro-step (each unit as soon as its gradient is complete), all-gather
      Ψ once per step;
    - ZeRO-3: `fsdp_comm_bytes_per_micro_step` per micro-step;
    - HSDP (R > 1): the above within the shard group, plus an all-reduce of each reduce-scattered 1/S
      shard across the replicas: Ψ/S per reduce-scatter."""
    psi = root + blocks
    if stage == 3:
        out = {k: v * micro_steps for k, v in fsdp_comm_bytes_per_micro_step(root, blocks, shard, True, param_bytes,
                                                                             reduce_bytes).items()}
        scatters = micro_steps if shard > 1 else 0
    else:
        scatters = (1 if stage == 1 else micro_steps) if shard > 1 else 0
        out = {"all_gather": psi * param_bytes if shard > 1 else 0, "reduce_scatter": psi * reduce_bytes * scatters}
    out["all_reduce"] = psi // shard * reduce_bytes * (1 if stage == 1 else micro_steps) if replicas > 1 else 0
    return out


def fsdp_comm_bytes_per_micro_step(root: int, blocks: int, world: int, reshard_after_forward: bool = True,
                                   param_bytes: int = 4, reduce_bytes: int = 4) -> dict[str, int]:
    """Payload bytes of one rank's all-gathers and reduce-scatters in one synchronised forward + backward,
    given the elements of the root unit and of all Block units together: the root is gathered once (kept
    from forward to backward), each Block twice (once without `reshard_after_forward`), and every gradient
    is reduce-scattered once. In Ψ terms: all-gather 2Ψ_blocks + Ψ_root, reduce-scatter Ψ. Nothing with one
    rank."""
    if world == 1:
        return {"all_gather": 0, "reduce_scatter": 0}
    passes = 2 if reshard_after_forward else 1
    return {"all_gather": (root + passes * blocks) * param_bytes, "reduce_scatter": (root + blocks) * reduce_bytes}
