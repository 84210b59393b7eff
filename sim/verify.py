"""python -m sim.verify: a layout checked across its ranks, by simulating them (sim/fake_rank.py).

    python -m sim.verify --world_size 64 -- --model gpt2-xl --pipeline_parallel_size 2 --pp_schedule zbv ...
    python -m sim.verify --world_size 16 --all_ranks -- <train.py flags>

Each simulated rank runs train.py's build and two training steps on the fake backend and fake tensors, recorded.
The ranks are then checked against each other and against the planner:
1. groups: every rank makes the same new_group calls, with the same ranks, in the same order (a new_group is
   collective over the world: one that some ranks skip hangs the others);
2. collectives: within every group every member issues the same sequence (op, dtype, elements in and out,
   reduce op); otherwise the first mismatch is named: the group, the op's index, which ranks issue what, where;
3. p2p (the replay: sim/replay.py): every send meets its receive, of the same size, and the ranks' posts and
   waits play out without deadlock under every point-to-point discipline the schedule simulator models
   (`DISCIPLINES`: gloo's per-direction order, NCCL's pair FIFOs, NCCL's per-rank FIFO of an eagerly initialised
   communicator, blocking send/recv),
   and each rank waits on every p2p op it posts exactly once (`check_waits`);
4. planner: per simulated rank, state bytes equal plan.predict's exactly, and the second step's comm bytes and
   calls; the peak (memory.LiveStorages on the fake storages) within 15% of the predicted peak; and what each
   registered concept checks of its own (runtime/registry.Concept.findings);
5. startup (reported): the new_group calls each rank makes (and how many hold it), the ops at init, and how many
   of them span the whole world.

Classes. Without --all_ranks one rank per class is simulated, and every other rank's recording is its class
representative's with the mesh shifted (sim/layout.py: which ranks must record alike, and the shift). The planner's
numbers are checked for the representative and, against the same recording, for each other stage it stands for.
With --all_ranks every rank is simulated and each one's recording is also held against its representative's shifted
one (`symmetry`): that the classes are sound.

The p2p replay (3) runs on the whole world's traces, cut into components (ranks joined by messages) and one of each
kind replayed (`p2p_components`: alike up to the ranks' names; pp=32 x dp=16 x cp=2 has 16 alike components).

Exit code 0: consistent; 1: a finding (each printed); 2: bad input, in one line.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

from sim.fake_rank import Op, RankRun, planner_view
from sim.layout import Layout, fault_ranks
from sim.replay import (
    DISCIPLINES,
    p2p_components,
    p2p_models,
    replay_components,
    span,
)
from trainer.concepts import concepts

PEAK_RTOL = 0.15  # the planner's peak, as tests/test_plan_runs.py holds it against the CPU's allocated peak


# ----------------------------------------------------------------------------- simulating


def plan_for(flags: list[str], world: int, rank: int):
    """config.validate of train.py's `flags` as rank `rank` of `world` simulated (UsageError on bad input)."""
    from trainer import config

    return config.validate(
        config.parse_args([*flags, "--fake_world_size", str(world), "--fake_rank", str(rank)]),
        launch="pass --world_size {n}",
    )


def simulate_ranks(flags: list[str], world: int, ranks: list[int], progress=None) -> dict[int, RankRun]:
    """Each of `ranks` simulated in this process, one after another."""
    from sim.fake_rank import run_fake_rank

    out = {}
    for r in ranks:
        out[r] = run_fake_rank(plan_for(flags, world, r))
        if progress is not None:
            progress(r, out[r])
    return out


# ----------------------------------------------------------------------------- the expanded world


