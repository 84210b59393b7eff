"""Pipeline schedules as per-rank action lists: which compute runs when on each rank, and every SEND/RECV.

Chunks. The model's Blocks are cut into C = P·V consecutive chunks (P pipeline ranks, V virtual chunks per rank).
Chunk 0 also holds wte/wpe, chunk C-1 also ln_f and lm_head. Rank r holds chunks r, r+P, r+2P, ... (Megatron's
interleaving; V = 1 is the plain pipeline; the V schedules: r and 2P-1-r).

Actions (parallel/pipeline/actions.py). `Action(kind, chunk, micro)`; `chunk` is always a chunk of the rank that runs
the action:
  F(c, m) / B(c, m)    forward / backward of micro-batch m through chunk c;
  W(c, m)              the weight gradients of B(c, m), in a split schedule (SPLIT_SCHEDULES): there B is the
                       gradient w.r.t. the chunk's input only, what the previous chunk waits for, and W the
                       weight gradients, which nothing waits for (Qi et al. 2023, "Zero Bubble Pipeline
                       Parallelism"); parallel/pipeline/zero_bubble.py splits the backward;
  SEND_F(c, m)         chunk c's output to chunk c+1's rank;   matches RECV_F(c+1, m) there;
  RECV_F(c, m)         chunk c's input from chunk c-1's rank;  matches SEND_F(c-1, m);
  SEND_B(c, m)         grad of chunk c's input to chunk c-1;   matches RECV_B(c-1, m) there;
  RECV_B(c, m)         grad of chunk c's output from chunk c+1; matches SEND_B(c+1, m).

Where the SEND/RECV go (`_with_p2p`). Each schedule fixes only the order of F/B on each rank; `ideal_times` runs
those orders once as early as data allows (F = 1, B = 2 units, messages free), and a message's SEND and RECV are
both listed at its ready time, keyed alike on both sides (ready time, sender, chunk, micro): one global order,
so each peer pair posts its messages in the same order on both sides, as NCCL and gloo need (docs/pipeline.md,
Messages; the proofs and the p2p models that check them: plan/timeline.py). A receive is waited on only by the
compute that reads it; a send where `send_waits` says.

See a schedule before reading the runner: `python -m plan.schedule_grid 1f1b --pp 2 --micro 4` prints each rank's
list as a grid.
"""

from __future__ import annotations

import itertools

from parallel.pipeline.actions import COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W


class ScheduleError(ValueError):
    """A schedule that deadlocks, mismatches a send and a receive, or misorders or misses work."""


# ---- the partition: which Blocks each chunk holds -----------------------------------------------------


def even_partition(n_layer: int, pp: int, virtual: int = 1) -> list[range]:
    """Block indices of each of the P·V chunks, consecutive and as even as possible.

    With n_layer = q·C + e, the first e chunks get q+1 Blocks and the rest q: the extra layers go to the
    front because the last chunk already carries lm_head and the loss (for GPT-2 124M the lm_head matmul
    alone costs ~5 Blocks of FLOPs), while wte/wpe on the first chunk are lookups. Every chunk gets >= 1.
    """
    chunks = pp * virtual
    if pp < 1 or virtual < 1 or n_layer < chunks:
        raise ValueError(
            f"cannot partition {n_layer} layers into pp={pp} x virtual={virtual} = {chunks} non-empty chunks"
        )
    q, e = divmod(n_layer, chunks)
    return consecutive([q + (c < e) for c in range(chunks)])


def consecutive(counts: list[int]) -> list[range]:
    """Consecutive index ranges of the given lengths, from 0."""
    ends = list(itertools.accumulate(counts))
    return [range(end - n, end) for n, end in zip(counts, ends)]


def chunk_of(rank: int, v: int, pp: int, v_shape: bool = False) -> int:
    """Global index of rank's v-th local chunk (Megatron: rank r holds r, r+P, r+2P, ...; `v_shape`, the V
    schedules' two chunks: rank r holds r and 2P-1-r, so rank 0 holds the first and the last)."""
    if v_shape:
        return rank if v == 0 else 2 * pp - 1 - rank
    return v * pp + rank


def rank_of(chunk: int, pp: int, v_shape: bool = False) -> int:
    """The rank holding `chunk` (`chunk_of`'s inverse)."""
    if v_shape:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def boundary(a: Action) -> int:
    """The chunk boundary a SEND/RECV crosses: c for the message between chunks c and c+1 (SEND_F(c) and
    RECV_B(c) on chunk c's rank, RECV_F(c+1) and SEND_B(c+1) on chunk c+1's)."""
    return a.chunk if a.kind in (SEND_F, RECV_B) else a.chunk - 1


