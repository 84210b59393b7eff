"""python -m debug hang OUT_DIR: what the ranks' flight recorders say about a hang, in a few lines.

Reads each rank's last comm ops (debug/flight_recorder.py): <out_dir>/hang/rank_N.json, written by the
step watchdog (--timeout) or when a collective failed, and, for a rank without one, its live ring
<out_dir>/flight_recorder/rank_N.bin (a stopped, killed or crashed rank wrote no dump, but its ring holds
its ops up to then). Nothing in either is backend-specific: gloo and NCCL runs read alike.

Findings, first the causes, then their consequences:
- mismatch: the first sequence number at which the ranks of one group issued different collectives (op,
  shape, dtype); the rank whose op is new at its call site, or that issued the op which normally follows
  the others' (it skipped one), is named;
- unmatched_send / unmatched_recv: a p2p message one side posted and the other never did;
- not_reached: a rank that never issued the op its group waits in and wrote no dump (stopped or dead);
- behind: a live rank that never issued the op its group waits in (it waits elsewhere, or computes).

Exit codes: 0 no finding (every group's ranks issued the same ops: the hang is not in the recorded
communication; read the stacks, rank_N.txt), 1 at least one finding, 2 bad input (no dumps, unreadable).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from dataclasses import dataclass, field

from debug.flight_recorder import FORMAT, decode


class BadInput(Exception):
    pass


@dataclass
class Finding:
    kind: str  # mismatch, unmatched_send, unmatched_recv, not_reached, behind
    op: str  # the op it is about
    group: tuple[int, ...]  # that op's group (global ranks)
    ranks: tuple[int, ...]  # the ranks at fault (the skipping, mismatching, missing or behind ones)
    seq: int
    text: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # where each rank is

    def text(self) -> str:
        head = [f"finding: {f.text}" for f in self.findings] or [
            "no finding: every group's ranks issued the same ops, no p2p message is unmatched; the hang is not "
            "in the communication parallel/comm.py recorded (read the stacks, hang/rank_N.txt)"
        ]
        return "\n".join([*self.lines, *head])


# ----------------------------------------------------------------------------- reading

DUMPS = (("dump", "hang", "rank_*.json"), ("ring", "flight_recorder", "rank_*.bin"))  # (kind, folder, files)


def run_dir(path: str) -> str:
    """The out_dir whose dumps `path` names: `path` itself when it holds them (hang/rank_N.json or
    flight_recorder/rank_N.bin), else, for a run's hang/ folder, its parent. So an out_dir that is itself named
    `hang` (runs/hang) is read as the run, and its hang/ folder (runs/hang/hang) too."""
    holds = lambda root: any(glob.glob(os.path.join(root, folder, files)) for _, folder, files in DUMPS)  # noqa: E731
    parent = os.path.dirname(os.path.normpath(path))
    if not holds(path) and os.path.basename(os.path.normpath(path)) == "hang" and holds(parent):
        return parent
    return path


def load(path: str) -> dict[int, dict]:
    """rank -> its dump ({..., "ops": [...], "source": "dump" | "ring"}) from a run's out_dir (or its hang/)."""
    if not os.path.isdir(path):
        raise BadInput(f"{path}: not a directory")
    root = run_dir(path)
    dumps: dict[int, dict] = {}
    for kind, folder, files in DUMPS:
        pattern = os.path.join(root, folder, files)
        for file in sorted(glob.glob(pattern)):
            m = re.fullmatch(r"rank_(\d+)\.(json|bin)", os.path.basename(file))
            if m is None or int(m.group(1)) in dumps:
                continue
            try:
                if kind == "dump":
                    with open(file) as f:
                        d = json.load(f)
                    if d.get("format") != FORMAT:
                        raise ValueError(f"format {d.get('format')!r}, not {FORMAT}")
                else:
                    with open(file, "rb") as f:
                        d = decode(f.read())
            except (OSError, ValueError, KeyError) as e:
                raise BadInput(f"{file}: not a flight-recorder dump ({e})") from None
            d["source"] = kind
            dumps[int(m.group(1))] = d
    if not dumps:
        raise BadInput(
            f"{path}: no flight-recorder dumps (hang/rank_N.json or flight_recorder/rank_N.bin): "
            f"not the out_dir of a multi-rank train.py run"
        )
    return dumps


# ----------------------------------------------------------------------------- analysis


def _sig(o: dict) -> tuple:
    """What every rank of a group issues alike at one seq: op, shape and dtype (an all_to_all's first dim is each
    rank's own sum of splits, so only its other dims must agree)."""
    shape = tuple(o["shape"][1:] if o["op"] == "all_to_all" else o["shape"])
    return o["op"], shape, o["dtype"]


def _gkey(o: dict) -> tuple:
    return o["group_name"], tuple(o["group"])


