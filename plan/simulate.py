"""The schedule simulator: a process-free dry run of parallel/pipeline_schedule.py's action lists under three
models of point-to-point messaging, and the proofs the runtime's message order rests on.

Pairings (`_with_p2p(..., pairing=)`). Each schedule fixes only the order of F/B on each rank; `_with_p2p` runs
those orders once as early as data allows (F=1, B=2 units, messages free) and gives every message two times:
ready (its producer's end) and meet (its consumer's start). Each rank then lists its actions in time order, a
message before any compute starting at its time, by one of three pairings:
- "ready" (the runtime's): SEND and RECV both at the ready time, with the same key on both sides (ready time,
  sender, chunk, micro). Every rank's messages then follow one global order, so within a peer pair both sides
  list the pair's messages, both directions merged, in the same order. That is what NCCL needs: torch runs a
  pair's unbatched isend/irecv on one communicator and stream in posting order, and a send completes only
  when the peer's matching receive is at the head of its side (simulate(..., p2p="nccl")); what gloo needs
  (the k-th send from a to b meets the k-th receive on b from a) follows. With the global order the lowest
  unfinished message always has both ranks posted on it, so no p2p model deadlocks, and with isends the
  timeline is the ideal one: every schedule meets `plan.theory.bubble_fraction` exactly. A receiver posts at
  the ready time and waits on the data only at the compute that reads it, so with stage times other than the
  units the rank runs on while the data is late (TestReceiveWaits). A wait on a send (`send_waits`) stands at a
  compute that starts after the message is ready, so it waits only on lower keys: no deadlock either.
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

from parallel.pipeline_schedule import (B, COMPUTE, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, ScheduleError,
                                        is_split, rank_of, send_waits, unit_times)


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
