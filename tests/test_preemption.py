"""Cluster faults: preemption and checkpoints written in the background.

Preemption: SIGTERM or SIGINT on one rank, mid-step, stops every rank after that step, with a checkpoint,
each rank printing one line and exiting PREEMPTED (5); `--resume` then continues bit-equal to an
uninterrupted run. The signal comes from the trainer/faults.py hook GPT_SIGNAL_AT_STEP (after the step's backward,
before its optimizer step), so "mid-step" is the same point every time. Ranks are forked from the session's
fork server (tests/harness.forked_ranks: no agent stops the others when one exits) so each rank's own exit
code and stderr are seen.

Async checkpoints (--async_checkpoint): the files a background thread writes equal a synchronous save's, a
resume from them is bit-equal, and a write that fails in the background leaves the previous checkpoint the
newest (the failure surfaces at the next save)."""

import os
import shutil
import tempfile
import unittest

import pytest
import torch

from checkpoints import checkpoint
from runtime.metrics import read_jsonl
from tests.harness import forked_ranks, rank0_only, shared_data, train_losses
from trainer.faults import PREEMPTED

STEPS, SIGNAL_AT = 5, 3
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "32",
    "--total_batch_size",
    "256",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "10",
    "--eval_iters",
    "1",
    "--warmup_steps",
    "1",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
]  # saves only at the end
LAYOUTS = {
    "ddp": ["--data_parallel_size", "2", "--data_parallel_type", "ddp"],
    "fsdp": ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"],
    "tp": ["--tensor_parallel_size", "2", "--sequence_parallel"],
}


