"""Whole train.py runs of the zero-bubble schedules (--pp_schedule zb_h1 | zbv | dualpipev): kill + resume bit for
bit, checkpoints carried across schedules (and so across the V layout's other cut), and bf16 under CPU autocast.

The runs are tests/test_pipeline_train.py's (its BASE, SHORT = 6 steps, a checkpoint every 3; the same flags
train once per session through tests/harness.shared_run): a 4-Block tiny GPT on P = 2 ranks and M = 4
micro-batches. 1F1B cuts it [0-2] | [3] (the cost model: tiny's 50304-way head outweighs its Blocks); a V
layout has 2P = 4 chunks of one Block, rank 0 holding Blocks 0 and 3 (with the embedding and the head), rank 1
Blocks 1 and 2. Checkpoints keep full tensors by parameter name, so one cut's checkpoint loads into the other.

Bars. ZB-H1's split backward sums every gradient's terms in 1F1B's order (tests/test_zero_bubble.py), so a ZB-H1
run is a 1F1B run's bits: its kill + resume is held to the uninterrupted 1F1B run, bit for bit, and so is a 1F1B
checkpoint resumed under ZB-H1. The V schedules sum the tied embedding's 2M terms in another order than 1F1B
(rank 0 adds both copies' gradients in one .grad): against another layout they are held to 1e-5 relative, the
bar tests/test_pipeline_train.py derives for a layout that only reorders fp32 sums (measured here: 0, every run
below gave the reference's bits; a bound, not a promise of bits on another machine). bf16: see TestBf16.

Switched off once each (then restored): checkpoint.load skipping Block 3's tensors fails every kill + resume and
cross-schedule test; W computing dW in fp32 (autocast off) fails the bf16 ZB-H1 = 1F1B test (the u-bounded
comparisons with one process move by only 1.5e-5 and pass); micro-batch 0's W dropped fails all three bf16 tests.
"""

from __future__ import annotations

import os
import unittest

import pytest
import torch

from bench.sweep import BF16_RTOL
from checkpoints import checkpoint
from tests.harness import (
    WholeRuns,
    assert_close,
    check_kill_and_resume,
    check_resume_from,
    evals_of,
    rank0_only,
    steps_of,
)
from tests.test_pipeline_train import BASE, PP2, SHORT