@dataclass
class World:
    """Every rank's recording: the simulated ones as recorded, the others as their representative's shifted.
    `groups[r]`: rank r's new_group calls; `collectives[r]`: {group: [Op]} (p2p and waits apart); `p2p[r]`: its
    sends, receives and waits in order, ranks shifted."""

    layout: Layout
    runs: dict[int, RankRun]
    rep: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        self._shifts: dict[tuple[int, int], object] = {}
        self._coll: dict[int, dict[tuple, list[Op]]] = {}
        self._p2p: dict[int, list[tuple]] = {}
        self._group_cache: dict[tuple, tuple] = {}

    def source(self, r: int) -> tuple[RankRun, object]:
        """(the recording rank r's is made from, the rank map that makes it)."""
        if r in self.runs:
            return self.runs[r], None
        rep = self.rep[r]
        key = (rep, r)
        if key not in self._shifts:
            self._shifts[key] = self.layout.shift(rep, r)
        return self.runs[rep], self._shifts[key]

    def _map_group(self, group: tuple[int, ...], f, key) -> tuple[int, ...]:
        if f is None or len(group) == self.layout.world:
            return group
        k = (group, key)
        out = self._group_cache.get(k)
        if out is None:
            out = self._group_cache[k] = tuple(sorted(f(g) for g in group))
        return out

    def collectives(self, r: int) -> dict[tuple, list[Op]]:
        if r not in self._coll:
            run, f = self.source(r)
            out: dict[tuple, list[Op]] = defaultdict(list)
            for e in run.events:
                if e.op not in ("send", "recv", "wait"):
                    out[self._map_group(e.group, f, (run.rank, r))].append(e)
            self._coll[r] = out
        return self._coll[r]

    def p2p(self, r: int) -> list[tuple]:
        """[(kind, n, peer, group, dtype, numel, phase, step, site)]: kind send, recv or wait (n: the waited op)."""
        if r not in self._p2p:
            run, f = self.source(r)
            out = []
            for e in run.events:
                if e.op == "wait":
                    out.append(("wait", e.peer, -1, (), "", 0, e.phase, e.step, e.site))
                elif e.op in ("send", "recv"):
                    out.append(
                        (
                            e.op,
                            e.n,
                            f(e.peer) if f else e.peer,
                            self._map_group(e.group, f, (run.rank, r)),
                            e.dtype,
                            e.numel,
                            e.phase,
                            e.step,
                            e.site,
                        )
                    )
            self._p2p[r] = out
        return self._p2p[r]


# ----------------------------------------------------------------------------- the checks


def where(op: Op) -> str:
    phase = op.phase if op.phase in ("init", "exit") else f"{op.phase} {op.step}"
    return f"{op.site} ({phase})"


def describe_op(op: Op | None) -> str:
    if op is None:
        return "nothing (the sequence ends)"
    size = f"{op.numel}" + (f"->{op.out}" if op.out else "")
    return f"{op.op} {op.dtype} x{size}" + (f" {op.reduce}" if op.reduce else "") + f" at {where(op)}"


def check_groups(w: World) -> list[str]:
    """1. Every simulated rank makes rank 0's new_group calls (the other ranks' are their representatives')."""
    runs = w.runs
    calls = {r: [g for g, _, _ in run.groups] for r, run in runs.items()}
    ref_rank = min(runs)
    ref = calls[ref_rank]
    out = []
    by_calls: dict[tuple, list[int]] = defaultdict(list)
    for r, c in calls.items():
        by_calls[tuple(c)].append(r)
    if len(by_calls) == 1:
        return out
    members = {r: [r] + [m for m, rep in w.rep.items() if rep == r and m not in runs] for r in runs}  # + shifted
    for c, ranks in by_calls.items():
        if list(c) == ref:
            continue
        i = next((i for i, (x, y) in enumerate(zip(c, ref)) if x != y), min(len(c), len(ref)))
        who = sorted(m for r in ranks for m in members[r])
        mine = f"new_group({list(c[i])}) at {runs[ranks[0]].groups[i][2]}" if i < len(c) else "no further new_group"
        theirs = f"new_group({list(ref[i])})" if i < len(ref) else "no further new_group"
        out.append(
            f"groups: ranks {span(who)} make {len(c)} new_group calls, rank {ref_rank} makes {len(ref)}; at "
            f"call #{i} ranks {span(who)} make {mine} where rank {ref_rank} makes {theirs}"
        )
    return out


