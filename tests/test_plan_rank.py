"""bench.plan_rank's pure logic on synthetic numbers: what a run's time is, what noise is, and when a pair of
layouts counts as ordered by the measurement (no run, no clock: the bench itself is `python -m bench.plan_rank`)."""

from __future__ import annotations

import pytest

from bench.plan_rank import fit_overhead, measured, pairwise, ranks, relative_noise, run_seconds, tally, verdict


def test_a_run_is_the_median_of_its_steps_after_the_skipped_ones():
    """Steps 1 and 2 (saved-activation hooks, warm-up) are left out however slow; the step-0 prediction record
    and eval records are not steps."""
    recs = [
        {"step": 0, "predicted": {}},
        {"step": 1, "loss": 1, "step_time_ms": 900.0},
        {"step": 2, "loss": 1, "step_time_ms": 800.0},
        {"step": 2, "val_loss": 1},
        {"step": 3, "loss": 1, "step_time_ms": 30.0},
        {"step": 4, "loss": 1, "step_time_ms": 10.0},
        {"step": 5, "loss": 1, "step_time_ms": 20.0},
    ]
    assert run_seconds(recs) == 0.02
    assert run_seconds(recs[:3]) is None


def test_a_run_can_be_the_min_of_its_steps():
    """`--stat min`: the fastest step after the skipped ones (a step only gains time from the machine's other work)."""
    recs = [
        {"step": 1, "loss": 1, "step_time_ms": 5.0},
        {"step": 3, "loss": 1, "step_time_ms": 30.0},
        {"step": 4, "loss": 1, "step_time_ms": 10.0},
        {"step": 5, "loss": 1, "step_time_ms": 20.0},
    ]
    assert run_seconds(recs, stat="min") == 0.01
    assert run_seconds(recs, stat="median") == 0.02


def test_relative_noise_is_the_median_spread_over_time_by_statistic():
    """Two layouts, two repeats each: a's medians 0.10 and 0.12 (spread 0.02 over the median 0.11), mins 0.10 and
    0.10 (0); b's medians 0.20 and 0.20 (0), mins 0.15 and 0.20 (0.05 / 0.175): the median over the layouts of each."""
    steps = {(2, "a"): [[0.10, 0.10, 0.11], [0.10, 0.12, 0.13]], (2, "b"): [[0.20, 0.20, 0.21], [0.15, 0.20, 0.30]]}
    got = relative_noise(steps)
    assert got["median"] == pytest.approx((0.02 / 0.11 + 0) / 2, rel=1e-9)
    assert got["min"] == pytest.approx((0 + 0.05 / 0.175) / 2, rel=1e-9)


def test_noise_is_the_spread_of_the_repeats():
    assert measured([0.30, 0.10, 0.25]) == (0.25, 0.30 - 0.10)


def test_ranks_count_from_the_fastest_and_ties_share():
    assert ranks([0.3, 0.1, 0.3, 0.2]) == [3, 1, 3, 2]


def test_a_difference_within_the_two_noises_gets_no_verdict():
    """0.10 and 0.12 s, each repeat spreading 0.01: 0.02 apart is not more than 0.01 + 0.01, whichever order
    the planner predicts; 0.025 apart is."""
    assert verdict((1, 2), (0.10, 0.12), (0.01, 0.01)) == "noise"
    assert verdict((2, 1), (0.10, 0.12), (0.01, 0.01)) == "noise"
    assert verdict((1, 2), (0.10, 0.125), (0.01, 0.01)) == "agree"
    assert verdict((2, 1), (0.10, 0.125), (0.01, 0.01)) == "disagree"


def test_an_equal_prediction_of_a_measured_order_is_a_tie():
    assert verdict((1.0, 1.0), (0.10, 0.20), (0.0, 0.0)) == "tie"