def describe(o: dict) -> str:
    peer = f" {'to' if o['op'] == 'send' else 'from'} rank {o['peer']}" if o["op"] in ("send", "recv") else ""
    micro = f" micro {o['micro']}" if o["micro"] >= 0 else ""
    return (
        f"{o['op']} #{o['seq']}{peer} {o['dtype']} {tuple(o['shape'])} on group {list(o['group'])} at "
        f"{o['site']} (step {o['step']}{micro}, {o['state']})"
    )


def _waiting(d: dict) -> dict | None:
    """The op a rank waits in: its oldest posted one (a later posted op cannot finish first: waits are in order)."""
    return next((o for o in d["ops"] if o["state"] == "posted"), None)


def _after(ops: list[dict], o: dict) -> tuple | None:
    """In one rank's ops of one group (by seq), the signature and site of the op that followed the latest
    earlier occurrence of o's signature and site in the same step: what normally comes after o."""
    key = (_sig(o), o["site"])
    for prev, nxt in zip(reversed(ops[:-1]), reversed(ops[1:])):
        if prev["seq"] < o["seq"] and (_sig(prev), prev["site"]) == key:
            return (_sig(nxt), nxt["site"]) if nxt["step"] == prev["step"] and nxt["seq"] == prev["seq"] + 1 else None
    return None


def _seen(ops: list[dict], o: dict) -> bool:
    """Whether o's signature occurred at o's call site earlier in this rank's ops of the group."""
    return any(p["seq"] < o["seq"] and p["site"] == o["site"] and _sig(p) == _sig(o) for p in ops)


def _mismatch(gkey: tuple, by_rank: dict[int, list[dict]]) -> Finding | None:
    """The first seq at which the ranks of one group disagree on (op, shape, dtype)."""
    index = {r: {o["seq"]: o for o in ops} for r, ops in by_rank.items() if ops}
    if len(index) < 2:
        return None
    lo, hi = max(min(i) for i in index.values()), min(max(i) for i in index.values())
    for seq in range(lo, hi + 1):
        at = {r: i[seq] for r, i in index.items() if seq in i}
        if len({_sig(o) for o in at.values()}) <= 1:
            continue
        skipped = {
            r
            for r, o in at.items()
            for q, p in at.items()
            if q != r and _sig(p) != _sig(o) and _after(by_rank[q], p) == (_sig(o), o["site"])
        }
        novel = {r for r, o in at.items() if not _seen(by_rank[r], o)}
        counts: dict[tuple, list[int]] = {}
        for r, o in at.items():
            counts.setdefault(_sig(o), []).append(r)
        top = max(len(v) for v in counts.values())
        minority = {r for v in counts.values() if len(v) < top for r in v}
        bad = skipped or (novel if 0 < len(novel) < len(at) else set()) or minority or set(at)
        good = [r for r in at if r not in bad]
        o, ref = at[min(bad)], at[good[0]] if good else None
        how = "skipped it: it issued the op that follows it instead" if skipped else "issued another op"
        text = f"mismatched collective #{seq} on group {list(gkey[1])}: rank(s) {sorted(bad)} {how}: {describe(o)}" + (
            f"; rank(s) {good} issued {describe(ref)}" if ref else ""
        )
        return Finding("mismatch", (ref or o)["op"], gkey[1], tuple(sorted(bad)), seq, text)
    return None


def _p2p(gkey: tuple, dumps: dict[int, dict]) -> list[Finding]:
    """Sends without their receive and receives without their send, per (sender, receiver) pair of one group."""
    out = []
    sends: dict[tuple[int, int], list[dict]] = {}
    recvs: dict[tuple[int, int], list[dict]] = {}
    for r, d in dumps.items():
        for o in d["ops"]:
            if _gkey(o) == gkey and o["op"] == "send":
                sends.setdefault((r, o["peer"]), []).append(o)
            elif _gkey(o) == gkey and o["op"] == "recv":
                recvs.setdefault((o["peer"], r), []).append(o)
    for a, b in sorted(set(sends) | set(recvs)):
        if a not in dumps or b not in dumps:
            continue  # a rank without any dump: not_reached says so
        s, v = sends.get((a, b), []), recvs.get((a, b), [])
        last_s, last_v = (s[-1]["seq"] if s else -1), (v[-1]["seq"] if v else -1)
        # the k-th send meets the k-th receive: one of another micro-batch means a message was left out before it
        by_seq = {y["seq"]: y for y in s}
        shift = next(
            (
                (x, by_seq[x["seq"]])
                for x in v
                if x["seq"] in by_seq
                and (x["step"], x["micro"]) != (by_seq[x["seq"]]["step"], by_seq[x["seq"]]["micro"])
            ),
            None,
        )
        if last_s > last_v:
            o = next((o for o in s if o["seq"] == last_v + 1), s[-1])
            why, culprits = f"rank {b} posted only {last_v + 1} receives from rank {a}", (a, b)
            if shift is not None:
                x, y = shift
                why += (
                    f"; its receive #{x['seq']} (step {x['step']} micro {x['micro']}) met the send of step "
                    f"{y['step']} micro {y['micro']}: rank {b} skipped a receive before it"
                )
                culprits = (b,)
            out.append(
                Finding(
                    "unmatched_send",
                    "send",
                    gkey[1],
                    culprits,
                    o["seq"],
                    f"rank {a}'s {describe(o)} has no receive: {why}",
                )
            )
        elif last_v > last_s:
            o = next((o for o in v if o["seq"] == last_s + 1), v[-1])
            out.append(
                Finding(
                    "unmatched_recv",
                    "recv",
                    gkey[1],
                    (a, b),
                    o["seq"],
                    f"rank {b}'s {describe(o)} has no send: rank {a} posted only {last_s + 1} sends to rank {b}",
                )
            )
    return out


