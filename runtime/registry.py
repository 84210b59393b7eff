"""The registry: each concept (a parallelism, an optimizer, a model feature) declares itself here, from its own
module, and the trainer, the planner and the sweep read it instead of naming each concept.

A concept's `Concept` record says, beside its code:
- its flags (`flags`: adds them to train.py's parser, in a group of their own) and their ranges (`ranges`);
- its size in the mesh (`mesh`: its `ParallelDims` fields), its checks (`checks`: (phase, check) pairs, each
  raising `UsageError` with one line) and what it resolves into the layout (`parallel`: its `ParallelConfig`
  fields; `model`: its `GPTConfig` fields);
- the flags a checkpoint records (`math_flags`) and what a resume refuses (`resume`);
- its planner terms (`terms`: a `Terms`), the flags `python -m plan` takes for it (`plan_flags`) and the layouts
  the planner tries for it (`search`);
- its sweep rows and options (`sweep`: a `Sweep`);
- what a simulated rank needs of it (`simulate`, `findings`, `uneven_sites`: sim/fake_rank.py and sim/verify.py).

Every field but `name` is optional. The list of concepts is trainer/concepts.py: one import line each, in the order
they are consulted (the parser's groups, the checks within a phase, the planner's groups, the sweep's rows).
Here sit only the types: nothing in runtime/ imports a concept, and no runtime module imports a registration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class UsageError(ValueError):
    """Bad input: reported as one line, exit code 2, before any work."""


# a flag's range, checked before any work (trainer/config.check_ranges): integers, then finite floats
AT_LEAST_ONE, AT_LEAST_ZERO, POSITIVE, NON_NEGATIVE = ">= 1", ">= 0", "> 0", "float >= 0"
RANGES = (AT_LEAST_ONE, AT_LEAST_ZERO, POSITIVE, NON_NEGATIVE)

# When a check runs (trainer/config.check_layout), each phase knowing more than the one before:
#   flags   the arguments alone (after the trainer's own flag checks)
#   world   + `world`, the number of ranks (before the sizes are multiplied)
#   layout  + `dims`, `dtype`, `device` (the sizes multiply to the world size)
#   model   + `config` (the model's GPTConfig, from the flags or OpenAI's weights)
#   batch   + `micro` (the step's micro-batches: total_batch_size / (micro_batch_size x seq_len x dp))
PHASES = ("flags", "world", "layout", "model", "batch")


@dataclass
class Checking:
    """What validation knows so far (PHASES): a check reads it, and may leave what it resolved in `found`
    (the pipeline's Blocks per chunk, "pp_layers")."""

    args: Any
    world: int = 1
    dims: Any = None
    dtype: Any = None
    device: Any = None
    config: Any = None
    micro: int | None = None
    found: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """A process group the planner prices (plan/search.step_time): its ranks, the mesh dims whose link (inside a
    node or across) it travels, and whether its traffic hides behind compute (gradient syncs the wrappers issue
    asynchronously)."""

    size: int
    dims: tuple[str, ...]
    overlapped: bool = False


@dataclass(frozen=True)
class Terms:
    """A concept's planner terms, over the planner's layout view `s` (plan/counts.Setup: args, dims, config, dtype,
    grad_accum and what one rank holds: local_params, units, unit_shard, stage_blocks, moe_blocks, recomputed,
    root_gathers, unit_members, meta_gpt). Each is optional; the planner calls them in registration order.
    - comm(s, pp_rank, out): add its groups' payload bytes per step ({group: {kind: bytes}}), global rank 0 of
      stage pp_rank, as parallel/comm.COUNTER records them;
    - calls(s, pp_rank, out): the calls behind them, likewise;
    - state(s, pp_rank, shard_rank, expert_shard_rank, out): amend {"params", "grads", "optimizer"} bytes;
    - groups(s): {group: Group} for the groups it adds;
    - flops(s): FLOPs the busiest rank adds per step beyond the model's (compute, never hidden);
    - for_rank(s, coords, out): a prediction made the rank's at mesh `coords` (sim.verify)."""

    comm: Callable | None = None
    calls: Callable | None = None
    state: Callable | None = None
    groups: Callable | None = None
    flops: Callable | None = None
    for_rank: Callable | None = None


@dataclass(frozen=True)
class SweepOption:
    """A flag the whole sweep can run with (`python -m bench.sweep --optimizer ...`): every layout and its
    one-process reference get it; a value other than `default` holds step 1's grad norm only and adds `rtol`'s
    bound to the layout's tolerance (`rule` says why)."""

    flag: str
    choices: tuple[str, ...]
    default: str
    help: str = ""
    rule: str = ""
    rtol: Callable | None = None  # (the layout's GPTConfig, the lr at each step then 0 for the val loss, ref) -> float
    per_micro: bool = False  # its math is a function of the micro-batch: a layout's reference runs its micro-batch size


@dataclass(frozen=True)
class Sweep:
    """A concept's rows of the layout sweep (bench/sweep.Layout's fields, as dicts), in every sweep (`rows`) and
    in the 6- and 8-rank one (`large`, `--sample`), and an option the whole sweep may run with."""

    rows: Callable[[], list[dict]] | None = None
    large: Callable[[], list[dict]] | None = None
    option: SweepOption | None = None


@dataclass(frozen=True)
class Concept:
    name: str
    title: str = ""  # its flags' group in train.py --help
    flags: Callable | None = None  # (add_argument) -> None
    ranges: dict[str, str] = field(default_factory=dict)  # flag -> one of RANGES
    mesh: Callable | None = None  # (args) -> its sizes in parallel/mesh.ParallelDims ({"tp": 2})
    checks: tuple[tuple[str, Callable[[Checking], None]], ...] = ()  # (phase, check), in order
    parallel: Callable | None = None  # (Checking) -> its ParallelConfig fields
    model: Callable | None = None  # (args) -> its GPTConfig fields
    math_flags: tuple[str, ...] = ()  # recorded with each checkpoint; a resume with other values says so
    resume: Callable | None = None  # (manifest, args, path) -> None, or UsageError
    terms: Terms | None = None
    plan_flags: Callable | None = None  # (add_argument) -> None: python -m plan's, passed on when not the default
    search: Callable | None = None  # (sizes: {dim: n}) -> [(name part, flags)]: the variants the planner tries
    sweep: Sweep | None = None
    simulate: Callable | None = None  # (spec, setup) -> a context manager around a simulated rank's run
    findings: Callable | None = None  # (world, setup) -> [str]: sim.verify's checks of it
    uneven_sites: tuple[str, ...] = ()  # code whose collectives move other sizes on other ranks (sim.verify: op only)


_CONCEPTS: dict[str, Concept] = {}
_VERSION = [0]  # bumped by every change, for the caches of what is built from the registry


def register(concept: Concept) -> Concept:
    """Add `concept` (its module calls this once, at import); a second concept of the same name is an error."""
    if concept.name in _CONCEPTS:
        raise ValueError(f"concept {concept.name!r} is registered twice")
    for flag, kind in concept.ranges.items():
        if kind not in RANGES:
            raise ValueError(f"{concept.name}: range {kind!r} of --{flag} is none of {RANGES}")
    for phase, _ in concept.checks:
        if phase not in PHASES:
            raise ValueError(f"{concept.name}: phase {phase!r} is none of {PHASES}")
    _CONCEPTS[concept.name] = concept
    _VERSION[0] += 1
    return concept


def concepts() -> tuple[Concept, ...]:
    """Every registered concept, in registration order (trainer/concepts.py imports them)."""
    return tuple(_CONCEPTS.values())


def version() -> int:
    """Changes whenever the registry does: a key for caching what is built from it (a parser, say)."""
    return _VERSION[0]


@contextlib.contextmanager
def registered(concept: Concept) -> Iterator[Concept]:
    """`concept` registered for the block only (a test's throwaway concept)."""
    register(concept)
    try:
        yield concept
    finally:
        del _CONCEPTS[concept.name]
        _VERSION[0] += 1