def test_pairwise_over_three_layouts():
    """a < b < c measured, apart by more than the noise except b and c; predicted a < c < b."""
    rows = [
        {"layout": "a", "predicted_s": 1.0, "measured_s": 0.10, "noise_s": 0.01},
        {"layout": "b", "predicted_s": 3.0, "measured_s": 0.20, "noise_s": 0.02},
        {"layout": "c", "predicted_s": 2.0, "measured_s": 0.21, "noise_s": 0.02},
    ]
    got = {(p["a"], p["b"]): p["verdict"] for p in pairwise(rows)}
    assert got == {("a", "b"): "agree", ("a", "c"): "agree", ("b", "c"): "noise"}
    assert tally(pairwise(rows)) == {"agree": 2, "disagree": 0, "tie": 0, "noise": 1}


def test_the_calibrated_cluster_runs_all_busy_ranks_at_the_measured_contended_rate():
    """bench.plan_rank.cpu_cluster: contention is measured with all N ranks busy, so a layout with no bubble
    (dp=4, every rank busy) must be predicted at one process's FLOP/s x that contention, with 4 ranks on 2 cores
    as with 2 on 2; the cores are passed only when fewer than the ranks. The hop and bandwidth are the job's, and a
    call has no latency beyond its hops."""
    from bench.plan_rank import cpu_cluster
    from plan.search import core_share

    cal_1 = {"matmul_flops": 10e9}
    for world, rate in ((2, 8e9), (4, 4.5e9)):
        cal = {"matmul_flops": rate, "bus_bw": 1e9, "hop": 2e-4}
        cluster, figures = cpu_cluster(world, 3e9, cal, cal_1, cores=2)
        assert cluster.peak_flops * core_share(cluster, 0.0) == pytest.approx(3e9 * rate / 10e9, rel=1e-12)
        assert (cluster.cores, cluster.hop, cluster.latency, cluster.intra_bw) == (
            2 if world > 2 else None,
            2e-4,
            0.0,
            1e9,
        )
        assert figures["compute_flops"] == pytest.approx(3e9 * rate / 10e9, rel=1e-12)
        # one process's 1 ms per action, slowed by the contention as its FLOPs are, on a busy rank
        cluster, _ = cpu_cluster(world, 3e9, cal, cal_1, cores=2, overhead=1e-3)
        assert cluster.overhead / core_share(cluster, 0.0) == pytest.approx(1e-3 * 10e9 / rate, rel=1e-12)


def test_the_overhead_fit_recovers_a_line_through_two_runs():
    """1e9 FLOPs per step at 1e10 FLOP/s plus 1 ms per action: 2 actions take 0.102 s, 8 take 0.108 s; a small
    micro-batch measured faster than the big one (noise) fits no overhead."""
    overhead, rate = fit_overhead(1e9, (0.102, 2), (0.108, 8))
    assert (overhead, rate) == (pytest.approx(1e-3, rel=1e-9), pytest.approx(1e10, rel=1e-9))
    assert fit_overhead(1e9, (0.1, 2), (0.09, 8)) == (0.0, pytest.approx(1e10, rel=1e-12))


def test_the_calibrated_one_process_cluster_reproduces_both_reference_runs():
    """The bench's fit on SINGLE (mb=16) and SMALL (mb=4) counts their actions as plan.search.step_time does, so
    the calibrated one-rank cluster predicts both measured times back (here 0.10 s and 0.13 s)."""
    from bench.plan_rank import SINGLE, SMALL, cpu_cluster, planned
    from plan.cluster import Cluster
    from plan.counts import step_flops
    from plan.search import compute_actions

    ones = planned(1, Cluster(1, 1, 2**40, 1e12, 1e9, 1e9))
    big, small = ones[SINGLE].setup, ones[SMALL].setup
    overhead, rate = fit_overhead(step_flops(big), (0.10, compute_actions(big)), (0.13, compute_actions(small)))
    cal = {"matmul_flops": 1e10, "bus_bw": None, "hop": None}
    cluster, _ = cpu_cluster(1, rate, cal, cal, cores=2, overhead=overhead)
    got = planned(1, cluster)
    assert got[SINGLE].seconds == pytest.approx(0.10, rel=1e-9)
    assert got[SMALL].seconds == pytest.approx(0.13, rel=1e-9)
