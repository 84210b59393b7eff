"""The schedule simulator: a process-free dry run of parallel/pipeline/schedule.py's action lists under four
models of point-to-point messaging, and the proofs the runtime's message order rests on.

Pairings (`paired`). Each schedule fixes only the order of F/B on each rank; the runtime's lists
(pipeline_schedule._with_p2p) run those orders once as early as data allows (F=1, B=2 units, messages free) and
list every message at its ready time. `paired` lists the same compute orders' messages by another rule, to
show why the runtime's is the one: every message has two times, ready (its producer's end) and meet (its
consumer's start), and each rank lists its actions in time order, a message before any compute starting at its
time, by one of three pairing rules:
- "ready" (the runtime's): SEND and RECV both at the ready time, with the same key on both sides (ready time,
  sender, chunk, micro). Every rank's messages then follow one global order, so within a peer pair both sides
  list the pair's messages, both directions merged, in the same order. That is what NCCL needs: torch runs a
  pair's unbatched isend/irecv on one communicator and stream in posting order, and a send completes only
  when the peer's matching receive is at the head of its side (simulate_schedule(..., p2p="nccl")); what gloo needs
  (the k-th send from a to b meets the k-th receive on b from a) follows. With the global order the lowest
  unfinished message always has both ranks posted on it, at the head of both their streams even where a rank
  has one stream for all its peers (an eagerly initialised NCCL group: p2p="nccl_eager"), so no p2p model
  deadlocks, and with isends the timeline at unit times is the ideal one: every schedule meets
  `plan.theory.bubble_fraction` exactly. With uneven stage times one stream per rank costs makespan (a
  ready send waits behind a receive from the other neighbour): up to +9% for DualPipe-V, +12.5% for ZB-H1
  with a slow first stage (tests/test_pipeline_schedule.py TestEagerNccl); link groups (`links`) win it
  back. A receiver posts at
  the ready time and waits on the data only at the compute that reads it, so with stage times other than the
  units the rank runs on while the data is late (TestReceiveWaits). A wait on a send (`send_waits`) stands at a
  compute that starts after the message is ready, so it waits only on lower keys: no deadlock either.
- "meet": both at the meeting time (the same global-order argument). The sender posts late, so a sender
  that would have run ahead waits for its receiver: GPipe and 1F1B lose nothing, interleaved 1F1B loses
  some of its gain (tests/test_pipeline_schedule.py measures it).
- "ready_meet": SEND at ready, RECV at meet (the order before 2026-12: each direction agrees, the merged pair
  order does not). gloo and isend run it at the ideal timeline; under NCCL's pair order, and with blocking
  sends, interleaved 1F1B deadlocks (e.g. P=2, V=2, M=4: rank 0 posts SEND_F(c0,m2) before RECV_B(c2,m0)
  while rank 1 posts SEND_B(c3,m0) before RECV_F(c1,m2)). Kept so the tests show the simulator catches it.

`simulate_schedule` executes the lists under each p2p model (async, nccl, rendezvous, nccl_eager) and checks everything
above.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from parallel.groups import p2p_link
from parallel.pipeline.schedule import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    boundary,
    ideal_times,
    in_key_order,
    is_split,
    messages,
    peer_of,
    rank_of,
    send_waits,
    unit_times,
)


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
    return peer_of(a, pp, v), Action(kind, a.chunk + step, a.micro)


PAIRINGS = ("ready", "meet", "ready_meet")


def paired(schedule: list[list[Action]], pp: int, pairing: str, v_shape: bool = False) -> list[list[Action]]:
    """The schedule's compute orders with their messages listed by `pairing` (module docstring): "ready" gives
    back the runtime's lists; "meet" and "ready_meet" the rules they are held against."""
    if pairing not in PAIRINGS:
        raise ValueError(f"unknown pairing {pairing!r}; known: {PAIRINGS}")
    order = [[a for a in ops if a.kind in COMPUTE] for ops in schedule]
    start, end = ideal_times(order, pp)
    keyed = [((start[c], 1, r, c.chunk, c.micro), r, c) for r in range(pp) for c in order[r]]
    for r, c, recv, sender, send in messages(order, pp, v_shape):
        ready = end[(c.kind, send.chunk, c.micro)]
        ready_key, meet_key = ((t, 0, ready, sender, c.chunk, c.micro) for t in (ready, start[c]))
        keyed += [
            (ready_key if pairing == "ready" else meet_key, r, recv),
            (meet_key if pairing == "meet" else ready_key, sender, send),
        ]
    return in_key_order(keyed, pp)


