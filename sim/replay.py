"""The p2p replay: a layout's recorded point-to-point posts and waits, every rank's, played under each discipline a
backend orders them by (sim.verify's check 3). A send must meet a receive of the same size and dtype, and no rank
may wait forever. Event-driven, so 1,024 ranks replay in seconds, and one component of each kind stands for the
alike ones (`p2p_components`).

A trace is a rank's list of events, in order: ("send" | "recv", n, peer, group, dtype, numel, phase, step, site)
for a post (n: its index among the rank's ops) and ("wait", n) for a wait on post n (sim.verify.World.p2p).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass


def span(ranks) -> str:
    """[0, 1, 2, 3, 8] as '[0-3, 8]'."""
    ranks, out = sorted(ranks), []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return "[" + ", ".join(out) + "]"


@dataclass(frozen=True)
class Discipline:
    """How a backend orders a rank's p2p ops. `fifo`: None (posts complete in any order: the k-th send from a to b
    meets the k-th receive on b from a), "pair" (one FIFO per rank and peer, both directions: a send completes only
    with its receive at the head of the peer's side), "rank" (one FIFO per rank and communicator, every peer's ops
    in posting order); `blocking`: a post returns only once matched."""

    fifo: str | None
    blocking: bool = False


# plan.timeline's p2p models (P2P_MODELS), each as the discipline that replays a recorded trace. A model the
# simulator gains must be named here too (check_p2p refuses to skip one); "nccl_eager" is the GPU path's: NCCL
# communicators initialised eagerly (init_process_group's device_id), so a group's p2p ops share one stream.
DISCIPLINES = {
    "async": Discipline(None),
    "nccl": Discipline("pair"),
    "nccl_eager": Discipline("rank"),
    "rendezvous": Discipline("pair", blocking=True),
}


def p2p_models() -> list[str]:
    """Every p2p model the schedule simulator knows, and the GPU path's eager one; each must have a discipline."""
    from plan.timeline import P2P_MODELS

    missing = [m for m in P2P_MODELS if m not in DISCIPLINES]
    if missing:
        raise ValueError(f"plan.timeline's p2p model(s) {missing} have no discipline in sim.verify.DISCIPLINES")
    return list(dict.fromkeys([*P2P_MODELS, *DISCIPLINES]))


def replay_p2p(traces: dict[int, list[tuple]], d: Discipline) -> str | None:
    """Play every rank's recorded p2p posts and waits under discipline `d`; None when every op completes, else
    what went wrong: a send meeting a receive of another size or dtype, a deadlock (the ranks stuck and on what),
    or ops never matched. Event-driven: a rank is advanced again only when one of its ops completes, a channel
    (sender, receiver, group) is matched again only when a post or a FIFO's new head touches it, so the replay
    costs in the ops, not in rounds x ranks (1,024 ranks of a pp=32 GPipe: seconds, not a minute a discipline).
    Matching is confluent (each channel pairs its k-th send with its k-th receive; a post or a completion never
    undoes another), so the ops that complete, and a deadlock, do not depend on the order of the work."""
    return _Replay(traces, d).run()


