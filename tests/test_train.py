"""The trainer: every layout logs the same losses as one process, and bad input fails in one line.

Each run is a real `python train.py` / `torchrun train.py` on a random-token corpus the test writes.
Tolerances (relative, on the logged per-step losses): 1e-5 for data-parallel layouts, whose only
difference from one process is the order gradients are summed in; 1e-4 for tensor-parallel layouts,
which also split matmul reductions across ranks.
"""

import math
import os
import platform
import subprocess
import sys
import tempfile
import unittest

import pytest

from runtime.metrics import read_jsonl as read_metrics
from tests.harness import ROOT, WholeRuns, forked_ranks, launch_ranks, rank0_only, run_train, shared_data, train_losses

STEPS = 10
TINY = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "512",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "5",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    # a fixed MFU denominator: measuring it takes a timed matmul loop that, on a loaded machine, can end
    # before its first timing (peak 0.0 -> ZeroDivisionError in train_step); the MFU is not tested here
    "--peak_flops",
    "1e12",
]


DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]
RUNS = WholeRuns(TINY)  # TestLayoutsAgree's runs; nothing here uses its scratch folder (no setUpModule)


def assert_close_losses(test: unittest.TestCase, got: list[float], ref: list[float], rtol: float, what: str):
    test.assertEqual(len(got), len(ref), what)
    for s, (a, b) in enumerate(zip(got, ref), start=1):
        test.assertLessEqual(abs(a - b), rtol * abs(b), f"{what}: step {s} loss {a} vs one process {b}")