class Runs:
    """The two classes' setup: a scratch folder per class (`tmp`), the session's corpus (`data`), and `args`."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = shared_data()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def args(self, flags: list[str], out: str) -> list[str]:
        return [*BASE, *flags, "--dataset", self.data, "--out_dir", out]

    def resume(self, flags: list[str], out: str, step: int, nproc: int) -> None:
        """--resume the run in `out` (nproc 1: python, else ranks by hand): it exits 0, says it continues from
        step `step`'s checkpoint, and appends exactly steps step + 1.. to metrics.jsonl (a fresh start would
        append steps 1..)."""
        before = logged_steps(out)
        args = [*self.args(flags, out), "--resume"]
        procs = forked_ranks(args, nproc)
        self.assertEqual([p.returncode for p in procs], [0] * nproc, procs[0].stderr[-2000:])
        self.assertIn(f"resuming from {checkpoint.step_dir(out, step)} (", procs[0].stdout)
        self.assertIn(f"continuing at step {step + 1}", procs[0].stdout)
        self.assertEqual(logged_steps(out), before + list(range(step + 1, STEPS + 1)))


def logged_steps(out: str) -> list[int]:
    """The steps of out's training records in metrics.jsonl, in the order they were logged."""
    return [r["step"] for r in read_jsonl(out) if "loss" in r]


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestPreemption(Runs, unittest.TestCase):
    def test_signal_on_one_rank_stops_all_saves_and_resumes_bit_equal(self):
        for name, flags in LAYOUTS.items():
            for sig, rank in (("TERM", "1"), ("INT", "0")):
                with self.subTest(f"{name} SIG{sig} on rank {rank}"):
                    ref = os.path.join(self.tmp.name, f"{name}_ref")
                    if not os.path.isdir(ref):
                        self.assertEqual([p.returncode for p in forked_ranks(self.args(flags, ref), 2)], [0, 0])
                    out = os.path.join(self.tmp.name, f"{name}_{sig}")
                    ranks = forked_ranks(
                        self.args(flags, out),
                        2,
                        env={"GPT_SIGNAL_AT_STEP": str(SIGNAL_AT), "GPT_SIGNAL_RANK": rank, "GPT_SIGNAL": sig},
                    )
                    for r, proc in enumerate(ranks):
                        self.assertEqual(proc.returncode, PREEMPTED, f"rank {r}: {proc.stderr[-2000:]}")
                        lines = [ln for ln in proc.stderr.splitlines() if "preempted" in ln]
                        self.assertEqual(len(lines), 1, proc.stderr)
                        self.assertIn(f"stopped after step {SIGNAL_AT}, saved", lines[0])
                    # the step was finished, logged and saved (no regular saves: --checkpoint_interval 0)
                    self.assertEqual(checkpoint.newest(out), checkpoint.step_dir(out, SIGNAL_AT))
                    self.assertEqual(sorted(train_losses(out)), sorted(train_losses(ref)[:SIGNAL_AT]))
                    self.resume(flags, out, SIGNAL_AT, 2)
                    self.assertEqual(train_losses(out), train_losses(ref))  # bit for bit

    def test_one_process(self):
        ref, out = os.path.join(self.tmp.name, "single_ref"), os.path.join(self.tmp.name, "single")
        self.assertEqual(forked_ranks(self.args([], ref))[0].returncode, 0)
        proc = forked_ranks(self.args([], out), env={"GPT_SIGNAL_AT_STEP": str(SIGNAL_AT)})[0]
        self.assertEqual(proc.returncode, PREEMPTED, proc.stderr[-2000:])
        self.assertEqual(checkpoint.newest(out), checkpoint.step_dir(out, SIGNAL_AT))
        self.resume([], out, SIGNAL_AT, 1)
        self.assertEqual(train_losses(out), train_losses(ref))


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestAsyncCheckpoint(Runs, unittest.TestCase):
    FSDP = ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--checkpoint_interval", "2"]

    def test_same_files_and_bit_equal_resume(self):
        sync, asyn = os.path.join(self.tmp.name, "sync"), os.path.join(self.tmp.name, "async")
        self.assertEqual([p.returncode for p in forked_ranks(self.args(self.FSDP, sync), 2)], [0, 0])
        ranks = forked_ranks(self.args([*self.FSDP, "--async_checkpoint"], asyn), 2)
        self.assertEqual([p.returncode for p in ranks], [0, 0], ranks[0].stderr[-2000:])
        self.assertEqual(train_losses(asyn), train_losses(sync))
        for step in (4, STEPS):  # every tensor of the background-written checkpoints equals the synchronous one's
            a, b = (
                checkpoint.consolidate(checkpoint.step_dir(d, step), ("param", "exp_avg", "exp_avg_sq"))
                for d in (asyn, sync)
            )
            self.assertEqual(a.keys(), b.keys())
            for name in a:
                for kind in a[name]:
                    self.assertTrue(torch.equal(a[name][kind], b[name][kind]), f"step {step} {name} {kind}")
        shutil.rmtree(checkpoint.step_dir(asyn, STEPS))  # resume from the async step-4 checkpoint
        self.resume([*self.FSDP, "--async_checkpoint"], asyn, 4, 2)
        self.assertEqual(train_losses(asyn), train_losses(sync))

    def test_failed_background_write_leaves_the_previous_checkpoint(self):
        """One process, a checkpoint every 2 steps: its 3rd file (step 4's rank file; step 2 wrote a rank file
        and a manifest) fails in the background thread. The run stops at its next save with that error; step 2
        stays the newest checkpoint, and --resume from it is bit-equal to an undisturbed run."""
        ref, out = os.path.join(self.tmp.name, "one_ref"), os.path.join(self.tmp.name, "one_fail")
        every = ["--checkpoint_interval", "2", "--async_checkpoint"]
        self.assertEqual(forked_ranks(self.args(every, ref))[0].returncode, 0)
        proc = forked_ranks(self.args(every, out), env={"GPT_CKPT_FAIL_AFTER_FILES": "3"})[0]
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("GPT_CKPT_FAIL_AFTER_FILES=3", proc.stderr)
        self.assertEqual(checkpoint.newest(out), checkpoint.step_dir(out, 2))
        self.resume(every, out, 2, 1)
        self.assertEqual(train_losses(out), train_losses(ref))


if __name__ == "__main__":
    unittest.main()
