"""Pipeline schedules (parallel/pipeline/schedule.py) dry-run by the process-free simulator.

No processes: every check runs the per-rank action lists through `simulate_schedule`, which raises ScheduleError
on deadlock, a send meeting the wrong receive, a compute before its input, B before F, or missing or
repeated work. Each property is also shown to fail on a deliberately broken schedule.

Bubble with F = 1 and B = 2 units (derivation). GPipe and 1F1B: micro-batch 0's forward reaches the last
rank after P-1 forwards and its backward gets back to rank 0 after P-1 more backwards, so rank 0 waits
(P-1)·1 before its first backward could start in the ideal pipeline and the drain mirrors the fill:
makespan = (M + P - 1)(1 + 2), busy = 3M per rank, bubble = 1 - 3M / makespan = (P-1)/(M+P-1).
Interleaved with V chunks per rank (each chunk's F = 1, B = 2): makespan = 3(V·M + P - 1).

ZB-H1 splits B = 2 into B = 1 (input gradient) and W = 1 (weight gradients). The fill is 1F1B's: rank 0's
first B waits for micro-batch 0's F through P-1 ranks and its B back, (P-1)(t_F + t_B) = 2(P-1) past its
P warm-up F's; the drain is filled by the W's each rank r deferred (r of them), so the last B on rank 0 is
followed only by its own W's: makespan = 3M + P - 1, bubble (P-1)/(3M+P-1), Qi et al.'s (P-1)(t_F + t_B - t_W).
"""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from fractions import Fraction

import pytest

from parallel.groups import link_groups, p2p_link
from parallel.pipeline.schedule import (
    ALL_SCHEDULES,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    V_SCHEDULES,
    Action,
    B,
    F,
    ScheduleError,
    W,
    boundary,
    chunk_of,
    dualpipev,
    even_partition,
    gpipe,
    interleaved_one_f_one_b,
    one_f_one_b,
    rank_of,
    zb_h1,
    zbv,
)
from plan.schedule_grid import grid
from plan.theory import bubble_fraction
from plan.timeline import P2P_MODELS, paired, simulate_schedule

PPS = (2, 3, 4, 8)


def nccl_grid():
    """(name, pp, micro, virtual) the NCCL model must pass: P in 2..8, V in 1..3, M in {P, P+1, 2P, 4P}, as
    each schedule accepts them (gpipe and 1f1b run V = 1; interleaved needs M % P == 0)."""
    for name in SCHEDULES:
        for p in range(2, 9):
            for m in (p, p + 1, 2 * p, 4 * p):
                for v in (1,) if name != "interleaved_1f1b" else (1, 2, 3):
                    if not refuses(name, p, m, v):
                        yield name, p, m, v


def cases():
    """(name, pp, micro, virtual) over the grid, refused ones included."""
    for name in SCHEDULES:
        for p in PPS:
            for m in (p, p + 1, 2 * p):
                for v in (1, 2):  # V=2 is refused by gpipe and 1f1b
                    yield name, p, m, v


def refuses(name: str, p: int, m: int, v: int) -> bool:
    return (name != "interleaved_1f1b" and v != 1) or (name == "interleaved_1f1b" and m % p != 0)


def exact_bubble(res) -> Fraction:
    return 1 - Fraction(sum(res.busy), len(res.busy) * res.makespan)


class TestPartition(unittest.TestCase):
    def test_covers_every_layer_once_evenly(self):
        for n_layer in (4, 7, 12, 13, 48):
            for pp in (1, 2, 3, 4):
                for v in (1, 2):
                    if n_layer < pp * v:
                        continue
                    parts = even_partition(n_layer, pp, v)
                    self.assertEqual(len(parts), pp * v)
                    self.assertEqual([i for r in parts for i in r], list(range(n_layer)))
                    sizes = [len(r) for r in parts]
                    self.assertLessEqual(max(sizes) - min(sizes), 1)
                    self.assertEqual(sizes, sorted(sizes, reverse=True), "extra layers go to the first chunks")

    def test_refuses_empty_chunks(self):
        with self.assertRaisesRegex(ValueError, "non-empty"):
            even_partition(3, 2, 2)

    def test_chunk_of_is_megatron_interleaving(self):
        self.assertEqual([chunk_of(1, v, 4) for v in range(3)], [1, 5, 9])
        self.assertEqual(sorted(chunk_of(r, v, 3) for r in range(3) for v in range(2)), list(range(6)))


