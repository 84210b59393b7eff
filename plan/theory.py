"""The formula sheet: what every layout stores, sends and holds, per rank, in closed form, beside the runtime.

Each formula is written in the sizes parallel/comm.py counts (payload bytes per kind and calls: all_reduce the
tensor, all_gather the gathered output, reduce_scatter the full input, p2p each message once, by its sender)
and with its derivation in its docstring. None of it runs in a training step: the planner (plan/predict.py)
builds its predictions from them, train.py logs them beside what the wrappers measured, and the tests hold
each one equal to a measured run (tests/test_ddp.py, test_zero.py, test_tp.py, test_context_parallel.py,
test_pipeline.py, test_plan_runs.py). Backend overheads (a ring's 2(N-1)/N, gloo emulating reduce-scatter with
an all-reduce) are properties of the transport, not of the algorithm, and are left out.

    data parallel       ddp_comm_bytes_per_step, ddp_comm_calls_per_step
    ZeRO 1-3 / FSDP     zero_comm_bytes_per_step, zero_comm_calls_per_step, fsdp_comm_bytes_per_micro_step,
                        fsdp_unit_state_bytes (the ZeRO ladder of state), and under a pipeline
                        zero_comm_bytes_per_pipeline_step, pipelined_root_gathers; the backward's held gradients
                        reduce_held_bytes, reduce_accumulated_held_bytes
    tensor parallel     tp_comm_bytes_per_micro_step, tp_comm_calls_per_micro_step
    context parallel    cp_p2p_bytes_per_micro_step, cp_p2p_calls_per_micro_step
    expert parallel     ep_all_to_all_bytes_per_micro_step, ep_all_to_all_calls_per_micro_step
    pipeline            p2p_bytes_per_step, p2p_calls_per_step, bubble_fraction (the simulator behind the V
                        schedules' and the p2p models' proofs: plan/timeline.py)
"""

from __future__ import annotations

from model.gpt import GPTConfig
from parallel.data_parallel.flat_param import ZERO_LADDER, shard_numel
from parallel.pipeline.schedule import ALL_SCHEDULES, V_SCHEDULES, chunk_of, rank_of

# ----------------------------------------------------------------------------- data parallel


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


# ----------------------------------------------------------------------------- ZeRO 1-3, FSDP, HSDP


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


# ----------------------------------------------------------------------------- tensor parallel


def tp_comm_bytes_per_micro_step(
    config: GPTConfig,
    B: int,
    T: int,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool,
    dtype_bytes: int = 4,
    residual_bytes: int | None = None,
    recomputed_blocks: int = 0,
    blocks: int | None = None,
    first: bool = True,
    last: bool = True,
    moe_blocks: int = 0,
) -> dict[str, int]:
    """Bytes parallel/comm.COUNTER records on one rank for one forward + backward, by kind.

    dtype_bytes: element size of matmul outputs (the compute dtype). residual_bytes: that of the residual stream,
    embeddings, LayerNorm outputs and weights' compute copies (fp32 under autocast, a sharding engine's param_dtype).
    With A(b) = B*T*C*b, one activation:
    - the region's 2L+1 entries (ln_1, ln_2 of each block, ln_f): f's backward all-reduce of A(residual),
      or under SP an all-gather forward and a reduce-scatter backward of A(residual) each;
    - its 2L exits (attn.c_proj, mlp.c_proj): g's forward all-reduce of A(dtype), or under SP a
      reduce-scatter forward and an all-gather backward each; the embedding's exit likewise, of A(residual);
    - under SP also the position embeddings' backward all-gather (T*C) and the all-reduce of the gradients of
      the replicated parameters that saw only T/p positions (LayerNorms, row-parallel biases), of residual_bytes;
    - the loss: with loss parallelism 3 fp32 numbers per token (max; target logit and sum-exp), else the
      all-gather of lm_head's whole (V, C) weight, in the compute dtype (VocabShard);
    - activation checkpointing of `recomputed_blocks` Blocks: backward re-runs each one's forward up to the
      last tensor it saves (mlp.c_proj's input; non-reentrant checkpointing stops there), so its forward
      collectives run again except mlp.c_proj's exit: under SP 2 all-gathers of A(residual) (ln_1, ln_2
      entries) and 1 reduce-scatter of A(dtype) (attn.c_proj), else 1 all-reduce of A(dtype).
    - a pipeline stage (`blocks` of the Blocks; `first`: it holds the embeddings, `last`: ln_f and the loss):
      each module it runs costs what it costs in the whole model, and the others nothing (default: the whole
      model, L Blocks, first and last).
    - `moe_blocks` of those Blocks MoE layers (tensor_parallel._moe: replicated, run whole): their ln_2 is no
      entry and the layer no exit, so without SP neither all-reduce; under SP the layer all-gathers its input
      forward (A(residual)) and its output's gradient backward (A(dtype)), the entry's and exit's all-gathers, but
      reduce-scatters neither, and has no row-parallel c_proj bias to all-reduce (ln_2's weight and bias, which
      still see T/p positions, are).
    """
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if tp == 1:
        return out
    residual_bytes = dtype_bytes if residual_bytes is None else residual_bytes
    C, N, E = config.n_embd, B * T, moe_blocks
    L = config.n_layer if blocks is None else blocks
    norms = 2 * L + last  # ln_1, ln_2 of each Block, and ln_f
    entries = (norms - E) * N * C * residual_bytes
    exits = (2 * L - E) * N * C * dtype_bytes + first * N * C * residual_bytes
    if sequence_parallel:
        moe = E * N * C * (residual_bytes + dtype_bytes)  # the MoE layers' own all-gathers, forward and backward
        out["all_gather"] += entries + exits + moe + first * T * C * residual_bytes
        out["reduce_scatter"] += entries + exits
        n_bias = 1 if config.bias else 0
        out["all_reduce"] += (norms * (1 + n_bias) * C + (2 * L - E) * n_bias * C) * residual_bytes
    else:
        out["all_reduce"] += entries + exits
    if sequence_parallel:
        out["all_gather"] += recomputed_blocks * 2 * N * C * residual_bytes
        out["reduce_scatter"] += recomputed_blocks * N * C * dtype_bytes
    else:
        out["all_reduce"] += recomputed_blocks * N * C * dtype_bytes
    if not last:
        return out
    if loss_parallel:
        out["all_reduce"] += 3 * N * 4
    else:
        out["all_gather"] += config.vocab_size * C * dtype_bytes
    return out


