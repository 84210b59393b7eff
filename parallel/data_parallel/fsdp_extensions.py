"""What the pipeline and expert parallelism add to our sharding engine (parallel/data_parallel/fsdp.py), composed in:
the composition (parallel/parallelize.py) builds a `PipelineAndExperts` over the module it shards and hands it to
the engine as `extras`, which the engine asks at a few named places (the units after the Blocks, which Blocks run in
one call, the own-group units' norm items and copies). Without one the engine is plain ZeRO over a GPT.

Where the pipeline meets sharding (parallel/pipeline/runner.py runs a stage's chunks through the engine's `run`):
- `block_runs`: a stage's chunks are separate calls, so a prefetch stays within one chunk's Blocks (`same_run`);
- `separate`: units of their own beside the root and the Blocks (a stage's end of the tied embedding), gathered
  around every call as the root is (`roots`).

Parameters that another dimension keeps on fewer ranks than the data-parallel group (expert parallelism: an
expert's copies are its expert-data-parallel group, `parallel.marks.mark_replicas`) go into units of their own,
one per Block that has them ("transformer.h.<i>.experts", after every other unit, `own_units`), sharded over
that group instead: gathered, released and prefetched with their Block (`gathered_with`), reduce-scattered over that
group (never all-reduced over HSDP's replicas: the group already spans them), and divided by the same total as every
unit.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from parallel.data_parallel.ddp import replica_group
from parallel.data_parallel.flat_param import unit_key
from parallel.grads import norm_items
from runtime.blocks import blocks_by_index


class PipelineAndExperts:
    """The units a pipeline stage and expert parallelism add to an engine sharding `module` over `group`, and
    which Blocks one call runs. Unit order: the root (0), the Blocks (1..n), then the `separate` units (unit name ->
    the module prefixes it holds), then the own-group units; it answers as a plain run would when neither is on."""

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup | None, separate: dict[str, tuple[str, ...]] | None = None
    ):
        self.group = group
        blocks = blocks_by_index(module)
        self._position = {i: pos for pos, (i, _) in enumerate(blocks, start=1)}  # global Block -> unit
        self.first = 1 + len(blocks)  # the first unit after the Blocks
        # global Block -> the run it belongs to: the Blocks one forward call runs together (prefetch stays in one)
        self._run_of = {i: k for k, run in enumerate(block_runs(module)) for i in run}
        self.separate = dict(separate or {})
        # parameters copied over a group of their own (EP's experts): unit name -> (its Block's unit, the group)
        self.own_units: dict[str, tuple[int, dist.ProcessGroup | None]] = {}
        self._own_unit_of: dict[str, str] = {}  # parameter name -> its own-group unit
        for name, p in module.named_parameters():
            own = replica_group(p, group)
            if own is not group:
                self._add_own(name, own)
        self.count = len(self.separate) + len(self.own_units)  # units after the Blocks
        self.roots = list(range(self.first, self.first + len(self.separate)))  # gathered around every call

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

    def unit_of(self, name: str) -> int | None:
        """The unit of parameter `name` when it is a `separate` unit's or an own-group unit's, else None."""
        if name in self._own_unit_of:
            return self.first + len(self.separate) + list(self.own_units).index(self._own_unit_of[name])
        key = unit_key(name, self.separate)
        return self.first + list(self.separate).index(key) if key in self.separate else None

    def unit(self, index: int) -> tuple[str, dist.ProcessGroup | None]:
        """(name, shard group) of unit `index`, one of the units after the Blocks."""
        k = index - self.first
        if k < len(self.separate):
            return list(self.separate)[k], self.group
        name = list(self.own_units)[k - len(self.separate)]
        return name, self.own_units[name][1]

    def gathered_with(self, i: int) -> list[int]:
        """The own-group units gathered, released and prefetched with Block unit i (its experts)."""
        first = self.first + len(self.separate)
        return [first + k for k, (block, _) in enumerate(self.own_units.values()) if block == i]

    def same_run(self, i: int, j: int) -> bool:
        """Global Blocks i and j run in one call (`block_runs`: a pipeline stage's chunks, whose forward and
        backward are separate calls at other times; a V's middle rank holds Blocks i and i+1 in two chunks, and a
        prefetch from one into the other was released unused at the end of the chunk's backward)."""
        return self._run_of[i] == self._run_of[j]

    def replica_of(self, name: str, replica_rank: int) -> int:
        """Parameter `name`'s index among its data-parallel copies: `replica_rank`, or 0 in an own-group unit."""
        return 0 if name in self._own_unit_of else replica_rank

    def norm_items(self, engine: nn.Module, groups: dict[str, tuple | None]) -> tuple[set[str], list[tuple]]:
        """(names, items): every name of the parameters in own-group units, and their items for
        clip_grad_norm_, listed after the other units' (FullyShardedDataParallel.grad_norm_items). Each element
        is sharded over its unit's group (EP's experts over their expert-data-parallel group), plus `groups`' for
        the name (None: a copy counted elsewhere); the patterns (unit group, *its groups) are listed first, the
        same on every rank (`norm_items`), so every rank issues the same all-reduces in the same order."""
        own = {n for names in engine._aliases for n in names if names[0] in self._own_unit_of}
        if not self.own_units:
            return own, []
        within = {n: (engine.units[engine._unit_index(n)].group,) for n in own}
        extra = {n: None if groups.get(n, ()) is None else within[n] + groups.get(n, ()) for n in sorted(own)}
        held = (
            (spec.names[0], p, lo, hi)
            for u, spec, p, lo, hi in engine.layout.slices()
            if p is not None and u.group is not engine.group
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