def _progress(gkey: tuple, by_rank: dict[int, list[dict]], dumps: dict[int, dict]) -> list[Finding]:
    """Ranks of one group that never issued the latest collective another rank of it issued."""
    last = {r: (ops[-1]["seq"] if ops else -1) for r, ops in by_rank.items()}
    ahead = max(last.values(), default=-1)
    out = []
    for r in gkey[1]:
        if r in last and last[r] >= ahead:
            continue
        seq = last.get(r, -1) + 1
        if r not in dumps:  # no record of it at all: name the op its group waits in (else the last one)
            waiting = [w for w in (_waiting(dumps[q]) for q in by_rank) if w is not None and _gkey(w) == gkey]
            seq = min((w["seq"] for w in waiting), default=ahead)
        holders = [q for q, ops in by_rank.items() if any(o["seq"] == seq for o in ops)]
        if not holders:
            continue
        o = next(o for o in by_rank[holders[0]] if o["seq"] == seq)
        waiters = [
            q
            for q in holders
            if _waiting(dumps[q]) is not None and _gkey(_waiting(dumps[q])) == gkey and _waiting(dumps[q])["seq"] <= seq
        ]
        who = f"rank(s) {waiters} wait in it" if waiters else f"rank(s) {holders} issued it"
        if r not in dumps:
            out.append(
                Finding(
                    "not_reached",
                    o["op"],
                    gkey[1],
                    (r,),
                    seq,
                    f"rank {r} never reached {describe(o)} ({who}): it left no dump and no ring (dead "
                    f"before recording, or its out_dir is elsewhere)",
                )
            )
        elif dumps[r]["source"] == "ring":
            end = dumps[r]["ops"][-1] if dumps[r]["ops"] else None
            out.append(
                Finding(
                    "not_reached",
                    o["op"],
                    gkey[1],
                    (r,),
                    seq,
                    f"rank {r} never reached {describe(o)} ({who}): it wrote no dump at the hang, so it "
                    f"is stopped, dead or crashed; its ring ends at "
                    f"{describe(end) if end else 'nothing'}",
                )
            )
        else:
            w = _waiting(dumps[r])
            where = (
                f"it waits in {describe(w)} instead"
                if w is not None
                else "it is in no comm op (computing, or stuck outside parallel/comm.py: see its stack)"
            )
            out.append(
                Finding("behind", o["op"], gkey[1], (r,), seq, f"rank {r} never issued {describe(o)} ({who}): {where}")
            )
    return out


def analyze(dumps: dict[int, dict]) -> Report:
    """The report on every rank's dump (load's dict): where each rank is, and the findings (module docstring)."""
    world = max(d["world_size"] for d in dumps.values())
    report = Report()
    for r in range(world):
        d = dumps.get(r)
        if d is None:
            report.lines.append(f"rank {r}: no dump and no ring")
            continue
        w, end = _waiting(d), (d["ops"][-1] if d["ops"] else None)
        src = "its dump" if d["source"] == "dump" else "no dump: stopped, dead or crashed? its ring file"
        now = (
            f"waits in {describe(w)}"
            if w is not None
            else f"in no comm op; its last: {describe(end)}"
            if end is not None
            else "no comm op recorded"
        )
        report.lines.append(f"rank {r} ({src}): {now}")
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for d in dumps.values():
        for o in d["ops"]:
            groups.setdefault(_gkey(o), {q: [] for q in o["group"] if q in dumps})
    for r, d in dumps.items():
        for o in d["ops"]:
            if o["op"] not in ("send", "recv"):
                groups[_gkey(o)][r].append(o)
    causes, effects = [], []
    for gkey, by_rank in sorted(groups.items()):
        for ops in by_rank.values():
            ops.sort(key=lambda o: o["seq"])
        m = _mismatch(gkey, by_rank)
        causes += [m] if m else []
        causes += _p2p(gkey, dumps)
        if m is None:
            effects += _progress(gkey, by_rank, dumps)
    effects.sort(key=lambda f: (f.kind != "not_reached", f.ranks))
    report.findings = causes + effects
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m debug hang", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", help="the run's --out_dir (or its hang/ folder)")
    args = p.parse_args(argv)
    try:
        report = analyze(load(args.out_dir))
    except BadInput as e:
        print(f"debug hang: error: {e}", file=sys.stderr)
        return 2
    print(report.text())
    return 1 if report.findings else 0