def tp_comm_calls_per_micro_step(
    config: GPTConfig,
    B: int,
    T: int,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool,
    recomputed_blocks: int = 0,
    blocks: int | None = None,
    first: bool = True,
    last: bool = True,
    moe_blocks: int = 0,
) -> dict[str, int]:
    """The calls behind `tp_comm_bytes_per_micro_step` (its arguments, less the element sizes): one per f or g
    and per SP all-gather or reduce-scatter (each moves one activation), so the 2L + last entries and 2L + first
    exits are a call each way; under SP the position embeddings' backward all-gather (first) and one all-reduce
    per replicated parameter that saw T/p positions (each LayerNorm's weight and bias, each row-parallel bias);
    a recomputed Block 2 all-gathers and 1 reduce-scatter (SP), else 1 all-reduce; the loss, whatever its number
    of row chunks, 2 all-reduces (max; target logit and sum-exp, each for all rows at once) with loss parallelism,
    else 1 all-gather of lm_head's weight. An MoE Block (`moe_blocks` of them) has one entry and one exit fewer,
    and under SP gathers its input and its output's gradient itself (2 all-gathers) and has no c_proj bias to
    all-reduce."""
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if tp == 1:
        return out
    L, E = (config.n_layer if blocks is None else blocks), moe_blocks
    entries, exits = 2 * L + last - E, 2 * L + first - E
    if sequence_parallel:
        n_bias = 1 if config.bias else 0
        out["all_gather"] += entries + exits + 2 * E + first + 2 * recomputed_blocks
        out["reduce_scatter"] += entries + exits + recomputed_blocks
        out["all_reduce"] += (entries + E) * (1 + n_bias) + (2 * L - E) * n_bias
    else:
        out["all_reduce"] += entries + exits + recomputed_blocks
    if last:
        out["all_reduce" if loss_parallel else "all_gather"] += 2 if loss_parallel else 1
    return out


# ----------------------------------------------------------------------------- context parallel