def check_collectives(w: World) -> list[str]:
    """2. Within every group, every member's sequence of collectives is the same; the first mismatch, named."""
    lay = w.layout
    members_of: dict[tuple, None] = {}
    for r in range(lay.world):
        for g in w.collectives(r):
            members_of.setdefault(g, None)
    out = []
    for g in members_of:
        seqs = {r: w.collectives(r).get(g, []) for r in g}
        sigs = {r: tuple(o.signature() for o in s) for r, s in seqs.items()}
        if len(set(sigs.values())) == 1:
            continue
        n = max(len(s) for s in sigs.values())
        i = next(i for i in range(n) if len({s[i] if i < len(s) else None for s in sigs.values()}) > 1)
        by: dict[object, list[int]] = defaultdict(list)
        for r, s in sigs.items():
            by[s[i] if i < len(s) else None].append(r)
        parts = sorted(by.items(), key=lambda kv: -len(kv[1]))
        said = "; ".join(
            f"ranks {span(rs)} issue {describe_op(seqs[rs[0]][i] if i < len(seqs[rs[0]]) else None)}" for _, rs in parts
        )
        odd = sorted(r for _, rs in parts[1:] for r in rs)
        out.append(f"collectives: group {lay.describe_group(g)}, op #{i}: ranks {span(odd)} differ: {said}")
    return out


def check_p2p(w: World) -> tuple[list[str], int]:
    """3. Every model of p2p_models(): (findings, p2p messages per step summed over ranks in the last step). One
    component of each kind (`p2p_components`) is replayed: a pp=32 x dp=16 x cp=2 layout's 16 pp x cp
    components are alike, one replay of 64 ranks stands for 1,024."""
    traces = {r: w.p2p(r) for r in range(w.layout.world)}
    if not any(traces.values()):
        return [], 0
    out, kinds = [], p2p_components(traces)
    for m in p2p_models():
        problem = replay_components(traces, DISCIPLINES[m], kinds)
        if problem:
            out.append(f"p2p under {m}: {problem}")
    return out, sum(1 for t in traces.values() for e in t if e[0] == "send")


def check_waits(w: World) -> list[str]:
    """3b. Every p2p op a simulated rank posts, it waits on exactly once. A receive never waited is read before it
    has arrived (NCCL: the compute stream never waits for the message), a send never waited may have its buffer
    reused while in flight, and a receive waited twice hangs gloo (the second wait waits for another message:
    seen, a 300 s timeout). The first such op of each rank, and how many it has."""
    out = []
    for r, run in sorted(w.runs.items()):
        waits: dict[int, int] = defaultdict(int)
        for e in run.events:
            if e.op == "wait":
                waits[e.peer] += 1
        bad = [(e, waits[e.n]) for e in run.events if e.op in ("send", "recv") and waits[e.n] != 1]
        if bad:
            e, k = bad[0]
            out.append(
                f"waits: rank {r} waits {k} time(s) on its {e.op} {'to' if e.op == 'send' else 'from'} rank "
                f"{e.peer} at {where(e)}" + (f" ({len(bad) - 1} more such op(s))" if len(bad) > 1 else "")
            )
    return out


def predicted(spec, coords: tuple[int, ...]) -> dict:
    """plan.predict for the rank at mesh `coords`: its stage's, on the planner's GPUs (no gloo copy of a
    reduce-scatter's input: the fake backend copies nothing either), with the state of its own shard."""
    from plan.counts import state_bytes
    from plan.predict import predict

    setup = planner_view(spec)
    pp, _, shard, cp, _ = coords
    out = predict(setup, pp)
    out["state_bytes_by_kind"] = state_bytes(setup, pp, shard * spec.dims.cp + cp)
    for c in concepts():  # a concept's view of this rank (an optimizer's exchange: what its owners send)
        if c.terms is not None and c.terms.for_rank is not None:
            c.terms.for_rank(setup, coords, out)
    out["state_bytes"] = sum(out["state_bytes_by_kind"].values())
    return out


