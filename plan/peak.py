"""One rank's peak memory, predicted: parameters + AdamW state + the largest phase of a step (`peak_parts`).

The phases are the end of forward (the saved activations, the loss's buffers, the gradients a forward runs beside,
autocast's weight copies), full AC's recomputation, a sharding engine's backward as its units complete
(`reduce_phase`: `reduce_transient`, and under a split schedule the largest over the states its B's run in,
`split_moment`: the flat gradients held for W, the W's reductions in flight), and the optimizer step. Every term is
a count of tensors the code keeps, each derived in its docstring from the module that keeps it; the per-rank
parameters, units, state and saved activations come from plan.counts. An allocator's peak: what
torch.cuda.max_memory_allocated and, on the CPU, memory.AllocatedPeak (under fake tensors memory.LiveStorages)
measure.
"""

from __future__ import annotations

import functools

import torch

from model.loss import loss_chunk_rows
from parallel.data_parallel.flat_param import ZERO_STAGES, shard_numel
from parallel.pipeline.schedule import (
    ALL_SCHEDULES,
    RECV_B,
    RECV_F,
    SPLIT_SCHEDULES,
    V_SCHEDULES,
    B,
    F,
    W,
    chunk_of,
    rank_of,
)
from plan.counts import (
    Setup,
    _head_in_flight,
    _layers,
    block_input_bytes,
    block_saved_bytes,
    ends_saved_bytes,
    head_grad_bytes,
    is_expert,
    local_params,
    micro_saved_bytes,
    moe_saved_bytes,
    recomputed_blocks,
    saved_activation_bytes,
    stage_blocks,
    stage_chunks,
    state_bytes,
    unit_shard,
    units,
)
from plan.theory import reduce_accumulated_held_bytes, reduce_held_bytes


def largest_transient(s: Setup, pp_rank: int = 0) -> int:
    """The buffers alive beside the end of forward's activations, when the loss runs (`loss_transient`), and
    under ZeRO-3 the units gathered then: the root (or the tied unit: the head's weight) and the next,
    prefetched for backward (the largest other unit). An allocator's view: fragmentation and the CUDA context
    are not in it."""
    out = 0
    if s.dp_type == "fsdp":
        padded = _padded(s, pp_rank)
        head = padded.pop("tied", 0) or padded.pop("root")
        blocks = [n + padded.get(f"{u}.experts", 0) for u, n in padded.items() if not u.endswith(".experts")]
        out = (head + max(blocks, default=0)) * s.param_bytes  # a Block gathered with its experts
    if stage_blocks(s, pp_rank)[2]:
        out += loss_transient(s)
    return out


def _padded(s: Setup, pp_rank: int = 0) -> dict[str, int]:
    """Each unit's flat buffer, padded to a multiple of its group's size (`unit_shard`)."""
    return {u: shard_numel(n, unit_shard(s, u)) * unit_shard(s, u) for u, (n, _) in units(s, pp_rank).items()}


def loss_transient(s: Setup) -> int:
    """The most bytes the chunked loss (loss._LinearCrossEntropy, loss.loss_chunk_rows rows a chunk for the run's
    device) holds at once in its forward, beside its gradients' buffers (saved: `ends_saved_bytes`), a = compute
    bytes, n = chunk rows, N = rows, V' = V/p (this rank's columns):
    - under autocast (a != 4) the compute-dtype casts of x and the weight, (N + V') x C x a;
    - whole vocabulary (one process, DP, CP): a chunk's logits, log-softmax and gradient, 3 x n x V x 4 in fp32 (the
      log_softmax kernels); under autocast then the gradient's cast, n x V x a, and one chunk's bf16 g^T x (V x C x a)
      beside the fp32 gradient, n x V x 4;
    - vocab-parallel (tensor_parallel.VocabShard, TP) with loss parallelism: the first pass's last chunk keeps its
      (n, V') logits beside their exponentials, 2 x n x V' x 4; the second pass's chunk (in fp32, turned into its
      gradient in place) with, under autocast, the gradient's cast and g^T x and g W's (n, C): n x V' x (4 + a) +
      (V' + n) x C x a;
    - without loss parallelism: lm_head's weight all-gathered, V x C x a, beside the whole vocabulary's chunk, of
      which the gradient's cast and g^T x are this rank's columns."""
    a, c = s.args, s.config
    N = a.micro_batch_size * a.seq_len // s.dims.cp
    n, C, V = min(loss_chunk_rows(c.vocab_size, a.device.split(":")[0]), N), c.n_embd, c.vocab_size
    cb, Vp = s.compute_bytes, c.vocab_size // s.dims.tp
    mixed = cb != 4
    casts = (N + Vp) * C * cb if mixed else 0
    if not s.dims.tp_enabled:
        return casts + max(3 * n * V * 4, n * V * (4 + cb) + V * C * cb if mixed else 0)
    if a.enable_loss_parallelism:
        return casts + max(2 * n * Vp * 4, n * Vp * (4 + cb) + (Vp + n) * C * cb if mixed else 0)
    return casts + V * C * cb + max(3 * n * V * 4, n * V * 4 + n * Vp * cb + (Vp + n) * C * cb if mixed else 0)


