"""The sharding engine's ladder and formulas: what each ZeRO stage keeps (`ZERO_LADDER`, the policy
parallel/fsdp.py runs), and, per rank, the bytes and calls it sends per step (all-gathers, reduce-scatters, HSDP's
all-reduce; under a pipeline the roots' extra gathers) and the gradient bytes its backward holds as units
complete. tests/test_zero.py and tests/test_plan_runs.py hold them equal to parallel/comm.COUNTER and to the
allocator; plan/predict.py imports them."""
from __future__ import annotations

from dataclasses import dataclass


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


ZERO_LADDER = {1: ZeroStage(1, keeps_params=True, reduces_at_end=True),    # shards the optimizer state
               2: ZeroStage(2, keeps_params=True, reduces_at_end=False),   # + the gradients
               3: ZeroStage(3, keeps_params=False, reduces_at_end=False)}  # + the parameters (FSDP)


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


def pipelined_root_gathers(actions: list[tuple[str, int]], rooted: set[int]) -> int:
    """How often ZeRO-3 all-gathers a pipeline stage's roots (its root unit and tied matrix) in one step, from the
    rank's compute actions in order, (kind, chunk) with kind "F" or "B" (a split schedule's "W" touches no unit):
    `run_chunk` releases and re-gathers them for every chunk forward; a chunk backward gathers them again only
    when the previous backward's end released them (no forward since) and its backward starts at the roots' hook
    on the chunk's output: the chunks in `rooted`, the last (its output is the loss). Any other chunk's output is
    its last Block's, whose pre-backward hook runs first and starts the backward, and `_root_pre_backward` then
    returns at once: its backward needs no root values (the embedding's weight gradient reads only the ids).
    1F1B or GPipe, P = 2, M = 6: rank 0 gathers 6 times; rank 1 (the loss: F B F B ...) 6 as well, GPipe's
    last rank (M forwards, then M backwards) 2M - 1."""
    n, gathered = 0, False
    for kind, chunk in actions:
        if kind == "F":
            n, gathered = n + 1, True
        elif kind == "B":
            n, gathered = n + (chunk in rooted and not gathered), False
    return n


def zero_comm_bytes_per_pipeline_step(stage: int, roots: int, blocks: int, shard: int, replicas: int,
                                      micro_steps: int, root_gathers: int, param_bytes: int = 4,
                                      reduce_bytes: int = 4) -> dict[str, int]:
    """`zero_comm_bytes_per_step` for a pipeline stage's units (`roots`: the root and tied-matrix elements, padded)
    over a step of `micro_steps` micro-batches, each chunk run by `run_chunk`. ZeRO-1/2 keep full copies, so
    they gather once per step and reduce as without a pipeline (each unit's gradient is complete once per
    micro-batch: its Blocks sit in one chunk, the roots' users in the first or the last). ZeRO-3 gathers the
    Blocks twice per micro-batch as without one, but the roots `root_gathers` times (`pipelined_root_gathers`)
    instead of once per micro-step. (The tied embedding's all-reduce over [first, last] is the pipeline's.)"""
    out = zero_comm_bytes_per_step(stage, roots, blocks, shard, replicas, micro_steps, param_bytes, reduce_bytes)
    if stage == 3 and shard > 1:
        out["all_gather"] += (root_gathers - micro_steps) * roots * param_bytes
    return out


def zero_comm_calls_per_step(stage: int, roots: int, blocks: int, shard: int, replicas: int = 1,
                             micro_steps: int = 1, root_gathers: int | None = None) -> dict[str, int]:
    """The calls behind `zero_comm_bytes_per_step` (and, given `root_gathers`, `zero_comm_bytes_per_pipeline_step`),
    for `roots` root units (the root, and a pipeline stage's tied matrix; an empty root issues nothing) and
    `blocks` Block units: every unit is one flat buffer, so each gather, reduce-scatter and HSDP all-reduce of
    the bytes formula is one call per unit. ZeRO-1/2: a gather per unit per step, a reduce-scatter per unit per
    step (ZeRO-1) or per micro-step; ZeRO-3: per micro-step each Block gathered twice and the roots once (under
    a pipeline `root_gathers` times per step instead), a reduce-scatter per unit; HSDP: an all-reduce of each
    reduced shard."""
    units, M = roots + blocks, micro_steps
    out = {"all_gather": 0, "reduce_scatter": 0}
    if shard > 1:
        if stage == 3:
            out["all_gather"] = (M if root_gathers is None else root_gathers) * roots + 2 * M * blocks
        else:
            out["all_gather"] = units
        out["reduce_scatter"] = units * (1 if stage == 1 else M)
    out["all_reduce"] = units * (1 if stage == 1 else M) if replicas > 1 else 0
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


def reduce_held_bytes(stage: int, grads: int, padded: int, prev: int, before: int, shard: int,
                      param_bytes: int = 4, reduce_bytes: int = 4, copies_input: bool = False) -> int:
    """Gradient bytes a backward holds beyond the state at the moment a unit's flat gradient is made, the last
    allocation before `_post_backward` runs: autograd's SplitWithSizesBackward concatenates (aten::cat) the
    unit's parameter gradients, `grads` elements it still holds, into one flat gradient of `padded` elements,
    both in the compute dtype. ZeRO-2/3 (`GradReduction`, one reduce-scatter in flight: `finish(final=False)`
    before each `start`) also hold the previous unit's reduction (`prev` padded elements, 0 for none): its full
    gradient in `reduce_dtype`, the reduce-scatter's output (prev / S) and, where the backend copies its input
    (`copies_input`: gloo's reduce_scatter_tensor clones it, all-reduces the clone, and copies this rank's chunk
    out on wait; NCCL reduces in place), that copy; and the reduced output of the unit before it (`before`
    padded elements), kept in `reducing` until the next `finish` adds it into `.grad`. ZeRO-1 adds the flat
    gradient into the unit's kept full buffer (state) and frees it: nothing in flight."""
    out = (grads + padded) * param_bytes
    if not ZERO_LADDER[stage].reduces_at_end:
        copy = prev if copies_input and shard > 1 else 0
        out += (prev + copy + prev // shard + before // shard) * reduce_bytes
    return out


def reduce_accumulated_held_bytes(padded: list[int], shard: int, reduce_bytes: int = 4,
                                  copies_input: bool = False) -> int:
    """What ZeRO-1's end-of-step reduction (`reduce_accumulated`, `keep`) holds beyond its full gradient
    buffers (state), for units of `padded` elements: every reduce-scatter is started before any is waited, so
    the backend's copies of every input (`copies_input`, gloo: see `reduce_held_bytes`) and, unless the output
    is the buffer's own slice (an fp32 reduction), every 1/S output."""
    copy = copies_input and shard > 1
    return sum(p * copy + (p // shard if reduce_bytes != 4 else 0) for p in padded) * reduce_bytes