ZB_H1 = [*PP2, "--pp_schedule", "zb_h1"]
ZBV = [*PP2, "--pp_schedule", "zbv", "--pp_virtual_stages", "2"]
DUALPIPEV = [*PP2, "--pp_schedule", "dualpipev", "--pp_virtual_stages", "2"]
DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]
FP32_RTOL = 1e-5
BF16 = ["--dtype", "bfloat16", "--param_dtype", "bfloat16", "--vocab_size", "512"]  # bench/sweep.py's vocab
BF16_STEPS = 3  # and its bf16 rows' 3 steps, for which BF16_RULE is stated

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int, steps: int = SHORT, checkpoints: bool = True) -> str:
    """Train once per name (shared with test_pipeline_train's runs of the same flags); its out_dir. With
    `checkpoints` a checkpoint every 3 steps and the final one, as test_pipeline_train's SHORT runs."""
    saving = ["--checkpoint_interval", "3"] if checkpoints else ["--no_checkpoint"]
    return RUNS.run(name, ["--max_steps", str(steps), *saving, *flags], nproc)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestKillAndResume(unittest.TestCase):
    """SIGKILL one rank after step 3, --resume from step 2's checkpoint (tests/harness.check_kill_and_resume):
    every loss, grad_norm, val_loss and the final checkpoint's parameters equal the uninterrupted run's bits."""

    def test_zb_h1_is_the_1f1b_run(self):
        """ZB-H1 killed on the last stage (rank 1) and resumed: bit-equal to the uninterrupted 1F1B run
        (pp_short), so the resumed state (AdamW's moments, the step, the data position) and the split backward
        are both exact."""
        check_kill_and_resume(
            self,
            RUNS.args("--max_steps", str(SHORT), *ZB_H1),
            2,
            RUNS.path("zb_h1_killed"),
            run("pp_short", PP2, 2),
            SHORT,
            kill_at=3,
            kill_rank=1,
            every=2,
        )

    def test_zbv_with_ddp(self):
        """ZB-V x DDP 2 (4 ranks), rank 0 (which holds the embedding, the head and Blocks 0 and 3) killed: bit-equal
        to the uninterrupted ZB-V x DDP run; DDP's bucket all-reduce runs after the last W in both."""
        flags = [*ZBV, *DDP2]
        check_kill_and_resume(
            self,
            RUNS.args("--max_steps", str(SHORT), *flags),
            4,
            RUNS.path("zbv_ddp_killed"),
            run("zbv_ddp_short", flags, 4),
            SHORT,
            kill_at=3,
            kill_rank=0,
            every=2,
        )


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestAcrossSchedules(unittest.TestCase):
    """A step-3 checkpoint resumed under another schedule (tests/harness.check_resume_from: only that checkpoint
    in a fresh out_dir), continued to step SHORT, against the run that continued without the change."""

    def resume(self, name: str, source: str, flags: list[str]) -> dict[int, dict]:
        out = RUNS.path(name)
        check_resume_from(self, source, 3, RUNS.args("--max_steps", str(SHORT), *flags), 2, out, SHORT)
        return out

    def compare(self, out: str, ref: str, rtol: float, what: str) -> None:
        """Steps 4..SHORT's loss and grad_norm, and the val losses at 5 and SHORT, within rtol of `ref`'s."""
        assert_close(self, steps_of(out), steps_of(ref), "loss", rtol, what)
        assert_close(self, steps_of(out), steps_of(ref), "grad_norm", rtol, what)
        assert_close(self, evals_of(out), evals_of(ref), None, rtol, what, steps=[5, SHORT])

    def test_1f1b_checkpoint_under_zb_h1_is_bit_equal(self):
        """The same cut, the split backward: steps 4-6 are the 1F1B run's bits."""
        pp = run("pp_short", PP2, 2)
        self.compare(self.resume("1f1b_to_zb_h1", pp, ZB_H1), pp, 0, "1f1b -> zb_h1")

    def test_1f1b_checkpoint_under_zbv(self):
        """[0-2] | [3] saved, Blocks 0, 3 | 1, 2 loaded (rank 0 now holds the embedding and the head, tied as one
        parameter): steps 4-6 within 1e-5 of the 1F1B run continuing."""
        pp = run("pp_short", PP2, 2)
        self.compare(self.resume("1f1b_to_zbv", pp, ZBV), pp, FP32_RTOL, "1f1b -> zbv")

    def test_1f1b_checkpoint_under_dualpipev(self):
        """The same V cut under DualPipe-V's order: within 1e-5 of the 1F1B run continuing."""
        pp = run("pp_short", PP2, 2)
        self.compare(self.resume("1f1b_to_dualpipev", pp, DUALPIPEV), pp, FP32_RTOL, "1f1b -> dualpipev")

    def test_zbv_checkpoint_under_1f1b(self):
        """The V layout's checkpoint, saved by ZB-V x DDP 2 on 4 ranks (pp rank 0 wrote Blocks 0 and 3 and the one
        tied matrix), into 1F1B's cut on 2 ranks, whose last stage keeps its own lm_head copy of wte: steps 4-6
        within 1e-5 of the ZB-V x DDP run continuing (the same global batch; a layout only reorders fp32 sums)."""
        zbv = run("zbv_ddp_short", [*ZBV, *DDP2], 4)
        self.assertEqual(blocks_written(checkpoint.step_dir(zbv, 3)), {0: {0, 3}, 1: {1, 2}})
        self.compare(self.resume("zbv_to_1f1b", zbv, PP2), zbv, FP32_RTOL, "zbv x ddp -> 1f1b")


