"""train.py with --fp8: one process's FP8 is torchao's (its twin, --implementation pytorch) and every layout that
holds the scaled operands whole (DDP, ZeRO-1/2, FSDP, a pipeline) logs one process's losses, gradient norms and
val losses bit for bit, at the same micro-batch size (a tensorwise activation scale is the micro-batch's amax);
FP8 is a compute format (a checkpoint resumes with --fp8 switched); bad --fp8 input is one line, exit 2.

Each run is a real train.py on the stand-in corpus of tests/harness.py: a 2-Block tiny GPT (n_embd 64: every
Block linear a multiple of 16), micro-batches of MB x T = 64 tokens, M = 2 micro-batches per step at dp=1 (1 under
dp=2), STEPS steps; runs are shared by name (tests/harness.WholeRuns).
"""

import unittest

import pytest

from tests.harness import (
    WholeRuns,
    assert_close,
    check_against,
    check_resume_from,
    evals_of,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    rank0_only,
    steps_of,
)

STEPS = 4
MB, T, M = 2, 32, 2
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--micro_batch_size",
    str(MB),
    "--seq_len",
    str(T),
    "--total_batch_size",
    str(M * MB * T),
    "--eval_interval",
    "2",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "1",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    "--max_steps",
    str(STEPS),
]
EVALS = [0, 2, STEPS]
FP8 = ["--fp8", "tensorwise"]
SAVING = ["--checkpoint_interval", "2", "--keep_checkpoints", "2"]

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int = 1, saving: list[str] | None = None) -> str:
    return RUNS.run(name, [*(saving or ["--no_checkpoint"]), *flags], nproc)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestFp8AgreesWithOneProcess(unittest.TestCase):
    """Bit for bit (rtol 0): DDP and FSDP (ZeRO-1/2 too: the sweep's rows) give every rank whole micro-batches and
    whole weights (FSDP casts the all-gathered weight), so each cast sees one process's values; an fp32 sum of 2
    addends is the same in either order, so the 2 ranks' gradient sums are one process's and the weights stay
    equal. A pipeline stage holds whole Blocks (test_pipeline: its tolerance)."""

    @classmethod
    def setUpClass(cls):
        cls.ref = run("fp8", FP8, saving=SAVING)

    def check(self, name: str, flags: list[str], nproc: int, rtol: float = 0.0) -> None:
        check_against(self, run(name, [*FP8, *flags], nproc), self.ref, STEPS, EVALS, rtol)

    def test_fp8_is_on(self):
        """FP8's rounding moves the loss from the fp32 run's: the flag reaches the Blocks' linears."""
        plain, fp8 = steps_of(run("fp32", [])), steps_of(self.ref)
        self.assertEqual(plain[1]["loss"] == fp8[1]["loss"], False)
        self.assertLess(abs(plain[STEPS]["loss"] - fp8[STEPS]["loss"]), 0.05 * plain[STEPS]["loss"])

    def test_torchao_twin(self):
        """--implementation pytorch: torchao's Float8Linear, bit for bit ours (tests/test_fp8.py, per GEMM)."""
        check_against(self, run("fp8_torchao", [*FP8, "--implementation", "pytorch"]), self.ref, STEPS, EVALS, 0.0)

    def test_ddp(self):
        self.check("ddp", ["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 2)

    def test_fsdp(self):
        self.check("fsdp", ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 2)

    def test_pipeline(self):
        """Within the sweep's fp32 tolerance (bench/sweep.FP32_RTOL, 1e-5), not bit for bit: the tied embedding's
        gradient is summed over the first and last stage in another order than one process's backward sums it,
        and a weight one fp32 rounding off can land on the other side of an FP8 rounding boundary (measured:
        1.9e-6 in the sweep's pp rows)."""
        self.check("pp", ["--pipeline_parallel_size", "2"], 2, rtol=1e-5)

    def test_context_parallel_first_step(self):
        """CP cuts each sequence's tokens: x's and dy's amaxes are all-reduced MAX over the cp group
        (parallel/fp8/layouts.py), so step 1 (one process's weights) casts one process's values and its loss,
        grad norm and the val loss before it are within the fp32 tolerance of CP's own rows (1e-5: the ring's
        softmax merge and the token-split weight gradient reorder fp32 sums). Later steps are not compared yet:
        AdamW's first updates turn those reorderings into lr-sized moves of near-zero-gradient weights, which FP8
        rounds to whole FP8 steps, and no bound on that is derived (measured: 7.8e-5 by step 3 in the sweep)."""
        got, want = steps_of(run("cp", [*FP8, "--context_parallel_size", "2"], 2)), steps_of(self.ref)
        for key in ("loss", "grad_norm"):
            assert_close(self, got, want, key, 1e-5, "cp", [1])
        assert_close(self, evals_of(RUNS["cp"]), evals_of(self.ref), None, 1e-5, "cp", [0])

    def test_resume(self):
        """Resumed from step 2 with --fp8, the run is the uninterrupted one bit for bit; with --fp8 switched off it
        resumes too (FP8 is a compute format: the checkpoint holds fp32 master weights and AdamW's state only)
        and its steps are FP8-free (step 3's loss is not FP8's)."""
        check_resume_from(self, self.ref, 2, RUNS.args(*FP8), 1, RUNS.path("resumed_fp8"), STEPS)
        got, want = steps_of(RUNS.path("resumed_fp8")), steps_of(self.ref)
        for key in ("loss", "grad_norm"):
            assert_close(self, got, want, key, 0.0, "resumed with --fp8")
        assert_close(self, evals_of(RUNS.path("resumed_fp8")), evals_of(self.ref), None, 0.0, "resumed", [STEPS])
        check_resume_from(self, self.ref, 2, RUNS.args(), 1, RUNS.path("resumed_plain"), STEPS)
        self.assertNotEqual(steps_of(RUNS.path("resumed_plain"))[3]["loss"], steps_of(self.ref)[3]["loss"])


class TestFp8Refusals(unittest.TestCase):
    """One line, exit 2, before any work."""

    def expect(self, flags: list[str], needle: str) -> None:
        expect_train_error_in_process(self, RUNS.args(*flags), needle, RUNS.path("refused"))

    def test_float16(self):
        self.expect([*FP8, "--dtype", "float16"], "--fp8 with --dtype float16")

    def test_not_a_multiple_of_16(self):
        self.expect([*FP8, "--n_embd", "40", "--n_head", "2"], "multiples of 16")

    def test_tokens_per_call(self):
        self.expect([*FP8, "--seq_len", "20", "--total_batch_size", "80"], "token rows per call")

    def test_unknown_recipe(self):
        self.expect(["--fp8", "mxfp8"], "invalid choice")

    @pytest.mark.slow
    @unittest.skipUnless(rank0_only(), "launches its own ranks")
    def test_cut_layouts_on_every_rank(self):
        """TP cuts the weights a scale spans: refused on both ranks until its amax all-reduce is built (torchao's
        twin would need its Float8 TP styles, and says so); torchao under CP scales by each rank's own amax."""
        for flags, needle in (
            (["--tensor_parallel_size", "2"], "amax all-reduce is not built"),
            (["--tensor_parallel_size", "2", "--implementation", "pytorch"], "Float8 TP styles"),
            (["--context_parallel_size", "2", "--implementation", "pytorch"], "use --implementation custom"),
        ):
            expect_train_error_on_ranks(self, [*RUNS.args(*FP8), *flags], needle, 2, RUNS.path("refused"))