Times = int | Sequence[int]  # a compute's units: the same for every chunk, or one per chunk
P2P_MODELS = ("async", "nccl", "rendezvous", "nccl_eager")
FIFO_MODELS = ("nccl", "nccl_eager")  # torch's unbatched NCCL p2p: streams of posted ops, each run in order


@dataclass
class _Entry:
    """One entry of a p2p stream (FIFO_MODELS): the ops posted as one call, one op unless batched (then the
    ops of one `batch_isend_irecv`, which NCCL runs as one group: they progress together and the entry ends
    when the last of them has met its peer). ops: (action, the peer's matching action, the peer's stream)."""

    ops: list[tuple[Action, Action, tuple[int, int]]]
    post: int
    closed: bool = False  # every op of the call posted: the call is issued
    start: int = 0  # when it runs: its post, or the end of the entry before it on its stream if later
    fired: dict[int, int] = field(default_factory=dict)  # op index -> when it met its peer


def simulate_schedule(
    schedule: list[list[Action]],
    pp: int,
    virtual: int = 1,
    micro_batches: int | None = None,
    f_time: Times = 1,
    b_time: Times | None = None,
    w_time: Times | None = None,
    p2p: str = "rendezvous",
    v_shape: bool = False,
    links: bool = False,
    batched: bool = False,
) -> SimResult:
    """Run every rank's list; computes take f_time / b_time / w_time units (default `unit_times`: B = 2 for a
    whole backward, B = W = 1 when the schedule is split), each one number or one per chunk; `v_shape`: the
    chunks sit as `chunk_of(..., v_shape=True)` puts them (the V schedules). Messages take no time. Four p2p models:
    - "rendezvous": a send blocks until its receive is posted; both complete at the later arrival
      (blocking send/recv).
    - "async" (gloo, isend/irecv): posting never blocks the rank. The k-th send from a to b meets the k-th
      receive on b from a, and the data is there at the send's post time.
    - "nccl" (torch's unbatched isend/irecv on NCCL with lazily created communicators): one FIFO per peer
      pair and side, shared by both directions, in posting order. ProcessGroupNCCL::pointToPoint, when the
      group was not eagerly initialised, creates a 2-rank communicator per peer pair (key getKeySendRecv),
      with its own stream. Posting never blocks the rank. The ops at the heads of a pair's two sides complete
      together, at the later post, when one is a send and the other its receive; two sends (or two receives)
      at the heads wait for each other forever.
    - "nccl_eager" (the same calls on a group initialised eagerly: init_process_group(device_id=...), which
      runtime/device.py passes on CUDA, binds the world group to the device, and every group split from it,
      DeviceMesh's and new_group's, is eager too): one FIFO per rank (per group: `links`), across all its
      peers, in posting order. In eager mode pointToPoint reuses the group's own communicator (key
      getKeyFromDevice) and so its one NCCL stream for every unbatched send and receive: the ops of a rank run
      one after the other in the order it posted them, whichever peer they name; torch warns once ("In eager
      initialization mode, unbatched P2P ops are treated as independent collective ops, and are thus serialized
      with all other ops on this ProcessGroup, including other P2P ops"). An op runs once every op posted
      before it on its stream has completed; a send completes when its receive is running at the head of the
      peer's stream, and vice versa (ncclSend/ncclRecv: "This operation is blocking for the GPU"), both at the
      later of the two heads' start times. So a send to rank r+1 that is ready waits behind a receive from
      r-1 posted before it, until r-1 sends. Two heads naming each other with the same kind never complete;
      a head whose peer's head names a third rank waits. (NCCL may complete a small send into the receiver's
      buffer before the receive runs; that only lets ops finish earlier than modelled.)
      `links`: the fix, every message on the group of its link (`parallel.groups.p2p_link` of the chunk
      boundary it crosses, as PipelineRunner posts it given link groups): each rank's stream on a group then
      carries one peer's messages, as "nccl"'s pairs do. `batched`: the other fix, the p2p ops a rank lists
      back to back posted as one `batch_isend_irecv` (one stream entry, its ops progressing together; a
      receive's data is there when the whole entry ends, torch returning one work for the batch).
    In all, a compute waits for the receive of its input, which must be posted before it in the rank's list
    (PipelineRunner posts each receive at its place in the list and waits on it just before the compute), and
    for the sends `send_waits` names before it to be matched with their receives (the runner waits on them
    there, and frees what they sent).
    Raises ScheduleError on deadlock, a send meeting the wrong receive, a compute before its input's receive,
    F/B/W out of order, work on another rank's chunk, or any (chunk, micro) without exactly one F and one B (and
    one W in a split schedule). A rank holds a micro-batch's activations from its F to its B, or to its W when
    split (what W needs stays until W): `max_in_flight`."""
    _check_models(p2p, links, batched)
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks, pp={pp}")
    split = is_split(schedule)
    _, b_default, w_default = unit_times(split)
    cost = {F: f_time, B: b_default if b_time is None else b_time, W: w_default if w_time is None else w_time}
    if micro_batches is None:
        micro_batches = 1 + max((a.micro for ops in schedule for a in ops), default=-1)
    _check_places(schedule, pp, virtual, micro_batches, v_shape)
    sim = _Simulation(schedule, pp, virtual, cost, W if split else B, p2p, v_shape, links, batched)
    while sim.left:
        if not sim.round():
            sim.deadlock()
    sim.check_complete(micro_batches, COMPUTE if split else (F, B))
    return SimResult(max(sim.clock), sim.timeline, sim.peak, sim.busy)


