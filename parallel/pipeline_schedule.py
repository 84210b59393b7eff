"""Pipeline schedules as per-rank action lists, and a process-free simulator that dry-runs them.

Chunks. The model's Blocks are cut into C = P·V consecutive chunks (P pipeline ranks, V virtual chunks
per rank). Chunk 0 also holds wte/wpe, chunk C-1 also ln_f and lm_head. Rank r holds chunks
r, r+P, r+2P, ... (Megatron's interleaving; V = 1 is the plain pipeline).

Actions. `Action(kind, chunk, micro)`; `chunk` is always a chunk of the rank that runs the action:
  F(c, m) / B(c, m)    forward / backward of micro-batch m through chunk c;
  W(c, m)              the weight gradients of B(c, m), in a split schedule (SPLIT_SCHEDULES): there B is the
                       gradient w.r.t. the chunk's input only, what the previous chunk waits for, and W the
                       weight gradients, which nothing waits for (Qi et al. 2023, "Zero Bubble Pipeline
                       Parallelism"); parallel/zero_bubble.py splits the backward;
  SEND_F(c, m)         chunk c's output to chunk c+1's rank;   matches RECV_F(c+1, m) there;
  RECV_F(c, m)         chunk c's input from chunk c-1's rank;  matches SEND_F(c-1, m);
  SEND_B(c, m)         grad of chunk c's input to chunk c-1;   matches RECV_B(c-1, m) there;
  RECV_B(c, m)         grad of chunk c's output from chunk c+1; matches SEND_B(c+1, m).

Pairing rule. Each schedule fixes only the order of F/B on each rank; `_with_p2p` runs those orders once
as early as data allows (F=1, B=2 units, messages free) and gives every message two times: ready (its
producer's end) and meet (its consumer's start). Each rank then lists its actions in time order, a message
before any compute starting at its time, by one of three pairings:
- "ready" (default): SEND and RECV both at the ready time, with the same key on both sides (ready time,
  sender, chunk, micro). Every rank's messages then follow one global order, so within a peer pair both sides list
  the pair's messages, both directions merged, in the same order. That is what NCCL needs: torch runs a
  pair's unbatched isend/irecv on one communicator and stream in posting order, and a send completes only
  when the peer's matching receive is at the head of its side (simulate(..., p2p="nccl")); what gloo needs
  (the k-th send from a to b meets the k-th receive on b from a) follows. With the global order the lowest
  unfinished message always has both ranks posted on it, so no p2p model deadlocks, and with isends the
  timeline is the ideal one: every schedule meets `bubble_fraction` exactly. A receiver posts at the
  ready time and waits on the data only at the compute that reads it, so with stage times other than the
  units the rank runs on while the data is late (TestReceiveWaits).
- "meet": both at the meeting time (the same global-order argument). The sender posts late, so a sender
  that would have run ahead waits for its receiver: GPipe and 1F1B lose nothing, interleaved 1F1B loses
  some of its gain (tests/test_pipeline_schedule.py measures it).
- "split": SEND at ready, RECV at meet (the order before 2026-12: each direction agrees, the merged pair
  order does not). gloo and isend run it at the ideal timeline; under NCCL's pair order, and with blocking
  sends, interleaved 1F1B deadlocks (e.g. P=2, V=2, M=4: rank 0 posts SEND_F(c0,m2) before RECV_B(c2,m0)
  while rank 1 posts SEND_B(c3,m0) before RECV_F(c1,m2)). Kept so the tests show the simulator catches it.

`simulate` executes the lists under each p2p model (async, nccl, rendezvous) and checks everything above.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

F, B, W, SEND_F, RECV_F, SEND_B, RECV_B = "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)


class Action(NamedTuple):
    kind: str
    chunk: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}(c{self.chunk},m{self.micro})"


class ScheduleError(ValueError):
    """A schedule that deadlocks, mismatches a send and a receive, or misorders or misses work."""


# ---- stage split -------------------------------------------------------------------------------------

def split_layers(n_layer: int, pp: int, virtual: int = 1) -> list[range]:
    """Block indices of each of the P·V chunks, consecutive and as even as possible.

    With n_layer = q·C + e, the first e chunks get q+1 Blocks and the rest q: the extra layers go to the
    front because the last chunk already carries lm_head and the loss (for GPT-2 124M the lm_head matmul
    alone costs ~5 Blocks of FLOPs), while wte/wpe on the first chunk are lookups. Every chunk gets >= 1.
    """
    chunks = pp * virtual
    if pp < 1 or virtual < 1 or n_layer < chunks:
        raise ValueError(f"cannot split {n_layer} layers into pp={pp} x virtual={virtual} = {chunks} "
                         "non-empty chunks")
    q, e = divmod(n_layer, chunks)
    bounds = [0]
    for c in range(chunks):
        bounds.append(bounds[-1] + q + (c < e))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


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


# ---- schedules: per-rank compute order, then the P2P actions -----------------------------------------

def gpipe(pp: int, micro_batches: int, virtual: int = 1, pairing: str = "ready") -> list[list[Action]]:
    """GPipe / picotron's AFAB: every forward, then every backward, micro-batches in order."""
    _check(pp, micro_batches, virtual, need_v1=True)
    order = [[Action(F, r, m) for m in range(micro_batches)] + [Action(B, r, m) for m in range(micro_batches)]
             for r in range(pp)]
    return _with_p2p(order, pp, pairing)


