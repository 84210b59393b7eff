"""Preemption: SIGTERM or SIGINT on one rank, mid-step, stops every rank after that step, with a checkpoint,
each rank printing one line and exiting PREEMPTED (5); `--resume` then continues bit-equal to an
uninterrupted run. The signal comes from the faults.py hook GPT_SIGNAL_AT_STEP (after the step's backward,
before its optimizer step), so "mid-step" is the same point every time. Ranks are started by hand
(tests/harness.launch_ranks) so each rank's own exit code and stderr are seen."""
import os
import tempfile
import unittest

import pytest

import checkpoint
from tests.harness import launch, launch_ranks, make_token_bins, rank0_only, train_losses
from train import PREEMPTED

STEPS, SIGNAL_AT = 5, 3
BASE = ["--model", "tiny", "--n_layer", "2", "--micro_batch_size", "2", "--seq_len", "32",
        "--total_batch_size", "256", "--max_steps", str(STEPS), "--eval_interval", "10", "--eval_iters", "1",
        "--warmup_steps", "1", "--gradient_clipping", "--peak_flops", "1e12"]  # saves only at the end
LAYOUTS = {
    "ddp": ["--data_parallel_size", "2", "--data_parallel_type", "ddp"],
    "fsdp": ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"],
    "tp": ["--tensor_parallel_size", "2", "--sequence_parallel"],
}


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestPreemption(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def args(self, flags: list[str], out: str) -> list[str]:
        return [*BASE, *flags, "--dataset", self.data, "--out_dir", out]

    def test_signal_on_one_rank_stops_all_saves_and_resumes_bit_equal(self):
        for name, flags in LAYOUTS.items():
            for sig, rank in (("TERM", "1"), ("INT", "0")):
                with self.subTest(f"{name} SIG{sig} on rank {rank}"):
                    ref = os.path.join(self.tmp.name, f"{name}_ref")
                    if not os.path.isdir(ref):
                        self.assertEqual([p.returncode for p in launch_ranks(self.args(flags, ref), 2)], [0, 0])
                    out = os.path.join(self.tmp.name, f"{name}_{sig}")
                    ranks = launch_ranks(self.args(flags, out), 2, env={"GPT_SIGNAL_AT_STEP": str(SIGNAL_AT),
                                                                       "GPT_SIGNAL_RANK": rank,
                                                                       "GPT_SIGNAL": sig})
                    for r, proc in enumerate(ranks):
                        self.assertEqual(proc.returncode, PREEMPTED, f"rank {r}: {proc.stderr[-2000:]}")
                        lines = [ln for ln in proc.stderr.splitlines() if "preempted" in ln]
                        self.assertEqual(len(lines), 1, proc.stderr)
                        self.assertIn(f"stopped after step {SIGNAL_AT}, saved", lines[0])
                    # the step was finished, logged and saved (no regular saves: --checkpoint_interval 0)
                    self.assertEqual(checkpoint.newest(out), checkpoint.step_dir(out, SIGNAL_AT))
                    self.assertEqual(sorted(train_losses(out)), sorted(train_losses(ref)[:SIGNAL_AT]))
                    resumed = launch_ranks([*self.args(flags, out), "--resume"], 2)
                    self.assertEqual([p.returncode for p in resumed], [0, 0], resumed[0].stderr[-2000:])
                    self.assertEqual(train_losses(out), train_losses(ref))  # bit for bit

    def test_one_process(self):
        ref, out = os.path.join(self.tmp.name, "single_ref"), os.path.join(self.tmp.name, "single")
        self.assertEqual(launch(self.args([], ref)).returncode, 0)
        proc = launch(self.args([], out), env={"GPT_SIGNAL_AT_STEP": str(SIGNAL_AT)})
        self.assertEqual(proc.returncode, PREEMPTED, proc.stderr[-2000:])
        self.assertEqual(launch([*self.args([], out), "--resume"]).returncode, 0)
        self.assertEqual(train_losses(out), train_losses(ref))


if __name__ == "__main__":
    unittest.main()