def _check_models(p2p: str, links: bool, batched: bool) -> None:
    """The p2p model is one of P2P_MODELS, and `links` or `batched` (not both) only fix "nccl_eager"."""
    if p2p not in P2P_MODELS:
        raise ValueError(f"unknown p2p model {p2p!r}; known: {P2P_MODELS}")
    if (links or batched) and p2p != "nccl_eager":
        raise ValueError("links and batched are fixes of the nccl_eager model")
    if links and batched:
        raise ValueError("links or batched, not both")


def _check_places(schedule: list[list[Action]], pp: int, virtual: int, micro_batches: int, v_shape: bool) -> None:
    """Every action is listed on the rank that holds its chunk, names a chunk and micro-batch that exist, and
    sends or receives only across a chunk boundary that has a neighbour."""
    chunks = pp * virtual
    for r, ops in enumerate(schedule):
        for a in ops:
            if rank_of(a.chunk, pp, v_shape) != r or not 0 <= a.chunk < chunks or not 0 <= a.micro < micro_batches:
                raise ScheduleError(f"rank {r} cannot run {a} (pp={pp}, virtual={virtual}, M={micro_batches})")
            if (a.kind in (SEND_F, RECV_B) and a.chunk == chunks - 1) or (a.kind in (RECV_F, SEND_B) and a.chunk == 0):
                raise ScheduleError(f"rank {r}: {a} has no neighbouring chunk")