class TestSchedules(unittest.TestCase):
    def test_refused_layouts_raise_clear_value_errors(self):
        refused = [c for c in cases() if refuses(*c)]
        self.assertTrue(any(c[0] == "interleaved_1f1b" for c in refused))
        for name, p, m, v in refused:
            with self.subTest(name=name, pp=p, micro=m, virtual=v), self.assertRaises(ValueError) as ctx:
                SCHEDULES[name](p, m, v)
            self.assertRegex(str(ctx.exception), "divisible by pp|one chunk per rank")

    def test_lists_cover_each_chunk_and_micro_once(self):
        for name, p, m, v in cases():
            if refuses(name, p, m, v):
                continue
            with self.subTest(name=name, pp=p, micro=m, virtual=v):
                sched = SCHEDULES[name](p, m, v)
                for kind in (F, B):
                    seen = sorted((a.chunk, a.micro) for ops in sched for a in ops if a.kind == kind)
                    self.assertEqual(seen, [(c, i) for c in range(p * v) for i in range(m)])
                n_send = sum(a.kind.startswith("SEND") for ops in sched for a in ops)
                self.assertEqual(n_send, sum(a.kind.startswith("RECV") for ops in sched for a in ops))
                self.assertEqual(n_send, 2 * m * (p * v - 1))

    def test_simulator_accepts_every_schedule(self):
        """No deadlock, sends meet receives in order, F before B, exactly-once coverage: the default ("ready")
        and "meet" lists under every p2p model."""
        for name, p, m, v in cases():
            if refuses(name, p, m, v):
                continue
            with self.subTest(name=name, pp=p, micro=m, virtual=v):
                for pairing in ("ready", "meet"):
                    sched = paired(SCHEDULES[name](p, m, v), p, pairing)
                    for mode in P2P_MODELS:
                        simulate_schedule(sched, p, v, m, p2p=mode)

    def test_nccl_pair_order_every_schedule(self):
        """NCCL's model (one FIFO per peer pair for both directions; a send completes only with its receive at
        the head of the peer's side) over P in 2..8, V in 1..3, M in {P, P+1, 2P, 4P}: the runner's lists
        finish, at the ideal makespan 3(V·M + P - 1), as under gloo's async model."""
        n = 0
        for name, p, m, v in nccl_grid():
            with self.subTest(name=name, pp=p, micro=m, virtual=v):
                sched = SCHEDULES[name](p, m, v)
                for mode in ("nccl", "async"):
                    self.assertEqual(simulate_schedule(sched, p, v, m, p2p=mode).makespan, 3 * (v * m + p - 1))
                n += 1
        self.assertEqual(n, 7 * 4 * 2 + 7 * 3 * 3)  # gpipe, 1f1b: 4 M each; interleaved: V in 1..3, M in {P, 2P, 4P}

    def test_pairs_merge_both_directions_in_one_order(self):
        """What NCCL needs, checked on the lists themselves: each peer pair's messages, both directions merged,
        appear in the same order on both of its ranks."""
        for name, p, m, v in nccl_grid():
            sched = SCHEDULES[name](p, m, v)
            with self.subTest(name=name, pp=p, micro=m, virtual=v):
                for r in range(p):
                    for q in range(r + 1, p):

                        def on(rank, peer):  # the pair's messages on `rank`, named by (sender's chunk, micro, dir)
                            out = []
                            for a in sched[rank]:
                                if a.kind in (SEND_F, SEND_B, RECV_F, RECV_B):
                                    src = {SEND_F: a.chunk, SEND_B: a.chunk, RECV_F: a.chunk - 1, RECV_B: a.chunk + 1}[
                                        a.kind
                                    ]
                                    dst = {SEND_F: a.chunk + 1, SEND_B: a.chunk - 1, RECV_F: a.chunk, RECV_B: a.chunk}[
                                        a.kind
                                    ]
                                    if {src % p, dst % p} == {rank, peer}:
                                        out.append((src, dst, a.micro))
                            return out

                        self.assertEqual(on(r, q), on(q, r))

    def test_in_flight_activations(self):
        for p in PPS:
            for m in (p, p + 1, 2 * p):
                res = simulate_schedule(one_f_one_b(p, m), p, 1, m)
                self.assertEqual(res.max_in_flight, [min(p - r, m) for r in range(p)])
                self.assertEqual(simulate_schedule(gpipe(p, m), p, 1, m).max_in_flight, [m] * p)
        # the 1F1B bound is a real constraint: GPipe breaks it once M > P - rank
        res = simulate_schedule(gpipe(4, 5), 4, 1, 5)
        self.assertTrue(any(res.max_in_flight[r] > 4 - r for r in range(4)))

    def test_bubble_matches_theory_exactly(self):
        for name in ("gpipe", "1f1b"):
            for p in PPS:
                for m in (p, p + 1, 2 * p):
                    for pairing in ("ready", "meet"):
                        for mode in P2P_MODELS:
                            with self.subTest(name=name, pp=p, micro=m, pairing=pairing, p2p=mode):
                                res = simulate_schedule(paired(SCHEDULES[name](p, m), p, pairing), p, 1, m, p2p=mode)
                                self.assertEqual(res.makespan, 3 * (m + p - 1))
                                self.assertEqual(exact_bubble(res), Fraction(p - 1, m + p - 1))
                                self.assertAlmostEqual(res.bubble_fraction, bubble_fraction(name, p, m))

    def test_interleaved_bubble(self):
        """The default lists reach Megatron's (P-1)/(V·M+P-1) exactly with isends (gloo and NCCL); "meet"
        lists (senders post at the meeting time) stay above it."""
        for p in PPS:
            for m in (p, 2 * p):
                for v in (1, 2):
                    with self.subTest(pp=p, micro=m, virtual=v):
                        for mode in ("async", "nccl"):
                            res = simulate_schedule(interleaved_one_f_one_b(p, m, v), p, v, m, p2p=mode)
                            self.assertEqual(res.makespan, 3 * (v * m + p - 1))
                            self.assertEqual(exact_bubble(res), Fraction(p - 1, v * m + p - 1))
                        slow = simulate_schedule(paired(interleaved_one_f_one_b(p, m, v), p, "meet"), p, v, m)
                        self.assertGreaterEqual(exact_bubble(slow), exact_bubble(res))

    def test_theory_values(self):
        self.assertAlmostEqual(bubble_fraction("gpipe", 4, 8), 3 / 11)
        self.assertAlmostEqual(bubble_fraction("1f1b", 4, 8), 3 / 11)
        self.assertAlmostEqual(bubble_fraction("interleaved_1f1b", 4, 8, 2), 3 / 19)
        self.assertAlmostEqual(bubble_fraction("zb_h1", 4, 8), 3 / 27)
        with self.assertRaisesRegex(ValueError, "unknown schedule"):
            bubble_fraction("zb", 2, 2)