def cp_p2p_bytes_per_micro_step(
    n_layer: int, B: int, T: int, n_embd: int, cp: int, tp: int = 1, element_size: int = 4, recomputed_blocks: int = 0
) -> int:
    """What parallel/comm.COUNTER records as "p2p" on one rank for one forward + backward: per attention, with
    A = B·(T/C)·(n_embd/tp) elements (one k or v block: all of this rank's heads), forward sends 2(C-1)·A
    (k and v, C-1 moves; fully masked blocks still travel, only their compute is skipped) and backward
    2(C-1)·A (k, v) + 2(C-1)·A (dK, dV, C-1 moves) + 2·A (dK, dV home). k and v travel in `element_size` (the
    compute dtype's), dK and dV in fp32 (the ring sums them in fp32: context_parallel._RingAttention._backward).
    Activation checkpointing re-runs the forward of each recomputed Block. Nothing with one cp rank."""
    if cp == 1:
        return 0
    A = B * (T // cp) * (n_embd // tp)
    per_layer_fwd = 2 * (cp - 1) * A * element_size
    per_layer_bwd = 2 * (cp - 1) * A * element_size + (2 * (cp - 1) + 2) * A * 4
    return n_layer * (per_layer_fwd + per_layer_bwd) + recomputed_blocks * per_layer_fwd


def cp_p2p_calls_per_micro_step(n_layer: int, cp: int, recomputed_blocks: int = 0) -> int:
    """The messages behind `cp_p2p_bytes_per_micro_step`: `_exchange` sends each tensor (a k, v, dK or dV block
    of A elements) on its own, so one call per A: 2(C-1) forward and 4(C-1) + 2 backward per attention, and
    2(C-1) more per recomputed Block. Nothing with one cp rank."""
    if cp == 1:
        return 0
    return n_layer * (6 * (cp - 1) + 2) + recomputed_blocks * 2 * (cp - 1)


# ----------------------------------------------------------------------------- expert parallel


def ep_all_to_all_bytes_per_micro_step(
    tokens: int,
    k: int,
    n_embd: int,
    experts: int,
    moe_layers: int,
    ep: int = 2,
    dtype_bytes: int = 4,
    received: int | None = None,
    recomputed_layers: int = 0,
) -> int:
    """What parallel/comm.COUNTER records as "all_to_all" on one EP rank for one forward + backward of `tokens`
    tokens (its micro-batch's, B·T, or B·T/cp) through `moe_layers` MoE layers, k experts a token (each
    all_to_all counts this rank's input, parallel/comm.py):
    - the counts, E int64 (8E bytes), once per layer forward;
    - forward: its N·k assignment rows out (N·k·C·s), then the outputs of the rows its experts received back
      (R·C·s);
    - backward: the gradients of those two the other way round (R·C·s, then N·k·C·s);
    s = `dtype_bytes`, the compute dtype's (bf16 under bf16 autocast): the experts' outputs are in it, and the rows
    go in it too, cast before they are sent (moe.expert_rows: ln_2's output is fp32 under autocast, but the
    experts' first matmul casts it anyway, so the cast moves to the sender and the all_to_all carries half the
    bytes for the same values).
    R = `received`, the rows that reached this rank's experts. Summed over an EP group, Σ R = Σ N·k, so the
    group sends ep·(8E + 4·N·k·C·s) per layer; R = N·k exactly when the routing is balanced (the default).
    Activation checkpointing re-runs the forward of `recomputed_layers` layers (counts and both moves again).
    Nothing without EP."""
    if ep == 1:
        return 0
    R = tokens * k if received is None else received
    forward = 8 * experts + (tokens * k + R) * n_embd * dtype_bytes
    backward = (R + tokens * k) * n_embd * dtype_bytes
    return moe_layers * (forward + backward) + recomputed_layers * forward


def ep_all_to_all_calls_per_micro_step(moe_layers: int, ep: int = 2, recomputed_layers: int = 0) -> int:
    """The all_to_alls behind `ep_all_to_all_bytes_per_micro_step`: per MoE layer the counts and two moves
    forward, two moves backward; three more per recomputed layer. Nothing without EP."""
    return 0 if ep == 1 else 5 * moe_layers + 3 * recomputed_layers


# ----------------------------------------------------------------------------- pipeline


def p2p_bytes_per_step(
    pp: int, virtual: int, rank: int, micro: int, shape: tuple[int, ...], element_size: int = 4, v_shape: bool = False
) -> int:
    """Bytes rank `rank` sends per step (theory): every local chunk whose next chunk is on another rank sends
    each micro-batch's activation forward, every local chunk whose previous one is sends its input gradient
    backward (none between the V's chunks P-1 and P, both on rank P-1)."""
    n = 1
    for s in shape:
        n *= s
    return p2p_calls_per_step(pp, virtual, rank, micro, v_shape) * n * element_size


def p2p_calls_per_step(pp: int, virtual: int, rank: int, micro: int, v_shape: bool = False) -> int:
    """The messages (one `comm.send` each) rank `rank` sends per step, `p2p_bytes_per_step`'s: per micro-batch,
    one per local chunk whose next chunk is on another rank and one per local chunk whose previous one is."""
    if pp == 1:
        return 0
    C = pp * virtual
    chunks = [chunk_of(rank, v, pp, v_shape) for v in range(virtual)]
    messages = sum(c < C - 1 and rank_of(c + 1, pp, v_shape) != rank for c in chunks) + sum(
        c > 0 and rank_of(c - 1, pp, v_shape) != rank for c in chunks
    )
    return messages * micro


def bubble_fraction(schedule_name: str, pp: int, micro: int, virtual: int = 1) -> float:
    """Idle share of the makespan, bubble / (ideal + bubble), when every chunk's F and B take fixed times.

    GPipe and 1F1B: the fill and drain cost (P-1)(t_f+t_b) against M(t_f+t_b) of work per rank, so
    (P-1)/(M+P-1). Interleaving with V chunks per rank divides the fill and drain by V (each chunk is 1/V
    of a stage): (P-1)/(V·M+P-1). Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", section 2.2, state the same bubbles as bubble / ideal time:
    (p-1)/m and (p-1)/(v·m); x/(1+x) of those gives ours.

    ZB-H1 (Qi et al. 2023, section 3.1): the backward split into B and W, t_F = t_B = t_W; its bubble is
    (P-1)(t_F + t_B - t_W) = P-1 units against M·3 units of work per rank, so (P-1)/(3M+P-1): 1F1B's
    3(P-1) units of fill and drain cut to a third.

    ZB-V and DualPipe-V: the simulator's ideal timeline of the list (each chunk's F = B = W = 1). For M >= 2P
    both take 6M + P - 1 units (tests/test_pipeline_schedule.py): every rank idles P-1 chunk-F units, the
    least any list can (the last rank's first F waits for micro-batch 0 to cross P-1 chunks), so
    (P-1)/(6M+P-1): in units of a whole stage (2 chunks) half of ZB-H1's. DualPipe-V's gain over ZB-V, F and B
    of two micro-batches overlapped on two streams, is outside this model (its overlapped pairs run in turn).
    """
    if schedule_name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule_name!r}; known: {sorted(ALL_SCHEDULES)}")
    if schedule_name == "zb_h1":  # (P-1)(t_F + t_B - t_W) of idle against M(t_F + t_B + t_W) of work, all = 1
        return (pp - 1) / (3 * micro + pp - 1)
    if schedule_name in V_SCHEDULES:  # from the list itself: its ideal timeline (unit times, isends)
        from plan.timeline import simulate_schedule

        return simulate_schedule(
            ALL_SCHEDULES[schedule_name](pp, micro, 2), pp, 2, micro, p2p="async", v_shape=True
        ).bubble_fraction
    v = virtual if schedule_name == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro + pp - 1)