def held_grad_bytes(s: Setup, pp_rank: int = 0) -> int:
    """The gradient bytes alive while a forward runs: DDP's buckets and ZeRO-1's full-gradient buffers (both kept
    across steps), and every gradient when a step runs more than one backward (M micro-steps, or a pipeline's
    micro-batches: the first backward allocates them beside the next forward's activations). Otherwise none:
    train.py's zero_grad(set_to_none) frees them after the optimizer step, and backward allocates them as it
    frees the activations."""
    grads = state_bytes(s, pp_rank)["grads"]
    if s.dp_type == "ddp" or s.grad_accum > 1 or (s.dp_type in ZERO_STAGES and ZERO_STAGES[s.dp_type] == 1):
        return grads
    return 0


# ----------------------------------------------------------------------------- the sharding engine's backward

EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
HEAD = ("lm_head.weight", "transformer.ln_f.weight", "transformer.ln_f.bias")  # lm_head: wte where tied to it


def reduce_transient(s: Setup, pp_rank: int = 0, tail: tuple[int, int] = (0, 0), missing: int = 0) -> int:
    """The most bytes a sharding engine's chunk backward holds for its gradients beyond the parameters and
    optimizer state, the other micro-batches' activations and ZeRO-3's gathered roots: over each of the rank's
    chunks and the units its backward completes, in order, `theory.reduce_held_bytes` at the unit's flat gradient
    (its parameter gradients and their concatenation; ZeRO-2/3 the previous unit's reduce-scatter in flight and
    the one before's output), plus the shard gradients (every one once a step runs more than one backward, and
    ZeRO-1's full buffers always; in a step's only backward those of the units reduced before), plus ZeRO-3's
    gathered Block and the one `_pre_backward` prefetched below it, plus this micro-batch's activations still
    saved then (the Blocks below; the head's units see all of them). The order, per chunk:
    the head's units (a last stage's tied lm_head copy, then the root's ln_f), the Blocks top down, and the
    embeddings' units: both embedding_dense_backward gradients (whole tables) exist before either unit is
    concatenated, the tied unit (wte) first (`_run` shows it after the root: autograd runs the later node of
    two ready ones first), then the root (wpe). One chunk with both ends (no pipeline) completes its root last,
    so lm_head's and ln_f's gradients wait through the Blocks; a V's rank 0 holds the ends in two chunks, and under
    ZeRO-2/3 keeps the root's full gradient (reduce dtype) from the head's chunk backward, where it completes first,
    through the embeddings' chunk backward, which reduces the sum (`PipelineRunner._hold_roots`).

    Under a split schedule (ZB-H1, ZB-V, DualPipe-V) a B reduces nothing of its Blocks: each Block's (and its
    experts') flat gradient is kept for the W (zero_bubble.hold_for_w), so the B's units made before the current
    one are all alive (compute dtype), and what is in flight is the last W's: the reductions the W's since the
    previous B started (`tail`, (before, prev): the last one's reduce-scatter, the one before's output; a B's end
    waits for all), which the B's own root units (not deferred: the embeddings, the head) then follow in the chain;
    `missing`: the shard gradients' bytes not made yet at this B (`_b_states`). Nor does a B free its Blocks'
    activations: each deferred linear keeps its input and output gradient for the W, about a Block's saved bytes
    (`saved_activation_bytes`), a checkpointed Block's too once recomputed. 0 without a sharding engine."""
    if s.dp_type not in ZERO_STAGES:
        return 0
    a, d, stage = s.args, s.dims, ZERO_STAGES[s.dp_type]
    shard, pb, rb, copies = d.dp_shard * d.cp, s.param_bytes, s.reduce_bytes, s.copies_reduce_input
    sizes = units(s, pp_rank)
    padded = _padded(s, pp_rank)
    params = {n: k for n, k, _ in local_params(s, pp_rank)}
    numel = lambda names: sum(params.get(n, 0) for n in names)  # noqa: E731
    lm_head = "lm_head.weight" if "lm_head.weight" in params else "transformer.wte.weight"
    head = numel((lm_head, *HEAD[1:]))
    B, T = a.micro_batch_size, a.seq_len // d.cp
    X = block_input_bytes(s)
    tied = "tied" in padded
    V, v_shape = a.pp_virtual_stages or 1, a.pp_schedule in V_SCHEDULES
    split = d.pp_enabled and a.pp_schedule in SPLIT_SCHEDULES
    if d.pp_enabled:
        layers = _layers(s.config, d.pp, V, a.seq_len, s.pp_layers, v_shape)
        chunks = [chunk_of(pp_rank, v, d.pp, v_shape) for v in range(V)]
    else:
        layers, chunks = (range(s.config.n_layer),), [0]
    every, every_held = state_bytes(s, pp_rank)["grads"], stage == 1 or s.grad_accum > 1
    # a V's rank 0 (both ends, two chunks) under ZeRO-2/3: the head's root gradient, held for chunk 0's backward
    kept = padded["root"] * rb if stage > 1 and len(chunks) > 1 and 0 in chunks and len(layers) - 1 in chunks else 0
    orders = {}
    for c in chunks:
        blocks, first, last = list(layers[c]), c == 0, c == len(layers) - 1
        ends = ends_saved_bytes(s, B, T, first, False)
        below = [
            ends + sum(X if recomputed_blocks(s, [i]) else block_saved_bytes(s, B, T, i) for i in blocks[:k])
            for k in range(len(blocks) + 1)
        ]
        if split:  # the Blocks from k up keep their linears' (x, dy) for the W: about their saved bytes
            below = [below[k] + sum(block_saved_bytes(s, B, T, i) for i in blocks[k:]) for k in range(len(below))]
        # (gradient elements, padded, gathered elements, activation bytes, the unit's group size, kept for W)
        order: list[tuple[int, int, int, int, int, bool]] = []
        heads: list[tuple[int, int, int, int, int, bool]] = []
        if last and not first:  # split: after the Blocks (measured), all of whose (x, dy) are still kept
            all_saved = below[0] if split else below[-1] + ends_saved_bytes(s, B, T, False, True)
            root_saved = below[0] if split else 0
            heads = (
                [
                    (params[lm_head], padded["tied"], 0, all_saved, shard, False),
                    (head - params[lm_head], padded["root"], 0, root_saved, shard, False),
                ]
                if tied
                else [(head, padded["root"], 0, root_saved, shard, False)]
            )
        if not split:
            order += heads
        waiting = head if first and last else 0  # lm_head's and ln_f's gradients, until the root's concatenation
        with_experts = lambda u: padded[u] + padded.get(f"{u}.experts", 0)  # noqa: E731 (gathered together)
        for k in reversed(range(len(blocks))):
            u, lower = f"transformer.h.{blocks[k]}", f"transformer.h.{blocks[k - 1]}" if k else None
            gathered = with_experts(u) + (with_experts(lower) if lower else 0) if stage == 3 else 0
            if f"{u}.experts" in padded:  # its experts' unit completes first, in the MoE's backward, the Block's
                # attention and LayerNorms still saved
                e = f"{u}.experts"
                rest = block_saved_bytes(s, B, T, blocks[k]) - moe_saved_bytes(s, B, T)
                order.append(
                    (sizes[e][0], padded[e], gathered, below[k] + (0 if split else rest), unit_shard(s, e), split)
                )
            order.append((sizes[u][0] + waiting, padded[u], gathered, below[k], shard, split))
        if split:
            order += heads
        if first:
            wpe, saved = numel(EMBEDDINGS[1:]), below[0] if split else 0  # split: the Blocks' (x, dy) still kept
            order += (
                [
                    (numel(EMBEDDINGS), padded["tied"], 0, saved, shard, False),
                    (wpe, padded["root"], 0, saved, shard, False),
                ]
                if tied and not last
                else [
                    (
                        numel(EMBEDDINGS) + waiting - (params[lm_head] if last else 0),
                        padded["root"],
                        0,
                        saved,
                        shard,
                        False,
                    )
                ]
            )
        orders[c] = order
    most, every = 0, every - missing
    for c, order in orders.items():
        first = c == 0
        chain, held_for_w = list(tail), 0  # split: the reductions in flight (.., before, prev); the B's kept for W
        for i, (grads, n, gathered, saved, group, for_w) in enumerate(order):
            if split:
                prev, before = chain[-1], chain[-2]
            else:
                prev, before = (order[i - 1][1] if i >= 1 else 0), (order[i - 2][1] if i >= 2 else 0)
            held = reduce_held_bytes(stage, grads, n, prev, before, group, pb, rb, copies) + held_for_w * pb
            most = max(
                most,
                held
                + gathered * pb
                + saved
                + (kept if first or i > 0 else 0)
                + (every if every_held else 4 * sum(u[1] // u[4] for u in order[: max(i - 2, 0)])),
            )
            if for_w:
                held_for_w += n
            else:
                chain.append(n)
    return most


def reduce_phase(s: Setup, pp_rank: int = 0) -> int:
    """peak_parts' "reduce" (a sharding engine; 0 otherwise): the larger of a backward's moment, the other
    (chunk, micro-batch) pairs the schedule holds (saved_activation_bytes less one pair) + ZeRO-3's roots
    gathered (a forward ran since the last backward: a pipeline's steady state; without one the root is kept
    from forward to backward) + `reduce_transient`, and ZeRO-1's end-of-step reduction, its full buffers +
    `theory.reduce_accumulated_held_bytes` (no activations left then). Each term of the moment is what some
    backward holds; together an upper bound where they do not coincide (GPipe's first backward holds the most
    pairs, but its reduced outputs are the shard gradients, not beside them: +8% measured). Under a split
    schedule the moment is the largest over the states its B's run in (`split_moment`)."""
    if s.dp_type not in ZERO_STAGES:
        return 0
    padded = _padded(s, pp_rank)
    roots = (padded["root"] + padded.get("tied", 0)) * s.param_bytes if s.dp_type == "fsdp" else 0
    end_of_step = (
        sum(
            reduce_accumulated_held_bytes(
                [n for u, n in padded.items() if u.endswith(".experts") == e],
                unit_shard(s, "x.experts" if e else "root"),
                s.reduce_bytes,
                s.copies_reduce_input,
            )
            for e in (False, True)
        )
        if s.dp_type == "zero1"
        else 0
    )
    if _split(s):
        moment = (
            roots
            + runner_held_bytes(s, pp_rank)
            + max(
                split_moment(s, pp_rank, state)
                for state in _b_states(s.args.pp_schedule, s.dims.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[
                    pp_rank
                ]
            )
        )
    else:
        others = (
            saved_activation_bytes(s, pp_rank) - micro_saved_bytes(s, pp_rank) // (s.args.pp_virtual_stages or 1)
            if s.dims.pp_enabled
            else 0
        )
        moment = max(others, 0) + roots + reduce_transient(s, pp_rank)
    return max(moment, state_bytes(s, pp_rank)["grads"] + end_of_step)


def _split(s: Setup) -> bool:
    """A split schedule (ZB-H1, ZB-V, DualPipe-V) under a sharding engine: B holds its Blocks' flat gradients for W."""
    return s.dp_type in ZERO_STAGES and s.dims.pp_enabled and s.args.pp_schedule in SPLIT_SCHEDULES


def split_moment(s: Setup, pp_rank: int, state: tuple[int, int, tuple[int, ...], frozenset]) -> int:
    """A split schedule's B, in `state` (`_b_states`: others, kept, run, done), beyond the parameters, optimizer
    state and runner's buffers: the other pairs' saved activations (each whole: after its B a pair keeps its
    deferred linears' (x, dy), about its saved bytes), the kept pairs' Blocks' flat gradients (`kept_flat_bytes`),
    and `reduce_transient` with the run's last two unit gradients in flight (`_run_tail`) and without the shard
    gradients no reduction has made yet: the Blocks of chunks no W reduced, and the run's tail where its last
    chunk had no W before (in flight: reduce_held_bytes counts its outputs); ZeRO-1 reduces at the step's end."""
    others, kept, run, done = state
    V, micro = s.args.pp_virtual_stages or 1, micro_saved_bytes(s, pp_rank)
    last = stage_blocks(s, pp_rank)[2]
    head = head_grad_bytes(s, s.args.micro_batch_size, s.args.seq_len // s.dims.cp) if last else 0
    heads = _head_in_flight(s.args.pp_schedule, s.dims.pp, s.grad_accum, V)[pp_rank]
    saved = others * (micro - head) // V + max(heads - 1, 0) * head
    shards = {c: [4 * n // unit_shard(s, u) for u, n in us] for c, us in _chunk_units(s, pp_rank).items()}
    missing = sum(sum(shards[c]) for c in shards if c not in done and c not in run)
    if run and run[-1] not in done and run.count(run[-1]) == 1:
        missing += sum(shards[run[-1]][-2:])
    if ZERO_STAGES[s.dp_type] == 1:  # ZeRO-1's full buffers: state, all step
        missing = 0
    return (
        saved + kept * kept_flat_bytes(s, pp_rank) + reduce_transient(s, pp_rank, _run_tail(s, pp_rank, run), missing)
    )


def _chunk_units(s: Setup, pp_rank: int = 0) -> dict[int, list[tuple[str, int]]]:
    """Each chunk of the rank: its Blocks' units (and experts'), (name, padded elements), in the order a W reduces
    them (top down, a Block's experts before it, as its B kept them)."""
    padded = _padded(s, pp_rank)
    return {
        c: [
            (u, padded[u])
            for i in reversed(layers)
            for u in (f"transformer.h.{i}.experts", f"transformer.h.{i}")
            if u in padded
        ]
        for c, layers in stage_chunks(s, pp_rank)
    }


def _run_tail(s: Setup, pp_rank: int, run: tuple[int, ...]) -> tuple[int, int]:
    """(before, prev): the padded sizes of the last two unit gradients a run of W's (its chunks, in order)
    reduces, in flight after it (`GradReduction`: the last one's reduce-scatter, the one before's output)."""
    units_ = _chunk_units(s, pp_rank)
    tail = [n for c in run for _, n in units_[c]][-2:]
    return tuple([0] * (2 - len(tail)) + tail)


def kept_flat_bytes(s: Setup, pp_rank: int = 0) -> int:
    """One (chunk, micro-batch) pair's flat gradients held from its B to its W (zero_bubble.hold_for_w: each of
    the chunk's Blocks' and experts' units, padded, in the compute copies' dtype), the rank's largest chunk."""
    return max(sum(n for _, n in us) for us in _chunk_units(s, pp_rank).values()) * s.param_bytes


def held_for_w_bytes(s: Setup, pp_rank: int = 0) -> int:
    """At an F of a split schedule under a sharding engine (beside a forward's activations and the loss's buffers:
    the peak of ZB-H1's last stage): the flat gradients of the most pairs whose B ran and whose W has not
    (`_b_states`' kept, at an F), `kept_flat_bytes` each."""
    if not _split(s):
        return 0
    held = _held_at_f(s.args.pp_schedule, s.dims.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[pp_rank]
    return held * kept_flat_bytes(s, pp_rank)


@functools.lru_cache(maxsize=1024)
def _held_at_f(schedule: str, pp: int, micro: int, virtual: int) -> tuple[int, ...]:
    """Each rank of a split schedule: its most (chunk, micro-batch) pairs between their B and their W at an F."""
    out = []
    for ops in SPLIT_SCHEDULES[schedule](pp, micro, virtual):
        held, most = set(), 0
        for x in ops:
            if x.kind == F:
                most = max(most, len(held))
            elif x.kind == B:
                held.add((x.chunk, x.micro))
            elif x.kind == W:
                held.discard((x.chunk, x.micro))
        out.append(most)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _b_states(schedule: str, pp: int, micro: int, virtual: int) -> tuple[tuple[tuple, ...], ...]:
    """Each rank of a split schedule: the distinct states its B's run in, (others, kept, run, done): the other
    (chunk, micro-batch) pairs whose F ran and whose W has not (their activations saved), of them those whose B
    ran (their flat gradients held for W), the chunks of the W's since the previous B, in order (their reductions
    in flight: a B's end waits for them), and the chunks a W reduced before that run (their shard gradients
    made)."""
    out = []
    for ops in SPLIT_SCHEDULES[schedule](pp, micro, virtual):
        forward, kept, run, done, states = set(), set(), [], set(), set()
        for x in ops:
            key = (x.chunk, x.micro)
            if x.kind == F:
                forward.add(key)
            elif x.kind == B:
                states.add((len(forward) - 1 + len(kept), len(kept), tuple(run), frozenset(done)))
                forward.discard(key)
                kept.add(key)
                done.update(run)
                run = []
            elif x.kind == W:
                kept.discard(key)
                run.append(x.chunk)
        out.append(tuple(sorted(states, key=repr)))
    return tuple(out)


def w_in_flight_bytes(s: Setup, pp_rank: int = 0) -> int:
    """At an F of a split schedule under ZeRO-2/3: the reductions the W's since the last B left in flight, the
    run whose tail holds the most (`_run_tail`; `theory.reduce_held_bytes`' share: the last unit's full gradient,
    and gloo's copy of it, and its reduce-scatter's output, the one before's output)."""
    if not _split(s):
        return 0
    stage, shard = ZERO_STAGES[s.dp_type], s.dims.dp_shard * s.dims.cp
    runs = {
        run
        for _, _, run, _ in _b_states(s.args.pp_schedule, s.dims.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[
            pp_rank
        ]
    }
    return max(
        (
            reduce_held_bytes(stage, 0, 0, prev, before, shard, s.param_bytes, s.reduce_bytes, s.copies_reduce_input)
            for before, prev in (_run_tail(s, pp_rank, r) for r in runs)
            if prev
        ),
        default=0,
    )


def runner_held_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Under a pipeline, the activations its runner (parallel.pipeline.runner.PipelineRunner.step) keeps beside the
    saved
    ones, at the B of this rank where there are the most (`_runner_buffers`), each a (B, T/cp, C) tensor in the
    residual dtype (1/tp of it under SP: `block_input_bytes`): each (chunk, micro-batch) pair's output from its F
    to its B (`stored`; a sent output is a buffer of its own, the peer receives into another; a local one is the
    next chunk's input, saved there once its F ran), the receives posted and not yet read, and the running B's
    output gradient (received, or handed over by the next chunk on this rank) and the input gradient it makes;
    output gradients handed to a local chunk whose B has not run. A received input is also what the chunk's first
    LayerNorm saves (counted twice: an upper bound by one (B, T/cp, C) a pair). `reduce_phase` counts it under a
    split schedule (measured there: the middle stage of pp=3 ZB-H1 x zero2 holds 5 at its peak B); 0 without a
    pipeline."""
    if not s.dims.pp_enabled:
        return 0
    n = _runner_buffers(s.args.pp_schedule, s.dims.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[pp_rank]
    return n * block_input_bytes(s)


@functools.lru_cache(maxsize=1024)
def _runner_buffers(schedule: str, pp: int, micro: int, virtual: int) -> tuple[int, ...]:
    """Each rank: the most of `runner_held_bytes`' buffers at one of its B's, from its action list."""
    v_shape, last, out = schedule in V_SCHEDULES, pp * virtual - 1, []
    for rank, ops in enumerate(ALL_SCHEDULES[schedule](pp, micro, virtual)):
        forward, backward, posted, most = set(), set(), set(), 0
        local = lambda c, rank=rank: rank_of(c, pp, v_shape) == rank  # noqa: E731
        for x in ops:
            key = (x.chunk, x.micro)
            if x.kind in (RECV_F, RECV_B):
                posted.add((x.kind, key))
            elif x.kind == F:
                posted.discard((RECV_F, key))
                forward.add(key)
            elif x.kind == B:
                posted.discard((RECV_B, key))
                outputs = sum(c != last and not (local(c + 1) and (c + 1, m) in forward) for c, m in forward - backward)
                handed = sum(c > 0 and local(c - 1) and (c - 1, m) not in backward for c, m in backward)
                most = max(most, outputs + len(posted) + (x.chunk != last) + (x.chunk > 0) + handed)
                backward.add(key)
        out.append(most)
    return tuple(out)


def peak_parts(s: Setup, pp_rank: int = 0) -> dict[str, int]:
    """The peak's phases, each over parameters + optimizer state (alive all step):
    - "forward": the gradients a forward runs beside (held_grad_bytes) + the saved activations at the end of
      forward + the weights' compute-dtype copies under autocast (weight_cast_bytes) + the largest transient
      (the loss's backward starts on them; under full AC without a pipeline the saved bytes there are the
      checkpointed inputs and the head's, not a recomputed Block's); under a split schedule and a sharding engine
      also the unit gradients kept for W's still to run and the W's reductions in flight (`held_for_w_bytes` at an
      F, `w_in_flight_bytes`);
    - "recompute" (full AC only): every gradient + the inputs + one recomputed Block (saved_activation_bytes);
    - "reduce" (a sharding engine): the shard gradients and a backward's gradient copies as its units complete
      (`reduce_phase`): under a pipeline the peak of a ZeRO-2/3 stage 0, at the embeddings' gradients, beside
      the other micro-batches;
    - "optimizer": every gradient (AdamW's temporaries: on CPU it runs per tensor, at most a few of the largest
      parameter's size; on GPU foreach kernels allocate lists of them: not modelled)."""
    state = state_bytes(s, pp_rank)
    base, grads = state["params"] + state["optimizer"], state["grads"]
    saved = saved_activation_bytes(s, pp_rank)
    out = {"forward": saved, "recompute": 0, "reduce": reduce_phase(s, pp_rank), "optimizer": grads}
    if s.args.activation_checkpointing == "full" and not s.dims.pp_enabled:
        a = s.args
        B, T = a.micro_batch_size, a.seq_len // s.dims.cp
        blocks, first, last = stage_blocks(s, pp_rank)
        out["forward"] = len(blocks) * block_input_bytes(s) + ends_saved_bytes(s, B, T, first, last)
        out["recompute"] = grads + saved
    out["forward"] += (
        held_grad_bytes(s, pp_rank)
        + largest_transient(s, pp_rank)
        + weight_cast_bytes(s, pp_rank)
        + held_for_w_bytes(s, pp_rank)
        + w_in_flight_bytes(s, pp_rank)
    )
    return {"base": base, **out}


def weight_cast_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Under autocast with fp32 weights (no data parallelism, DDP, or a sharding engine without bf16 compute
    copies): the compute-dtype copy of every Block linear's weight and bias this rank holds. Autocast's cast cache
    (and the split backward's zero_bubble.cast_once) makes one per weight per step, alive from the weight's first
    forward to the last backward that saved it: at the end of forward, all of them (gpt2-xl's pp=2 stage 0:
    1.5 GB). The experts' casts are counted in moe_saved_bytes; the head's is the loss's transient."""
    weights = s.param_bytes if s.dp_type in ZERO_STAGES else 4
    if s.dtype == torch.float32 or weights == s.compute_bytes:
        return 0
    return s.compute_bytes * sum(
        n
        for name, n, _ in local_params(s, pp_rank)
        if (".attn.c_" in name or ".mlp.c_" in name) and not is_expert(name)
    )


def peak_memory_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Parameters + optimizer state + the largest of peak_parts' phases (an allocator's peak, not a process's
    resident set): what torch.cuda.max_memory_allocated and, on the CPU, memory.AllocatedPeak measure."""
    parts = peak_parts(s, pp_rank)
    return parts.pop("base") + max(parts.values())
