"""train.py under pipeline parallelism: every schedule and every mesh with a pp dimension logs the losses and
gradient norms of one process, sends the activation bytes the theory says, checkpoints across PP layouts, and
refuses bad pipeline flags in one line.

Each run is a real `python train.py` / `torchrun train.py` on the stand-in corpus of tests/harness.py, with a
4-Block tiny GPT (so P=4, and P=2 with V=2 chunks per rank, give every chunk a Block) and M = 4 micro-batches
per step (2 under dp=2). Runs are made once and shared by name (`run`; tests/harness.WholeRuns: a run identical
to another file's, such as the one-process reference of test_activation_checkpointing, is trained once); the
one-process references are made in setUpClass.
"""

import contextlib
import io
import os
import shutil
import unittest

import pytest
import torch

from checkpoints import checkpoint
from model.gpt import GPT, make_config
from plan.theory import p2p_bytes_per_step
from runtime.metrics import read_jsonl
from tests.harness import (
    WholeRuns,
    assert_close,
    check_against,
    check_kill_and_resume,
    check_resume_from,
    evals_of,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    forked,
    rank0_only,
    steps_of,
)
from tests.harness import (
    checkpoint_params as state,
)
from tests.rounding import rounding_rtol_of

STEPS, SHORT = 6, 6  # SHORT: the checkpoint runs, the 8-rank 3D run; STEPS: shared with AC and zero-bubble tests
MB, T, C, N_LAYER, M = 2, 32, 64, 4, 4  # micro-batch, seq_len, n_embd of `tiny`, Blocks, micro-batches per step
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
    "5",
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
PP2 = ["--pipeline_parallel_size", "2"]
INTERLEAVED = [*PP2, "--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"]
TP2_SP = ["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"]
DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int, steps: int = STEPS, checkpoints: bool = False) -> str:
    """Train once per name (later callers reuse the run); returns its out_dir. Without `checkpoints`,
    --no_checkpoint; with it, a checkpoint every 3 steps (and the final one)."""
    saving = ["--checkpoint_interval", "3"] if checkpoints else ["--no_checkpoint"]
    return RUNS.run(name, ["--max_steps", str(steps), *saving, *flags], nproc)