# ----------------------------------------------------------------------------- Muon (optim/distributed_muon.py)


def muon_ns_flops(shape: tuple[int, int], ns_steps: int) -> int:
    """Newton-Schulz's matmul FLOPs on one (R, C) matrix, m = min(R, C), n = max: per step the Gram X X^T (m x n
    times n x m: 2 m^2 n), its square A A (2 m^3) and (b A + c A^2) X (2 m^2 n); k steps."""
    m, n = sorted(shape)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def muon_owners(flops: list[int], held: list[list[int]], keys: list[str]) -> list[int]:
    """Each matrix's owner rank, LPT (longest processing time first): matrices in decreasing NS FLOPs (ties by key),
    each to the rank with the least FLOPs so far; ties to the rank holding most of it (least to gather), then the
    lowest. `held[m][r]`: elements rank r holds of matrix m. Graham's bound for this greedy: no rank ends above
    `muon_lpt_bound`."""
    world = len(held[0]) if held else 1
    load, out = [0] * world, [0] * len(flops)
    for m in sorted(range(len(flops)), key=lambda m: (-flops[m], keys[m])):
        out[m] = min(range(world), key=lambda r: (load[r], -held[m][r], r))
        load[out[m]] += flops[m]
    return out


def muon_lpt_bound(flops: list[int], world: int) -> float:
    """The most NS FLOPs LPT can give one rank of `world`: when the last matrix f went to the busiest rank it was
    the least loaded, so its load before was <= (F - f) / world, and the busiest ends at <= F / world +
    (1 - 1/world) f <= F / world + (1 - 1/world) max f (F the total). Graham 1969 (list scheduling)."""
    if not flops:
        return 0.0
    return sum(flops) / world + (1 - 1 / world) * max(flops)


