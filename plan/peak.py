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
from typing import NamedTuple

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
    order = _BackwardOrder(s, pp_rank)
    both_ends = len(order.chunks) > 1 and 0 in order.chunks and len(order.layers) - 1 in order.chunks
    # a V's rank 0 (both ends, two chunks) under ZeRO-2/3: the head's root gradient, held for chunk 0's backward
    kept = order.padded["root"] * s.reduce_bytes if ZERO_STAGES[s.dp_type] > 1 and both_ends else 0
    shards = state_bytes(s, pp_rank)["grads"] - missing
    return max([0, *(_most_held(s, order.chunk(c), c == 0, tail, kept, shards) for c in order.chunks)])


class _Unit(NamedTuple):
    """One unit a chunk backward completes: its gradient elements (the parameter gradients its flat gradient
    concatenates, and any waiting beside them), its flat gradient's elements (padded), the elements ZeRO-3 holds
    gathered meanwhile, this micro-batch's activation bytes still saved, its group's size, and whether a split
    schedule keeps its flat gradient for the W."""

    grads: int
    padded: int
    gathered: int
    saved: int
    group: int
    for_w: bool


def _most_held(s: Setup, order: list[_Unit], first: bool, tail: tuple[int, int], kept: int, shards: int) -> int:
    """The most bytes a chunk backward holds as it completes `order`'s units (`reduce_transient`): the unit's
    `theory.reduce_held_bytes`, with the two flat gradients reduced before it in flight (split: the chain of W
    reductions from `tail` on) and the B's flat gradients kept for W, plus what ZeRO-3 holds gathered, the saved
    activations, the root gradient `kept` for chunk 0's backward (in the head's chunk, once its first unit is
    done), and the shard gradients (`shards` when every one is held, else those of the units reduced before)."""
    stage, pb = ZERO_STAGES[s.dp_type], s.param_bytes
    every_held, split = stage == 1 or s.grad_accum > 1, _split(s)
    most, chain, held_for_w = 0, list(tail), 0  # split: the reductions in flight (.., before, prev); kept for W
    for i, u in enumerate(order):
        if split:
            prev, before = chain[-1], chain[-2]
        else:
            prev, before = (order[i - 1].padded if i >= 1 else 0), (order[i - 2].padded if i >= 2 else 0)
        held = reduce_held_bytes(
            stage, u.grads, u.padded, prev, before, u.group, pb, s.reduce_bytes, s.copies_reduce_input
        )
        reduced = shards if every_held else 4 * sum(v.padded // v.group for v in order[: max(i - 2, 0)])
        most = max(most, held + held_for_w * pb + u.gathered * pb + u.saved + (kept if first or i > 0 else 0) + reduced)
        if u.for_w:
            held_for_w += u.padded
        else:
            chain.append(u.padded)
    return most


class _BackwardOrder:
    """The units each of a rank's chunk backwards completes, in order (`reduce_transient`'s docstring): what the
    rank's chunks share (its units' sizes, parameters, layers and chunks), and per chunk `chunk(c)`."""

    def __init__(self, s: Setup, pp_rank: int):
        a, d = s.args, s.dims
        self.s, self.stage, self.shard = s, ZERO_STAGES[s.dp_type], d.dp_shard * d.cp
        self.sizes, self.padded = units(s, pp_rank), _padded(s, pp_rank)
        self.tied = "tied" in self.padded
        self.params = {n: k for n, k, _ in local_params(s, pp_rank)}
        self.lm_head = "lm_head.weight" if "lm_head.weight" in self.params else "transformer.wte.weight"
        self.head = self.numel((self.lm_head, *HEAD[1:]))
        self.B, self.T = a.micro_batch_size, a.seq_len // d.cp
        V, v_shape = a.pp_virtual_stages or 1, a.pp_schedule in V_SCHEDULES
        self.split = d.pp_enabled and a.pp_schedule in SPLIT_SCHEDULES
        if d.pp_enabled:
            self.layers = _layers(s.config, d.pp, V, a.seq_len, s.pp_layers, v_shape)
            self.chunks = [chunk_of(pp_rank, v, d.pp, v_shape) for v in range(V)]
        else:
            self.layers, self.chunks = (range(s.config.n_layer),), [0]

    def numel(self, names: tuple[str, ...]) -> int:
        """The rank's elements of the named parameters."""
        return sum(self.params.get(n, 0) for n in names)

    def chunk(self, c: int) -> list[_Unit]:
        """Chunk c's units in the order its backward completes them: a last stage's head (after the Blocks under a
        split schedule), the Blocks top down, a first stage's embeddings. With both ends (no pipeline) lm_head's
        and ln_f's gradients wait beside every unit until the root's concatenation."""
        blocks, first, last = list(self.layers[c]), c == 0, c == len(self.layers) - 1
        below = self.saved_below(blocks, first)
        heads = self.head_units(below) if last and not first else []
        waiting = self.head if first and last else 0
        ends = self.embedding_units(below, waiting, last) if first else []
        body = self.block_units(blocks, below, waiting)
        return [*body, *heads, *ends] if self.split else [*heads, *body, *ends]

    def saved_below(self, blocks: list[int], first: bool) -> list[int]:
        """below[k]: this micro-batch's activation bytes still saved as Block blocks[k] completes, the ends' and the
        Blocks' under it (a checkpointed Block's input); split, also the (x, dy) the Blocks from k up keep for the
        W, about their saved bytes."""
        s, B, T = self.s, self.B, self.T
        X, ends = block_input_bytes(s), ends_saved_bytes(s, B, T, first, False)
        below = [
            ends + sum(X if recomputed_blocks(s, [i]) else block_saved_bytes(s, B, T, i) for i in blocks[:k])
            for k in range(len(blocks) + 1)
        ]
        if self.split:
            below = [below[k] + sum(block_saved_bytes(s, B, T, i) for i in blocks[k:]) for k in range(len(below))]
        return below

    def head_units(self, below: list[int]) -> list[_Unit]:
        """A last stage's head (not also the first): the tied lm_head copy, with every activation still saved,
        then the root's ln_f; untied, one root. Split: after the Blocks, all of whose (x, dy) are still kept."""
        p, shard = self.padded, self.shard
        all_saved = below[0] if self.split else below[-1] + ends_saved_bytes(self.s, self.B, self.T, False, True)
        root_saved = below[0] if self.split else 0
        if not self.tied:
            return [_Unit(self.head, p["root"], 0, root_saved, shard, False)]
        lm = self.params[self.lm_head]
        return [
            _Unit(lm, p["tied"], 0, all_saved, shard, False),
            _Unit(self.head - lm, p["root"], 0, root_saved, shard, False),
        ]

    def block_units(self, blocks: list[int], below: list[int], waiting: int) -> list[_Unit]:
        """The Blocks top down, under ZeRO-3 each gathered with the one below it (prefetched), experts included. A
        Block's experts' unit completes first, in the MoE's backward, the Block's attention and LayerNorms still
        saved (not split: their (x, dy) are kept for the W in any case)."""
        s, p, split, out = self.s, self.padded, self.split, []
        with_experts = lambda u: p[u] + p.get(f"{u}.experts", 0)  # noqa: E731 (gathered together)
        for k in reversed(range(len(blocks))):
            u, lower = f"transformer.h.{blocks[k]}", f"transformer.h.{blocks[k - 1]}" if k else None
            gathered = with_experts(u) + (with_experts(lower) if lower else 0) if self.stage == 3 else 0
            if (e := f"{u}.experts") in p:
                rest = block_saved_bytes(s, self.B, self.T, blocks[k]) - moe_saved_bytes(s, self.B, self.T)
                saved = below[k] + (0 if split else rest)
                out.append(_Unit(self.sizes[e][0], p[e], gathered, saved, unit_shard(s, e), split))
            out.append(_Unit(self.sizes[u][0] + waiting, p[u], gathered, below[k], self.shard, split))
        return out

    def embedding_units(self, below: list[int], waiting: int, last: bool) -> list[_Unit]:
        """A first stage's embeddings: both tables' gradients exist before either unit is concatenated; tied (and
        not also the last stage) the tied unit (wte), then the root (wpe); else one root, with the head's waiting
        gradients and less the tied lm_head's (counted in wte's). Split: the Blocks' (x, dy) still kept."""
        p, shard, saved = self.padded, self.shard, below[0] if self.split else 0
        both = self.numel(EMBEDDINGS)
        if self.tied and not last:
            wpe = self.numel(EMBEDDINGS[1:])
            return [_Unit(both, p["tied"], 0, saved, shard, False), _Unit(wpe, p["root"], 0, saved, shard, False)]
        lm = self.params[self.lm_head] if last else 0
        return [_Unit(both + waiting - lm, p["root"], 0, saved, shard, False)]


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
