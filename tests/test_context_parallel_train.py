"""train.py under context parallelism: every mesh with a cp dimension logs the losses and gradient norms of one
process, sends the ring bytes the theory says, writes checkpoints that know nothing of cp, and refuses bad
context flags in one line.

Each run is a real `python train.py` / `torchrun train.py` on the stand-in corpus of tests/harness.py, with a
2-Block tiny GPT, seq_len 32 (divisible by 2C for C = 2 and 4: the zigzag split cuts each row into 2C chunks) and
M = 2 micro-batches per step (1 under dp=2). Runs are made once and shared by name (`run`, through
tests/harness.WholeRuns); the one-process reference is made in setUpClass.
"""

import unittest

import pytest
import torch

from checkpoints import checkpoint
from model.gpt import GPT, make_config
from plan.theory import (
    cp_p2p_bytes_per_micro_step,
    p2p_bytes_per_step,
    tp_comm_bytes_per_micro_step,
    ulysses_all_to_all_bytes_per_micro_step,
)
from tests.harness import (
    WholeRuns,
    assert_close,
    check_against,
    check_kill_and_resume,
    check_resume_from,
    evals_of,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    rank0_only,
    steps_of,
)
from tests.harness import (
    checkpoint_params as state,
)
from tests.rounding import rounding_rtol_of

STEPS = 10  # the "first 10 losses"
MB, T, C, N_LAYER = 2, 32, 64, 2  # micro-batch, seq_len, n_embd of `tiny`, Blocks
M = 2  # micro-batches per step at dp=1
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    str(N_LAYER),
    "--micro_batch_size",
    str(MB),
    "--seq_len",
    str(T),
    "--total_batch_size",
    str(M * MB * T),
    "--eval_interval",
    "3",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
]  # fixed MFU denominator (see test_train)
CP2 = ["--context_parallel_size", "2"]
DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int, checkpoints: bool = False) -> str:
    """Train once per name (later callers reuse the run); returns its out_dir. Without `checkpoints`,
    --no_checkpoint; with it, a checkpoint every 3 steps (and the final one), all 4 kept: steps 3, 6, 9, 10."""
    saving = ["--checkpoint_interval", "3", "--keep_checkpoints", "4"] if checkpoints else ["--no_checkpoint"]
    return RUNS.run(name, ["--max_steps", str(STEPS), *saving, *flags], nproc)


def cp2_run() -> str:
    """The CP=2 run, with checkpoints at steps 3 and 6: shared by the agreement, bytes and checkpoint tests."""
    return run("cp2", CP2, 2, checkpoints=True)