def muon_exchange_bytes_per_step(
    holds: list[list[tuple[int, int] | None]], owners: list[int], rank: int
) -> dict[str, int]:
    """What `Exchange` sends from rank `rank` of a pipeline stage's group per optimizer step (its all_to_all inputs,
    as parallel/comm.COUNTER records them), in bf16 (2 bytes an element). `holds[m][s]`: rank s's piece of matrix
    m, (piece, elements) (ranks with equal `piece` hold the same elements: replicas) or None; `owners[m]`: its owner.
    - gather: the owner assembles m from one holder of each piece, itself for its own piece, else the lowest rank
      holding it; r sends h_r(m) for each m it does not own and is that holder of;
    - return: the owner sends its result's h_s(m) to every other rank s holding a piece: sum_s h_s(m) - h_o(m).
    Per layout (G ranks in the stage, n_m a matrix's elements, O_r those of the matrices r owns):
    - DDP, CP (every rank whole): gather 0, return 2 (G - 1) O_r;
    - TP over t (rows or columns, qkv as three matrices): gather 2 (N - O_r) / t, return 2 (t - 1) O_r / t, N all;
      with D data-parallel replicas the return grows to 2 (tD - 1) O_r / t, and only the lowest replica gathers;
    - ZeRO-1/2/3 over S (flat shards [r S_u, (r + 1) S_u) of each unit's padded buffer, S_u = ceil(numel_u / S)):
      h_r(m) = |[off_m, off_m + n_m) ∩ [r S_u, (r + 1) S_u)|, gather 2 sum_{m not r's} h_r(m), return
      2 sum_{m r's} (n_m - h_r(m));
    - EP: each expert whole on the G/ep ranks of its EP rank; the owner takes it from the lowest of them unless
      it is one, and returns it to each of them but itself;
    - PP: each stage on its own, over its own ranks and matrices."""
    return muon_exchange_bytes_by_rank(holds, owners)[rank]


def muon_exchange_bytes_by_rank(holds: list[list[tuple[int, int] | None]], owners: list[int]) -> list[dict[str, int]]:
    """`muon_exchange_bytes_per_step` of every rank of the group at once, in one pass over the holds (matrices x
    ranks: a 1,024-rank stage asks it whole in sim.verify)."""
    world = len(holds[0]) if holds else 1
    gather, back = [0] * world, [0] * world
    for row, o in zip(holds, owners):
        back[o] += sum(h[1] for s, h in enumerate(row) if h is not None and s != o)
        first: dict = {}
        for s, h in enumerate(row):
            if h is not None and h[1]:
                first.setdefault(h[0], s)
        for piece, s in first.items():
            if s != o and (row[o] is None or row[o][0] != piece):
                gather[s] += row[s][1]
    return [{"gather": 2 * g, "return": 2 * b} for g, b in zip(gather, back)]


def muon_exchange_calls_per_step(holds: list[list[tuple[int, int] | None]], owners: list[int]) -> int:
    """`Exchange`'s all_to_alls per step on every rank of the group (alike on all): the gather unless every owner
    holds its matrices whole, the return unless no rank but the owner holds a piece; none on one rank."""
    if len(holds[0] if holds else ()) <= 1:
        return 0
    whole = all(
        row[o] is not None and row[o][1] == sum(h[1] for h in {h[0]: h for h in row if h}.values())
        for row, o in zip(holds, owners)
    )
    alone = all(all(h is None or s == o for s, h in enumerate(row)) for row, o in zip(holds, owners))
    return (not whole) + (not alone)


def muon_optimizer_state_bytes(muon_elements: int, adamw_elements: int, adamw_tensors: int) -> int:
    """One rank's optimizer state under --optimizer muon: Muon keeps one fp32 momentum per element it steps (no
    step counter), AdamW its two fp32 moments per element and one fp32 step tensor per tensor it steps (on our
    flat engine a tensor is a view of a shard's piece: one per held non-Muon weight slice, and the no-decay piece
    whole). AdamW alone is 8 Ψ + 4 (tensors): Muon saves 4 bytes per element of its matrices."""
    return 4 * muon_elements + 8 * adamw_elements + 4 * adamw_tensors