class TestZeroBubbleH1(unittest.TestCase):
    """ZB-H1 over P in 2..8 and M in {P, P+1, 2P, 4P} (it needs M >= P), under every p2p model."""

    def grid(self):
        for p in range(2, 9):
            for m in (p, p + 1, 2 * p, 4 * p):
                yield p, m

    def test_lists_cover_f_b_w_once(self):
        for p, m in self.grid():
            sched = zb_h1(p, m)
            for kind in (F, B, W):
                seen = sorted((a.chunk, a.micro) for ops in sched for a in ops if a.kind == kind)
                self.assertEqual(seen, [(c, i) for c in range(p) for i in range(m)], (p, m, kind))
            for _r, ops in enumerate(sched):  # W's of a chunk in the order of its B's: 1F1B's gradient sums
                order = [a.micro for a in ops if a.kind == W]
                self.assertEqual(order, sorted(order))

    def test_bubble_and_memory_every_p2p_model(self):
        n = 0
        for p, m in self.grid():
            for mode in P2P_MODELS:
                with self.subTest(pp=p, micro=m, p2p=mode):
                    res = simulate_schedule(zb_h1(p, m), p, 1, m, p2p=mode)
                    self.assertEqual(res.makespan, 3 * m + p - 1)
                    self.assertEqual(exact_bubble(res), Fraction(p - 1, 3 * m + p - 1))
                    self.assertAlmostEqual(res.bubble_fraction, bubble_fraction("zb_h1", p, m))
                    # held from F to W: P micro-batches on every rank, 1F1B's rank 0
                    self.assertEqual(res.max_in_flight, [p] * p)
                    n += 1
        self.assertEqual(n, 7 * 4 * len(P2P_MODELS))

    def test_a_third_of_1f1b_bubble(self):
        """Idle units per rank, t_F = t_B = t_W = 1: 1F1B's fill and drain 3(P-1), ZB-H1's P-1."""
        for p in (2, 4):
            zb, one = (
                simulate_schedule(zb_h1(p, 8), p, 1, 8, p2p="nccl"),
                simulate_schedule(one_f_one_b(p, 8), p, 1, 8, p2p="nccl"),
            )
            self.assertEqual((zb.makespan - 3 * 8, one.makespan - 3 * 8), (p - 1, 3 * (p - 1)))

    def test_refuses_too_few_micro_batches(self):
        with self.assertRaisesRegex(ValueError, "zb_h1 needs micro_batches >= pp"):
            zb_h1(4, 3)
        with self.assertRaisesRegex(ValueError, "one chunk per rank"):
            zb_h1(2, 4, 2)

    def test_w_before_its_b(self):
        sched = zb_h1(2, 2)
        ops = sched[0]
        ops.insert(0, ops.pop(ops.index(Action(W, 0, 1))))
        with self.assertRaisesRegex(ScheduleError, "before its input-gradient B"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")

    def test_missing_w(self):
        sched = zb_h1(2, 2)
        sched[1].remove(Action(W, 1, 0))
        with self.assertRaisesRegex(ScheduleError, r"W\(c1,m0\) never runs"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")


class TestVSchedules(unittest.TestCase):
    """ZB-V and DualPipe-V on the V layout (rank r holds chunks r and 2P-1-r), P in 2..8, M in {P, P+1, 2P, 4P}
    as each accepts them (zbv: M >= P; dualpipev: M >= 2P), under every p2p model."""

    def grid(self):
        for name, least in (("zbv", 1), ("dualpipev", 2)):
            for p in range(2, 9):
                for m in (p, p + 1, 2 * p, 4 * p):
                    if m >= least * p:
                        yield name, p, m

    def test_layout(self):
        self.assertEqual(
            [[chunk_of(r, v, 4, v_shape=True) for v in range(2)] for r in range(4)], [[0, 7], [1, 6], [2, 5], [3, 4]]
        )

    def test_lists_cover_f_b_w_once(self):
        for name, p, m in self.grid():
            sched = {"zbv": zbv, "dualpipev": dualpipev}[name](p, m)
            for kind in (F, B, W):
                seen = sorted((a.chunk, a.micro) for ops in sched for a in ops if a.kind == kind)
                self.assertEqual(seen, [(c, i) for c in range(2 * p) for i in range(m)], (name, p, m, kind))
            for ops in sched:  # each chunk's W's in its B's order
                for c in {a.chunk for a in ops}:
                    self.assertEqual([a.micro for a in ops if a.kind == W and a.chunk == c], list(range(m)))
            # chunks P-1 and P share rank P-1: no message between them
            self.assertFalse(any(a.kind == SEND_F and a.chunk == p - 1 for a in sched[p - 1]))

    def test_every_p2p_model_and_bubble(self):
        n = 0
        for name, p, m in self.grid():
            sched = {"zbv": zbv, "dualpipev": dualpipev}[name](p, m)
            for mode in P2P_MODELS:
                with self.subTest(name=name, pp=p, micro=m, p2p=mode):
                    res = simulate_schedule(sched, p, 2, m, p2p=mode, v_shape=True)
                    self.assertAlmostEqual(res.bubble_fraction, bubble_fraction(name, p, m, 2))
                    if m >= 2 * p:
                        self.assertEqual(res.makespan, 6 * m + p - 1)
                        self.assertEqual(exact_bubble(res), Fraction(p - 1, 6 * m + p - 1))
                        # (chunk, micro) held from F to W: 2P (zbv, 1F1B's P stages of activations), 2P+1
                        self.assertEqual(res.max_in_flight, [2 * p + (name == "dualpipev")] * p)
                    n += 1
        self.assertEqual(n, (7 * 4 + 7 * 2) * len(P2P_MODELS))  # zbv: every M of the grid; dualpipev: 2P, 4P

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "zbv needs micro_batches >= pp"):
            zbv(4, 3)
        with self.assertRaisesRegex(ValueError, "dualpipev needs micro_batches >= 2 x pp"):
            dualpipev(4, 7)
        for fn in (zbv, dualpipev):
            with self.assertRaisesRegex(ValueError, "two chunks per rank"):
                fn(2, 8, 3)

    def test_wrong_layout_is_caught(self):
        """The V lists under the interleaved placement (rank r holding r and r+P) name chunks the rank lacks."""
        with self.assertRaisesRegex(ScheduleError, "cannot run"):
            simulate_schedule(zbv(2, 4), 2, 2, 4, p2p="async")


def eager_grid(every_m: bool):
    """(name, pp, micro, virtual) for every schedule: P in 2..8; V = 2 for the V schedules, 2 and 3 for
    interleaved 1F1B, 1 for the others; M from the least each accepts (P; DualPipe-V 2P) to 4P, interleaved
    1F1B's multiples of P only: every one (every_m), or least, least + 1, 2P, 2P + 1, 4P."""
    for name in ALL_SCHEDULES:
        for p in range(2, 9):
            least = 2 * p if name == "dualpipev" else p
            ms = range(least, 4 * p + 1) if every_m else sorted({least, least + 1, 2 * p, 2 * p + 1, 4 * p})
            for v in (2,) if name in V_SCHEDULES else (2, 3) if name == "interleaved_1f1b" else (1,):
                for m in ms:
                    if name != "interleaved_1f1b" or m % p == 0:
                        yield name, p, m, v


def ideal_makespan(name: str, p: int, m: int, v: int) -> int:
    """Unit times (F = 1, B = 2; split: F = B = W = 1), messages free: the makespans the tests above derive
    (ZB-V at M < 2P: what the isend models give, `simulate_schedule(..., p2p="async")`)."""
    if name in ("gpipe", "1f1b", "interleaved_1f1b"):
        return 3 * (v * m + p - 1)
    if name == "zb_h1":
        return 3 * m + p - 1
    if m >= 2 * p:
        return 6 * m + p - 1
    return simulate_schedule(ALL_SCHEDULES[name](p, m, v), p, v, m, p2p="async", v_shape=True).makespan


def slower(p: int, v: int, v_shape: bool, rank: int, t: int) -> list[int]:
    """Per-chunk times: `t` everywhere, 2t on `rank`'s chunks (one stage twice as slow)."""
    return [2 * t if rank_of(c, p, v_shape) == rank else t for c in range(p * v)]


class TestEagerNccl(unittest.TestCase):
    """NCCL's p2p order on an eagerly initialised group (simulate_schedule(p2p="nccl_eager"): one FIFO per rank across
    both its neighbours, torch's ProcessGroupNCCL::pointToPoint reusing the group's communicator and stream),
    which is what every group is here on CUDA (runtime/device.py passes device_id). The fix, link groups
    (parallel.groups.p2p_link; PipelineRunner posts each message on its boundary's), is modelled by links=True."""

    def check(self, every_m: bool) -> int:
        n = 0
        for name, p, m, v in eager_grid(every_m):
            with self.subTest(name=name, pp=p, micro=m, virtual=v):
                res = simulate_schedule(
                    ALL_SCHEDULES[name](p, m, v), p, v, m, p2p="nccl_eager", v_shape=name in V_SCHEDULES
                )
                self.assertEqual(res.makespan, ideal_makespan(name, p, m, v))
                n += 1
        return n

    def test_every_schedule_finishes_at_unit_times(self):
        """No deadlock, no send meeting the wrong receive, F before B before W, every (chunk, micro) once (what
        simulate checks under every model), and at unit times the ideal makespan: the serialisation costs
        nothing while every stage takes as long. A sample of M (the slow test below runs every M)."""
        self.assertEqual(self.check(every_m=False), 4 * 7 * 5 + 7 * 3 + 7 * 2 * 3)  # dualpipev: 2P, 2P+1, 4P

    @pytest.mark.slow
    def test_every_schedule_every_m(self):
        self.assertEqual(
            self.check(every_m=True),
            4 * sum(3 * p + 1 for p in range(2, 9)) + sum(2 * p + 1 for p in range(2, 9)) + 7 * 2 * 4,
        )

    def test_serialising_costs_makespan_and_link_groups_win_it_back(self):
        """With uneven stage times a rank's ready send to one neighbour waits behind a receive from the other
        posted before it: the V schedules lose with B slower than F, the rest with a slow first stage (what
        P = 2..8, M = least..4P measure at most: docs/pipeline.md's table); GPipe never (its forwards and its
        backwards never cross). Link groups take every message off the shared FIFO: the pair model's makespan,
        exactly; batching a rank's back-to-back ops (batch_isend_irecv) does not, and costs ZB-H1's run."""

        def first_slow(p: int, v: int, vs: bool, b: int) -> dict:
            one, slow_b = slower(p, v, vs, 0, 1), slower(p, v, vs, 0, b)
            return {"f_time": one, "b_time": slow_b, "w_time": one}

        cases = {  # name, P, V, M, times -> (pair FIFOs, one FIFO per rank, batched)
            ("dualpipev", 8, 2, 16, "2,3,1"): (225, 246, 237),
            ("zbv", 8, 2, 10, "2,3,1"): (158, 170, 170),
            ("zb_h1", 8, 1, 8, "first x2"): (48, 54, 49),
            ("1f1b", 8, 1, 8, "first x2"): (55, 61, 55),
            ("interleaved_1f1b", 7, 2, 14, "first x2"): (168, 173, 173),
            ("gpipe", 8, 1, 8, "first x2"): (69, 69, 69),
        }
        for (name, p, v, m, times), (pair, eager, batched) in cases.items():
            vs = name in V_SCHEDULES
            b = 1 if name == "zb_h1" else 2  # unit_times: a split B is 1, a whole one 2
            kw = {"f_time": 2, "b_time": 3, "w_time": 1} if times == "2,3,1" else first_slow(p, v, vs, b)
            sched = ALL_SCHEDULES[name](p, m, v)
            with self.subTest(name=name):
                got = [
                    simulate_schedule(sched, p, v, m, p2p=mode, v_shape=vs, **kw, **extra).makespan
                    for mode, extra in (
                        ("nccl", {}),
                        ("nccl_eager", {}),
                        ("nccl_eager", {"links": True}),
                        ("nccl_eager", {"batched": True}),
                    )
                ]
                self.assertEqual(got, [pair, eager, pair, batched])

    def test_link_groups_equal_the_pair_model(self):
        """Over every schedule at P = 4 and 8, M = 2P, three uneven timings: links=True gives "nccl"'s
        makespan, and each rank's stream on a link group only ever talks to one peer."""
        for name in ALL_SCHEDULES:
            vs = name in V_SCHEDULES
            v = 2 if vs or name == "interleaved_1f1b" else 1
            for p in (4, 8):
                sched = ALL_SCHEDULES[name](p, 2 * p, v)
                for kw in (
                    dict(f_time=2, b_time=3, w_time=1),
                    dict(f_time=1, b_time=1, w_time=3),
                    dict(f_time=slower(p, v, vs, 0, 1), b_time=slower(p, v, vs, 0, 2), w_time=1),
                ):
                    with self.subTest(name=name, pp=p, times=kw):
                        pair, links = (
                            simulate_schedule(sched, p, v, 2 * p, p2p=mode, v_shape=vs, **kw, **extra).makespan
                            for mode, extra in (("nccl", {}), ("nccl_eager", {"links": True}))
                        )
                        self.assertEqual(links, pair)
                for r, ops in enumerate(sched):
                    peers: dict[int, set[int]] = {}
                    for a in ops:
                        if a.kind in (SEND_F, SEND_B, RECV_F, RECV_B):
                            c = boundary(a)
                            lo, hi = rank_of(c, p, vs), rank_of(c + 1, p, vs)
                            g = p2p_link(lo, hi, p)
                            self.assertLess(g, link_groups(p))
                            peers.setdefault(g, set()).add(hi if lo == r else lo)
                    self.assertTrue(all(len(s) == 1 for s in peers.values()), (name, p, r, peers))

    def test_p2p_link_colours_a_ring(self):
        """Neighbouring links never share a group (so no rank has two peers on one), on rings of 2..9."""
        for n in range(2, 10):
            colour = [p2p_link(i, (i + 1) % n, n) for i in range(n)]
            self.assertTrue(all(colour[i] != colour[(i + 1) % n] for i in range(n)), (n, colour))
            self.assertEqual(max(colour) + 1, link_groups(n))
            if n > 2:  # the V's way back up (lower end above) names the same link; at n = 2 (1, 0) is the closing one
                self.assertEqual([p2p_link((i + 1) % n, i, n) for i in range(n)], colour)


class TestBrokenSchedules(unittest.TestCase):
    """The simulator's checks fire: each schedule below is a correct one with one thing broken."""

    def test_ready_meet_lists_deadlock_under_nccl(self):
        """The lists before the NCCL fix ("ready_meet": send at ready, receive at meet; bit-identical to main
        805c4ea's default lists) deadlock under NCCL's pair order for interleaved 1F1B with M > P, every P and V
        (V = 1 too: its warm-up is 2(P-r-1), not 1F1B's P-r-1), and under blocking sends; with M == P and for
        GPipe and 1F1B they pass."""
        failed = passed = 0
        for name, p, m, v in nccl_grid():
            sched = paired(SCHEDULES[name](p, m, v), p, "ready_meet")
            simulate_schedule(sched, p, v, m, p2p="async")  # gloo never blocks on it
            if name == "interleaved_1f1b" and m > p:
                for mode in ("nccl", "rendezvous"):
                    with (
                        self.subTest(pp=p, micro=m, virtual=v, p2p=mode),
                        self.assertRaisesRegex(ScheduleError, "deadlock"),
                    ):
                        simulate_schedule(sched, p, v, m, p2p=mode)
                failed += 1
            else:
                simulate_schedule(sched, p, v, m, p2p="nccl")
                passed += 1
        self.assertEqual(failed, 7 * 3 * 2)  # 42 of interleaved's 63; the other 21 have M == P
        with self.assertRaisesRegex(ScheduleError, r"pair heads.*\(0, 1\): SEND_F\(c0,m2\).*\(1, 0\): SEND_B\(c3,m0\)"):
            example = paired(interleaved_one_f_one_b(2, 4, 2), 2, "ready_meet")  # the issue's
            simulate_schedule(example, 2, 2, 4, p2p="nccl")

    def test_both_sides_sending_first_deadlocks_under_nccl(self):
        """Two sends at the heads of a pair's two sides never complete under NCCL; gloo buffers them."""
        sched = [
            [
                Action(F, 0, 0),
                Action(SEND_F, 0, 0),
                Action(F, 0, 1),
                Action(SEND_F, 0, 1),
                Action(RECV_B, 0, 0),
                Action(B, 0, 0),
                Action(RECV_B, 0, 1),
                Action(B, 0, 1),
            ],
            [
                Action(RECV_F, 1, 0),
                Action(F, 1, 0),
                Action(B, 1, 0),
                Action(SEND_B, 1, 0),
                Action(RECV_F, 1, 1),
                Action(F, 1, 1),
                Action(B, 1, 1),
                Action(SEND_B, 1, 1),
            ],
        ]
        simulate_schedule(sched, 2, 1, 2, p2p="async")
        with self.assertRaisesRegex(ScheduleError, r"deadlock.*\(0, 1\): SEND_F\(c0,m1\), \(1, 0\): SEND_B\(c1,m0\)"):
            simulate_schedule(sched, 2, 1, 2, p2p="nccl")

    def test_swap_with_both_sides_sending_first_deadlocks(self):
        sched = paired(one_f_one_b(2, 3), 2, "meet")
        ops = sched[1]
        i = next(k for k in range(len(ops) - 1) if ops[k].kind == RECV_F and ops[k + 1].kind == "SEND_B")
        ops[i], ops[i + 1] = ops[i + 1], ops[i]  # rank 1 now sends its grad before receiving the activation
        with self.assertRaisesRegex(ScheduleError, "deadlock"):
            simulate_schedule(sched, 2, 1, 3, p2p="rendezvous")
        with self.assertRaisesRegex(ScheduleError, "deadlock"):
            simulate_schedule(sched, 2, 1, 3, p2p="nccl")

    def test_receives_out_of_order(self):
        for mode in P2P_MODELS:
            sched = paired(gpipe(2, 2), 2, "meet")
            ops = sched[1]
            a, b = (k for k, x in enumerate(ops) if x.kind == RECV_F)
            ops[a], ops[b] = ops[b], ops[a]
            with self.assertRaisesRegex(ScheduleError, "order mismatch"):
                simulate_schedule(sched, 2, 1, 2, p2p=mode)

    def test_backward_before_forward(self):
        sched = gpipe(2, 2)
        last = sched[1]
        k = last.index(Action(B, 1, 0))
        last.insert(0, last.pop(k))
        with self.assertRaisesRegex(ScheduleError, "before its forward"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")

    def test_compute_before_its_input_arrives(self):
        sched = gpipe(2, 2)
        ops = sched[1]
        k = ops.index(Action(RECV_F, 1, 0))
        ops.insert(k + 1, ops.pop(k))  # F(c1,m0) now runs before RECV_F(c1,m0)
        with self.assertRaisesRegex(ScheduleError, "input arrived"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")

    def test_duplicate_and_missing_work(self):
        sched = one_f_one_b(2, 2)
        sched[0].append(Action(F, 0, 1))
        with self.assertRaisesRegex(ScheduleError, "twice"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")
        short = [[a for a in ops if a.micro != 1] for ops in one_f_one_b(2, 2)]
        with self.assertRaisesRegex(ScheduleError, "never runs"):
            simulate_schedule(short, 2, 1, 2, p2p="async")

    def test_unreceived_and_premature_sends(self):
        sched = gpipe(2, 2)
        sched[0].append(Action(SEND_F, 0, 1))
        with self.assertRaisesRegex(ScheduleError, "never received"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")
        sched = gpipe(2, 2)
        k = sched[0].index(Action(SEND_F, 0, 0))
        sched[0].insert(0, sched[0].pop(k))
        with self.assertRaisesRegex(ScheduleError, "before computing"):
            simulate_schedule(sched, 2, 1, 2, p2p="async")


class TestReceiveWaits(unittest.TestCase):
    """A receive is posted at its place in the list and waited on by the compute that reads it (PipelineRunner,
    and the async and nccl models), not where it is posted. So a compute that reads nothing from another rank
    (a forward of chunk 0, a W, a chunk whose neighbour is local) starts the moment the rank's previous compute
    ends, whatever the stage times. Fails if a receive blocks the rank where it is posted: ZB-H1's rank 0
    lists RECV_B(0, m-1) before F(0, m+1), and with t_B = 2 its F would wait for rank 1's B."""

    def test_independent_computes_never_wait(self):
        from parallel.pipeline.schedule import ALL_SCHEDULES, V_SCHEDULES, _needs

        n = 0
        for name, make in ALL_SCHEDULES.items():
            v_shape = name in V_SCHEDULES
            for p in (2, 3, 4):
                m, v = 2 * p, 2 if name in ("interleaved_1f1b", *V_SCHEDULES) else 1
                sched = make(p, m, v)
                for times in ((1, 2, 1), (2, 3, 1), (1, 1, 3)):
                    for mode in ("async", "nccl"):
                        res = simulate_schedule(sched, p, v, m, *times, p2p=mode, v_shape=v_shape)
                        for r, line in enumerate(res.timeline):
                            for (_, prev_end, _), (start, _, a) in zip(line, line[1:]):
                                if _needs(a, p, p * v, v_shape) is None:
                                    self.assertEqual(start, prev_end, (name, p, times, mode, r, a))
                                    n += 1
        self.assertGreater(n, 1000)


# 1F1B at P = 2, M = 4, derived by hand (F = 1, B = 2 units). Rank 0 runs F0 | F1 B0 | F2 B1 | F3 B2 | B3, rank 1
# F0 B0 | F1 B1 | F2 B2 | F3 B3. As early as data allows: rank 0's F's end at 1, 2, 7, 10 (it waits for B0 until
# rank 1's B0 ends at 4, B0 runs 4-6, F2 6-7, B1 7-9, F3 9-10, B2 10-12, B3 13-15); rank 1's F's start at 1, 4, 7,
# 10 and its B's end at 4, 7, 10, 13. Each SEND/RECV is listed at its ready time (the F's end, the B's end), before
# a compute starting then; at one time the lower sender's message first (rank 0's SEND_F2 before RECV_B1).
GRID_1F1B_P2_M4 = """\
         Rank 0   Rank 1
Step 00: 0F0      1RECV_F0
Step 01: 0SEND_F0 1F0
Step 02: 0F1      1RECV_F1
Step 03: 0SEND_F1 1B0
Step 04: 0RECV_B0 1SEND_B0
Step 05: 0B0      1F1
Step 06: 0F2      1B1
Step 07: 0SEND_F2 1RECV_F2
Step 08: 0RECV_B1 1SEND_B1
Step 09: 0B1      1F2
Step 10: 0F3      1B2
Step 11: 0SEND_F3 1RECV_F3
Step 12: 0RECV_B2 1SEND_B2
Step 13: 0B2      1F3
Step 14: 0RECV_B3 1B3
Step 15: 0B3      1SEND_B3
"""
COMMAND = [sys.executable, "-m", "plan.schedule_grid"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestGrid(unittest.TestCase):
    """`python -m plan.schedule_grid SCHEDULE --pp P --micro M [--virtual V]`: each rank's list as a grid
    (plan/schedule_grid.py), as torch's _format_pipeline_order prints one."""

    def test_1f1b_p2_m4_is_the_hand_derived_grid(self):
        self.assertEqual(grid(one_f_one_b(2, 4)), GRID_1F1B_P2_M4)
        run = subprocess.run(
            COMMAND + ["1f1b", "--pp", "2", "--micro", "4"], capture_output=True, text=True, cwd=ROOT, timeout=60
        )
        self.assertEqual((run.returncode, run.stdout, run.stderr), (0, GRID_1F1B_P2_M4, ""))

    def test_each_column_is_its_ranks_list(self):
        """Read back by the header's "Rank r" positions, column r of the grid is rank r's list, in order, every
        action named chunk, kind, micro-batch (torch's names), for every schedule at P = 3, M = 6."""
        for name, make in ALL_SCHEDULES.items():
            sched = make(3, 6, 2 if name in ("interleaved_1f1b", *V_SCHEDULES) else 1)
            header, *rows = grid(sched).splitlines()
            starts = [header.index(f"Rank {r}") for r in range(3)] + [None]
            cols = [[row[a:b].strip() for row in rows if row[a:b].strip()] for a, b in zip(starts, starts[1:])]
            self.assertEqual(cols, [[f"{a.chunk}{a.kind}{a.micro}" for a in ops] for ops in sched], name)
            self.assertEqual([row[: len("Step 00:")] for row in rows], [f"Step {i:02d}:" for i in range(len(rows))])

    def test_bad_input_is_one_line_and_exit_2(self):
        for args in (
            ["1f1c", "--pp", "2", "--micro", "4"],
            ["1f1b", "--pp", "0", "--micro", "4"],
            ["1f1b", "--pp", "two", "--micro", "4"],
            ["1f1b", "--pp", "2"],
            ["interleaved_1f1b", "--pp", "2", "--micro", "3", "--virtual", "2"],
            ["1f1b", "--pp", "2", "--micro", "4", "--virtual", "2"],
            ["dualpipev", "--pp", "2", "--micro", "3"],
        ):
            with self.subTest(args=args):
                run = subprocess.run(COMMAND + args, capture_output=True, text=True, cwd=ROOT, timeout=60)
                self.assertEqual((run.returncode, run.stdout), (2, ""))
                self.assertEqual(len(run.stderr.splitlines()), 1, run.stderr)
                self.assertTrue(run.stderr.startswith("python -m plan.schedule_grid: error: "), run.stderr)


class TestPairings(unittest.TestCase):
    """The runtime's lists are the simulator's "ready" pairing (plan.timeline.paired), which the proofs above
    hold against "meet" and "ready_meet": `paired(..., "ready")` gives every schedule's own lists back."""

    def test_ready_pairing_is_the_runtimes(self):
        for name, make in ALL_SCHEDULES.items():
            for p in (2, 3, 4):
                for v in (1, 2, 3) if name == "interleaved_1f1b" else (2,) if name in V_SCHEDULES else (1,):
                    m = 2 * p
                    sched = make(p, m, v)
                    self.assertEqual(paired(sched, p, "ready", v_shape=name in V_SCHEDULES), sched, (name, p, v))
        with self.assertRaisesRegex(ValueError, "unknown pairing"):
            paired(one_f_one_b(2, 2), 2, "split")


if __name__ == "__main__":
    unittest.main()
