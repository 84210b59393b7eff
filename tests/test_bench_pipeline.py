"""bench/pipeline.py: the idle arithmetic on hand-built timelines, the saved-bytes counter on hand-sized
graphs, and one small end-to-end run checked against the schedules' derived bounds (no timing asserted)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench.pipeline import SavedBytes, idle_stats, pipeline_rows, run
from parallel.pipeline.schedule import SCHEDULES
from plan.theory import bubble_fraction
from plan.timeline import simulate_schedule


def test_idle_of_hand_built_gpipe_timeline():
    """GPipe, P=2, M=2, F=1, B=2 units, starting at t=10. rank 0: F0 10-11, F1 11-12, B0 15-17, B1 17-19;
    rank 1: F0 11-12, F1 12-13, B0 13-15, B1 15-17. Span 9, busy 6 each: idle 1/3 = (P-1)/(M+P-1).
    Receives and sends fill the gaps and must not count as busy."""
    r0 = [
        ("F", 10, 11),
        ("F", 11, 12),
        ("SEND_F", 12, 12.5),
        ("RECV_B", 12.5, 15),
        ("B", 15, 17),
        ("RECV_B", 17, 17),
        ("B", 17, 19),
    ]
    r1 = [
        ("RECV_F", 10, 11),
        ("F", 11, 12),
        ("RECV_F", 12, 12),
        ("F", 12, 13),
        ("B", 13, 15),
        ("SEND_B", 15, 15.5),
        ("B", 15.5, 17.5),
    ]
    busy, span, idle = idle_stats([r0, r1])
    assert busy == [6, 6] and span == 9
    assert idle == pytest.approx([1 / 3, 1 / 3])
    assert sum(idle) / 2 == pytest.approx(bubble_fraction("gpipe", 2, 2))


@pytest.mark.parametrize(
    "name,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved_1f1b", 4, 8, 2), ("1f1b", 3, 5, 1)]
)
def test_rows_of_simulated_timelines_meet_theory(name, pp, m, v):
    """The simulator's ideal timelines, fed through pipeline_rows as if measured: mean idle over ranks is
    bubble_fraction (simulate's timelines meet it exactly, parallel/pipeline/schedule.py)."""
    sim = simulate_schedule(SCHEDULES[name](pp, m, v), pp, v, m, p2p="async")
    raw = {
        "pp": pp,
        "micro": m,
        "virtual": v,
        "schedules": {
            name: [
                {
                    "timeline": [(a.kind, a.chunk, a.micro, t0, t1) for t0, t1, a in sim.timeline[r]],
                    "peak_in_flight": sim.max_in_flight[r],
                    "peak_saved_bytes": 0,
                }
                for r in range(pp)
            ]
        },
    }
    rows = pipeline_rows(raw)
    assert [r["rank"] for r in rows] == list(range(pp))
    assert sum(r["idle_fraction"] for r in rows) / pp == pytest.approx(bubble_fraction(name, pp, m, v))
    assert all(r["idle_theory"] == bubble_fraction(name, pp, m, v) for r in rows)


def test_saved_bytes_counts_live_activations_once_and_not_parameters():
    """exp saves its output (1000 fp32 = 4000 bytes); two graphs alive: 8000; a backward frees its graph's.
    Linear saves its input (5x100 fp32 = 2000) and weight (excluded); gelu saves its input (5x100 = 2000)."""
    a = torch.randn(1000, requires_grad=True)
    with SavedBytes() as saved:
        b, c = a.exp(), a.exp()
        assert saved.bytes == 8000
        b.sum().backward()
        assert saved.bytes == 4000
        del c
        assert saved.bytes == 0 and saved.peak == 8000
    lin = torch.nn.Linear(100, 100)
    x = torch.randn(5, 100, requires_grad=True)
    with SavedBytes(exclude=list(lin.parameters())) as saved:
        y = torch.nn.functional.gelu(lin(x))
        assert saved.bytes == 4000
        y.sum().backward()
    assert saved.bytes == 0 and saved.peak == 4000
    assert torch.allclose(a.grad, a.detach().exp())  # the hooks hand autograd the right tensors


@pytest.mark.slow
def test_end_to_end_p2(tmp_path):
    """P=2, M=4, V=2: files written; peak in-flight as derived (1F1B P-rank, GPipe M) and as simulate says;
    rank 0 saves the same bytes per micro-batch under both schedules (same chunk, same shapes, own batch
    storages), so GPipe's peak over 1F1B's is M/P exactly."""
    P, M = 2, 4
    rows = run(
        str(tmp_path), pp=P, micro=M, virtual=2, warmup=1, repeats=1, seq_len=32, micro_batch_size=2, timeout=600
    )
    for f in ("pipeline.json", "pipeline.md", "pipeline_timeline.png", "pipeline_timelines.json"):
        assert os.path.getsize(tmp_path / f) > 0, f
    with open(tmp_path / "pipeline.json") as f:
        assert json.load(f)["rows"] == rows
    by = {(r["schedule"], r["rank"]): r for r in rows}
    assert len(by) == 3 * P
    for rank in range(P):
        assert by["1f1b", rank]["peak_in_flight"] == P - rank
        assert by["gpipe", rank]["peak_in_flight"] == M
    assert all(r["peak_in_flight"] == r["peak_in_flight_theory"] for r in rows)
    gpipe, one_f = by["gpipe", 0]["peak_saved_bytes"], by["1f1b", 0]["peak_saved_bytes"]
    assert gpipe > one_f > 0
    assert gpipe * P == one_f * M
    assert all(0 <= r["idle_fraction"] < 1 for r in rows)