def one_f_one_b(pp: int, micro_batches: int, virtual: int = 1, pairing: str = "ready") -> list[list[Action]]:
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
    return _with_p2p(order, pp, pairing)


def interleaved_one_f_one_b(pp: int, micro_batches: int, virtual: int = 1, pairing: str = "ready") -> list[list[Action]]:
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
        raise ValueError(f"interleaved 1F1B needs micro_batches divisible by pp (Megatron's rule); "
                         f"got micro_batches={micro_batches}, pp={pp}")
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
    return _with_p2p(order, pp, pairing)


def zb_h1(pp: int, micro_batches: int, virtual: int = 1, pairing: str = "ready") -> list[list[Action]]:
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
    return _with_p2p(order, pp, pairing)


def zbv(pp: int, micro_batches: int, virtual: int = 2, pairing: str = "ready") -> list[list[Action]]:
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
    return _with_p2p(order, pp, pairing, v_shape=True)


def dualpipev(pp: int, micro_batches: int, virtual: int = 2, pairing: str = "ready") -> list[list[Action]]:
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
        for i in range(micro_batches - 2 * pp + r + 1):
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
    return _with_p2p(order, pp, pairing, v_shape=True)


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
        raise ValueError(f"this schedule runs one chunk per rank; got virtual={virtual} "
                         "(use interleaved_one_f_one_b)")


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
    model (`simulate` runs them). A rank then holds, beyond its stored activations, at most one input gradient
    in flight: the bound does not grow with M."""
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


PAIRINGS = ("ready", "meet", "split")


def _with_p2p(order: list[list[Action]], pp: int, pairing: str, v_shape: bool = False) -> list[list[Action]]:
    """Insert SEND/RECV actions into per-rank compute orders by the pairing rule (module docstring)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}; known: {PAIRINGS}")
    cost = dict(zip(COMPUTE, unit_times(is_split(order))))
    chunks = max(a.chunk for ops in order for a in ops) + 1
    # 1. ideal start times: each compute as soon as its rank is free and its inputs exist (messages free)
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
            raise ScheduleError(f"compute orders deadlock at {[order[r][pos[r]:pos[r] + 1] for r in range(pp)]}")
    # 2. every cross-rank message gets one key per side: (time, 0, tie-breaks); computes (start, 1, ...)
    keyed = []
    for r in range(pp):
        for c in order[r]:
            keyed.append(((start[c], 1, r, c.chunk, c.micro), r, c))
            if (recv := _needs(c, pp, chunks, v_shape)) is not None:
                src_chunk = c.chunk - 1 if c.kind == F else c.chunk + 1
                send = Action(SEND_F if c.kind == F else SEND_B, src_chunk, c.micro)
                ready, sender = end[(c.kind, src_chunk, c.micro)], rank_of(src_chunk, pp, v_shape)
                ready_key = (ready, 0, ready, sender, c.chunk, c.micro)
                meet_key = (start[c], 0, ready, sender, c.chunk, c.micro)
                send_key = meet_key if pairing == "meet" else ready_key
                recv_key = ready_key if pairing == "ready" else meet_key
                keyed += [(recv_key, r, recv), (send_key, sender, send)]
    # 3. each rank's actions in that order: a message before any compute starting at its time
    out: list[list[Action]] = [[] for _ in range(pp)]
    for _, r, a in sorted(keyed, key=lambda x: x[0]):
        out[r].append(a)
    return out


