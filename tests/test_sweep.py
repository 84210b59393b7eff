"""The layout sweep (bench/sweep.py): every layout up to 4 ranks, the bf16 rows, and (GPT_SWEEP_LARGE=1) a seeded
sample at 6 and 8 ranks, each held against one process in its dtype, or refused by validation in one line
with exit 2 on every rank. A crash, a hang (past bench.sweep's timeout) or a traceback fails its layout.

Refusals are pinned: `REFUSED` lists every layout validation refuses, with the words its line must hold, so a
layout that starts being refused (a regression hidden as a refusal) or stops being refused (then it must
match one process) fails.

Marked `sweep` and `slow` (`pytest -m sweep`; the everyday `-m "not slow"` loop skips it). CI runs the 4-rank
part, two 6-rank layouts with a middle stage (pp=3 x dp=2), the zero-bubble rows and the bf16 rows; `GPT_SWEEP_LARGE=1
pytest -m sweep` adds the 6- and 8-rank sample. The same table, for
reading: `python -m bench.sweep`.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from bench import sweep as S
from bench.forkserver import ForkServer, RunResult
from tests.harness import make_token_bins, rank0_only

LARGE = os.environ.get("GPT_SWEEP_LARGE") == "1"
# every registered concept's rows (runtime/registry.Sweep): the pipeline's middle-stage and zero-bubble rows, the
# experts' (MoE and EP) rows; the experts' bf16 row with the bf16 ones
ROWS = S.concept_rows("rows")
SMALL = [x for x in S.layouts(4) if not x.is_reference] + [x for x in ROWS if x.dtype == "float32" or not x.experts]
BF16 = S.bf16_rows() + [x for x in ROWS if x.dtype != "float32" and x.experts]
SAMPLE = S.sample(12) + S.concept_rows("large")

# layout name -> what its one refusal line says (every other layout must train and match one process)
REFUSED: dict[str, str] = {}


@pytest.fixture(scope="module")
def sweep_env():
    with tempfile.TemporaryDirectory() as tmp, ForkServer() as server:
        data = make_token_bins(os.path.join(tmp, "data"), vocab=S.VOCAB)
        refs: dict[S.Layout, dict] = {}

        def reference(ref: S.Layout) -> dict:
            if ref not in refs:
                row = S.judge(ref, *S.run_layout(server, ref, data, tmp), None)
                assert row.status == "ok", f"one-process reference {ref.name}: {row.detail}"
                refs[ref] = row.values
            return refs[ref]

        def run(layout: S.Layout) -> S.Row:
            return S.judge(layout, *S.run_layout(server, layout, data, tmp), reference(layout.reference()))

        yield run


def check(row: S.Row) -> None:
    name = row.layout.name
    if name in REFUSED:
        assert row.status == "refused", (
            f"{name}: expected a refusal ({REFUSED[name]!r}), got {row.status}: {row.detail}"
        )
        assert REFUSED[name] in row.detail, f"{name}: refused for another reason: {row.detail}"
    else:
        assert row.status == "ok", f"{name}: {row.status}: {row.detail}"


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.skipif(not rank0_only(), reason="whole-job test: rank 0 launches its own ranks")
@pytest.mark.parametrize("layout", SMALL + BF16, ids=lambda x: x.name)
def test_layout_matches_one_process(sweep_env, layout):
    check(sweep_env(layout))


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.skipif(not LARGE, reason="the 6- and 8-rank sample: GPT_SWEEP_LARGE=1")
@pytest.mark.skipif(not rank0_only(), reason="whole-job test: rank 0 launches its own ranks")
@pytest.mark.parametrize("layout", SAMPLE, ids=lambda x: x.name)
def test_large_layout_matches_one_process(sweep_env, layout):
    check(sweep_env(layout))


# ----------------------------------------------------------------------------- the sweep's own logic (fast)


class TestEnumeration:
    def test_every_small_layout_once(self):
        names = [x.name for x in S.layouts(4)]
        assert len(names) == len(set(names))
        assert all(1 <= x.nproc <= 4 for x in S.layouts(4))
        # the grid, counted by hand: 88 = 1 + 15 (2 ranks) + 8 (3 ranks) + 64 (4 ranks)
        by_world = {n: sum(x.nproc == n for x in S.layouts(4)) for n in (1, 2, 3, 4)}
        assert by_world == {1: 1, 2: 15, 3: 8, 4: 64}
        assert {(x.pp, x.dp, x.tp, x.cp) for x in S.layouts(4)} >= {
            (3, 1, 1, 1),
            (1, 3, 1, 1),
            (4, 1, 1, 1),
            (1, 4, 1, 1),
            (2, 2, 1, 1),
            (2, 1, 2, 1),
            (2, 1, 1, 2),
            (1, 2, 2, 1),
            (1, 2, 1, 2),
            (1, 1, 2, 2),
        }
        assert {x.replicate for x in S.layouts(4) if x.dp == 4} == {1, 2}
        assert {(x.schedule, x.virtual) for x in S.layouts(4) if x.pp == 4} == set(S.SCHEDULES)

    def test_sample_is_seeded_and_holds_the_named_layouts(self):
        assert S.sample(12) == S.sample(12) and S.sample(12, seed=1) != S.sample(12)
        got = S.sample(12)
        assert len(got) >= 12 and all(x.nproc in (6, 8) for x in got)
        assert any(x.pp == 3 and x.dp == 2 for x in got)
        assert any(x.dp == 3 for x in got)
        assert any(x.pp > 1 and x.cp > 1 and x.tp > 1 for x in got)

    def test_bf16_rows_cover_the_issue_layouts(self):
        kinds = {(x.pp > 1, x.dp_type, x.tp > 1) for x in S.bf16_rows()}
        assert {(True, "fsdp", False), (True, "zero2", False), (False, None, True), (False, "ddp", False)} <= kinds
        assert all(x.dtype == "bfloat16" and "--param_dtype" in x.flags() for x in S.bf16_rows())

    def test_tolerances(self):
        assert S.tolerance(S.Layout(dp=2, dp_type="ddp")) == 1e-5
        assert S.tolerance(S.Layout(tp=2)) == 1e-4
        bf = S.Layout(dp=2, dp_type="fsdp", dtype="bfloat16")
        assert S.tolerance(bf) == 2.0**-8
        ref = {"loss": [1.0, 1.0], "grad_norm": [1.0, 1.0], "val_loss": [1.0]}
        later = {**ref, "grad_norm": [1.0, 1.05]}  # only step 1's grad norm is held in bf16 (BF16_RULE)
        assert S.worst_difference(later, ref, S.compared(bf)) == 0.0
        assert S.worst_difference(later, ref, S.compared(S.Layout(dp=2, dp_type="fsdp"))) == pytest.approx(0.05)


class TestJudge:
    """judge() on hand-made results: what counts as a refusal, a failure, a match."""

    lay = S.Layout(dp=2, dp_type="ddp")

    def result(self, codes, stderr):
        return RunResult(codes=codes, stdout="", stderr=stderr, seconds=1.0)

    def test_refusal_needs_one_line_on_every_rank_and_nothing_written(self, tmp_path):
        line = "train.py: error: --x must be >= 1, got 0\n"
        row = S.judge(self.lay, self.result([2, 2], [line, line]), str(tmp_path / "none"), None)
        assert (row.status, row.detail) == ("refused", "--x must be >= 1, got 0")
        assert S.judge(self.lay, self.result([2, 0], [line, ""]), str(tmp_path / "none"), None).status == "FAIL"
        assert (
            S.judge(self.lay, self.result([2, 2], [line, "Traceback\n" + line]), str(tmp_path / "n"), None).status
            == "FAIL"
        )
        assert S.judge(self.lay, self.result([2, 2], [line, line]), str(tmp_path), None).status == "FAIL"  # wrote

    def test_crash_and_mismatch_fail(self, tmp_path):
        assert (
            S.judge(self.lay, self.result([1, -9], ["Traceback\nValueError: x", ""]), str(tmp_path), None).status
            == "FAIL"
        )
        ref = {"loss": [1.0, 2.0], "grad_norm": [1.0, 1.0], "val_loss": [3.0]}
        assert S.worst_difference(ref, ref) == 0.0
        assert S.worst_difference({**ref, "loss": [1.0, 2.0 * (1 + 2e-5)]}, ref) == pytest.approx(2e-5)
        assert S.worst_difference({**ref, "loss": [1.0]}, ref) == float("inf")  # a step missing

    def test_bitwise_against_a_recorded_sweep(self, tmp_path):
        """--against: equal only when every logged number is the same float (one ulp apart differs), and a
        layout the record lacks, or refused there, differs."""
        import json

        vals = {"loss": [1.0, 2.0], "grad_norm": [0.5, 0.25], "val_loss": [3.0]}
        other = S.Layout(dp=2, dp_type="fsdp")
        path = tmp_path / "sweep.json"
        path.write_text(
            json.dumps(
                [
                    {"layout": self.lay.name, "status": "ok", "values": vals},
                    {"layout": other.name, "status": "refused", "values": {}},
                ]
            )
        )
        row = lambda lay, v, status="ok": S.Row(lay, status, values=v)
        assert S.bitwise_against([row(self.lay, vals)], str(path)) == ([self.lay.name], [])
        nudged = {**vals, "grad_norm": [0.5, float.__add__(0.25, 2.0**-54)]}  # the next float above 0.25
        assert nudged["grad_norm"][1] != 0.25
        assert S.bitwise_against([row(self.lay, nudged)], str(path)) == ([], [self.lay.name])
        assert S.bitwise_against([row(other, vals)], str(path)) == ([], [other.name])  # refused before
        assert S.bitwise_against([row(S.Layout(tp=2), vals)], str(path))[1] == [S.Layout(tp=2).name]  # missing