class _Simulation:
    """One run of simulate_schedule: each rank's place in its list and its clock, what has completed, the messages
    in flight under the p2p model, and what each action needs (`_needs`). `round` moves every rank as far as it
    can; the caller repeats it until every action is done, or no rank moves (`deadlock`)."""

    def __init__(
        self,
        schedule: list[list[Action]],
        pp: int,
        virtual: int,
        cost: dict[str, Times],
        release: str,
        p2p: str,
        v_shape: bool,
        links: bool,
        batched: bool,
    ):
        self.schedule, self.pp, self.chunks, self.cost, self.release = schedule, pp, pp * virtual, cost, release
        self.p2p, self.v_shape, self.links, self.batched = p2p, v_shape, links, batched
        self.done: set[Action] = set()  # computes and receives completed, over all ranks (chunks name their rank)
        self.pos, self.clock, self.held, self.peak, self.busy = [0] * pp, [0] * pp, [0] * pp, [0] * pp, [0] * pp
        self.timeline: list[list[tuple[int, int, Action]]] = [[] for _ in range(pp)]
        self.posted: dict[tuple[int, int], deque] = defaultdict(deque)  # async: (src, dst) -> sends in flight
        self.listening: dict[tuple[int, int], deque] = defaultdict(deque)  # async: (src, dst) -> receives unmatched
        self.streams: dict[tuple[int, int], deque[_Entry]] = defaultdict(deque)  # FIFO_MODELS: (rank, stream)
        self.free: dict[tuple[int, int], int] = defaultdict(int)  # FIFO_MODELS: when a stream's last entry ended
        self.arrived: dict[Action, int] = {}  # async, FIFO_MODELS: when a completed receive's data is there
        self.pending: set[Action] = set()  # async, FIFO_MODELS: receives posted and not yet completed
        self.sent: dict[Action, int] = {}  # sends matched with their receive, and when: what a send wait waits for
        self.needs = self._needs()
        self.left = sum(len(ops) for ops in schedule)

    def stream(self, r: int, q: int, a: Action) -> tuple[int, int]:
        """The stream rank r posts `a` (to or from q) on: the pair's ("nccl"), the group's ("nccl_eager": 0,
        or the link's group)."""
        if self.p2p == "nccl":
            return r, q
        if not self.links:
            return r, 0
        c = boundary(a)
        return r, p2p_link(rank_of(c, self.pp, self.v_shape), rank_of(c + 1, self.pp, self.v_shape), self.pp)

    def _needs(self) -> list[list[tuple]]:
        """Per action, what running or posting it needs: a compute its input's arrival (None: its input is a batch
        of data, or it is a W) and the sends it waits on (`send_waits`: PipelineRunner's rule); a SEND/RECV its
        peer, the peer's action, and for the FIFO models its stream, the peer's, and whether it is the last op of
        its call."""
        pp, v_shape, chunks = self.pp, self.v_shape, self.chunks
        out: list[list[tuple]] = []
        for r, ops in enumerate(self.schedule):
            waits, row = send_waits(ops), []
            for i, a in enumerate(ops):
                if a.kind in COMPUTE:
                    src = a.chunk - 1 if a.kind == F else a.chunk + 1
                    arrival = None
                    if a.kind != W and 0 <= src < chunks:
                        local = rank_of(src, pp, v_shape) == r
                        arrival = (
                            Action(a.kind, src, a.micro) if local else Action(RECV_F if a.kind == F else RECV_B, *a[1:])
                        )
                    row.append((arrival, waits.get(a, ())))
                else:
                    q, want = _peer(a, pp, v_shape)
                    nxt = ops[i + 1] if i + 1 < len(ops) else None
                    closes = not (self.batched and nxt is not None and nxt.kind not in COMPUTE)
                    fifo = self.p2p in FIFO_MODELS
                    keys = (self.stream(r, q, a), self.stream(q, r, want)) if fifo else (None, None)
                    row.append((q, want, *keys, closes))
            out.append(row)
        return out

    def head(self, r: int) -> Action | None:
        """Rank r's next action, None when its list is done."""
        return self.schedule[r][self.pos[r]] if self.pos[r] < len(self.schedule[r]) else None

    def round(self) -> bool:
        """Every rank runs the computes at the head of its list that can run, then posts the p2p ops after them
        that it can; then the posted messages meet under the p2p model. Whether anything moved."""
        moved = False
        for r in range(self.pp):
            moved |= self.compute(r)
            ops, n = self.schedule[r], len(self.schedule[r])
            while self.pos[r] < n and (a := ops[self.pos[r]]).kind not in COMPUTE and self.post(r, a):
                moved = True
        if self.p2p in FIFO_MODELS:
            moved |= _match_stream_heads(self.streams, self.free, self.arrived, self.done, self.sent)
        if self.p2p == "async":
            moved |= self.match_async()
        self.pending -= self.done
        return moved

    def compute(self, r: int) -> bool:
        """Rank r runs the computes at the head of its list while each one's input is there and the sends it waits
        on are matched, each from the later of the rank's clock and those times; whether it ran any. Raises on a
        compute run twice, out of F/B/W order, or before its input's receive is posted."""
        ops, n, done, moved = self.schedule[r], len(self.schedule[r]), self.done, False
        while self.pos[r] < n and (a := ops[self.pos[r]]).kind in COMPUTE:
            arrival, ws = self.needs[r][self.pos[r]]
            if a in done:
                raise ScheduleError(f"rank {r} runs {a} twice")
            if a.kind == B and Action(F, a.chunk, a.micro) not in done:
                raise ScheduleError(f"rank {r} runs {a} before its forward")
            if a.kind == W and Action(B, a.chunk, a.micro) not in done:
                raise ScheduleError(f"rank {r} runs {a} before its input-gradient B")
            if arrival is not None and arrival not in done:
                if arrival in self.pending:
                    break  # its receive is posted, the data not there yet: the rank waits
                raise ScheduleError(f"rank {r} runs {a} before its input arrived")
            if any(s not in self.sent for s in ws):
                break  # a send it must wait on is not matched yet: the rank waits
            t = max(self.clock[r], self.arrived.get(arrival, 0), *(self.sent[s] for s in ws))
            cost = self.cost[a.kind]
            dt = cost if isinstance(cost, int) else cost[a.chunk]
            self.timeline[r].append((t, t + dt, a))
            self.clock[r] = t + dt
            self.busy[r] += dt
            self.held[r] += 1 if a.kind == F else -1 if a.kind == self.release else 0
            self.peak[r] = max(self.peak[r], self.held[r])
            done.add(a)
            self.pos[r], self.left, moved = self.pos[r] + 1, self.left - 1, True
        return moved

    def post(self, r: int, a: Action) -> bool:
        """Rank r posts its head p2p action `a`; whether it did (a blocking send waits for its receive)."""
        q, want, key, peer_key, closes = self.needs[r][self.pos[r]]
        if a.kind[0] == "S" and Action(a.kind[-1], a.chunk, a.micro) not in self.done:
            raise ScheduleError(f"rank {r} posts {a} before computing it")  # SEND_B follows B: the input gradient
        if key is not None:  # FIFO_MODELS: isend / irecv, enqueued on its stream; the rank goes on
            s = self.streams[key]
            if s and not s[-1].closed:  # batched: the call these ops go out in is still being listed
                s[-1].ops.append((a, want, peer_key))
            else:
                s.append(_Entry([(a, want, peer_key)], self.clock[r], start=max(self.clock[r], self.free[key])))
            s[-1].closed = closes
            if a.kind[0] == "R":
                self.pending.add(a)  # the compute that reads it waits
        elif self.p2p == "async" and a.kind[0] == "S":  # isend: queue it and go on
            self.posted[(r, q)].append((a, want, self.clock[r]))
        elif self.p2p == "async":  # irecv: post it and go on; the compute that reads it waits
            self.listening[(q, r)].append((a, want, self.clock[r]))
            self.pending.add(a)
        elif a.kind[0] == "R":
            return False  # a blocking receive completes when its sender reaches the send
        elif not self.rendezvous(r, q, a, want):
            return False
        self.pos[r] += 1
        self.left -= 1
        return True

    def rendezvous(self, r: int, q: int, a: Action, want: Action) -> bool:
        """The blocking send `a` from rank r completes with rank q's receive `want` if q is posting it now, both
        ranks at the later of their clocks; whether it did (q busy with another peer: r waits)."""
        b = self.head(q)
        if b is None or b.kind[0] != "R" or _peer(b, self.pp, self.v_shape)[0] != r:
            return False  # the peer is busy with someone else: wait (a deadlock shows as no progress)
        if b != want:
            raise ScheduleError(f"order mismatch: rank {r} sends {a} but rank {q} posts {b} (wants {want})")
        self.clock[r] = self.clock[q] = self.sent[a] = max(self.clock[r], self.clock[q])
        self.done.add(b)
        self.pos[q] += 1
        self.left -= 1
        return True

    def match_async(self) -> bool:
        """Under "async" the k-th send from q to r meets the k-th receive on r from q; the data is there at the send's
        post, the send matched at the later post. Whether any met; raises on a send meeting the wrong receive."""
        moved = False
        for (q, r), recvs in self.listening.items():
            while recvs and self.posted[(q, r)]:
                (send, meets, t), (got, _, t_recv) = self.posted[(q, r)].popleft(), recvs.popleft()
                if meets != got:
                    raise ScheduleError(f"order mismatch: rank {q} sends {send} but rank {r} posts {got}")
                self.arrived[got] = t
                self.sent[send] = max(t, t_recv)
                self.done.add(got)
                moved = True
        return moved

    def deadlock(self) -> None:
        """Raise the deadlock: each stuck rank's head action and, for the FIFO models, each stream's head op."""
        stuck = {r: self.head(r) for r in range(self.pp) if self.head(r) is not None}
        heads = {
            k: next(op[0] for i, op in enumerate(v[0].ops) if i not in v[0].fired) for k, v in self.streams.items() if v
        }
        what = "pair heads (rank, peer)" if self.p2p == "nccl" else "stream heads (rank, group)"
        raise ScheduleError(
            f"deadlock: no rank can progress; waiting {stuck}" + (f"; {what}: {heads}" if heads else "")
        )

    def check_complete(self, micro_batches: int, kinds: Sequence[str]) -> None:
        """Every (chunk, micro) ran each of `kinds` (F and B, and W when split), and no message is left unmatched."""
        for c in range(self.chunks):
            for m in range(micro_batches):
                for kind in kinds:
                    if Action(kind, c, m) not in self.done:
                        raise ScheduleError(f"{Action(kind, c, m)} never runs")
        posted, listening, streams = self.posted, self.listening, self.streams
        if any(posted.values()) or any(listening.values()) or any(streams.values()):
            raise ScheduleError(
                f"sends never received: {[x[0] for x in posted.values() for x in x]}; receives never "
                f"sent: {[x[0] for x in listening.values() for x in x]}; never completed: "
                f"{[op[0] for s in streams.values() for e in s for op in e.ops]}"
            )