def ring_bytes(cp: int, dp: int = 1, tp: int = 1, n_layer: int = N_LAYER) -> int:
    """Ring bytes global rank 0 sends per step: the step's M / dp micro-batches, each a forward + backward
    through n_layer ring attentions (parallel.context_parallel.ring.cp_p2p_bytes_per_micro_step)."""
    return M // dp * cp_p2p_bytes_per_micro_step(n_layer, MB, T, C, cp, tp)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestContextParallelAgreesWithOneProcess(unittest.TestCase):
    """Each CP layout's per-step loss, grad_norm and val_loss against one process, over STEPS steps.

    Tolerances (relative): 1e-5 without TP: context parallelism only changes the order fp32 sums are taken in
    (attention's softmax merged block by block in the ring, each row's loss summed over cp shares, gradients
    summed over dp x cp). With TP, which also splits matmul reductions across ranks: 4x how far the one-process
    run itself is from the same run in float64 (tests/rounding.py; measured: 1.2e-6, step 6's grad_norm, so
    4.6e-6; CP x TP's worst is 1.2e-6). A missing sequence-parallel LayerNorm-gradient all-reduce moves CP x TP's
    grad_norm by 1e-2.

    rank 0's comm_bytes["p2p"] (metrics.jsonl is written by rank 0) is its ring traffic every step, plus the
    pipeline's activations under PP.
    """

    @classmethod
    def setUpClass(cls):
        cls.ref = steps_of(run("single", [], 1))
        cls.ref_evals = evals_of(RUNS["single"])

    def check(self, out: str, rtol: float = 1e-5, p2p: int | None = None) -> dict[int, dict]:
        """Losses, grad norms and val losses of the run in `out` within rtol of one process; rank 0's p2p bytes
        equal `p2p` every step."""
        return check_against(self, out, RUNS["single"], STEPS, [0, 3, 6, 9, STEPS], rtol, p2p)

    def test_reference_learns(self):
        self.assertEqual(len(self.ref), STEPS)
        self.assertLess(self.ref[STEPS]["loss"], self.ref[1]["loss"] - 0.3)

    def test_cp2(self):
        self.check(cp2_run(), p2p=ring_bytes(2))

    def test_cp2_p2p_bytes_by_hand(self):
        """The ring's bytes per step of the CP=2 run, counted by hand. One k (or v) block is all of rank 0's heads
        for its T/2 tokens: A = MB x T/2 x n_embd x 4 bytes (fp32) = 2 x 16 x 64 x 4 = 8,192. Per attention,
        forward sends k and v on once (C-1 = 1 move; the block that is fully masked for some queries still
        travels): 2A. Backward sends k, v and their running dK, dV on once (4A), then hands dK, dV home (2A): 6A.
        So 8A = 65,536 per Block, x 2 Blocks = 131,072 per micro-batch, x M = 2 micro-batches = 262,144 per
        step; eval forwards are not counted in any step."""
        by_hand = 8 * (MB * (T // 2) * C * 4) * N_LAYER * M
        self.assertEqual(by_hand, 262_144)
        self.assertEqual(ring_bytes(2), by_hand)
        got = steps_of(cp2_run())
        self.assertEqual([got[s]["comm_bytes"]["p2p"] for s in sorted(got)], [by_hand] * STEPS)

    def test_cp4(self):
        """4 ranks on one ring: rank 0 holds chunks 0 and 7 of 8."""
        self.check(run("cp4", ["--context_parallel_size", "4"], 4), p2p=ring_bytes(4))

    def test_cp_ddp_2x2(self):
        self.check(run("cp_ddp", [*CP2, *DDP2], 4), p2p=ring_bytes(2, dp=2))

    def test_cp_fsdp_2x2(self):
        self.check(
            run("cp_fsdp", [*CP2, "--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 4),
            p2p=ring_bytes(2, dp=2),
        )

    def test_cp_hsdp_2x2(self):
        """HSDP under CP: 2 replicas of a shard group that is dp_shard (1) x cp (2), as torchtitan's dp_shard_cp.
        Parameters are replicated over cp, so FSDP shards them over the cp ranks too: the state per rank is
        4Ψ/2 (fp32 parameters, gradients, AdamW's two moments; Ψ = 4 bytes x the parameter count), plus per
        unit (N_LAYER + 1 of them) at most one padding element in each of those 4 buffers and AdamW's 4-byte
        step counters (at most 2 flat parameters per unit): < 24 bytes a unit. (Measured: 12 bytes in all.)"""
        got = self.check(
            run(
                "cp_hsdp",
                [
                    *CP2,
                    "--data_parallel_size",
                    "2",
                    "--data_parallel_replicate_size",
                    "2",
                    "--data_parallel_type",
                    "fsdp",
                ],
                4,
            ),
            p2p=ring_bytes(2, dp=2),
        )
        with torch.device("meta"):
            psi = 4 * GPT(make_config("tiny", n_layer=N_LAYER)).num_params()
        extra = got[1]["state_bytes"] - 2 * psi
        self.assertGreaterEqual(extra, 0)
        self.assertLess(extra, 24 * (N_LAYER + 1))

    def test_cp_tp_sp_2x2(self):
        """TP with sequence and loss parallelism inside each cp rank's share: SP splits the rank's T/C tokens
        (in their zigzag order) over tp, its all-gathers restore them before attention, and each rank's ring
        carries its n_head / tp heads, so A is n_embd / tp wide. TP's collectives are those of a T/C sequence."""
        got = self.check(
            run("cp_tp", [*CP2, "--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"], 4),
            rtol=rounding_rtol_of(RUNS, "single"),
            p2p=ring_bytes(2, tp=2),
        )
        tp = tp_comm_bytes_per_micro_step(make_config("tiny", n_layer=N_LAYER), MB, T // 2, 2, True, True)
        for kind in ("all_gather", "reduce_scatter"):
            self.assertEqual({got[s]["comm_bytes"][kind] for s in got}, {M * tp[kind]}, kind)

    def test_cp_pp_2x2(self):
        """Rank 0 is pp rank 0: its ring runs through its stage's one Block, and it sends each micro-batch's
        activations on as (MB, T / C, n_embd), this rank's share of the rows."""
        pipeline = p2p_bytes_per_step(2, 1, 0, M, (MB, T // 2, C), element_size=4)
        self.check(
            run("cp_pp", [*CP2, "--pipeline_parallel_size", "2"], 4), p2p=pipeline + ring_bytes(2, n_layer=N_LAYER // 2)
        )


ULYSSES = ["--cp_algorithm", "ulysses"]
BF16 = ["--dtype", "bfloat16", "--param_dtype", "bfloat16"]


def ulysses_bytes(dp: int = 1, tp: int = 1, n_layer: int = N_LAYER, element_size: int = 4) -> int:
    """Ulysses's all-to-all bytes global rank 0 counts per step at C = 2: the step's M / dp micro-batches, each 8
    all-to-alls of A = MB x T/2 x n_embd/tp elements per Block (context_parallel/theory.py)."""
    return M // dp * ulysses_all_to_all_bytes_per_micro_step(n_layer, MB, T, C, 2, tp, element_size)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestUlyssesAgreesWithOneProcess(unittest.TestCase):
    """--cp_algorithm ulysses (parallel/context_parallel/ulysses.py) in the held-out layouts: alone, with TP (4 heads:
    2 a tp rank, 1 a cp rank), FSDP, a pipeline, and DDP in bf16, against one process as the ring's layouts are:
    rtol 1e-5 in fp32 (Ulysses's attention equals one process's bits; only the loss's and the gradients' sums
    over ranks are reordered), TP's rounding_rtol with TP, and bf16 by bench.sweep's rule (every loss and val loss
    and step 1's grad norm within u = 2^-8 of one process in bf16: BF16_RULE). Rank 0's all_to_all bytes equal
    the theory every step (in bf16 at 2 bytes an element: autocast's q, k, v and output), and the ring sends
    nothing (p2p is the pipeline's alone)."""

    @classmethod
    def setUpClass(cls):
        run("single", [], 1)

    def check(self, name: str, flags: list[str], nproc: int, all_to_all: int, rtol: float = 1e-5, p2p: int = 0):
        out = run(name, [*ULYSSES, *CP2, *flags], nproc)
        got = check_against(self, out, RUNS["single"], STEPS, [0, 3, 6, 9, STEPS], rtol)
        for kind, want in (("all_to_all", all_to_all), ("p2p", p2p)):
            self.assertEqual([got[s]["comm_bytes"].get(kind, 0) for s in got], [want] * STEPS, f"{name}: {kind}")
        return got

    def test_cp2(self):
        """By hand: A = MB x T/2 x n_embd x 4 bytes = 8,192; 8A a Block, 2 Blocks, M = 2 micro-batches: 262,144,
        what the ring sends at C = 2 (its 6(C-1)+2 = 8 blocks a Block, fp32 dK and dV)."""
        self.assertEqual(ulysses_bytes(), 8 * (MB * (T // 2) * C * 4) * N_LAYER * M)
        self.assertEqual(ulysses_bytes(), ring_bytes(2))
        self.check("u_cp2", [], 2, ulysses_bytes())

    def test_cp_tp_sp_2x2(self):
        self.check(
            "u_cp_tp",
            ["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"],
            4,
            ulysses_bytes(tp=2),
            rtol=rounding_rtol_of(RUNS, "single"),
        )

    def test_cp_fsdp_2x2(self):
        self.check("u_cp_fsdp", ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 4, ulysses_bytes(dp=2))

    def test_cp_pp_2x2(self):
        """Rank 0, pp rank 0, runs one Block's all-to-alls and sends its activations on as (MB, T / C, n_embd)."""
        pipeline = p2p_bytes_per_step(2, 1, 0, M, (MB, T // 2, C), element_size=4)
        self.check("u_cp_pp", ["--pipeline_parallel_size", "2"], 4, ulysses_bytes(n_layer=N_LAYER // 2), p2p=pipeline)

    def test_cp_ddp_2x2_bf16(self):
        from bench.sweep import BF16_RTOL

        ref = steps_of(run("single_bf16", BF16, 1))
        out = run("u_cp_ddp_bf16", [*ULYSSES, *CP2, *DDP2, *BF16], 4)
        got = steps_of(out)
        self.assertEqual(sorted(got), list(range(1, STEPS + 1)))
        assert_close(self, got, ref, "loss", BF16_RTOL, "u_cp_ddp_bf16")
        assert_close(self, got, ref, "grad_norm", BF16_RTOL, "u_cp_ddp_bf16", steps=[1])
        assert_close(self, evals_of(out), evals_of(RUNS["single_bf16"]), None, BF16_RTOL, "u_cp_ddp_bf16")
        want = ulysses_bytes(dp=2, element_size=2)
        self.assertEqual([got[s]["comm_bytes"]["all_to_all"] for s in got], [want] * STEPS)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestContextParallelCheckpoints(unittest.TestCase):
    """CP checkpoints hold the one-process tensors (parameters are replicated over cp), so they load into any
    layout. References (setUpClass): one process and CP=2, STEPS steps each. Steps 1-3 of a STEPS run are those
    of any run of >= 3 steps (2 warmup steps, then the cosine starts at the peak). Runs resumed from CP=2's step-3
    checkpoint continue to STEPS and are compared with the uninterrupted one-process run at 1e-5. A killed CP=2
    run resumed under CP=2 is bit-equal to the uninterrupted CP=2 run."""

    @classmethod
    def setUpClass(cls):
        cls.single = run("single", [], 1)
        cls.cp = cp2_run()

    def resume(self, name: str, flags: list[str], nproc: int) -> str:
        """A fresh out_dir holding only the CP=2 run's step-3 checkpoint, resumed to STEPS in this layout."""
        out = RUNS.path(name)
        check_resume_from(
            self,
            self.cp,
            3,
            RUNS.args("--max_steps", str(STEPS), *flags),
            nproc,
            out,
            STEPS,
            saved_by="saved by custom pp=1 cp=2 dp=1",
        )
        return out

    def check_resumed(self, out: str, what: str) -> None:
        ref = steps_of(self.single)
        assert_close(self, steps_of(out), ref, "loss", 1e-5, what)
        assert_close(self, steps_of(out), ref, "grad_norm", 1e-5, what)
        assert_close(self, evals_of(out), evals_of(self.single), None, 1e-5, what, steps=[STEPS])

    def test_cp_checkpoint_holds_the_one_process_tensors(self):
        """No tensor is sharded over cp: the step-3 checkpoint lists the model's parameters at full shape, and
        its manifest records the saving layout's cp degree."""
        from model.gpt import GPT, make_config

        model = GPT(make_config("tiny", n_layer=N_LAYER))
        want = {n: p.shape for n, p in model.named_parameters() if n != "lm_head.weight"}
        got = state(checkpoint.step_dir(self.cp, 3))
        self.assertEqual({n: t.shape for n, t in got.items()}, want)
        self.assertEqual(checkpoint.read_manifest(checkpoint.step_dir(self.cp, 3))["layout"]["cp"], 2)

    def test_cp_checkpoint_resumes_in_one_process(self):
        self.check_resumed(self.resume("cp_to_single", [], 1), "CP=2 -> one process")

    def test_cp_checkpoint_resumes_under_ddp(self):
        self.check_resumed(self.resume("cp_to_ddp", DDP2, 2), "CP=2 -> DDP x2")

    def test_kill_and_resume_is_bit_equal(self):
        """CP=2, a checkpoint every 3 steps, rank 1 SIGKILLs itself after step 4 (trainer/faults.py: GPT_KILL_AT_STEP);
        --resume continues from step 3's checkpoint and recomputes step 4. Every step's loss and grad_norm, every
        val_loss and the final checkpoint's parameters equal the uninterrupted CP=2 run's bits
        (tests/harness.check_kill_and_resume)."""
        check_kill_and_resume(
            self,
            RUNS.args("--max_steps", str(STEPS), *CP2),
            2,
            RUNS.path("cp_killed"),
            self.cp,
            STEPS,
            kill_at=4,
            kill_rank=1,
            every=3,
        )


# ----------------------------------------------------------------------------- bad input


def expect_error_in_process(test: unittest.TestCase, flags: list[str], needle: str) -> None:
    """train.main in this process, as one rank (tests/harness.expect_train_error_in_process)."""
    expect_train_error_in_process(test, RUNS.args("--max_steps", "2", *flags), needle, RUNS.path("bad_in_process"))


class TestBadContextFlagsOneRank(unittest.TestCase):
    """One-rank checks, in this process (no torch import per case): each well under a second. The other context
    checks need a world of C ranks to get past the layout check, so they are in TestBadContextFlags."""

    def test_cp_does_not_match_one_rank(self):
        expect_error_in_process(
            self,
            CP2,
            "pipeline_parallel_size (1) x data_parallel_size (1) x "
            "context_parallel_size (2) x tensor_parallel_size (1) = 2 must equal "
            "the world size (1)",
        )

    def test_cp_size_below_one(self):
        expect_error_in_process(self, ["--context_parallel_size", "0"], "--context_parallel_size must be >= 1, got 0")

    def test_unknown_cp_algorithm(self):
        """argparse's own line (its quoting of the choices differs across Python versions)."""
        expect_error_in_process(self, ["--cp_algorithm", "star"], "argument --cp_algorithm: invalid choice: 'star'")


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestBadContextFlags(unittest.TestCase):
    """Forked ranks (tests/harness.forked): every rank exits 2 with exactly its one line
    `train.py: error: ...`, before any work (nothing written).

    Dropout > 0 is refused too (parallel/context_parallel/concept.check_context), but no flag or preset sets
    dropout, so no run can ask for it."""

    def expect_error(self, flags: list[str], needle: str, nproc: int = 2):
        out = RUNS.path(f"bad_{self._testMethodName}")  # a run that wrongly starts fails only its test
        expect_train_error_on_ranks(self, RUNS.args("--max_steps", "2", *flags), needle, nproc, out)

    def test_seq_len_not_divisible_by_2c(self):
        """seq_len 34 is divisible by C = 2 but not by 2C = 4: zigzag cuts each row into 2C chunks."""
        self.expect_error(
            [*CP2, "--seq_len", "34", "--total_batch_size", str(M * MB * 34)],
            "--context_parallel_size 2 needs --seq_len (34) divisible by 2 x 2",
        )

    def test_pytorch_implementation(self):
        self.expect_error(
            [*CP2, "--implementation", "pytorch"],
            "PyTorch's context_parallel rings only the flash, memory-efficient and cuDNN SDPA kernels",
        )

    def test_ulysses_heads_not_divisible_by_tp_x_cp(self):
        """4 heads, tp = 2 takes 2 a rank: C = 2 splits them into 1 each (test_cp_tp_sp_2x2), but 2 heads of 32
        (--n_head 2) leave 1 a tp rank, which 2 cp ranks cannot share."""
        self.expect_error(
            [*ULYSSES, *CP2, "--n_head", "2", "--tensor_parallel_size", "2"],
            "--cp_algorithm ulysses: Ulysses context parallelism needs n_head (2) divisible by "
            "tensor_parallel_size (2) x context_parallel_size (2)",
            nproc=4,
        )


if __name__ == "__main__":
    unittest.main()