def blocks_written(path: str) -> dict[int, set[int]]:
    """pp rank -> the Block indices written by the rank files of the checkpoint at `path` (P = 2, the mesh's
    pp-major rank order: global ranks [pp_rank · W/2, (pp_rank + 1) · W/2) are pp rank pp_rank)."""
    files = sorted(f for f in os.listdir(path) if f.startswith("rank_"))
    per_pp = len(files) // 2
    return {
        r: {
            int(k.split(".")[2])
            for f in files[r * per_pp : (r + 1) * per_pp]
            for k in torch.load(os.path.join(path, f), weights_only=True, mmap=True)
            if k.startswith("transformer.h.")
        }
        for r in range(2)
    }


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestBf16(unittest.TestCase):
    """--dtype bfloat16 --param_dtype bfloat16 (CPU autocast: bf16 matmuls, fp32 master weights), BF16_STEPS steps.

    ZB-H1 against 1F1B in bf16: the same bits. The split backward's W runs the products autograd runs for an
    autocast linear, in its compute dtype and cast back as autocast's ToCopy backward casts
    (parallel/pipeline/zero_bubble.py),
    and sums them in 1F1B's order, so no bf16 rounding moves: torch.equal, not a tolerance.

    ZB-H1 and ZB-V against one process in bf16: bench/sweep.py's BF16_RULE, derived there. Both runs compute the
    same math from the same fp32 weights with bf16 roundings in other places, each within u/2 of the exact value
    to first order, so every loss and val loss, and step 1's grad norm, agree within u = 2^-8 = 3.9e-3
    (BF16_RTOL). Later grad norms are not held: AdamW's m/sqrt(v) turns a rounding-sized change of a near-zero
    gradient into an lr-sized step. Measured: 0 (the pipelines gave one process's bf16 bits here).
    vocab 512 (bench/sweep.py's): CPU bf16 matmuls on the 50304-way head made each run ~10x slower.
    """

    @classmethod
    def setUpClass(cls):
        cls.single = run("single_bf16", BF16, 1, BF16_STEPS, checkpoints=False)

    def bf16_run(self, name: str, flags: list[str]) -> str:
        return run(name, [*BF16, *flags], 2, BF16_STEPS, checkpoints=False)

    def check_bf16_rule(self, out: str, what: str) -> None:
        got, ref = steps_of(out), steps_of(self.single)
        self.assertEqual(sorted(got), list(range(1, BF16_STEPS + 1)), what)
        assert_close(self, got, ref, "loss", BF16_RTOL, what)
        assert_close(self, got, ref, "grad_norm", BF16_RTOL, what, steps=[1])
        self.assertEqual(sorted(evals_of(out)), [0, BF16_STEPS], what)
        assert_close(self, evals_of(out), evals_of(self.single), None, BF16_RTOL, what)

    def test_zb_h1_is_the_1f1b_run(self):
        got, want = steps_of(self.bf16_run("zb_h1_bf16", ZB_H1)), steps_of(self.bf16_run("1f1b_bf16", PP2))
        assert_close(self, got, want, "loss", 0, "zb_h1 vs 1f1b in bf16")
        assert_close(self, got, want, "grad_norm", 0, "zb_h1 vs 1f1b in bf16")
        self.assertEqual(evals_of(RUNS["zb_h1_bf16"]), evals_of(RUNS["1f1b_bf16"]))

    def test_zb_h1_against_one_process(self):
        self.check_bf16_rule(self.bf16_run("zb_h1_bf16", ZB_H1), "zb_h1 bf16 vs one process")

    def test_zbv_against_one_process(self):
        self.check_bf16_rule(self.bf16_run("zbv_bf16", ZBV), "zbv bf16 vs one process")


if __name__ == "__main__":
    unittest.main()