ALLOCATOR_STEPS = """
import resource, torch
from runtime import allocator
assert allocator.keep_freed_memory()
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
blocks = [torch.ones(128, 50304) for _ in range(3)]  # 3 logit-sized blocks (24.6 MiB each), written, then freed
before = resident()
del blocks
returned = before - resident()
def step():  # the loss's forward: per chunk the logits, their log-softmax, both freed
    for _ in range(4):
        z = torch.ones(128, 50304)
        p = z.log_softmax(-1)
        del z, p
for _ in range(3):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(returned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@unittest.skipUnless(sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc", "glibc's mallopt")
class TestKeepFreedMemory(unittest.TestCase):
    """allocator.keep_freed_memory, which train.py calls on CPU, in a fresh process (mallopt is process-wide): blocks of
    the loss's chunk size that are freed stay resident (glibc's defaults map the first ones afresh and unmap them:
    73.7 MiB handed back for 3), and steady steps of the loss's chunk pattern fault no pages in (10 steps write
    80 x 24.6 MiB, 503,040 pages of 4 KiB; with the threshold fixed but the heap's free top trimmed, as glibc
    does at 128 KiB, 12,512 faults a step)."""

    def test_a_step_reuses_the_memory_the_last_one_freed(self):
        out = subprocess.run(
            [sys.executable, "-c", ALLOCATOR_STEPS],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=True,
        )
        returned, faults = (int(x) for x in out.stdout.split()[-2:])
        self.assertLess(returned, 2**20)  # bytes handed back to the kernel: measured 0
        self.assertLess(faults, 1000)  # < 0.2 % of the pages written: measured 0


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestLayoutsAgree(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ref = cls.run_layout("single", [], 1)

    @classmethod
    def run_layout(cls, name: str, flags: list[str], nproc: int) -> list[float]:
        """Train once per name (a test that needs another's run reuses it): tests/harness.WholeRuns."""
        return train_losses(RUNS.run(name, flags, nproc))

    def check(self, name: str, flags: list[str], nproc: int, rtol: float, impl: str = "pytorch") -> list[float]:
        losses = self.run_layout(name, ["--implementation", impl] + flags, nproc)
        assert_close_losses(self, losses, self.ref, rtol, name)
        return losses

    def test_reference_learns(self):
        self.assertEqual(len(self.ref), STEPS)
        self.assertLess(self.ref[-1], self.ref[0] - 1.0)

    # PyTorch's wrappers
    def test_ddp(self):
        self.check("ddp", DDP2, 2, 1e-5)

    def test_fsdp2(self):
        self.check("fsdp", ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 2, 1e-5)

    def test_fsdp2_deferred_init(self):
        self.check(
            "fsdp_meta", ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--deferred_init"], 2, 1e-5
        )

    def test_tp(self):
        self.check("tp", ["--tensor_parallel_size", "2"], 2, 1e-4)

    def test_tp_loss_parallel_sequence_parallel(self):
        self.check(
            "tp_lp_sp", ["--tensor_parallel_size", "2", "--enable_loss_parallelism", "--sequence_parallel"], 2, 1e-4
        )

    def test_tp_fsdp2_2x2(self):
        self.check(
            "tp_fsdp",
            [
                "--tensor_parallel_size",
                "2",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "fsdp",
                "--deferred_init",
            ],
            4,
            1e-4,
        )

    def test_tp_ddp_2x2(self):
        self.check(
            "tp_ddp",
            [
                "--tensor_parallel_size",
                "2",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "ddp",
                "--enable_loss_parallelism",
            ],
            4,
            1e-4,
        )

    # ours
    def test_custom_ddp_bit_equal_to_torch_ddp(self):
        """Under --profile too (a profiler changes no bits): both ranks write their trace. Rank 0's step-2
        allocated peak opened a second profiler inside torch.profiler's warm-up, and rank 0 died of SIGSEGV
        in the profiler's exit."""
        ours = self.check("custom_ddp", DDP2 + ["--profile", "2"], 2, 1e-5, impl="custom")
        torch_ddp = self.run_layout("ddp", ["--implementation", "pytorch"] + DDP2, 2)
        self.assertEqual(ours, torch_ddp)  # same bits, step for step
        traces = os.listdir(os.path.join(RUNS["custom_ddp"], "profile"))
        self.assertEqual(len([f for f in traces if f.endswith(".pt.trace.json")]), 2, traces)

    def test_custom_fsdp_equals_fsdp2_and_deferred_init(self):
        fsdp = ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"]
        ours = self.check("custom_fsdp", fsdp, 2, 1e-5, impl="custom")
        meta = self.check("custom_fsdp_meta", fsdp + ["--deferred_init"], 2, 1e-5, impl="custom")
        self.assertEqual(meta, ours)  # deferred init is bit-identical to eager init
        assert_close_losses(
            self, ours, self.run_layout("fsdp", ["--implementation", "pytorch"] + fsdp, 2), 1e-6, "custom FSDP vs FSDP2"
        )
        assert_close_losses(
            self,
            ours,
            self.run_layout("ddp", ["--implementation", "pytorch"] + DDP2, 2),
            1e-6,
            "custom FSDP vs torch DDP",
        )

    def test_custom_tp_fsdp_2x2_sequence_parallel_deferred(self):
        self.check(
            "custom_tp_fsdp",
            [
                "--tensor_parallel_size",
                "2",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "fsdp",
                "--sequence_parallel",
                "--deferred_init",
                "--enable_loss_parallelism",
            ],
            4,
            1e-4,
            impl="custom",
        )

    def test_custom_tp(self):
        self.check("custom_tp", ["--tensor_parallel_size", "2"], 2, 1e-4, impl="custom")

    def test_custom_tp_loss_parallel(self):
        self.check("custom_tp_lp", ["--tensor_parallel_size", "2", "--enable_loss_parallelism"], 2, 1e-4, impl="custom")

    def test_custom_tp_sequence_parallel_deferred(self):
        self.check(
            "custom_tp_sp",
            ["--tensor_parallel_size", "2", "--sequence_parallel", "--deferred_init"],
            2,
            1e-4,
            impl="custom",
        )

    def test_custom_tp_ddp_2x2(self):
        self.check(
            "custom_tp_ddp",
            [
                "--tensor_parallel_size",
                "2",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "ddp",
                "--sequence_parallel",
                "--enable_loss_parallelism",
            ],
            4,
            1e-4,
            impl="custom",
        )


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestMetrics(unittest.TestCase):
    def test_metrics_jsonl_fields_and_val(self):
        with tempfile.TemporaryDirectory() as tmp:
            data = shared_data()
            out = os.path.join(tmp, "run")
            proc = run_train(TINY + ["--dataset", data, "--out_dir", out, "--max_steps", "4"])
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            records = read_metrics(out)
            steps = [r for r in records if "loss" in r]
            evals = [r for r in records if "val_loss" in r]
            self.assertEqual([r["step"] for r in steps], [1, 2, 3, 4])
            for r in steps:
                self.assertTrue({"step", "loss", "lr", "grad_norm", "step_time_ms", "tokens_per_sec"} <= r.keys())
            self.assertEqual([r["step"] for r in evals], [0, 4])
            self.assertTrue(any(f.startswith("events.out.tfevents") for f in os.listdir(out)))
            # the schedule, every logged step: linear warmup over W=2 steps to 3e-3, then cosine to 10% of it
            # at max_steps M=4: lr(s) = lr*s/W for s <= W, else lr*(0.1 + 0.45*(1 + cos(pi*(s-1-W)/(M-W))))
            lr, warmup, max_steps = 3e-3, 2, 4
            for r in steps:
                s = r["step"]
                want = (
                    lr * s / warmup
                    if s <= warmup
                    else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - 1 - warmup) / (max_steps - warmup))))
                )
                self.assertAlmostEqual(r["lr"], want, delta=1e-12, msg=f"step {s}")
            for got, by_hand in zip([r["lr"] for r in steps], [1.5e-3, 3e-3, 3e-3, 1.65e-3]):  # the same, by hand
                self.assertAlmostEqual(got, by_hand, delta=1e-12)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestBadInput(unittest.TestCase):
    """Each case: exit code 2, exactly one line on stderr naming the problem, nothing written."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = shared_data()
        cls.out = os.path.join(cls.tmp.name, "out")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def expect_error(
        self, flags: list[str], needle: str, nproc: int = 1, dataset: str | None = None, launched: bool = False
    ):
        """Ranks forked from the session's fork server (tests/harness.forked: each rank's own exit code and stderr,
        no agent stopping the others), or with `launched` as a user starts them: `python train.py` for one rank,
        more started by hand as torchrun would start them (torchrun's agent SIGTERMs the slower ranks as soon as
        one exits, so their own exit codes and lines could not be checked). Every rank exits 2 with exactly its
        one line."""
        args = TINY + ["--dataset", dataset or self.data, "--out_dir", self.out] + flags
        if not launched:
            ranks = forked_ranks(args, nproc)
        else:
            ranks = [run_train(args)] if nproc == 1 else launch_ranks(args, nproc)
        for rank, proc in enumerate(ranks):
            self.assertEqual(proc.returncode, 2, f"rank {rank}: {proc.stderr}")
            lines = proc.stderr.splitlines()
            self.assertEqual(len(lines), 1, f"rank {rank}: {proc.stderr}")  # one line: no usage, no traceback
            self.assertTrue(lines[0].startswith("train.py: error: "), f"rank {rank}: {lines[0]}")
            self.assertEqual(lines[0].count("train.py: error:"), 1, f"rank {rank}: {lines[0]}")
            self.assertIn(needle, lines[0], f"rank {rank}")
        self.assertFalse(os.path.exists(os.path.join(self.out, "metrics.jsonl")))

    def test_world_size_mismatch(self):
        self.expect_error(["--data_parallel_size", "2", "--data_parallel_type", "ddp"], "must equal the world size")

    def test_world_size_mismatch_on_every_rank(self):
        self.expect_error(
            ["--tensor_parallel_size", "2", "--data_parallel_size", "2", "--data_parallel_type", "ddp"],
            "must equal the world size (2)",
            nproc=2,
            launched=True,
        )

    def test_heads_not_divisible_by_tp(self):
        self.expect_error(
            ["--tensor_parallel_size", "2", "--n_head", "1", "--implementation", "pytorch"],
            "n_head (1) is not divisible",
            nproc=2,
        )

    def test_n_embd_not_divisible_by_heads(self):
        self.expect_error(["--n_head", "3"], "divisible by n_head")

    def test_missing_dp_type(self):
        self.expect_error(["--data_parallel_size", "2"], "--data_parallel_type", nproc=2)

    def test_batch_does_not_divide(self):
        self.expect_error(["--total_batch_size", "500"], "not divisible")

    def test_seq_len_over_block_size(self):
        self.expect_error(["--seq_len", "2048"], "exceeds the model's block_size")

    def test_unknown_preset(self):
        self.expect_error(["--model", "gpt5"], "unknown model preset", launched=True)

    def test_missing_data_names_the_command(self):
        empty = os.path.join(self.tmp.name, "no_bins")
        os.makedirs(empty, exist_ok=True)
        self.expect_error([], "prepare it with: python data/openwebtext/prepare.py --input", dataset=empty)
        self.expect_error([], "python data/openwebtext/prepare.py", dataset=os.path.join(self.tmp.name, "nowhere"))
        from data.batches import prepare_hint

        self.assertEqual(prepare_hint("shakespeare"), "python data/shakespeare/prepare.py")

    def test_empty_and_corrupt_bins(self):
        for name, content, needle in (
            ("empty", b"", "is empty"),
            ("odd", b"\x01\x02\x03", "not a whole number"),
            ("oov", b"\xff\xff" * 5000, ">= vocab size"),
        ):
            d = os.path.join(self.tmp.name, name)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "train.bin"), "wb") as f:
                f.write(content)
            with open(os.path.join(d, "val.bin"), "wb") as f:
                f.write(b"\x01\x00" * 5000)
            with self.subTest(name):
                self.expect_error([], needle, dataset=d)

    def test_existing_run_is_not_overwritten(self):
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, "metrics.jsonl")
        with open(path, "w") as f:
            f.write('{"step": 1, "loss": 1.0}\n')
        try:
            proc = forked_ranks(TINY + ["--dataset", self.data, "--out_dir", self.out])[0]
            self.assertEqual(proc.returncode, 2)
            self.assertIn("already holds a run", proc.stderr)
            with open(path) as f:
                self.assertEqual(f.read(), '{"step": 1, "loss": 1.0}\n')
        finally:
            os.remove(path)


if __name__ == "__main__":
    unittest.main()