# ---- simulator -----------------------------------------------------------------------------------------

@dataclass
class SimResult:
    """timeline[r]: (start, end, action) of each compute on rank r; max_in_flight[r]: most micro-batch
    activations rank r held at once (forwards done whose backward is not); busy[r]: compute units."""
    makespan: int
    timeline: list[list[tuple[int, int, Action]]]
    max_in_flight: list[int]
    busy: list[int]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time up to the makespan."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)


def _peer(a: Action, pp: int, v: bool = False) -> tuple[int, Action]:
    """The rank `a` talks to and the action that must meet it there."""
    other = {SEND_F: (RECV_F, 1), RECV_F: (SEND_F, -1), SEND_B: (RECV_B, -1), RECV_B: (SEND_B, 1)}
    kind, step = other[a.kind]
    return rank_of(a.chunk + step, pp, v), Action(kind, a.chunk + step, a.micro)


P2P_MODELS = ("async", "nccl", "rendezvous")


def simulate(schedule: list[list[Action]], pp: int, virtual: int = 1, micro_batches: int | None = None,
             f_time: int = 1, b_time: int | None = None, w_time: int | None = None,
             p2p: str = "rendezvous", v_shape: bool = False) -> SimResult:
    """Run every rank's list; computes take f_time / b_time / w_time units (default `unit_times`: B = 2 for a
    whole backward, B = W = 1 when the schedule is split); `v_shape`: the chunks sit as `chunk_of(..., v_shape=True)`
    puts them (the V schedules). Three p2p models:
    - "rendezvous": a send blocks until its receive is posted; both complete at the later arrival
      (blocking send/recv).
    - "async" (gloo, isend/irecv): posting never blocks the rank. The k-th send from a to b meets the k-th
      receive on b from a, and the data is there at the send's post time.
    - "nccl" (torch's unbatched isend/irecv on NCCL): one FIFO per peer pair and side, shared by both
      directions, in posting order. Posting never blocks the rank. The ops at the heads of a pair's two sides
      complete together, at the later post, when one is a send and the other its receive; two sends (or two
      receives) at the heads wait for each other forever.
    In both, a compute waits for the receive of its input, which must be posted before it in the rank's list
    (PipelineRunner posts each receive at its place in the list and waits on it just before the compute), and
    for the sends `send_waits` names before it to be matched with their receives (the runner waits on them
    there, and frees what they sent).
    Raises ScheduleError on deadlock, a send meeting the wrong receive, a compute before its input's receive,
    F/B/W out of order, work on another rank's chunk, or any (chunk, micro) without exactly one F and one B (and
    one W in a split schedule). A rank holds a micro-batch's activations from its F to its B, or to its W when
    split (what W needs stays until W): `max_in_flight`."""
    if p2p not in P2P_MODELS:
        raise ValueError(f"unknown p2p model {p2p!r}; known: {P2P_MODELS}")
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, pp={pp}")
    chunks = pp * virtual
    split = is_split(schedule)
    _, b_default, w_default = unit_times(split)
    cost = {F: f_time, B: b_default if b_time is None else b_time, W: w_default if w_time is None else w_time}
    release = W if split else B
    if micro_batches is None:
        micro_batches = 1 + max((a.micro for ops in schedule for a in ops), default=-1)
    for r, ops in enumerate(schedule):
        for a in ops:
            if rank_of(a.chunk, pp, v_shape) != r or not 0 <= a.chunk < chunks or not 0 <= a.micro < micro_batches:
                raise ScheduleError(f"rank {r} cannot run {a} (pp={pp}, virtual={virtual}, M={micro_batches})")
            if (a.kind in (SEND_F, RECV_B) and a.chunk == chunks - 1) or (a.kind in (RECV_F, SEND_B) and a.chunk == 0):
                raise ScheduleError(f"rank {r}: {a} has no neighbouring chunk")
    done: set[Action] = set()  # computes and receives completed, over all ranks (chunks name their rank)
    pos, clock, held, peak, busy = [0] * pp, [0] * pp, [0] * pp, [0] * pp, [0] * pp
    timeline: list[list[tuple[int, int, Action]]] = [[] for _ in range(pp)]
    posted: dict[tuple[int, int], deque] = defaultdict(deque)  # async: (src, dst) -> sends in flight;
    # nccl: (me, peer) -> my ops on that pair not yet completed, oldest first
    listening: dict[tuple[int, int], deque] = defaultdict(deque)  # async: (src, dst) -> receives posted, unmatched
    arrived: dict[Action, int] = {}  # async, nccl: when a completed receive's data is there
    pending: set[Action] = set()  # async, nccl: receives posted and not yet completed
    sent: dict[Action, int] = {}  # sends matched with their receive, and when: what a send wait waits for
    waits = [send_waits(ops) for ops in schedule]  # where each rank waits on its sends (PipelineRunner's rule)

    def head(r: int) -> Action | None:
        return schedule[r][pos[r]] if pos[r] < len(schedule[r]) else None

    while any(head(r) is not None for r in range(pp)):
        moved = False
        for r in range(pp):
            while (a := head(r)) is not None and a.kind in COMPUTE:
                if a in done:
                    raise ScheduleError(f"rank {r} runs {a} twice")
                if a.kind == B and Action(F, a.chunk, a.micro) not in done:
                    raise ScheduleError(f"rank {r} runs {a} before its forward")
                if a.kind == W and Action(B, a.chunk, a.micro) not in done:
                    raise ScheduleError(f"rank {r} runs {a} before its input-gradient B")
                src = a.chunk - 1 if a.kind == F else a.chunk + 1
                local = rank_of(src, pp, v_shape) == r
                arrival = Action(a.kind, src, a.micro) if local else Action(RECV_F if a.kind == F else RECV_B, *a[1:])
                if a.kind != W and 0 <= src < chunks and arrival not in done:
                    if arrival in pending:
                        break  # its receive is posted, the data not there yet: the rank waits
                    raise ScheduleError(f"rank {r} runs {a} before its input arrived")
                if any(s not in sent for s in waits[r].get(a, ())):
                    break  # a send it must wait on is not matched yet: the rank waits
                if arrival in arrived:
                    clock[r] = max(clock[r], arrived[arrival])
                clock[r] = max([clock[r]] + [sent[s] for s in waits[r].get(a, ())])
                timeline[r].append((clock[r], clock[r] + cost[a.kind], a))
                clock[r] += cost[a.kind]
                busy[r] += cost[a.kind]
                held[r] += 1 if a.kind == F else -1 if a.kind == release else 0
                peak[r] = max(peak[r], held[r])
                done.add(a)
                pos[r], moved = pos[r] + 1, True
        for r in range(pp):
            a = head(r)
            if a is None or a.kind in COMPUTE:
                continue
            q, want = _peer(a, pp, v_shape)
            if a.kind.startswith("SEND"):
                if Action(a.kind[-1], a.chunk, a.micro) not in done:  # SEND_B follows B: the input gradient
                    raise ScheduleError(f"rank {r} posts {a} before computing it")
                if p2p in ("async", "nccl"):  # isend: queue it and go on
                    posted[(r, q)].append((a, want, clock[r]))
                    pos[r], moved = pos[r] + 1, True
                    continue
                b = head(q)
                if b is None or not b.kind.startswith("RECV") or _peer(b, pp, v_shape)[0] != r:
                    continue  # the peer is busy with someone else: wait (a deadlock shows as no progress)
                if b != want:
                    raise ScheduleError(f"order mismatch: rank {r} sends {a} but rank {q} posts {b} (wants {want})")
                clock[r] = clock[q] = sent[a] = max(clock[r], clock[q])
                done.add(b)
                pos[r], pos[q], moved = pos[r] + 1, pos[q] + 1, True
            elif p2p in ("async", "nccl"):  # irecv: post it and go on; the compute that reads it waits
                (posted[(r, q)] if p2p == "nccl" else listening[(q, r)]).append((a, want, clock[r]))
                pending.add(a)
                pos[r], moved = pos[r] + 1, True
        if p2p == "nccl":
            moved |= _match_pair_heads(posted, arrived, done, sent)
        if p2p == "async":  # the k-th send from q to r meets the k-th receive on r from q
            for (q, r), recvs in listening.items():
                while recvs and posted[(q, r)]:
                    (send, meets, t), (got, _, t_recv) = posted[(q, r)].popleft(), recvs.popleft()
                    if meets != got:
                        raise ScheduleError(f"order mismatch: rank {q} sends {send} but rank {r} posts {got}")
                    arrived[got] = t
                    sent[send] = max(t, t_recv)
                    done.add(got)
                    moved = True
        pending -= done
        if not moved:
            stuck = {r: head(r) for r in range(pp) if head(r) is not None}
            heads = {k: v[0][0] for k, v in posted.items() if v} if p2p == "nccl" else {}
            raise ScheduleError(f"deadlock: no rank can progress; waiting {stuck}"
                                + (f"; pair heads (rank, peer): {heads}" if heads else ""))
    for c in range(chunks):
        for m in range(micro_batches):
            for kind in COMPUTE if split else (F, B):
                if Action(kind, c, m) not in done:
                    raise ScheduleError(f"{Action(kind, c, m)} never runs")
    if any(posted.values()) or any(listening.values()):
        raise ScheduleError(f"sends never received: {[x[0] for x in posted.values() for x in x]}; receives never "
                            f"sent: {[x[0] for x in listening.values() for x in x]}")
    return SimResult(max(clock), timeline, peak, busy)