class _Replay:
    """One `replay_p2p`: each rank's place in its trace and the blocking post it waits on, the ops posted and
    completed, each channel's unmatched sends and receives, each FIFO's ops in posting order, and the work left:
    ranks to advance (`advance`) and channels to match (`match`)."""

    def __init__(self, traces: dict[int, list[tuple]], d: Discipline):
        self.traces, self.d = traces, d
        self.pos = {r: 0 for r in traces}
        self.done: set[tuple[int, int]] = set()  # (rank, n) of completed ops
        self.ops: dict[tuple[int, int], tuple] = {}  # (rank, n) -> event
        self.chan: dict[tuple, dict[str, deque]] = defaultdict(lambda: {"send": deque(), "recv": deque()})
        self.fifo: dict[tuple, deque] = defaultdict(deque)  # FIFO key -> (rank, n) in posting order
        self.waiting: dict[int, tuple[int, int]] = {}  # a blocking post: rank -> its op
        self.ready, self.queued = deque(traces), set(traces)  # ranks to advance
        self.dirty: deque = deque()  # channels to match
        self.dirty_set: set[tuple] = set()

    def run(self) -> str | None:
        """Advance ranks and match channels until neither has work left; then `replay_p2p`'s verdict."""
        while self.ready or self.dirty:
            while self.ready:
                r = self.ready.popleft()
                self.queued.discard(r)
                self.advance(r)
            while self.dirty:
                key = self.dirty.popleft()
                self.dirty_set.discard(key)
                problem = self.match(key)
                if problem:
                    return problem
        return self.stuck() or self.unmatched()

    def fifo_key(self, r: int, e: tuple) -> tuple | None:
        """The FIFO rank r's post `e` joins: None, the (rank, peer, group) pair's, or the (rank, group)'s."""
        return None if self.d.fifo is None else (r, e[2], e[3]) if self.d.fifo == "pair" else (r, e[3])

    def chan_key(self, x: tuple[int, int]) -> tuple:
        """The channel (sender, receiver, group) op x is posted on."""
        e = self.ops[x]
        return (x[0], e[2], e[3]) if e[0] == "send" else (e[2], x[0], e[3])

    def touch(self, key: tuple) -> None:
        """Channel `key` may match now: queue it, once."""
        if key not in self.dirty_set:
            self.dirty_set.add(key)
            self.dirty.append(key)

    def advance(self, r: int) -> None:
        """Rank r goes down its trace, posting each op on its channel (and FIFO), until a wait whose op is not
        done, or a blocking post not yet matched."""
        trace, pos, waiting, d = self.traces[r], self.pos, self.waiting, self.d
        while pos[r] < len(trace):
            if r in waiting:
                if waiting[r] not in self.done:
                    break
                del waiting[r]
            e = trace[pos[r]]
            if e[0] == "wait":
                if (r, e[1]) not in self.done:
                    break
            else:
                x = (r, e[1])
                self.ops[x] = e
                self.chan[self.chan_key(x)][e[0]].append(x)
                self.touch(self.chan_key(x))
                if d.fifo is not None:
                    self.fifo[self.fifo_key(r, e)].append(x)
                if d.blocking:
                    waiting[r] = x
            pos[r] += 1
        if r in waiting and waiting[r] in self.done:
            del waiting[r]

    def heads(self, x: tuple[int, int]) -> bool:
        """Whether op x may complete now: at the head of its FIFO, or any op without FIFOs."""
        return self.d.fifo is None or self.fifo[self.fifo_key(x[0], self.ops[x])][0] == x

    def match(self, key: tuple) -> str | None:
        """Channel `key`'s first send and first receive complete together while both may; each completion queues
        its rank and touches the channel of its FIFO's new head. A send meeting a receive of another size or dtype:
        the problem, said."""
        q, ops = self.chan[key], self.ops
        while q["send"] and q["recv"] and self.heads(q["send"][0]) and self.heads(q["recv"][0]):
            s, v = q["send"].popleft(), q["recv"].popleft()
            es, ev = ops[s], ops[v]
            if (es[4], es[5]) != (ev[4], ev[5]):
                return (
                    f"rank {s[0]}'s send of {es[4]} x{es[5]} to rank {v[0]} ({es[8]}, {es[6]} {es[7]}) meets "
                    f"a receive of {ev[4]} x{ev[5]} ({ev[8]})"
                )
            for x in (s, v):
                self.done.add(x)
                if x[0] not in self.queued:
                    self.queued.add(x[0])
                    self.ready.append(x[0])
                if self.d.fifo is not None:
                    f = self.fifo[self.fifo_key(x[0], ops[x])]
                    f.popleft()
                    if f:
                        self.touch(self.chan_key(f[0]))
        return None

    def stuck(self) -> str | None:
        """The deadlock, if ranks are left short of their trace's end: which, and on what op the first four wait."""
        traces, pos, waiting = self.traces, self.pos, self.waiting
        ranks = sorted(r for r in traces if pos[r] < len(traces[r]) or r in waiting)
        if not ranks:
            return None

        def on(r: int) -> str:
            e = self.ops[waiting[r]] if r in waiting else self.ops.get((r, traces[r][pos[r]][1]))
            if e is None:
                return "?"
            return f"{e[0]} {'to' if e[0] == 'send' else 'from'} rank {e[2]} ({e[8]}, {e[6]} {e[7]})"

        shown = "; ".join(f"rank {r} waits on its {on(r)}" for r in ranks[:4])
        return f"deadlock: ranks {span(ranks)} cannot go on: {shown}" + (" ..." if len(ranks) > 4 else "")

    def unmatched(self) -> str | None:
        """Ops posted and never completed, though every rank reached its trace's end: how many, and the first."""
        left = [x for x in self.ops if x not in self.done]
        if not left:
            return None
        r, n = min(left)
        e = self.ops[(r, n)]
        return (
            f"{len(left)} p2p op(s) never matched, first rank {r}'s {e[0]} {'to' if e[0] == 'send' else 'from'} "
            f"rank {e[2]} ({e[8]}, {e[6]} {e[7]})"
        )


def p2p_components(traces: dict[int, list[tuple]]) -> list[list[list[int]]]:
    """The ranks cut into components, ranks joined by a message (a replay never lets one component wait on
    another: FIFOs and blocking posts are a rank's own, a channel joins two ranks), and the components grouped by
    their traces with every rank renamed by its place in its component (a group's rank outside it kept as it
    is): alike components replay alike, up to those names. [[component, alike, ...], ...], ranks sorted."""
    parent = {r: r for r in traces}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r, t in traces.items():
        for e in t:
            if e[0] != "wait" and e[2] in parent:
                a, b = find(r), find(e[2])
                if a != b:
                    parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = defaultdict(list)
    for r in sorted(traces):
        comps[find(r)].append(r)
    alike: dict[tuple, list[list[int]]] = {}
    for comp in comps.values():
        idx = {r: i for i, r in enumerate(comp)}
        names: dict[tuple, tuple] = {}
        rename = lambda g: names.get(g) or names.setdefault(g, tuple(idx.get(x, ("out", x)) for x in g))  # noqa: E731
        form = tuple(
            tuple((e[0], e[1], idx.get(e[2], ("out", e[2])), rename(e[3]), *e[4:]) for e in traces[r]) for r in comp
        )
        alike.setdefault(form, []).append(comp)
    return list(alike.values())


def replay_components(traces: dict[int, list[tuple]], d: Discipline, kinds: list | None = None) -> str | None:
    """`replay_p2p` of one component of each kind (`kinds`: p2p_components(traces)); the first problem, with the
    components alike to the one it is in."""
    for comps in kinds if kinds is not None else p2p_components(traces):
        problem = replay_p2p({r: traces[r] for r in comps[0]}, d)
        if problem:
            others = [r for c in comps[1:] for r in c]
            return problem + (
                f" (so too in the {len(comps) - 1} component(s) alike: ranks {span(others)})" if others else ""
            )
    return None