def peer_of(a: Action, pp: int, v_shape: bool = False) -> int:
    """The rank a SEND/RECV talks to: chunk c+1's for SEND_F and RECV_B, chunk c-1's for RECV_F and SEND_B."""
    return rank_of(a.chunk + (1 if a.kind in (SEND_F, RECV_B) else -1), pp, v_shape)


# ---- schedules: per-rank compute order, then the P2P actions -----------------------------------------


def gpipe(pp: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """GPipe / picotron's AFAB: every forward, then every backward, micro-batches in order."""
    _check(pp, micro_batches, virtual, need_v1=True)
    order = [
        [Action(F, r, m) for m in range(micro_batches)] + [Action(B, r, m) for m in range(micro_batches)]
        for r in range(pp)
    ]
    return _with_p2p(order, pp)


def one_f_one_b(pp: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """PipeDream-flush 1F1B: P-r-1 warm-up forwards, then (F, B) pairs, then the remaining backwards.

    Rank r never holds more than P-r micro-batches' activations (GPipe holds M)."""
    _check(pp, micro_batches, virtual, need_v1=True)
    order = []
    for r in range(pp):
        warm = min(pp - r - 1, micro_batches)
        ops = [Action(F, r, m) for m in range(warm)]
        for i in range(micro_batches - warm):
            ops += [Action(F, r, warm + i), Action(B, r, i)]
        ops += [Action(B, r, m) for m in range(micro_batches - warm, micro_batches)]
        order.append(ops)
    return _with_p2p(order, pp)


def interleaved_one_f_one_b(pp: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2; megatron/core/pipeline_parallel/
    schedules.py, forward_backward_pipelining_with_interleaving).

    Micro-batches go through the local chunks in groups of P: the k-th forward on a rank runs chunk
    (k mod P·V) div P on micro-batch (k div P·V)·P + k mod P; the k-th backward walks the chunks in
    reverse. Warm-up is 2(P-r-1) + (V-1)·P forwards (all of them when M == P), then (F, B) pairs, then
    cool-down. Requires M % P == 0, Megatron's rule ("number of microbatches is not divisible by
    pipeline-model-parallel-size when using interleaved schedule"). torch's ScheduleInterleaved1F1B relaxes
    it to M % max(1, M // P) == 0 by regrouping; we keep Megatron's so every group is full.
    """
    _check(pp, micro_batches, virtual)
    if micro_batches % pp:
        raise ValueError(
            f"interleaved 1F1B needs micro_batches divisible by pp (Megatron's rule); "
            f"got micro_batches={micro_batches}, pp={pp}"
        )
    group, total = pp * virtual, micro_batches * virtual

    def nth(k: int, kind: str, r: int) -> Action:
        v = (k % group) // pp
        return Action(kind, chunk_of(r, v if kind == F else virtual - 1 - v, pp), (k // group) * pp + k % pp)

    order = []
    for r in range(pp):
        warm = total if micro_batches == pp else min(2 * (pp - r - 1) + (virtual - 1) * pp, total)
        ops = [nth(k, F, r) for k in range(warm)]
        for i in range(total - warm):
            ops += [nth(warm + i, F, r), nth(i, B, r)]
        ops += [nth(k, B, r) for k in range(total - warm, total)]
        order.append(ops)
    return _with_p2p(order, pp)


def zb_h1(pp: int, micro_batches: int, virtual: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, section 3.1; torch's ScheduleInterleavedZeroBubble with one stage per rank):
    1F1B's order with the backward split into B (input gradient) and W (weight gradients).

    Rank r runs P-r-1 warm-up forwards, then for i = 0..M-1: F(i + P-r-1) while any is left, B(i), and from
    i = r on one W (the oldest whose B ran); the last r W's close the list. Deferring rank r's first r W's fills
    the drain, where rank r would wait r·(t_B) under 1F1B: with t_F = t_B = t_W the bubble is
    (P-1)(t_F + t_B - t_W) against 1F1B's (P-1)(t_F + t_B + t_W) (`bubble_fraction`). Memory: rank r holds
    what W(i) needs from F(i) until W(i), at most P micro-batches on every rank (1F1B's rank 0). Needs M >= P.
    """
    _check(pp, micro_batches, virtual, need_v1=True)
    if micro_batches < pp:
        raise ValueError(f"zb_h1 needs micro_batches >= pp; got micro_batches={micro_batches}, pp={pp}")
    order = []
    for r in range(pp):
        warm = pp - r - 1
        ops = [Action(F, r, m) for m in range(warm)]
        w = 0
        for i in range(micro_batches):
            if warm + i < micro_batches:
                ops.append(Action(F, r, warm + i))
            ops.append(Action(B, r, i))
            if i >= r:
                ops.append(Action(W, r, w))
                w += 1
        ops += [Action(W, r, m) for m in range(w, micro_batches)]
        order.append(ops)
    return _with_p2p(order, pp)


def zbv(pp: int, micro_batches: int, virtual: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, section 6; torch's ScheduleZBVZeroBubble, whose order this is): two chunks per rank
    in a V (rank r holds chunk r on the way down and 2P-1-r on the way up: `chunk_of(..., v_shape=True)`).

    Rank r, with c0 = r and c1 = 2P-1-r: 2(P-r)-1 forwards of c0; r pairs F(c1), F(c0); P-r triples F(c1),
    B(c1), W(c1); then, while forwards are left, F(c0) B(c0) W(c0) F(c1) B(c1) W(c1); the cool-down runs the
    remaining B's (c0 and c1 alternating for r rounds, then B(c0) W(c0) for P-r) and the deferred W's of c1,
    then of c0. As torch, the order is built for max(M, 2P-1) micro-batches and those >= M are dropped. Each
    chunk's W's follow its B's micro-batch order. Needs M >= P (every rank's warm-up reaches the bottom of the
    V)."""
    if virtual != 2:
        raise ValueError(f"zbv runs two chunks per rank in a V; got virtual={virtual}")
    _check(pp, micro_batches, virtual)
    if micro_batches < pp:
        raise ValueError(f"zbv needs micro_batches >= pp; got micro_batches={micro_batches}, pp={pp}")
    n = max(2 * pp - 1, micro_batches)
    order = []
    for r in range(pp):
        c0, c1 = r, 2 * pp - 1 - r
        cnt = {(k, c): 0 for k in (F, B, W) for c in (c0, c1)}
        ops: list[Action] = []

        def add(kind: str, c: int) -> None:
            ops.append(Action(kind, c, cnt[kind, c]))
            cnt[kind, c] += 1

        for _ in range(2 * (pp - r) - 1):
            add(F, c0)
        for _ in range(r):
            add(F, c1), add(F, c0)
        for _ in range(pp - r):
            add(F, c1), add(B, c1), add(W, c1)
        while cnt[F, c1] < cnt[F, c0] or cnt[F, c0] < n:
            if cnt[F, c0] < n:
                add(F, c0)
            add(B, c0), add(W, c0)
            add(F, c1), add(B, c1), add(W, c1)
        for _ in range(r):
            add(B, c0), add(B, c1)
        for _ in range(pp - r):
            add(B, c0), add(W, c0)
        while cnt[W, c1] < cnt[B, c1]:
            add(W, c1)
        while cnt[W, c0] < cnt[B, c0]:
            add(W, c0)
        order.append([a for a in ops if a.micro < micro_batches])
    return _with_p2p(order, pp, v_shape=True)


def dualpipev(pp: int, micro_batches: int, virtual: int = 2) -> list[list[Action]]:
    """DualPipe-V (DeepSeek-V3's DualPipe on a V: torch's ScheduleDualPipeV, after deepseek-ai/DualPipe, whose
    order this is). Chunks as `zbv`'s. Steps on rank r, c0 = r, c1 = 2P-1-r:
    1. 2(P-r-1) F(c0); 2. r+1 pairs F(c0) F(c1); 3. P-r-1 rounds B(c1) W(oldest) F(c1);
    4. M-2P+r+1 rounds of two overlapped pairs (F(c0) with the whole backward of c1, F(c1) with that of c0;
       the last rank's first round runs its first pair unoverlapped);
    5. P-r-1 rounds: whole backward of c1, F(c1) with the whole backward of c0;
    6. r+1 rounds B(c1) B(c0), whole backwards until halfway, then split (B now, W later);
    7. P-r-1 rounds W(oldest) B(c0); 8. the remaining W's, oldest first.
    A whole backward is B then W at once; an overlapped pair is its F then its whole backward (DualPipe overlaps
    their compute and communication on two streams; here they run one after the other, which the list and the
    simulator's timeline show as such). Needs M >= 2P (torch's "at least as many microbatches as stages")."""
    if virtual != 2:
        raise ValueError(f"dualpipev runs two chunks per rank in a V; got virtual={virtual}")
    _check(pp, micro_batches, virtual)
    if micro_batches < 2 * pp:
        raise ValueError(f"dualpipev needs micro_batches >= 2 x pp; got micro_batches={micro_batches}, pp={pp}")
    order = []
    for r in range(pp):
        c0, c1 = r, 2 * pp - 1 - r
        cnt = {(k, c): 0 for k in (F, B) for c in (c0, c1)}
        ops: list[Action] = []
        weights: list[Action] = []  # split B's whose W is still to run, oldest first

        def add(kind: str, c: int, whole: bool = False) -> None:
            a = Action(kind, c, cnt[kind, c])
            cnt[kind, c] += 1
            ops.append(a)
            if kind == B:
                (ops if whole else weights).append(Action(W, c, a.micro))

        def pending_w() -> None:
            if weights:
                ops.append(weights.pop(0))

        for _ in range(2 * (pp - r - 1)):
            add(F, c0)
        for _ in range(r + 1):
            add(F, c0), add(F, c1)
        for _ in range(pp - r - 1):
            add(B, c1), pending_w(), add(F, c1)
        for _ in range(micro_batches - 2 * pp + r + 1):
            add(F, c0), add(B, c1, whole=True)
            add(F, c1), add(B, c0, whole=True)
        for _ in range(pp - r - 1):
            add(B, c1, whole=True)
            add(F, c1), add(B, c0, whole=True)
        split = False
        steps = r + 1
        for i in range(steps):
            if i == steps // 2 and r % 2 == 1:
                split = True
            add(B, c1, whole=not split)
            if i == steps // 2 and r % 2 == 0:
                split = True
            add(B, c0, whole=not split)
        for _ in range(pp - r - 1):
            pending_w()
            add(B, c0, whole=not split)
        while weights:
            pending_w()
        order.append(ops)
    return _with_p2p(order, pp, v_shape=True)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_one_f_one_b}
SPLIT_SCHEDULES = {"zb_h1": zb_h1, "zbv": zbv, "dualpipev": dualpipev}  # B: the input gradient; W: the weights'
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V (chunk_of(..., v_shape=True))
ALL_SCHEDULES = {**SCHEDULES, **SPLIT_SCHEDULES}


def is_split(schedule: list[list[Action]]) -> bool:
    """Whether a schedule's backward is split into B and W (it has W actions)."""
    return any(a.kind == W for ops in schedule for a in ops)


def unit_times(split: bool) -> tuple[int, int, int]:
    """(t_F, t_B, t_W) in the simulator's units: F = 1, a whole backward 2; split, B = W = 1."""
    return (1, 1, 1) if split else (1, 2, 0)


def _check(pp: int, micro_batches: int, virtual: int, need_v1: bool = False) -> None:
    if pp < 1 or micro_batches < 1 or virtual < 1:
        raise ValueError(f"pp, micro_batches and virtual must be >= 1; got {pp}, {micro_batches}, {virtual}")
    if need_v1 and virtual != 1:
        raise ValueError(f"this schedule runs one chunk per rank; got virtual={virtual} (use interleaved_one_f_one_b)")


def _needs(a: Action, pp: int, chunks: int, v: bool = False) -> Action | None:
    """The receive compute action `a` waits for, or None (first/last chunk, or the neighbour is local)."""
    if a.kind == F and a.chunk > 0 and rank_of(a.chunk - 1, pp, v) != rank_of(a.chunk, pp, v):
        return Action(RECV_F, a.chunk, a.micro)
    if a.kind == B and a.chunk < chunks - 1 and rank_of(a.chunk + 1, pp, v) != rank_of(a.chunk, pp, v):
        return Action(RECV_B, a.chunk, a.micro)
    return None


def send_waits(actions: list[Action]) -> dict[Action, list[Action]]:
    """Where a rank waits on each of its sends, and so frees what it sent, at a point its own list names (the
    same on every backend; no completion polling): SEND_F(c, m) just before B(c, m), whose input, the peer's
    gradient, is proof the activation arrived; SEND_B(c, m) just before the rank's next B (a later one than
    the one that computed it), or at the step's end when none follows. Every wait stands after its send in the
    list, at a compute that starts later than the message is ready, so it adds no deadlock under any p2p
    model (`plan.timeline.simulate_schedule` runs them). A rank then holds, beyond its stored activations, at most one
    input gradient in flight: the bound does not grow with M."""
    sent_forward = {a for a in actions if a.kind == SEND_F}
    waits: dict[Action, list[Action]] = {}
    pending_b: list[Action] = []  # SEND_B's waiting for the rank's next B
    for a in actions:
        if a.kind == B:
            mine = [s for s in [Action(SEND_F, a.chunk, a.micro)] if s in sent_forward] + pending_b
            if mine:
                waits[a] = mine
            pending_b = []
        elif a.kind == SEND_B:
            pending_b.append(a)
    return waits


def ideal_times(order: list[list[Action]], pp: int) -> tuple[dict[Action, int], dict[tuple[str, int, int], int]]:
    """Each compute's start, and (kind, chunk, micro)'s end, when every rank runs its compute order as soon as it
    is free and the compute's inputs exist (`unit_times`; messages free). ScheduleError if the orders deadlock."""
    cost = dict(zip(COMPUTE, unit_times(is_split(order))))
    chunks = max(a.chunk for ops in order for a in ops) + 1
    start: dict[Action, int] = {}
    end: dict[tuple[str, int, int], int] = {}
    pos, clock = [0] * pp, [0] * pp
    while any(pos[r] < len(order[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                src = a.chunk - 1 if a.kind == F else a.chunk + 1
                deps = [(a.kind, src, a.micro)] if a.kind != W and 0 <= src < chunks else []
                deps += [(F, a.chunk, a.micro)] if a.kind == B else [(B, a.chunk, a.micro)] if a.kind == W else []
                if any(d not in end for d in deps):
                    break
                start[a] = max([clock[r]] + [end[d] for d in deps])
                clock[r] = end[a] = start[a] + cost[a.kind]
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise ScheduleError(f"compute orders deadlock at {[order[r][pos[r] : pos[r] + 1] for r in range(pp)]}")
    return start, end


def messages(order: list[list[Action]], pp: int, v_shape: bool = False):
    """Each cross-rank message the compute orders need, as (receiving rank, the compute that reads it, its RECV,
    the sending rank, its SEND), in the orders' order."""
    chunks = max(a.chunk for ops in order for a in ops) + 1
    for r in range(pp):
        for c in order[r]:
            if (recv := _needs(c, pp, chunks, v_shape)) is not None:
                src = c.chunk - 1 if c.kind == F else c.chunk + 1
                yield r, c, recv, rank_of(src, pp, v_shape), Action(SEND_F if c.kind == F else SEND_B, src, c.micro)


def _with_p2p(order: list[list[Action]], pp: int, v_shape: bool = False) -> list[list[Action]]:
    """The compute orders with every SEND and RECV listed at its message's ready time (module docstring): each
    action keyed (time, 0 for a message or 1 for a compute, tie-breaks), each rank's list in key order."""
    start, end = ideal_times(order, pp)
    keyed = [((start[c], 1, r, c.chunk, c.micro), r, c) for r in range(pp) for c in order[r]]
    for r, c, recv, sender, send in messages(order, pp, v_shape):
        ready = end[(c.kind, send.chunk, c.micro)]
        key = (ready, 0, ready, sender, c.chunk, c.micro)  # the same on both sides
        keyed += [(key, r, recv), (key, sender, send)]
    return in_key_order(keyed, pp)


def in_key_order(keyed: list[tuple[tuple, int, Action]], pp: int) -> list[list[Action]]:
    """Each rank's actions from (key, rank, action) triples, sorted by key."""
    out: list[list[Action]] = [[] for _ in range(pp)]
    for _, r, a in sorted(keyed, key=lambda x: x[0]):
        out[r].append(a)
    return out


def evaluation(pp: int, micro_batches: int, virtual: int = 1, v_shape: bool = False) -> list[list[Action]]:
    """Each rank's forward-only list (PipelineRunner.forward_only): micro-batch after micro-batch, the rank's
    chunks in order, each F after the RECV_F of its input and before the SEND_F of its output where that
    neighbour is on another rank. Every rank posts in this one global order, so a receive waited on at its F
    (at once) never waits on a rank that is itself waiting."""
    out = []
    for r in range(pp):
        ops = []
        for m in range(micro_batches):
            for c in sorted(chunk_of(r, v, pp, v_shape) for v in range(virtual)):
                ops += [Action(RECV_F, c, m)] if c > 0 and rank_of(c - 1, pp, v_shape) != r else []
                ops.append(Action(F, c, m))
                ops += [Action(SEND_F, c, m)] if c < pp * virtual - 1 and rank_of(c + 1, pp, v_shape) != r else []
        out.append(ops)
    return out