def check_planner(w: World, plans: dict[int, object]) -> tuple[list[str], dict[int, dict]]:
    """4. Per simulated rank: state bytes, the last step's comm bytes and calls, the peak, against the planner;
    and the same recording against the planner's numbers for each other pipeline stage of its class (a stage
    that shares a class records alike, so the planner must predict it alike)."""
    out, rows = [], {}
    lay = w.layout
    members: dict[int, set[int]] = defaultdict(set)  # simulated rank -> the pp ranks of its class it stands for
    for m, rep in w.rep.items():
        if m not in w.runs:
            members[rep].add(lay.coords(m)[0])
    for r, run in sorted(w.runs.items()):
        if not run.steps:
            continue
        spec, coords = plans[r], lay.coords(r)
        p = predicted(spec, coords)
        m = run.steps[max(run.steps)]
        rows[r] = {
            "state": m["state_bytes"],
            "state_predicted": p["state_bytes"],
            "peak": m.get("peak_allocated_bytes"),
            "peak_predicted": p["peak_memory_bytes"],
        }
        out += planner_misses(f"rank {r}", m, max(run.steps), p, lay.world)
        for pp in sorted(members[r] - {coords[0]}):
            other = lay.rank((pp, *coords[1:]))
            out += planner_misses(
                f"rank {other} (rank {r}'s recording, shifted)",
                m,
                max(run.steps),
                predicted(spec, lay.coords(other)),
                lay.world,
            )
    return out, rows


def planner_misses(who: str, m: dict, step: int, p: dict, world: int) -> list[str]:
    """Where a step's record `m` (train.step_metrics) and the planner's prediction `p` for it differ."""
    out = []
    nz = lambda d: {k: v for k, v in (d or {}).items() if v}  # noqa: E731
    if m["state_bytes_by_kind"] != p["state_bytes_by_kind"]:
        out.append(f"planner: {who}: state bytes {m['state_bytes_by_kind']} != predicted {p['state_bytes_by_kind']}")
    if world > 1:
        for key in ("comm_bytes", "comm_calls"):
            if nz(m.get(key)) != nz(p.get(key)):
                out.append(f"planner: {who}: step {step}'s {key} {nz(m.get(key))} != predicted {nz(p.get(key))}")
    got = m.get("peak_allocated_bytes")
    if got and abs(p["peak_memory_bytes"] - got) > PEAK_RTOL * got:
        out.append(
            f"planner: {who}: peak {got} B (live fake storages, step {step}) vs predicted "
            f"{p['peak_memory_bytes']} B ({100 * (p['peak_memory_bytes'] - got) / got:+.1f}%, beyond "
            f"{PEAK_RTOL:.0%})"
        )
    return out


def startup(w: World) -> dict:
    """5. The new_group calls a rank makes (rank 0's; check 1 holds every rank to them), how many hold it, the ops
    at init and those over the whole world (most over the simulated ranks)."""
    r0 = w.runs[min(w.runs)]
    return {
        "new_group": len(r0.groups),
        "member": max(sum(m for _, m, _ in run.groups) for run in w.runs.values()),
        "init_ops": max(len(run.ops("init")) for run in w.runs.values()),
        "init_world": max(sum(len(o.group) == w.layout.world for o in run.ops("init")) for run in w.runs.values()),
    }


def symmetry(w: World) -> list[str]:
    """With every rank simulated: each rank's recording equals its class representative's shifted (ops, groups,
    peers, in order): the classes are sound for this layout."""
    out = []
    shifted = World(w.layout, {r: run for r, run in w.runs.items() if w.rep[r] == r}, w.rep)
    lay = w.layout
    seen = lambda world, r: {
        g: [
            (o.signature(), lay.local_site(o.site, world.source(r)[0].rank), o.phase, o.step)  # noqa: E731
            for o in ops
        ]
        for g, ops in world.collectives(r).items()
    }
    for r, run in sorted(w.runs.items()):
        if w.rep[r] == r:
            continue
        if (
            seen(w, r) != seen(shifted, r)
            or [e[:6] for e in w.p2p(r)] != [e[:6] for e in shifted.p2p(r)]
            or [g for g, _, _ in run.groups] != [g for g, _, _ in w.runs[w.rep[r]].groups]
        ):
            out.append(
                f"classes: rank {r}'s recording is not rank {w.rep[r]}'s shifted (the class shortcut would not see it)"
            )
    return out


@dataclass
class Verdict:
    findings: list[str]
    table: dict
    runs: dict[int, RankRun]