def expected_p2p(pp: int, virtual: int, dp: int, seq_shard: int) -> int:
    """Bytes global rank 0 (pp rank 0 of the (pp, dp, tp) mesh) sends per step: fp32 activations
    (mb, T / seq_shard, C) of each of the step's M / dp micro-batches."""
    return p2p_bytes_per_step(pp, virtual, 0, M // dp, (MB, T // seq_shard, C), element_size=4)


def params_on_meta(name: str) -> int:
    """Parameters on meta when train.py's parallelize got run `name`'s model (rank 0's build record)."""
    return next(r for r in read_jsonl(RUNS[name]) if "params_on_meta" in r)["params_on_meta"]


def tp_rtol(ref: str = "single") -> float:
    """Relative tolerance of TP layouts against the one-process run `ref`: its float32 rounding measured against
    float64 (tests/rounding.py); see TestPipelineAgreesWithOneProcess."""
    return rounding_rtol_of(RUNS, ref)


def n_params() -> int:
    with torch.device("meta"):
        return GPT(make_config("tiny", n_layer=N_LAYER)).num_params()


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestPipelineAgreesWithOneProcess(unittest.TestCase):
    """Each PP layout's per-step loss, grad_norm and val_loss against one process, over STEPS steps.

    Tolerances (relative), losses and grad norms: 1e-5 without TP: a pipeline only changes the order fp32 sums
    are taken in (the tied embedding's gradient is summed per stage, then over [first, last]; FSDP sums the
    micro-batches' reduce-scattered shards). With TP, which also splits matmul reductions across ranks:
    tp_rtol(), 4x how far the one-process run itself is from the same run in float64 (measured: 1.0e-6, step 3's
    grad_norm, so 4.1e-6; the TP layouts' worst is 3.6e-6, torch_pp_tp's grad_norm at that step). A missing
    sequence-parallel LayerNorm-gradient all-reduce moves PP x TP's grad_norm by 3e-2.
    The norm itself is accumulated in fp64 (parallel/grads.py): in fp32 it was off by up to 1.3e-3 on this run's
    3.2M-element embedding gradient, by a different amount per layout. The PyTorch twin
    (torch.distributed.pipelining) runs the same cut and is held to the same tolerances.

    rank 0's comm_bytes["p2p"] (it is pp rank 0: metrics.jsonl is written by rank 0) must equal
    parallel.pipeline.runner.p2p_bytes_per_step every step.
    """

    @classmethod
    def setUpClass(cls):
        cls.ref = steps_of(run("single", [], 1))
        cls.ref_evals = evals_of(RUNS["single"])

    def check(
        self,
        name: str,
        flags: list[str],
        nproc: int,
        rtol: float = 1e-5,
        steps: int = STEPS,
        ref: str = "single",
        p2p: int | None = None,
    ) -> dict[int, dict]:
        """Losses, grad norms and val losses within rtol of the one-process run `ref` (check_against); rank 0's
        p2p bytes equal `p2p` every step."""
        out = run(name, flags, nproc, steps, checkpoints=False)
        return check_against(self, out, RUNS[ref], steps, [0, 5, steps] if steps > 5 else [0, steps], rtol, p2p)

    def test_reference_learns(self):
        self.assertEqual(len(self.ref), STEPS)
        self.assertLess(self.ref[STEPS]["loss"], self.ref[1]["loss"] - 0.5)

    def test_p2_gpipe(self):
        self.check("gpipe", [*PP2, "--pp_schedule", "gpipe"], 2, p2p=expected_p2p(2, 1, 1, 1))

    def test_p2_1f1b(self):
        self.check("1f1b", PP2, 2, p2p=expected_p2p(2, 1, 1, 1))

    def test_schedules_reorder_work_only(self):
        """GPipe and 1F1B cut the model alike and each chunk runs its backwards in micro-batch order 0..M-1, so
        every gradient accumulates in the same order: the same bits, step for step. What tells them apart is
        what rank 0 holds: GPipe runs all M forwards before any backward, so it stores M micro-batches' activations
        at its peak; 1F1B at most P - rank of them (capped at M): 2 on rank 0 of P = 2 (pp_peak_in_flight)."""
        gpipe = steps_of(run("gpipe", [*PP2, "--pp_schedule", "gpipe"], 2))
        one_f_one_b = steps_of(run("1f1b", PP2, 2))
        assert_close(self, gpipe, one_f_one_b, "loss", 0, "gpipe vs 1f1b")
        assert_close(self, gpipe, one_f_one_b, "grad_norm", 0, "gpipe vs 1f1b")
        P, rank = 2, 0
        self.assertEqual([gpipe[s]["pp_peak_in_flight"] for s in sorted(gpipe)], [M] * STEPS, "gpipe")
        self.assertEqual(
            [one_f_one_b[s]["pp_peak_in_flight"] for s in sorted(one_f_one_b)], [min(P - rank, M)] * STEPS, "1f1b"
        )

    def test_p2_interleaved_v2(self):
        # rank 0 holds chunks 0 and 2: both send activations on, chunk 2 also sends its input gradient back
        self.assertEqual(expected_p2p(2, 2, 1, 1), 3 * 4 * MB * T * C * 4)
        self.check("interleaved", INTERLEAVED, 2, p2p=expected_p2p(2, 2, 1, 1))

    def test_p4_1f1b(self):
        self.check("p4", ["--pipeline_parallel_size", "4"], 4, p2p=expected_p2p(4, 1, 1, 1))

    def test_pp_ddp_2x2(self):
        self.check("pp_ddp", [*PP2, *DDP2], 4, p2p=expected_p2p(2, 1, 2, 1))

    def test_pp_tp_sequence_parallel_2x2(self):
        """Under sequence parallelism the stages hand over sequence shards: (mb, T / tp, C)."""
        self.check("pp_tp_sp", [*PP2, *TP2_SP], 4, rtol=tp_rtol(), p2p=expected_p2p(2, 1, 1, 2))

    def test_pp_fsdp_2x2_interleaved_deferred(self):
        """Our FSDP under the pipeline: each stage's units sharded over dp (the tied matrix in a unit of its own
        on both ends), reduce-scattered per micro-batch; interleaved V=2 and deferred init on top."""
        self.check(
            "pp_fsdp",
            [*PP2, "--data_parallel_size", "2", "--data_parallel_type", "fsdp"],
            4,
            p2p=expected_p2p(2, 1, 2, 1),
        )
        self.check(
            "pp_fsdp_interleaved",
            [*INTERLEAVED, "--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--deferred_init"],
            4,
        )
        self.assertEqual(params_on_meta("pp_fsdp_interleaved"), n_params(), "deferred: all on meta")

    def test_pytorch_twin_schedules(self):
        """torch.distributed.pipelining runs on gloo: each schedule on the same cut."""
        for name, flags in (("gpipe", [*PP2, "--pp_schedule", "gpipe"]), ("1f1b", PP2), ("interleaved", INTERLEAVED)):
            with self.subTest(name):
                self.check(f"torch_{name}", [*flags, "--implementation", "pytorch"], 2)

    def test_pytorch_twin_with_ddp_fsdp2_tp(self):
        """The twin composed with torch's DDP and FSDP2 (per chunk module) and DTensor TP."""
        for name, flags in (
            ("ddp", DDP2),
            ("fsdp2", ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"]),
            ("tp", ["--tensor_parallel_size", "2"]),
        ):
            with self.subTest(name):
                self.check(
                    f"torch_pp_{name}",
                    [*PP2, *flags, "--implementation", "pytorch"],
                    4,
                    rtol=tp_rtol() if name == "tp" else 1e-5,
                )

    def test_3d_pp_ddp_tp_2x2x2(self):
        """8 ranks on this machine's cores: SHORT steps (references of the same length: the cosine lr
        schedule depends on --max_steps)."""
        run("single_short", [], 1, SHORT, checkpoints=True)  # shared with TestPipelineCheckpoints
        rtol = tp_rtol("single_short")
        self.check(
            "3d", [*PP2, *DDP2, *TP2_SP], 8, rtol=rtol, steps=SHORT, ref="single_short", p2p=expected_p2p(2, 1, 2, 2)
        )
        # the twin: torch.distributed.pipelining x torch DDP (per chunk) x DTensor TP (no SP/LP under it)
        self.check(
            "torch_3d",
            [*PP2, *DDP2, "--tensor_parallel_size", "2", "--implementation", "pytorch"],
            8,
            rtol=rtol,
            steps=SHORT,
            ref="single_short",
        )

    def test_deferred_init(self):
        """Each stage materialises only its own chunks on meta, with the eager init's values: bit-equal to
        the eager P=2 run (and so within 1e-5 of one process). That it was deferred: every parameter was on
        meta when parallelize got the model (params_on_meta), and none under eager init."""
        got = self.check("1f1b_deferred", [*PP2, "--deferred_init"], 2)
        eager = steps_of(run("1f1b", PP2, 2))
        self.assertEqual((params_on_meta("1f1b_deferred"), params_on_meta("1f1b")), (n_params(), 0))
        assert_close(self, got, eager, "loss", 0, "deferred vs eager")
        assert_close(self, got, eager, "grad_norm", 0, "deferred vs eager")


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestPipelineCheckpoints(unittest.TestCase):
    """PP checkpoints hold every stage's tensors under the one-process names, so they load into any layout.

    References (setUpClass): one process and P=2 1F1B, SHORT steps each, saving at steps 3 and 6. Steps 1-3
    of a SHORT run are those of any run of >= 3 steps (2 warmup steps, then the cosine starts at the peak), so
    the step-3 checkpoint is the one a --max_steps 3 run saves. Resumed runs continue to step SHORT and are
    compared with the uninterrupted one-process run at 1e-5 (tp_rtol("single_short") with TP), as in
    TestPipelineAgreesWithOneProcess: a PP checkpoint is not bit-equal to one process's (the pipeline sums
    the tied embedding's gradient and the norm's squares in another order; after 3 AdamW steps the weights
    differ in the last bits, most in the attention key biases, whose gradient is rounding noise in exact
    arithmetic). A killed P=2 run resumed under P=2 is bit-equal to the uninterrupted P=2 run.
    """

    @classmethod
    def setUpClass(cls):
        cls.single = run("single_short", [], 1, SHORT, checkpoints=True)
        cls.pp = run("pp_short", PP2, 2, SHORT, checkpoints=True)

    def resume(self, name: str, source: str, flags: list[str], nproc: int) -> str:
        """A fresh out_dir holding only `source`'s step-3 checkpoint, resumed to SHORT in this layout."""
        out = RUNS.path(name)
        check_resume_from(self, source, 3, RUNS.args("--max_steps", str(SHORT), *flags), nproc, out, SHORT)
        return out

    def check_resumed(self, out: str, rtol: float, what: str) -> None:
        """Losses, grad norms and val losses within rtol of one process. The grad norm under TP too: without the
        sequence-parallel LayerNorm-gradient all-reduce, P=2 -> PP x TP-SP's losses move by only 6e-7 (val_loss
        1.2e-6) but its grad_norm by 9e-3."""
        ref = steps_of(self.single)
        assert_close(self, steps_of(out), ref, "loss", rtol, what)
        assert_close(self, steps_of(out), ref, "grad_norm", rtol, what)
        assert_close(self, evals_of(out), evals_of(self.single), None, rtol, what, steps=[5, SHORT])

    def test_pp_weights_match_one_process(self):
        """The step-3 checkpoints of P=2 and one process list the same tensors (lm_head's copy of the tied
        embedding is not written) and hold the same weights up to rounding: ||a - b|| / ||b|| <= 1e-6 over the
        whole model (measured: 2.2e-7; the worst tensor is an attention key bias)."""
        a, b = state(checkpoint.step_dir(self.pp, 3)), state(checkpoint.step_dir(self.single, 3))
        self.assertEqual(sorted(a), sorted(b))
        self.assertNotIn("lm_head.weight", a)
        for name in a:
            self.assertEqual(a[name].shape, b[name].shape, name)
        diff = sum(float((a[n].double() - b[n].double()).norm() ** 2) for n in a) ** 0.5
        self.assertLessEqual(diff, 1e-6 * sum(float(b[n].double().norm() ** 2) for n in b) ** 0.5)
        self.assertEqual(checkpoint.read_manifest(checkpoint.step_dir(self.pp, 3))["layout"]["pp"], 2)

    def test_pp_checkpoint_resumes_in_one_process(self):
        self.check_resumed(self.resume("pp_to_single", self.pp, [], 1), 1e-5, "P=2 -> one process")

    def test_pp_checkpoint_resumes_under_pp_tp(self):
        self.check_resumed(
            self.resume("pp_to_pp_tp", self.pp, [*PP2, *TP2_SP], 4), tp_rtol("single_short"), "P=2 -> PP x TP-SP"
        )

    def test_pp_checkpoint_resumes_interleaved(self):
        """Another cut of the Blocks: rank 0 holds Blocks 0 and 2, rank 1 Blocks 1 and 3."""
        self.check_resumed(self.resume("pp_to_interleaved", self.pp, INTERLEAVED, 2), 1e-5, "P=2 -> interleaved")

    def test_one_process_checkpoint_resumes_under_pp(self):
        self.check_resumed(self.resume("single_to_pp", self.single, PP2, 2), 1e-5, "one process -> P=2")

    def test_kill_and_resume_is_bit_equal(self):
        """P=2, a checkpoint every 2 steps, rank 1 (the last stage) SIGKILLs itself after step 3 (trainer/faults.py:
        GPT_KILL_AT_STEP); --resume continues from step 2's checkpoint and recomputes step 3. Every step's loss
        and grad_norm, every val_loss and the final checkpoint's parameters equal the uninterrupted P=2 run's
        bits (tests/harness.check_kill_and_resume)."""
        check_kill_and_resume(
            self,
            RUNS.args("--max_steps", str(SHORT), *PP2),
            2,
            RUNS.path("pp_killed"),
            self.pp,
            SHORT,
            kill_at=3,
            kill_rank=1,
            every=2,
        )

    def test_resume_under_another_split_is_bit_equal(self):
        """pp_short runs the cost model's split, Blocks [0-2] | [3] (tiny's 50304-way head outweighs its 4 Blocks:
        tests/test_pipeline_partition.py); its step-3 checkpoint resumed under --pp_layers_per_stage 1,3 logs steps 4-6
        with the same bits (loss, grad_norm, val_loss) and saves a final checkpoint equal to pp_short's, each rank
        writing exactly its own Blocks. A split changes which rank runs a Block, not what it computes; the one sum
        it regroups, the norm's squares (fp64, per stage, then over pp), rounds to the same fp32 norm and clip
        coefficient unless its ~1e-16 relative change straddles an fp32 rounding boundary."""
        out = RUNS.path("pp_resplit")
        shutil.copytree(checkpoint.step_dir(self.pp, 3), checkpoint.step_dir(out, 3))
        proc = forked(
            RUNS.args("--max_steps", str(SHORT), *PP2, "--pp_layers_per_stage", "1,3", "--out_dir", out, "--resume"), 2
        )
        self.assertEqual(proc.returncode, 0, f"{proc.stdout[-2000:]}\n" + "\n".join(e[-3000:] for e in proc.stderr))
        self.assertIn(
            "pipeline partition by --pp_layers_per_stage (training FLOPs per token): chunk 0 Block 0 (", proc.stdout
        )
        got, want = steps_of(out), steps_of(self.pp)
        self.assertEqual(sorted(got), [4, 5, SHORT])
        self.assertEqual(
            [(got[s]["loss"], got[s]["grad_norm"]) for s in got], [(want[s]["loss"], want[s]["grad_norm"]) for s in got]
        )
        self.assertEqual(evals_of(out), {s: evals_of(self.pp)[s] for s in (5, SHORT)})
        final, wanted = state(checkpoint.newest(out)), state(checkpoint.newest(self.pp))
        self.assertEqual(final.keys(), wanted.keys())
        for name, p in final.items():
            self.assertTrue(torch.equal(p, wanted[name]), name)

        def blocks_written(path: str) -> dict[int, set[int]]:
            return {
                r: {
                    int(k.split(".")[2])
                    for k in torch.load(os.path.join(path, f"rank_{r:05d}.pt"), weights_only=True, mmap=True)
                    if k.startswith("transformer.h.")
                }
                for r in range(2)
            }

        self.assertEqual(blocks_written(checkpoint.step_dir(self.pp, 3)), {0: {0, 1, 2}, 1: {3}})
        self.assertEqual(blocks_written(checkpoint.newest(out)), {0: {0}, 1: {1, 2, 3}})

    def test_loaded_pp_checkpoint_gives_the_logged_val_loss(self):
        """checkpoint.load_model assembles the P=2 run's final checkpoint into one GPT whose loss on the eval
        batch (train.evaluate's micro-batches) is the val_loss the pipeline logged at that step."""
        from data.batches import BatchSource

        model = checkpoint.load_model(checkpoint.newest(self.pp)).eval()
        data = BatchSource(RUNS.data, T, model.config.vocab_size, 1337)
        n = 2  # --eval_iters
        with torch.no_grad():
            losses = [model(*data.get("val", 0, n * MB, chunk, MB))[1] for chunk in range(n)]
        got = float(sum(losses) / n)
        want = evals_of(self.pp)[SHORT]
        self.assertLessEqual(abs(got - want), 1e-6 * abs(want), f"{got} vs logged {want}")

    def test_sample_and_export_read_a_pp_checkpoint(self):
        """sample.py samples from the P=2 run's checkpoint (the same text twice for one seed); export.py writes
        it as HF safetensors whose tensors read back are the checkpoint's, bit for bit."""
        from safetensors.torch import load_file

        import export
        import sample
        from model.gpt import GPT

        def sample_text() -> str:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = sample.main(
                    [
                        "--out_dir",
                        self.pp,
                        "--device",
                        "cpu",
                        "--num_samples",
                        "2",
                        "--max_new_tokens",
                        "8",
                        "--seed",
                        "7",
                        "--start",
                        "Hello",
                    ]
                )
            self.assertEqual(code, 0)
            return out.getvalue()

        text = sample_text()
        self.assertEqual(text, sample_text())
        self.assertEqual(len(text.split("---------------\n")[:-1]), 2, text)
        output = os.path.join(RUNS.path("pp_export"), "model.safetensors")
        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(export.main(["--out_dir", self.pp, "--output", output]), 0)
        saved = state(checkpoint.newest(self.pp))
        config = checkpoint.load_model(checkpoint.newest(self.pp)).config
        back = GPT.from_hf_state_dict(load_file(output), vocab_size=config.vocab_size, n_head=config.n_head)
        for name, p in back.named_parameters():
            if name == "lm_head.weight":
                continue
            want = saved[name].view(p.shape)
            rows = 50257 if name == "transformer.wte.weight" else p.shape[0]  # export drops GPT-2's padding
            self.assertTrue(torch.equal(p[:rows], want[:rows]), name)


# ----------------------------------------------------------------------------- bad input


def expect_error_in_process(test: unittest.TestCase, flags: list[str], needle: str) -> None:
    """train.main in this process, as one rank (tests/harness.expect_train_error_in_process)."""
    expect_train_error_in_process(test, RUNS.args("--max_steps", "2", *flags), needle, RUNS.path("bad_in_process"))


class TestBadPipelineFlagsOneRank(unittest.TestCase):
    """One-rank checks, in this process (no torch import per case): each well under a second."""

    def test_pp_does_not_divide_one_rank(self):
        expect_error_in_process(self, PP2, "--pipeline_parallel_size 2 does not divide the world size (1 ranks)")

    def test_pp_size_below_one(self):
        expect_error_in_process(self, ["--pipeline_parallel_size", "0"], "--pipeline_parallel_size must be >= 1")

    def test_virtual_stages_need_interleaved(self):
        for schedule in ("gpipe", "1f1b"):
            with self.subTest(schedule):
                expect_error_in_process(
                    self,
                    ["--pp_schedule", schedule, "--pp_virtual_stages", "2"],
                    f"--pp_virtual_stages is for --pp_schedule interleaved_1f1b; {schedule}",
                )

    def test_layers_per_stage_needs_a_pipeline(self):
        expect_error_in_process(
            self, ["--pp_layers_per_stage", "4"], "--pp_layers_per_stage needs --pipeline_parallel_size > 1"
        )

    def test_layers_per_stage_checked(self):
        """As rank 0 of 2 (WORLD_SIZE=2): the flags are refused before any process group would exist."""
        for flags, needle in (
            ([*PP2, "--pp_layers_per_stage", "3,2"], "3,2 sums to 5, not n_layer (4)"),
            ([*PP2, "--pp_layers_per_stage", "4,0"], "4,0 gives chunk 1 no Block (0)"),
            (
                [*INTERLEAVED, "--pp_layers_per_stage", "1,1,2"],
                "1,1,2 gives 3 counts; the pipeline has P x V = 4 chunks, one count each",
            ),
            ([*PP2, "--pp_layers_per_stage", "2,x"], "2,x: not a comma-separated list of integers"),
        ):
            with self.subTest(flags):
                expect_train_error_in_process(
                    self,
                    RUNS.args("--max_steps", "2", *flags),
                    f"--pp_layers_per_stage {needle}",
                    RUNS.path("bad_in_process"),
                    env={"WORLD_SIZE": "2"},
                )

    def test_schedule_needs_a_pipeline(self):
        for flags in (["--pp_schedule", "gpipe"], ["--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"]):
            with self.subTest(flags):
                expect_error_in_process(self, flags, "need --pipeline_parallel_size > 1")


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestBadPipelineFlags(unittest.TestCase):
    """Two forked ranks (tests/harness.forked): every rank exits 2 with exactly its one line
    `train.py: error: ...`, before any work (nothing written)."""

    def expect_error(self, flags: list[str], needle: str, nproc: int = 2):
        expect_train_error_on_ranks(self, RUNS.args("--max_steps", "2", *flags), needle, nproc, RUNS.path("bad"))

    def test_pp_does_not_divide_the_world(self):
        self.expect_error(
            ["--pipeline_parallel_size", "3"], "--pipeline_parallel_size 3 does not divide the world size (2 ranks)"
        )

    def test_fewer_blocks_than_chunks(self):
        self.expect_error([*PP2, "--n_layer", "1"], "n_layer (1) < pipeline_parallel_size x virtual stages = 2 x 1")
        self.expect_error(
            [*INTERLEAVED, "--n_layer", "3"], "n_layer (3) < pipeline_parallel_size x virtual stages = 2 x 2"
        )

    def test_layers_per_stage_that_does_not_sum(self):
        self.expect_error(
            [*PP2, "--pp_layers_per_stage", "2,1"], "--pp_layers_per_stage 2,1 sums to 3, not n_layer (4)"
        )

    def test_interleaved_micro_batches_not_a_multiple_of_pp(self):
        self.expect_error(
            [*INTERLEAVED, "--total_batch_size", str(MB * T)],
            "micro-batches M = total_batch_size / "
            "(micro_batch_size x seq_len x data_parallel_size) = 1 to be a multiple of "
            "--pipeline_parallel_size 2",
        )

    def test_interleaved_needs_virtual_stages(self):
        for flags in ([*PP2, "--pp_schedule", "interleaved_1f1b"], [*INTERLEAVED[:-1], "1"]):
            with self.subTest(flags):
                self.expect_error(flags, "needs --pp_virtual_stages V > 1")

    def test_pytorch_twin_refuses_sequence_parallel(self):
        self.expect_error(
            [*PP2, "--implementation", "pytorch", "--tensor_parallel_size", "2", "--sequence_parallel"],
            "without --sequence_parallel / --enable_loss_parallelism",
            nproc=4,
        )


if __name__ == "__main__":
    unittest.main()
