"""What the pipeline and expert parallelism add to our sharding engine (parallel/data_parallel/fsdp.py), kept out of
the hooks a
first reading follows. `PipelineAndExperts` is a mixin of FullyShardedDataParallel: the engine's hooks ask it at
a few named places (`_same_run`, `_holds`, `_deferred`, the extra units), and it answers as a plain data-parallel
run would when neither is on.

Where the pipeline meets sharding (parallel/pipeline/runner.py uses all of these):
- `run`: the engine runs any function of the module it wraps (a pipeline chunk's forward), the roots gathered
  around it and each Block by its hooks, as `forward` does for the whole GPT;
- `block_runs`: a stage's chunks are separate calls, so a prefetch stays within one chunk's Blocks (`_same_run`);
- `separate`: units of their own beside the root and the Blocks (a stage's end of the tied embedding), gathered
  around every call as the root is;
- `hold_root_grads`: a rank that runs the roots' two users as two calls (a V's rank 0) reduces the roots once per
  micro-batch, not once per call;
- `defer_reduction`: a caller holds a unit's gradient and reduces it later (a zero-bubble schedule's W);
- `finish_on_exit`, `reduce_on_exit`: reductions that end outside a backward (a pipeline's step).

Parameters that another dimension keeps on fewer ranks than the data-parallel group (expert parallelism: an
expert's copies are its expert-data-parallel group, `parallel.marks.mark_replicas`) go into units of their own,
one per Block that has them ("transformer.h.<i>.experts", after every other unit, `own_units`), sharded over
that group instead: gathered, released and prefetched with their Block, reduce-scattered over that group (never
all-reduced over HSDP's replicas: the group already spans them), and divided by the same total as every unit.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.data_parallel.ddp import replica_group
from parallel.data_parallel.flat_param import _FlatUnit, unit_key
from parallel.grads import norm_items
from runtime.blocks import blocks_by_index


class PipelineAndExperts:
    """The pipeline's and expert parallelism's part of FullyShardedDataParallel (see the module docstring). Unit
    order: the root (0), the Blocks (1..n), then the `separate` units, then the own-group units."""

    # ------------------------------------------------------------------------------------------ setup

    def _extend(self, module: nn.Module, separate: dict[str, tuple[str, ...]] | None) -> int:
        """Find the units the pipeline (`separate`) and expert parallelism (own groups) add; return how many."""
        # global Block -> the run it belongs to: the Blocks one forward call runs together (prefetch stays in one)
        self._run_of = {i: k for k, run in enumerate(block_runs(module)) for i in run}
        self.separate = dict(separate or {})  # unit name -> the module prefixes it holds (units after the Blocks)
        # parameters copied over a group of their own (EP's experts): unit name -> (its Block's unit, the group)
        self.own_units: dict[str, tuple[int, dist.ProcessGroup | None]] = {}
        self._own_unit_of: dict[str, str] = {}  # parameter name -> its own-group unit
        for name, p in module.named_parameters():
            group = replica_group(p, self.group)
            if group is not self.group:
                self._add_own(name, group)
        self._holding_roots = False  # inside `hold_root_grads`: the roots' gradients accumulate, unreduced
        # (flat leaf, its gradient, a callback that reduces it) -> True if the caller keeps it to reduce later
        self.defer_reduction: Callable[[torch.Tensor, torch.Tensor, Callable], bool] | None = None
        return len(self.separate) + len(self.own_units)

    def _add_own(self, name: str, group: dist.ProcessGroup | None) -> None:
        """Parameter `name`, copied over `group` (not the engine's group), into its Block's own-group unit."""
        key = unit_key(name, self.separate)
        if key == "root" or key in self.separate:
            raise ValueError(
                f"{name}: parameters with a replica group of their own are sharded in a unit per "
                f"Block; this one is in no Block ({key})"
            )
        unit = f"{key}.experts"
        block, other = self.own_units.setdefault(unit, (self._position[int(key.split(".")[2])], group))
        if other is not group:
            raise ValueError(f"{name}: Block {key} has parameters copied over two different groups")
        self._own_unit_of[name] = unit

    def _extra_unit_of(self, name: str) -> int | None:
        """The unit of parameter `name` when it is a `separate` unit's or an own-group unit's, else None."""
        first = 1 + self._n_blocks
        if name in self._own_unit_of:
            return first + len(self.separate) + list(self.own_units).index(self._own_unit_of[name])
        key = unit_key(name, self.separate)
        return first + list(self.separate).index(key) if key in self.separate else None

    def _extra_unit(self, index: int) -> tuple[str, dist.ProcessGroup | None]:
        """(name, shard group) of unit `index`, one of the units after the Blocks."""
        k = index - 1 - self._n_blocks
        if k < len(self.separate):
            return list(self.separate)[k], self.group
        name = list(self.own_units)[k - len(self.separate)]
        return name, self.own_units[name][1]

    def _extra_roots(self) -> list[int]:
        """The `separate` units: gathered around every call, as the root is."""
        return list(range(1 + self._n_blocks, 1 + self._n_blocks + len(self.separate)))

    def _gathered_with(self, i: int) -> list[int]:
        """The own-group units gathered, released and prefetched with Block unit i (its experts)."""
        first = 1 + self._n_blocks + len(self.separate)
        return [first + k for k, (block, _) in enumerate(self.own_units.values()) if block == i]

    def replica_of(self, name: str, replica_rank: int) -> int:
        """Parameter `name`'s index among its data-parallel copies (checkpoint writers are copy 0): HSDP's
        `replica_rank`, or 0 in an own-group unit (sharded over every rank holding it: one copy)."""
        return 0 if name in self._own_unit_of else replica_rank

    def unit_pieces(self, name: str) -> list[nn.Parameter]:
        """This rank's shard pieces of the `separate` unit `name` (empty when there is none)."""
        return [p for u in self.units if u.name == name for p, _, _ in u.pieces]

    # ------------------------------------------------------------------------------ forward / backward

    def _same_run(self, i: int, j: int) -> bool:
        """Block units i and j run in one call (`block_runs`: a pipeline stage's chunks, whose forward and backward
        are separate calls at other times; a V's middle rank holds Blocks i and i+1 in two chunks, and a prefetch
        from one into the other was released unused at the end of the chunk's backward)."""
        return self._run_of[self._global[i]] == self._run_of[self._global[j]]

    def run(self, fn: Callable, *args):
        """`fn(*args)`, a function over part of the wrapped module (a pipeline chunk's forward), under this
        engine as `forward` is: the roots gathered around it, each Block by its hooks; its backward re-gathers and
        reduces as a whole forward's does, so between calls each rank holds 1/N. Prefetch stays inside `fn`'s
        Blocks (no first Block prefetched in forward, no last one in backward: `fn` may not run them)."""
        return self._run(fn, args, whole=False)

    def _holds(self, unit: _FlatUnit) -> bool:
        """Whether `unit`'s gradient is kept unreduced for now: a root's, inside `hold_root_grads`."""
        return self._holding_roots and unit in self.roots

    def _deferred(self, unit: _FlatUnit, grad: torch.Tensor) -> bool:
        """Whether the caller's `defer_reduction` keeps this backward's gradient of `unit`, to complete it and
        reduce it later through the callback it is given (a zero-bubble pipeline's W: parallel/pipeline/runner.py)."""
        return self.defer_reduction is not None and self.defer_reduction(
            unit.flat, grad, partial(self._reduce_grad, unit)
        )

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

    @contextlib.contextmanager
    def finish_on_exit(self):
        """For gradients reduced outside a backward (ZeRO-2/3, those `defer_reduction` kept: no end-of-backward
        callback waits for their reduce-scatters): waited for, and added into the shard gradients, on exit."""
        yield
        self.reduction.finish()

    @contextlib.contextmanager
    def reduce_on_exit(self):
        """For backward passes that run outside a syncing micro-step (a pipeline's chunks): inside, gradients
        accumulate unreduced (ZeRO-1's full buffers); on a normal exit they are reduce-scattered once."""
        with self.no_sync():
            yield
        self.reduce_accumulated()

    # ---------------------------------------------------------------------------------- gradient norm

    def _own_norm_items(self, groups: dict[str, tuple | None]) -> tuple[set[str], list[tuple]]:
        """(names, items): every name of the parameters in own-group units, and their items for
        clip_grad_norm_, listed after the other units' (FullyShardedDataParallel.grad_norm_items). Each element
        is sharded over its unit's group (EP's experts over their expert-data-parallel group), plus `groups`' for
        the name (None: a copy counted elsewhere); the patterns (unit group, *its groups) are listed first, the
        same on every rank (`norm_items`), so every rank issues the same all-reduces in the same order."""
        own = {n for names in self._aliases for n in names if names[0] in self._own_unit_of}
        if not self.own_units:
            return own, []
        within = {n: (self.units[self._unit_index(n)].group,) for n in own}
        extra = {n: None if groups.get(n, ()) is None else within[n] + groups.get(n, ()) for n in sorted(own)}
        held = (
            (spec.names[0], p, lo, hi)
            for u, spec, p, lo, hi in self.layout.slices()
            if p is not None and u.group is not self.group
        )
        return own, norm_items(held, extra, every_pattern=True)


def block_runs(module: nn.Module) -> list[list[int]]:
    """Global indices of the Blocks that one call of `module` runs together, run by run: a pipeline stage's chunks
    (`chunks`, `layers`: each run by its own `forward_chunk`, parallel/pipeline/runner.py), or a GPT's Blocks, one
    run."""
    chunks, layers = getattr(module, "chunks", None), getattr(module, "layers", None)
    if chunks is not None and layers is not None:
        return [list(layers[c]) for c in chunks]
    return [[i for i, _ in blocks_by_index(module)]]