def verify(flags: list[str], world: int, all_ranks: bool = False, progress=None) -> Verdict:
    """Simulate the layout's ranks (all, or one per class) and `judge` them. Raises config.UsageError on bad flags
    (before any rank runs)."""
    t0 = time.perf_counter()
    layout = Layout.of(plan_for(flags, world, 0), fault_ranks(world))
    ranks = list(range(world)) if all_ranks else sorted(layout.classes())
    runs = simulate_ranks(flags, world, ranks, progress)
    verdict = judge(layout, runs, {r: plan_for(flags, world, r) for r in ranks})
    verdict.table["seconds"] = time.perf_counter() - t0
    return verdict


def judge(layout: Layout, runs: dict[int, RankRun], plans: dict[int, object]) -> Verdict:
    """The five checks over `runs`: one per class at least (every rank is its class representative's recording
    shifted), or every rank (then `symmetry` too). `plans`: each simulated rank's, for the planner's prediction."""
    w = World(layout, runs, layout.representative())
    findings = [
        f"rank {r}: the simulated run " + (f"raised {run.error}" if run.error else f"exited {run.code}")
        for r, run in sorted(runs.items())
        if run.code or run.error
    ]
    findings += check_groups(w)
    findings += check_collectives(w)
    p2p_findings, messages = check_p2p(w)
    findings += p2p_findings + check_waits(w)
    planner, rows = check_planner(w, plans)
    view = planner_view(plans[min(plans)])  # 4. and what each concept checks of its own (Concept.findings)
    findings += planner + [f for c in concepts() if c.findings is not None for f in c.findings(w, view)]
    if len(runs) == layout.world and layout.world > 1:
        findings += symmetry(w)
    r0 = runs[min(runs)]
    last = max(r0.steps) if r0.steps else 0
    step_ops = [o for o in r0.ops("step") if o.step == last]
    table = {
        "ranks": layout.world,
        "classes": len(layout.classes()),
        "simulated": len(runs),
        **startup(w),
        "collectives": sum(o.op not in ("send", "recv") for o in step_ops),
        "p2p": sum(o.op in ("send", "recv") for o in step_ops),
        "messages": messages,
        "planner": rows,
        "verdict": "consistent" if not findings else f"{len(findings)} finding(s)",
        "seconds": sum(run.seconds for run in runs.values()),
    }
    return Verdict(findings, table, runs)


HEADER = (
    "| layout | ranks | classes (simulated) | new_group calls per rank (holding it) | ops at init (world-wide) | "
    "collectives / p2p per step, rank 0 | verdict | seconds |\n|---|---:|---:|---:|---:|---:|---|---:|"
)


def table_row(name: str, t: dict) -> str:
    return (
        f"| {name} | {t['ranks']} | {t['classes']} ({t['simulated']}) | {t['new_group']} ({t['member']}) | "
        f"{t['init_ops']} ({t['init_world']}) | {t['collectives']} / {t['p2p']} | {t['verdict']} | "
        f"{t['seconds']:.0f} |"
    )


def parser():
    from trainer.config import Parser

    p = Parser(prog="python -m sim.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--world_size", type=int, required=True, help="the ranks of the job (N)")
    p.add_argument("--all_ranks", action="store_true", help="simulate every rank, not one per class")
    p.add_argument("--name", default=None, help="the layout's name in the table (default: the flags)")
    return p


def main(argv: list[str] | None = None) -> int:
    from trainer.config import UsageError, error_line

    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    try:
        a = parser().parse_args(ours)
        if a.world_size < 1:
            raise UsageError(f"--world_size must be >= 1, got {a.world_size}")
        if not flags:
            raise UsageError("no train.py flags: python -m sim.verify --world_size N [--all_ranks] -- <train.py flags>")
        verdict = verify(
            flags,
            a.world_size,
            a.all_ranks,
            progress=lambda r, run: print(f"  rank {r}: {run.seconds:.1f} s", file=sys.stderr, flush=True),
        )
    except UsageError as e:
        error_line("python -m sim.verify", e)
        return 2
    print(HEADER)
    print(table_row(a.name or " ".join(flags), verdict.table))
    for f in verdict.findings:
        print(f"finding: {f}")
    return 1 if verdict.findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