def _sends(a: Action) -> bool:
    return a.kind.startswith("SEND")


def _match_stream_heads(
    streams: dict[tuple[int, int], deque],
    free: dict[tuple[int, int], int],
    arrived: dict[Action, int],
    done: set,
    sent: dict[Action, int],
) -> bool:
    """FIFO_MODELS: meet every op of a stream's head entry with its peer op in the head entry of the peer's
    stream (the first not yet met there that names this stream and goes the other way, as NCCL matches a
    pair's sends and receives in order), at the later of the two entries' starts; then retire every head entry
    whose ops have all met: its receives' data `arrived` and its sends `sent` at its end, when the next entry on
    its stream may start. Returns whether anything happened; raises on a send meeting the wrong receive."""
    moved = False
    for key, s in list(streams.items()):
        if not s or not s[0].closed:
            continue
        mine = s[0]
        for i, (a, want, peer) in enumerate(mine.ops):
            theirs = streams[peer][0] if streams.get(peer) else None
            if i in mine.fired or theirs is None or not theirs.closed:
                continue
            j = next(
                (
                    j
                    for j, (b, _, back) in enumerate(theirs.ops)
                    if j not in theirs.fired and back == key and _sends(b) != _sends(a)
                ),
                None,
            )
            if j is None:
                continue  # the peer's running entry has nothing for this op (yet, or ever: a deadlock)
            if theirs.ops[j][0] != want:
                raise ScheduleError(
                    f"order mismatch on streams {key}, {peer}: rank {key[0]}'s {a} meets rank "
                    f"{peer[0]}'s {theirs.ops[j][0]}"
                )
            mine.fired[i] = theirs.fired[j] = max(mine.start, theirs.start)
            moved = True
    for key, s in streams.items():
        while s and s[0].closed and len(s[0].fired) == len(s[0].ops):
            entry = s.popleft()
            end = free[key] = max(entry.fired.values())
            for a, _, _ in entry.ops:
                if _sends(a):
                    sent[a] = end
                else:
                    arrived[a] = end
                    done.add(a)
            if s:
                s[0].start = max(s[0].post, end)
    return moved
