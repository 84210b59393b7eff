"""Our sharding engine: ZeRO stages 1, 2 and 3 (FSDP) and HSDP over a data-parallel group, one flat
parameter per unit (Rajbhandari et al. 2020). This file holds the hook schedule and the gradient reduction;
parallel/data_parallel/flat_param.py holds the flat layout (what each rank stores) and its state-dict views.

Units are the transformer Blocks, plus the root: wte, wpe, ln_f and lm_head, whose tied weight is stored
once. Each rank keeps 1/N of every unit's flat fp32 buffer. Under ZeRO-3 a micro-step moves 2 all-gathers
(forward, and again before backward) and 1 reduce-scatter of each Block, and 1 of each for the root, which stays
gathered from forward to backward as under FSDP2 (`FullyShardedDataParallel` says when and which way).
`ZeroStage` (parallel/data_parallel/flat_param.py; what each stage sends and holds is in the formula sheet,
plan/theory.py) says what stages 1 and 2 keep instead, `GradReduction` (there too) what HSDP adds to the reduction.

Hooks: forward pre/post hooks on each Block; a tensor hook on each Block's output (runs before that
Block's backward); a post-accumulate-grad hook on each unit's `flat` leaf (runs once all the unit's
gradients are in); an autograd-engine callback at the end of backward.

What the pipeline and expert parallelism add is composed in, not inherited: their units beyond the root and the
Blocks (a pipeline stage's end of the tied embedding, the experts sharded over their own group) and which Blocks run
together are an `extras` object the composition hands in (parallel/data_parallel/fsdp_extensions.py); the engine
asks it at a few named places and reads as plain ZeRO without it. What a pipeline asks of the engine itself is
small: `run` (a chunk's forward under the hooks), `hold_root_grads` and `defer_reduction` (a reduction held for
later).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import comm
from parallel.data_parallel.flat_param import (
    ZERO_LADDER,
    FlatLayout,
    GradReduction,
    ShardPiece,
    _FlatUnit,
    flatten_unit,
    unit_key,
)
from parallel.grads import clip_grad_norm_, norm_items
from parallel.marks import data_replica, shards_of


class FullyShardedDataParallel(nn.Module):
    """ZeRO-1, 2 and 3 data parallelism (and HSDP) for GPT with flat parameters, one per unit (each Block, and the
    root). Below, the default, ZeRO-3 (FSDP); `zero_stage` 1 and 2 keep full copies instead (the end).

    What each rank stores: 1/N of every unit's parameters (fp32 `shard`), their gradients, and hence 1/N of
    AdamW's state; the optimizer steps on plain views of the shards (`param_groups`). Between uses the
    GPT's original parameter attributes are meta placeholders: no storage, and a loud error if used.

    What is communicated, when and in which direction (per micro-step; N = size of `process_group`):
    - forward: each Block's flat shard is all-gathered (in `param_dtype`) in its forward pre-hook and, with
      `reshard_after_forward`, freed in its forward hook; with `prefetch`, the next Block's all-gather is
      issued before the current one runs (the next in the same call: a pipeline stage's chunk, `_same_run`).
      The root is gathered at the start of forward and kept until its gradient is reduced (it is used at both
      ends of forward and first in backward).
    - backward: a hook on each Block's output re-gathers that Block before its backward (and prefetches
      the previous Block's); a hook on the unit's flat leaf fires once all its gradients are summed and
      starts the unit's `GradReduction` (reduce-scatter, accumulated in fp32 into the shard `.grad`). A
      callback queued on the autograd engine waits for the last reduce-scatters.
    - the global norm (`grad_norm_items`, parallel/grads.py): an all-reduce of a scalar per group pattern
      (uncounted). State dicts: views of the shards, none.

    Gradient accumulation. By default every micro-step's backward reduce-scatters, so memory stays 1/N.
    Under `no_sync()` each rank keeps the full gradient (in `reduce_dtype`) across micro-steps and the first
    backward outside it reduce-scatters the sum: k-1 fewer reduce-scatters for k micro-steps, but a
    full-size gradient per rank, which undoes ZeRO's gradient saving.

    Mixed precision: `param_dtype` (None = fp32) is the dtype of the gathered compute copies, `reduce_dtype`
    that of the reduce-scatter; the master shard, its gradient and the optimizer state stay fp32.

    A GPT built on `meta` is materialised one unit at a time by `materialize(module, name)` on `device` (the
    composition hands in the GPT's own init at the run's seed, model.gpt.materialize_module): init a unit, keep this
    rank's shard, drop the unit, so peak init memory is the shards plus one unit, and the weights equal eager
    `init_weights(seed)` bit for bit (an eager GPT given one is re-initialised the same way). The wrapped GPT owns
    no parameters any more: use the sharded views here (`sharded_state_dict`).

    `zero_stage` (1, 2 or 3, the default) picks `policy`, a `ZeroStage` of ZERO_LADDER: stage 2 keeps the
    full parameters (gathered once per step), stage 1 also the full gradients (reduced once per step).
    HSDP (`replicate_group`): the sharding above within `process_group` (S ranks), and the R replicas of
    each shard kept equal by `GradReduction`. Parameters are gathered within the shard group only.

    `extras`: a pipeline stage's units beside the root and the Blocks, the experts' own-group units, and which
    Blocks one call runs (`PipelineAndExperts`, parallel/data_parallel/fsdp_extensions.py); None: a plain model.
    """

    require_backward_grad_sync: bool = True  # False inside `no_sync`

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        materialize: Callable[[nn.Module, str], None] | None = None,
        device: torch.device | str | None = None,
        zero_stage: int = 3,
        replicate_group: dist.ProcessGroup | None = None,
        extras: object | None = None,
    ):
        super().__init__()
        if zero_stage not in ZERO_LADDER:
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        self.module = module
        self.group = process_group
        self.world = comm.world(process_group)
        self.rank = comm.rank(process_group)
        self.zero_stage, self.policy = zero_stage, ZERO_LADDER[zero_stage]
        self.replicate_group = replicate_group
        self.reshard_after_forward = reshard_after_forward and not self.policy.keeps_params
        self.prefetch = prefetch
        self.param_dtype = param_dtype or torch.float32
        self.reduce_dtype = reduce_dtype
        self.reduction = GradReduction(process_group, replicate_group, reduce_dtype)
        self._backward_started = False
        self._whole = True  # the last forward ran the whole module (a pipeline's `run` runs a part of it)
        self._holding_roots = False  # inside `hold_root_grads`: the roots' gradients accumulate, unreduced
        # (flat leaf, its gradient, a callback that reduces it) -> True if the caller keeps it to reduce later
        self.defer_reduction: Callable[[torch.Tensor, torch.Tensor, Callable], bool] | None = None
        self.extras = extras
        if extras is None and any(data_replica(p, None) is not None for p in module.parameters()):
            raise ValueError("parameters copied over a group of their own (experts): pass extras=PipelineAndExperts")
        if any(p.is_meta for p in module.parameters()) and (materialize is None or device is None):
            raise ValueError("the model is on the meta device: pass materialize and device to materialise it")
        device = torch.device(device) if device is not None else next(module.parameters()).device
        self._state_dict_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        # other dimensions' slices (FSDP over TP, EP): name -> their marks, for the norm groups and checkpoints
        self.shard_marks = {n: shards_of(p) for n, p in module.named_parameters() if shards_of(p)}
        aliases: dict[int, list[str]] = {}  # one entry per parameter object: [init name, *tied names]
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._aliases = list(aliases.values())
        # (global index, Block) of a GPT (a ModuleList) or of a pipeline stage (a ModuleDict keyed by index)
        blocks = [(int(i), b) for i, b in module.transformer.h.named_children()]
        self._position = {i: pos for pos, (i, _) in enumerate(blocks, start=1)}  # global Block -> unit
        self._global = [None] + [i for i, _ in blocks]
        self._n_blocks = len(blocks)
        n_units = 1 + self._n_blocks + (extras.count if extras else 0)  # + the pipeline's and EP's units
        self.units = [self._build_unit(i, materialize, device) for i in range(n_units)]
        self.layout = FlatLayout(self.units, process_group, self.rank, self.world, self._state_dict_names)
        self.roots = [self.units[i] for i in [0, *(extras.roots if extras else [])]]  # gathered around each call
        # Block unit i and the units gathered with it (EP's experts)
        self._with = [[i, *(extras.gathered_with(i) if extras else [])] for i in range(1 + self._n_blocks)]
        self.flat_params = nn.ParameterList([p for u in self.units for p, _, _ in u.pieces])

        for i, (_, block) in enumerate(blocks, start=1):
            block.register_forward_pre_hook(partial(self._pre_forward, i))
            block.register_forward_hook(partial(self._post_forward, i))
        for unit in self.units:
            unit.flat.register_post_accumulate_grad_hook(partial(self._post_backward, unit))

    # ------------------------------------------------------------------------------------------ setup

    def _unit_index(self, name: str) -> int:
        """0 for the root, the unit of Block i for transformer.h.i (i + 1 in a whole GPT), then the units the
        pipeline and EP add (`extras.unit_of`)."""
        extra = self.extras.unit_of(name) if self.extras else None
        if extra is not None:
            return extra
        key = unit_key(name)
        return 0 if key == "root" else self._position[int(key.split(".")[2])]

    def _adjacent(self, i: int, j: int) -> bool:
        """Units i and j are neighbouring Blocks run by one call (worth a prefetch): not across a gap in the
        Blocks' global indices, nor across two of a pipeline stage's chunks (`extras.same_run`)."""
        if not (1 <= j <= self._n_blocks and abs(self._global[i] - self._global[j]) == 1):
            return False
        return self.extras is None or self.extras.same_run(self._global[i], self._global[j])

    def _build_unit(self, index: int, materialize: Callable | None, device: torch.device) -> _FlatUnit:
        """Materialise (if asked), flatten and shard one unit, then drop its full parameters."""
        gpt = self.module
        if materialize is not None:
            for prefix, sub in gpt.init_units():
                if self._unit_index(prefix + ".") == index:
                    materialize(sub, prefix)
        mine = [names for names in self._aliases if self._unit_index(names[0]) == index]
        name, group = (
            ("root" if index == 0 else f"transformer.h.{self._global[index]}", self.group)
            if index <= self._n_blocks
            else self.extras.unit(index)
        )
        return flatten_unit(
            gpt,
            name,
            mine,
            comm.world(group),
            comm.rank(group),
            self.param_dtype,
            device,
            self.policy.keeps_params,
            group,
        )

    # ------------------------------------------------------------------------------ forward / backward

    def _gather(self, unit: _FlatUnit) -> None:
        if unit.state in ("sharded", "stale"):
            unit.gather()

    def _gather_block(self, i: int) -> None:
        """Start the all-gathers of unit i and of the own-group units that go with it (its experts)."""
        for j in self._with[i]:
            self._gather(self.units[j])

    def _show_block(self, i: int) -> None:
        """Wait for unit i and the units that go with it, and show their full parameters."""
        for j in self._with[i]:
            self.units[j].wait()
            self.units[j].show_full()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """GPT's forward: (logits, loss). Gathers the root (and prefetches the first Block) first."""
        return self._run(self.module, (idx, targets), whole=True)

    def _run(self, fn, args: tuple, whole: bool):
        """`fn(*args)` with the roots gathered around it; each Block is gathered by its hooks. `whole`: fn runs the
        whole module, so the first Block is prefetched now and the last at the start of backward (a pipeline
        chunk's `run` may run neither)."""
        self._whole = whole
        for root in self.roots:
            root.release()  # ZeRO-3: a copy left by a forward without backward may predate an optimizer step
            self._gather(root)
        if whole and self.prefetch and self._n_blocks:
            self._gather_block(1)
        for root in self.roots:
            root.wait()
            root.show_full()
        out = fn(*args)
        outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if t is not None and t.requires_grad]
        for t in outputs:
            t.register_hook(self._root_pre_backward)
        if not outputs:
            for root in self.roots:
                root.release()
        return out

    def run(self, fn: Callable, *args):
        """`fn(*args)`, a function over part of the wrapped module (a pipeline chunk's forward), under this
        engine as `forward` is: the roots gathered around it, each Block by its hooks; its backward re-gathers and
        reduces as a whole forward's does, so between calls each rank holds 1/N. Prefetch stays inside `fn`'s
        Blocks (no first Block prefetched in forward, no last one in backward: `fn` may not run them)."""
        return self._run(fn, args, whole=False)

    def _pre_forward(self, i: int, module: nn.Module, args) -> None:
        self._gather_block(i)
        if self.prefetch and self._adjacent(i, i + 1):
            self._gather_block(i + 1)
        self._show_block(i)

    def _post_forward(self, i: int, module: nn.Module, args, output: torch.Tensor) -> None:
        needs_backward = torch.is_grad_enabled() and output.requires_grad
        if self.reshard_after_forward or not needs_backward:
            for j in self._with[i]:
                self.units[j].release()
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
            self._gather(root)  # only if a later forward freed it
        if self.prefetch and self._n_blocks and self._whole:
            self._gather_block(self._n_blocks)
        for root in self.roots:
            root.wait()

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        self._start_backward()
        self._gather_block(i)
        if self.prefetch and self._adjacent(i, i - 1):
            self._gather_block(i - 1)
        self._show_block(i)  # activation checkpointing recomputes the Block's forward from its attributes

    def _post_backward(self, unit: _FlatUnit, flat: torch.Tensor) -> None:
        """All of the unit's gradients from this backward are in `flat.grad`: free the unit and reduce its
        gradient (`_reduce_grad`), unless the caller's `defer_reduction` keeps it, to complete it and reduce it
        later through the callback it is given (a zero-bubble pipeline's W: parallel/pipeline/zero_bubble.py)."""
        unit.release()
        grad, flat.grad = flat.grad, None
        deferred = self.defer_reduction is not None and self.defer_reduction(
            flat, grad, partial(self._reduce_grad, unit)
        )
        if not deferred:
            self._reduce_grad(unit, grad)

    def _reduce_grad(self, unit: _FlatUnit, grad: torch.Tensor) -> None:
        """Reduce-scatter one backward's full gradient of `unit` (or keep it: under no_sync, ZeRO-1 until the end
        of the step's backward, and a root a pipeline holds for a later backward: `hold_root_grads`)."""
        grad = grad.to(self.reduce_dtype)
        if unit.acc_grad is not None:
            grad = unit.acc_grad.copy_(grad) if unit.acc_stale else unit.acc_grad.add_(grad)
            unit.acc_grad, unit.acc_stale = None, False
        held = self._holding_roots and unit in self.roots
        if not self.require_backward_grad_sync or self.policy.reduces_at_end or held:
            unit.acc_grad = grad
            return
        self.reduction.finish(final=False)  # one reduce-scatter in flight: full gradients are not kept around
        self.reduction.start(unit, grad)

    def _end_backward(self) -> None:
        """Queued on the autograd engine by the first pre-backward hook; runs after the whole backward."""
        if self.policy.reduces_at_end and self.require_backward_grad_sync:
            self.reduce_accumulated()
        self.reduction.finish()
        for unit in self.units:
            unit.release()
        self._backward_started = False

    def reduce_accumulated(self) -> None:
        """Reduce-scatter every unit's accumulated full gradient (ZeRO-1 at the end of a step's backward,
        and the first syncing backward after `no_sync`). ZeRO-1 keeps its full-gradient buffers for the
        next step (the first accumulation overwrites them), reduce-scatters into each buffer's own slice,
        which then is the shard gradient (no separate Ψ/N), and with every buffer in memory anyway starts
        all reduce-scatters before waiting for any; otherwise one unit is in flight at a time."""
        keep = self.policy.reduces_at_end
        for unit in self.units:
            if unit.acc_grad is None:
                continue
            if keep:
                self.reduction.start(unit, unit.acc_grad, in_place=self.reduce_dtype == torch.float32)
                unit.acc_stale = True
            else:
                self.reduction.finish(final=False)
                self.reduction.start(unit, unit.acc_grad)
                unit.acc_grad = None
        self.reduction.finish()

    def after_optimizer_step(self) -> None:
        """ZeRO-1/2: the optimizer has updated this rank's shards, so every full copy is stale; the next
        forward all-gathers the updated shards into it (in place). ZeRO-3: nothing (gathered per use)."""
        for unit in self.units:
            unit.mark_stale()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward passes keep each unit's full gradient (summed over micro-steps); the first syncing
        backward after it reduce-scatters the sum (torch DDP's name)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @contextlib.contextmanager
    def hold_root_grads(self):
        """Inside, the roots' gradients are kept unreduced: a backward's full gradient of a root goes into its
        `acc_grad` (reduce dtype; summed with one kept before), and the root's next reduction outside adds it in,
        so the sum is reduce-scattered once. For a rank that runs the roots' two users as two calls (a V's rank 0:
        the head's chunk, whose backward comes first, and the embeddings' chunk): held in the head's backward, the
        root is reduce-scattered once per micro-batch, at the embeddings' backward, not after each (ZeRO-2/3;
        ZeRO-1 reduces once per step anyway). Costs one full root gradient kept from the one backward to the
        other."""
        self._holding_roots = True
        try:
            yield
        finally:
            self._holding_roots = False

    # ---------------------------------------------------------------------------- optimizer helpers

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over the shard views: decay on pieces of parameters with >= 2 dims, none on the rest."""
        pieces = [(p, d) for u in self.units for (p, _, _), d in zip(u.pieces, u.decay)]
        return [
            {"params": [p for p, d in pieces if d], "weight_decay": weight_decay},
            {"params": [p for p, d in pieces if not d], "weight_decay": 0.0},
        ]

    def grad_norm_items(self, groups: dict[str, tuple] | None = None) -> list[tuple]:
        """This rank's shard gradients as items for parallel.grads.clip_grad_norm_.

        Every element is sharded over this FSDP's group; `groups` ({original name: more groups}, e.g. TP's, EP's;
        names not in it have none) adds the groups a parameter is also sharded over; None marks a copy counted
        elsewhere (a pipeline's lm_head copy of wte: scaled, not measured). Without extra groups each flat piece
        is one item (param, (group,)); with them, each original parameter's slice is (piece, groups, lo, hi),
        after one empty item per pattern, the same on every rank (`norm_items`). The own-group units' items
        (EP's experts, sharded over their own group) come after the others' (`extras.norm_items`)."""
        groups = {n: g for n, g in (groups or {}).items() if g != ()}
        own, own_items = self.extras.norm_items(self, groups) if self.extras else (set(), [])
        dense = {n: g for n, g in groups.items() if n not in own}
        if not dense:
            items = norm_items(
                ((u.name, p) for u in self.units if u.group is self.group for p, _, _ in u.pieces), within=(self.group,)
            )
        else:
            held = (
                (spec.names[0], p, lo, hi)
                for u, spec, p, lo, hi in self.layout.slices()
                if p is not None and u.group is self.group
            )
            items = norm_items(held, dense, within=(self.group,), every_pattern=True)
        return items + own_items

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Scale the shard gradients so the global L2 norm is at most max_norm; return the norm before (FSDP1's
        name; the trainer clips through the protocol). Communication: an all-reduce of a scalar per pattern."""
        return clip_grad_norm_(self.grad_norm_items(), max_norm)

    # ------------------------------------------- state dicts: views of the shards (flat_param.py's FlatLayout)

    def sharded_state_dict(self) -> dict[str, ShardPiece]:
        """{original name: this rank's ShardPiece}, views of the live shards; no communication."""
        return self.layout.sharded_state_dict()

    def unit_pieces(self, name: str) -> list[nn.Parameter]:
        """This rank's shard pieces of unit `name` (empty when there is none: a pipeline's tied unit)."""
        return [p for u in self.units if u.name == name for p, _, _ in u.pieces]

    def replica_of(self, name: str, replica_rank: int) -> int:
        """Parameter `name`'s index among its data-parallel copies (checkpoint writers are copy 0): HSDP's
        `replica_rank`, or 0 in an own-group unit (`extras`: sharded over every rank holding it, one copy)."""
        return self.extras.replica_of(name, replica_rank) if self.extras else replica_rank

    @property
    def config(self):
        return self.module.config
