"""Data parallelism's formulas (DDP, ZeRO 1-3 / FSDP, HSDP): what each rank stores and sends per step, in closed
form, and its terms of the planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank).

Each formula is written in the sizes parallel/comm.py counts (payload bytes per kind and calls: all_reduce the
tensor, all_gather the gathered output, reduce_scatter the full input), with its derivation in its docstring. None
of it runs in a training step (the wrappers never import it): the planner and the tests hold each one equal to a
measured run (tests/test_ddp.py, test_zero.py, test_plan_runs.py).

    DDP                 ddp_comm_bytes_per_step, ddp_comm_calls_per_step
    ZeRO 1-3 / FSDP     zero_comm_bytes_per_step, zero_comm_calls_per_step, fsdp_comm_bytes_per_micro_step,
                        fsdp_unit_state_bytes (the ZeRO ladder of state), and under a pipeline
                        zero_comm_bytes_per_pipeline_step, pipelined_root_gathers; the backward's held gradients
                        reduce_held_bytes, reduce_accumulated_held_bytes
"""

from __future__ import annotations

from parallel.data_parallel.flat_param import ZERO_LADDER, ZERO_STAGES, shard_numel
from parallel.expert_parallel.theory import is_expert
from runtime.registry import Group, Terms


def ddp_comm_bytes_per_step(n_params: int, world: int, grad_bytes: int = 4) -> dict[str, int]:
    """What parallel/comm.COUNTER records on one rank per optimizer step: one all-reduce of the gradients
    of the `n_params` unique trainable parameters (Ψ), `grad_bytes` each (4; 2 with grad_compression="bf16"),
    however many micro-steps accumulated under `no_sync()` before it. Nothing with one rank. Not included:
    the int32 per parameter that find_unused_parameters=True adds."""
    return {"all_reduce": n_params * grad_bytes if world > 1 else 0}


def ddp_comm_calls_per_step(
    param_bytes: list[int], world: int, cap_bytes: int, groups: list[int] | None = None
) -> dict[str, int]:
    """The all-reduces behind `ddp_comm_bytes_per_step`: one per bucket per optimizer step (a pipeline's
    `reduce_on_exit` launches each bucket once too). `param_bytes`: each unique trainable parameter's bytes in
    registration order (one dtype and device, as our models are); the buckets are `build_buckets`' greedy rule
    (reverse order, a bucket closed when the next parameter would push it past `cap_bytes`, or is reduced over
    another group), counted on sizes. `groups`: each parameter's reduce group by its size (default: all
    `world`; expert parallelism's experts: their expert-data-parallel group, dp·cp/ep ranks, never the same size
    as dp·cp); the calls counted are the buckets over `world` ranks (a bucket over one rank issues none)."""
    groups = groups or [world] * len(param_bytes)
    if world == 1 or not param_bytes:
        return {"all_reduce": 0}
    buckets, size, last = [], 0, None
    for nbytes, g in zip(reversed(param_bytes), reversed(groups)):
        if not buckets or size + nbytes > cap_bytes or g != last:
            buckets, size, last = buckets + [g], 0, g
        size += nbytes
    return {"all_reduce": buckets.count(world)}


def zero_comm_bytes_per_step(
    stage: int,
    root: int,
    blocks: int,
    shard: int,
    replicas: int = 1,
    micro_steps: int = 1,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, int]:
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
        out = {
            k: v * micro_steps
            for k, v in fsdp_comm_bytes_per_micro_step(root, blocks, shard, True, param_bytes, reduce_bytes).items()
        }
        scatters = micro_steps if shard > 1 else 0
    else:
        scatters = (1 if stage == 1 else micro_steps) if shard > 1 else 0
        out = {"all_gather": psi * param_bytes if shard > 1 else 0, "reduce_scatter": psi * reduce_bytes * scatters}
    out["all_reduce"] = psi // shard * reduce_bytes * (1 if stage == 1 else micro_steps) if replicas > 1 else 0
    return out