def _match_pair_heads(posted: dict[tuple[int, int], deque], arrived: dict[Action, int], done: set,
                      sent: dict[Action, int]) -> bool:
    """NCCL pair FIFOs: complete every send/receive pair standing at the heads of both sides of a pair (the
    receive's data `arrived`, the send `sent`, at the later post). Returns whether anything completed; raises on
    a send meeting the wrong receive."""
    moved = False
    for (r, q) in list(posted):
        if r > q:
            continue
        mine, theirs = posted[(r, q)], posted[(q, r)]
        while mine and theirs:
            (a, want, ta), (b, _, tb) = mine[0], theirs[0]
            if a.kind.startswith("SEND") == b.kind.startswith("SEND"):
                break  # both sending (or both receiving): neither completes, ever
            if b != want:
                raise ScheduleError(f"order mismatch on pair ({r}, {q}): rank {r}'s {a} meets rank {q}'s {b}")
            recv, send = (b, a) if b.kind.startswith("RECV") else (a, b)
            arrived[recv] = sent[send] = max(ta, tb)
            done.add(recv)
            mine.popleft(), theirs.popleft()
            moved = True
    return moved


# ---- theory ------------------------------------------------------------------------------------------

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
        return simulate(ALL_SCHEDULES[schedule_name](pp, micro, 2), pp, 2, micro, p2p="async",
                        v_shape=True).bubble_fraction
    v = virtual if schedule_name == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro + pp - 1)