def pipelined_root_gathers(actions: list[tuple[str, int]], rooted: set[int]) -> int:
    """How often ZeRO-3 all-gathers a pipeline stage's roots (its root unit and tied matrix) in one step, from the
    rank's compute actions in order, (kind, chunk) with kind "F" or "B" (a split schedule's "W" touches no unit):
    `run` releases and re-gathers them for every chunk forward; a chunk backward gathers them again only
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


def zero_comm_bytes_per_pipeline_step(
    stage: int,
    roots: int,
    blocks: int,
    shard: int,
    replicas: int,
    micro_steps: int,
    root_gathers: int,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, int]:
    """`zero_comm_bytes_per_step` for a pipeline stage's units (`roots`: the root and tied-matrix elements, padded)
    over a step of `micro_steps` micro-batches, each chunk run by the engine's `run`. ZeRO-1/2 keep full copies, so
    they gather once per step and reduce as without a pipeline (each unit's gradient is complete once per
    micro-batch: its Blocks sit in one chunk, the roots' users in the first or the last; a V's rank 0 holds both,
    and its runner keeps the head's root gradient for chunk 0's backward, which reduces the sum). ZeRO-3 gathers the
    Blocks twice per micro-batch as without one, but the roots `root_gathers` times (`pipelined_root_gathers`)
    instead of once per micro-step. (The tied embedding's all-reduce over [first, last] is the pipeline's.)"""
    out = zero_comm_bytes_per_step(stage, roots, blocks, shard, replicas, micro_steps, param_bytes, reduce_bytes)
    if stage == 3 and shard > 1:
        out["all_gather"] += (root_gathers - micro_steps) * roots * param_bytes
    return out


def zero_comm_calls_per_step(
    stage: int,
    roots: int,
    blocks: int,
    shard: int,
    replicas: int = 1,
    micro_steps: int = 1,
    root_gathers: int | None = None,
) -> dict[str, int]:
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


def fsdp_comm_bytes_per_micro_step(
    root: int, blocks: int, world: int, reshard_after_forward: bool = True, param_bytes: int = 4, reduce_bytes: int = 4
) -> dict[str, int]:
    """Payload bytes of one rank's all-gathers and reduce-scatters in one synchronised forward + backward,
    given the elements of the root unit and of all Block units together: the root is gathered once (kept
    from forward to backward), each Block twice (once without `reshard_after_forward`), and every gradient
    is reduce-scattered once. In Ψ terms: all-gather 2Ψ_blocks + Ψ_root, reduce-scatter Ψ. Nothing with one
    rank."""
    if world == 1:
        return {"all_gather": 0, "reduce_scatter": 0}
    passes = 2 if reshard_after_forward else 1
    return {"all_gather": (root + passes * blocks) * param_bytes, "reduce_scatter": (root + blocks) * reduce_bytes}


def reduce_held_bytes(
    stage: int,
    grads: int,
    padded: int,
    prev: int,
    before: int,
    shard: int,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
    copies_input: bool = False,
) -> int:
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


def reduce_accumulated_held_bytes(
    padded: list[int], shard: int, reduce_bytes: int = 4, copies_input: bool = False
) -> int:
    """What ZeRO-1's end-of-step reduction (`reduce_accumulated`, `keep`) holds beyond its full gradient
    buffers (state), for units of `padded` elements: every reduce-scatter is started before any is waited, so
    the backend's copies of every input (`copies_input`, gloo: see `reduce_held_bytes`) and, unless the output
    is the buffer's own slice (an fp32 reduction), every 1/S output."""
    copy = copies_input and shard > 1
    return sum(p * copy + (p // shard if reduce_bytes != 4 else 0) for p in padded) * reduce_bytes


def fsdp_unit_state_bytes(
    numel: int,
    n_decay: int,
    world: int,
    rank: int,
    keeps_params: bool,
    reduces_at_end: bool,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
) -> dict[str, int]:
    """What `FlatLayout.state_breakdown` counts for one unit after an optimizer step (the theory, for the planner):
    of `numel` elements (`n_decay` of them in >= 2-D weights, first), rank `rank` of `world` holds
    [lo, lo + S) of the padded buffer, S = `shard_numel`, as up to two pieces (decay, no-decay):
    - params: the fp32 shard, and with `keeps_params` the full padded copy in the compute dtype (in fp32 the
      shard is a view of it, so only the copy counts);
    - grads: the fp32 shard gradient (S, one reduced buffer the pieces' .grad view) if it holds a piece;
      with `reduces_at_end` (ZeRO-1) the full padded buffer in `reduce_bytes`, which in fp32 is itself
      the shard gradient's storage;
    - optimizer: AdamW's two fp32 moments per held element and one fp32 step tensor per piece."""
    S = shard_numel(numel, world)
    lo = rank * S
    held = max(0, min(numel, lo + S) - lo)
    pieces = (min(n_decay, lo + S) > lo) + (min(numel, lo + S) > max(n_decay, lo))
    params = S * 4 if not keeps_params else S * world * param_bytes + (0 if param_bytes == 4 else S * 4)
    grads = S * 4 if pieces else 0
    if reduces_at_end:
        grads = S * world * reduce_bytes + (grads if reduce_bytes != 4 else 0)
    return {"params": params, "grads": grads, "optimizer": 8 * held + 4 * pieces}


def engine_comm_bytes_per_micro_step(fsdp) -> dict[str, int]:
    """`fsdp_comm_bytes_per_micro_step` of a built sharding engine (parallel/data_parallel/fsdp.py): its units' padded
    flat
    buffers, i.e. at most N - 1 elements per unit more than the parameters themselves, in its dtypes."""
    import torch

    roots = sum(u.padded for u in fsdp.roots)
    blocks = sum(u.padded for u in fsdp.units if u not in fsdp.roots)
    p_size = torch.empty((), dtype=fsdp.param_dtype).element_size()
    r_size = torch.empty((), dtype=fsdp.reduce_dtype).element_size()
    return fsdp_comm_bytes_per_micro_step(roots, blocks, fsdp.world, fsdp.reshard_after_forward, p_size, r_size)


# ----------------------------------------------------------------------------- the planner's terms


def comm(s, pp_rank: int, out: dict) -> None:
    """Groups "dp" (DDP over dp x cp, or a ZeRO stage's gathers and scatters over dp_shard x cp), "dp_replicate"
    (HSDP's all-reduce) and under expert parallelism "edp" (the experts' gradients: DDP's expert buckets
    all-reduced, a ZeRO stage's expert units gathered and reduce-scattered, over the dp·cp/ep ranks holding the
    same experts, as Blocks with no HSDP replicas: the edp group spans them); a sharding engine under a pipeline
    by `zero_comm_bytes_per_pipeline_step`, its roots' gathers counted on the rank's action list."""
    d, a, M = s.dims, s.args, s.grad_accum
    shard, edp = d.dp_shard * d.cp, d.dp * d.cp // d.ep
    if s.dp_type == "ddp":
        params = s.local_params(pp_rank)
        grad = 2 if a.grad_compression == "bf16" else 4
        experts = sum(k for n, k, _ in params if is_expert(n)) if d.ep > 1 else 0
        out["dp"] = ddp_comm_bytes_per_step(sum(k for _, k, _ in params) - experts, d.dp * d.cp, grad)
        if d.ep > 1:
            out["edp"] = ddp_comm_bytes_per_step(experts, edp, grad)
    elif s.dp_type in ZERO_STAGES:
        padded = {u: shard_numel(n, s.unit_shard(u)) * s.unit_shard(u) for u, (n, _) in s.units(pp_rank).items()}
        roots = padded.pop("root") + padded.pop("tied", 0)
        experts = sum(padded.pop(u) for u in list(padded) if u.endswith(".experts"))
        blocks_padded, stage = sum(padded.values()), ZERO_STAGES[s.dp_type]
        if d.pp_enabled:
            gathers = s.root_gathers(pp_rank)
            zero = zero_comm_bytes_per_pipeline_step(
                stage, roots, blocks_padded, shard, d.dp_replicate, M, gathers, s.param_bytes, s.reduce_bytes
            )
        else:
            gathers = M
            zero = zero_comm_bytes_per_step(
                stage, roots, blocks_padded, shard, d.dp_replicate, M, s.param_bytes, s.reduce_bytes
            )
        out["dp_replicate"] = {"all_reduce": zero.pop("all_reduce")}
        out["dp"] = zero
        if d.ep > 1:  # expert units: gathered and released with their Block, no roots, no replicas
            out["edp"] = zero_comm_bytes_per_pipeline_step(
                stage, 0, experts, edp, 1, M, gathers, s.param_bytes, s.reduce_bytes
            )


def calls(s, pp_rank: int, out: dict) -> None:
    """`comm`'s calls, group by group: DDP's buckets (`build_buckets`' key: an expert's own group), a sharding
    engine's unit by unit (an empty root, a middle stage's, issues nothing)."""
    d, a, M = s.dims, s.args, s.grad_accum
    edp = d.dp * d.cp // d.ep
    if s.dp_type == "ddp":
        params = s.local_params(pp_rank)
        sizes, cap = [4 * n for _, n, _ in params], int(a.bucket_cap_mb * 1024 * 1024)
        groups = [edp if d.ep > 1 and is_expert(n) else d.dp * d.cp for n, _, _ in params]  # build_buckets' key
        out["dp"] = ddp_comm_calls_per_step(sizes, d.dp * d.cp, cap, groups)
        if d.ep > 1:
            out["edp"] = ddp_comm_calls_per_step(sizes, edp, cap, groups)
    elif s.dp_type in ZERO_STAGES:
        u = {k: n for k, (n, _) in s.units(pp_rank).items() if n}  # an empty root (a middle stage) issues nothing
        roots = sum(k in ("root", "tied") for k in u)
        experts = sum(k.endswith(".experts") for k in u)
        gathers = s.root_gathers(pp_rank) if d.pp_enabled else None
        zero = zero_comm_calls_per_step(
            ZERO_STAGES[s.dp_type], roots, len(u) - roots - experts, d.dp_shard * d.cp, d.dp_replicate, M, gathers
        )
        out["dp_replicate"] = {"all_reduce": zero.pop("all_reduce")}
        out["dp"] = zero
        if d.ep > 1:
            out["edp"] = zero_comm_calls_per_step(ZERO_STAGES[s.dp_type], 0, experts, edp, 1, M, gathers)


def state(s, pp_rank: int, shard_rank: int, expert_shard_rank: int, out: dict) -> None:
    """A ZeRO stage's state per unit (`fsdp_unit_state_bytes`), for the rank `shard_rank` of the sharding group
    (dp_shard x cp: its shard holds one or two pieces of a unit, each with its own step tensor), and
    `expert_shard_rank` of an expert unit's (edp: Setup.unit_shard). DDP keeps the plain count: fp32 parameters and
    gradients (its buckets' views: the same bytes) and AdamW's two moments and step."""
    if s.dp_type not in ZERO_STAGES:
        return
    policy = ZERO_LADDER[ZERO_STAGES[s.dp_type]]
    held = dict.fromkeys(("params", "grads", "optimizer"), 0)
    for unit, (numel, n_decay) in s.units(pp_rank).items():
        expert = unit.endswith(".experts")
        got = fsdp_unit_state_bytes(
            numel,
            n_decay,
            s.unit_shard(unit),
            expert_shard_rank if expert else shard_rank,
            policy.keeps_params,
            policy.reduces_at_end,
            s.param_bytes,
            s.reduce_bytes,
        )
        for k in held:
            held[k] += got[k]
    out.update(held)


BATCH = ("dp_replicate", "dp_shard", "cp")  # the mesh dims of the batch ranks (dp x cp)


def groups(s) -> dict[str, Group]:
    """dp over dp x cp (DDP) or dp_shard x cp, HSDP's replicas, the experts' edp: gradient traffic the wrappers
    issue asynchronously (DDP's buckets, ZeRO-2/3's units; ZeRO-1 reduces at the end of the step)."""
    d = s.dims
    hidden = s.dp_type in ("ddp", "zero2", "fsdp")
    return {
        "dp": Group(d.dp_shard * d.cp if s.dp_type != "ddp" else d.dp * d.cp, BATCH, hidden),
        "dp_replicate": Group(d.dp_replicate, ("dp_replicate",), hidden),
        "edp": Group(d.dp * d.cp // d.ep, BATCH, hidden),
    }


TERMS = Terms(comm=comm, calls=calls, state=state, groups=groups)
