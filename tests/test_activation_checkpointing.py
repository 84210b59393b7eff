"""Activation checkpointing and torch.compile (runtime/blocks.py): recomputing a Block in backward changes
no number, keeps only the Block boundaries for backward, and re-runs exactly the TP collectives the theory
says; a compiled Block agrees with the eager one; bad flags are refused in one line.

Whole runs are real `python train.py` / `torchrun train.py` on the stand-in corpus of tests/harness.py, with
a 4-Block tiny GPT and 4 micro-batches per step (2 under dp=2), made once and shared by name (`run`, through
tests/harness.WholeRuns: the one-process run without AC is test_pipeline_train's reference, trained once). The
saved-activation measurements run in this process on a small GPT (vocab 512, so the logits do not hide the
Blocks), with bench.ac.SavedAndRecomputedBytes: bench.pipeline.SavedBytes plus
the tensors checkpoint recomputes in backward, which saved_tensors_hooks of ours never see.
"""

import tempfile
import unittest

import pytest
import torch

from bench.ac import SavedAndRecomputedBytes
from bench.pipeline import SavedBytes
from model.gpt import GPT, make_config
from plan.theory import tp_comm_bytes_per_micro_step
from runtime.blocks import apply_activation_checkpointing
from tests.harness import WholeRuns, evals_of, expect_train_error_in_process, rank0_only, steps_of

STEPS = 6  # as test_pipeline_train's, whose eager references the AC and compiled runs share
MB, T, N_LAYER, ACCUM = 2, 32, 4, 4  # micro-batch, seq_len, Blocks, micro-batches per step at dp=1
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
    str(ACCUM * MB * T),
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
    "--implementation",
    "custom",
]
FULL = ["--activation_checkpointing", "full"]
SELECTIVE = ["--activation_checkpointing", "selective", "--ac_every", "4"]  # not the default 2: Block 0 alone
DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]
FSDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"]
TP2_SP = ["--tensor_parallel_size", "2", "--sequence_parallel"]

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int) -> str:
    """Train STEPS steps once per name (later callers reuse the run), no checkpoints; returns its out_dir."""
    return RUNS.run(name, ["--max_steps", str(STEPS), "--no_checkpoint", *flags], nproc)


def flag(flags: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name` in flags (its last occurrence), else default."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == name]
    return values[-1] if values else default


def recomputed_blocks(flags: list[str]) -> int:
    """How many Blocks the flags checkpoint, from the flags alone: all n_layer under full; under selective
    those whose global index is a multiple of --ac_every (Blocks 0, 2 of 4 for every 2; Block 0 for every 4)."""
    n_layer = int(flag(BASE + flags, "--n_layer"))
    mode = flag(flags, "--activation_checkpointing", "none")
    if mode == "full":
        return n_layer
    if mode == "selective":
        return len(range(0, n_layer, int(flag(flags, "--ac_every"))))
    return 0


def micro_steps(flags: list[str]) -> int:
    """Micro-batches each rank runs per step: the global batch over micro-batch x seq_len x dp."""
    return int(flag(BASE, "--total_batch_size")) // (MB * T * int(flag(flags, "--data_parallel_size", "1")))


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestCheckpointingChangesNoNumber(unittest.TestCase):
    """For each layout, `full` and `selective` (every 4th Block: Block 0) log the same loss, grad_norm and
    val_loss bits as the same layout without AC, every step: the recomputation replays the Block's forward on
    the same inputs and parameters (FSDP re-gathers them before the Block's backward, so the recompute sees
    them), and autograd then runs the same backward ops in the same order.

    What makes the bits worth checking: rank 0 counted (blocks.AC_COUNTER) k x micro-steps
    checkpointed forwards and as many recomputations in backward every step, k the Blocks the flags pick.

    Under TP with sequence parallelism, comm_bytes (rank 0's, per step) also grows by exactly the collectives
    the recomputation re-runs: micro-steps x (tp_comm_bytes_per_micro_step(..., recomputed_blocks=k) - (..., 0))
    per kind, with k and the micro-steps worked out from the flags."""

    def check(self, name: str, flags: list[str], nproc: int) -> None:
        ref_out = run(f"{name}_none", flags, nproc)
        ref = steps_of(ref_out)
        self.assertEqual(sorted(ref), list(range(1, STEPS + 1)), name)
        for mode, ac in (("full", FULL), ("selective", SELECTIVE)):
            with self.subTest(mode):
                out = run(f"{name}_{mode}", flags + ac, nproc)
                got = steps_of(out)
                self.assertEqual(sorted(got), sorted(ref), f"{name} {mode}")
                self.assertEqual(
                    [(got[s]["loss"], got[s]["grad_norm"]) for s in sorted(got)],
                    [(ref[s]["loss"], ref[s]["grad_norm"]) for s in sorted(ref)],
                    f"{name} {mode}",
                )
                self.assertEqual(evals_of(out), evals_of(ref_out), f"{name} {mode} val_loss")
                want = recomputed_blocks(flags + ac) * micro_steps(flags)
                for key in ("ac_checkpointed_blocks", "ac_recomputed_blocks"):
                    self.assertEqual([got[s][key] for s in sorted(got)], [want] * STEPS, f"{name} {mode} {key}")
                if "--tensor_parallel_size" in flags:
                    self.check_comm(got, ref, flags + ac)

    def check_comm(self, got: dict, ref: dict, flags: list[str]) -> None:
        tp, k, micro = int(flag(flags, "--tensor_parallel_size")), recomputed_blocks(flags), micro_steps(flags)
        cfg = make_config("tiny", n_layer=N_LAYER)
        formula = lambda blocks: tp_comm_bytes_per_micro_step(  # noqa: E731
            cfg,
            MB,
            T,
            tp,
            "--enable_loss_parallelism" in flags,
            "--sequence_parallel" in flags,
            recomputed_blocks=blocks,
        )
        extra = {kind: micro * (formula(k)[kind] - formula(0)[kind]) for kind in formula(0)}
        self.assertGreater(sum(extra.values()), 0)
        for s in sorted(got):
            kinds = set(got[s]["comm_bytes"]) | set(ref[s]["comm_bytes"])
            want = {kind: ref[s]["comm_bytes"].get(kind, 0) + extra.get(kind, 0) for kind in kinds}
            self.assertEqual(
                {kind: got[s]["comm_bytes"].get(kind, 0) for kind in kinds},
                want,
                f"step {s}: k={k} recomputed Blocks x {micro} micro-steps",
            )

    def test_recomputed_blocks_from_flags(self):
        self.assertEqual((recomputed_blocks(FULL), recomputed_blocks(SELECTIVE), recomputed_blocks([])), (4, 1, 0))
        self.assertEqual(recomputed_blocks(["--activation_checkpointing", "selective", "--ac_every", "2"]), 2)
        self.assertEqual((micro_steps([]), micro_steps(DDP2), micro_steps(TP2_SP)), (4, 2, 4))

    def test_one_process(self):
        self.check("single", [], 1)

    def test_custom_ddp_2(self):
        self.check("ddp", DDP2, 2)

    def test_custom_fsdp_2(self):
        self.check("fsdp", FSDP2, 2)

    def test_custom_tp_2_sequence_parallel(self):
        self.check("tp_sp", TP2_SP, 2)

    def test_2d_fsdp_2_x_tp_2_sequence_parallel(self):
        self.check("fsdp_tp_sp", [*FSDP2, *TP2_SP], 4)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestCompiledAgreesWithEager(unittest.TestCase):
    """--compile (each Block's forward through inductor) against the eager run of the same layout: loss and
    grad_norm within 1e-5 relative for each of the first 6 steps. Not bit-equal: inductor fuses the
    LayerNorm / GELU / bias adds into kernels that sum in another order (measured on one process: loss
    within 1e-7, grad_norm within 5e-6). That compiled code ran: from step 1 on, dynamo had compiled graphs
    (compiled_graphs, rank 0's count; measured 2 in both layouts, and no more after step 1)."""

    def check(self, name: str, flags: list[str], nproc: int) -> None:
        ref = steps_of(run(f"{name}_none", flags, nproc))
        got = steps_of(run(f"{name}_compiled", flags + ["--compile"], nproc))
        self.assertEqual(sorted(got), list(range(1, STEPS + 1)), name)
        self.assertGreater(min(got[s]["compiled_graphs"] for s in got), 0, f"{name}: nothing compiled")
        for s in range(1, STEPS + 1):
            for key in ("loss", "grad_norm"):
                a, b = got[s][key], ref[s][key]
                self.assertLessEqual(abs(a - b), 1e-5 * abs(b), f"{name} step {s} {key}: {a} vs eager {b}")

    def test_one_process(self):
        self.check("single", [], 1)

    def test_custom_fsdp_2(self):
        self.check("fsdp", FSDP2, 2)


# ----------------------------------------------------------------------------- saved activations

B_, T_ = 2, 32
SMALL = make_config("tiny", n_layer=N_LAYER, vocab_size=512, block_size=64)  # C = 64, 4 heads


def small_gpt(ac: str, dropout: float = 0.0) -> GPT:
    config = make_config("tiny", n_layer=N_LAYER, vocab_size=512, block_size=64, dropout=dropout)
    model = GPT(config)
    model.init_weights(1337)
    if ac != "none":
        apply_activation_checkpointing(model, ac, every=2)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, SMALL.vocab_size, (B_, T_), generator=g),
        torch.randint(0, SMALL.vocab_size, (B_, T_), generator=g),
    )


def measure(ac: str) -> tuple[int, int]:
    """(peak during forward, peak over forward + backward) of saved plus recomputed bytes, one step."""
    model = small_gpt(ac)
    x, y = batch()
    with SavedAndRecomputedBytes(exclude=model.parameters()) as saved:
        _, loss = model(x, y)
        forward = saved.peak
        loss.backward()
    assert saved.bytes == 0 and not saved.live, "every saved or recomputed tensor is freed after backward"
    return forward, saved.peak


def one_block_bytes() -> int:
    """Saved bytes of one Block's forward alone (its input included: ln_1 saves it)."""
    block = small_gpt("none").transformer.h[0]
    x = torch.randn(B_, T_, SMALL.n_embd, requires_grad=True)
    with SavedBytes(exclude=block.parameters()) as saved:
        block(x).sum().backward()
    return saved.peak


class TestSavedActivations(unittest.TestCase):
    """What each mode keeps for backward, on SMALL (B=2, T=32, C=64, V=512, L=4 Blocks), fp32, one step.

    With A = B*T*C*4 bytes (one (B, T, C) fp32 activation), the bound for `full` is

        L*A                                   the Block boundaries: each checkpointed Block saves its input
      + B*T*8 + T*8                           the embeddings: token ids and positions (int64)
      + A + 2*B*T*4                           ln_f: its input, mean and rstd
      + A + V*C*4                             the loss: dx and dW in fp32, made in its forward (lm_head + loss
                                              chunked: no logits kept, nor x or the targets)
      + S                                     during backward, one Block recomputed at a time

    where S is one Block's saved bytes measured alone (its input included, so the bound is loose by one A).
    The Blocks run one after another in backward and each recomputed Block's tensors are freed as its
    backward consumes them, so at most one Block's are alive at once. Dropout is 0, so nothing saves a mask.
    `none` instead keeps every Block's S. `selective` (every 2) checkpoints Blocks 0 and 2: exactly `none`
    minus (S - A) for each of them (each still keeps its input); its recomputations happen after the Blocks
    above them have freed theirs, so they add nothing to the peak.
    """

    @classmethod
    def setUpClass(cls):
        cls.peaks = {ac: measure(ac) for ac in ("none", "full", "selective")}
        cls.block = one_block_bytes()

    def test_full_within_the_bound(self):
        B, T, C, L = B_, T_, SMALL.n_embd, SMALL.n_layer
        A = B * T * C * 4
        without_recompute = L * A + (B * T * 8 + T * 8) + (A + 2 * B * T * 4) + (A + SMALL.vocab_size * C * 4)
        forward, peak = self.peaks["full"]
        self.assertLessEqual(forward, without_recompute)
        self.assertLessEqual(peak, without_recompute + self.block)
        self.assertGreater(peak, forward, "the recomputed Block's tensors are counted in backward")
        self.assertLess(peak, self.peaks["none"][1] / 2, f"full {peak} vs none {self.peaks['none'][1]}")

    def test_none_keeps_every_block(self):
        """Without AC the forward keeps each Block's S (the bound's derivation above, with S for each A)."""
        forward, peak = self.peaks["none"]
        self.assertEqual(forward, peak)
        self.assertGreaterEqual(peak, SMALL.n_layer * self.block)

    def test_selective_is_none_minus_the_checkpointed_blocks(self):
        A = B_ * T_ * SMALL.n_embd * 4
        checkpointed = len(range(0, SMALL.n_layer, 2))
        peak = self.peaks["selective"][1]
        self.assertLess(self.peaks["full"][1], peak)
        self.assertLess(peak, self.peaks["none"][1])
        self.assertEqual(peak, self.peaks["none"][1] - checkpointed * (self.block - A))

    def test_dropout_is_replayed_bit_for_bit(self):
        """Dropout 0.1 (embeddings, attention, residual branches), one process: the same seed gives the same
        loss and the same gradient bits with and without AC, because checkpoint replays the forward's RNG
        state when it recomputes."""

        def grads(ac: str, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model = small_gpt(ac, dropout=0.1)
            torch.manual_seed(seed)
            _, loss = model(*batch())
            loss.backward()
            return loss, {n: p.grad for n, p in model.named_parameters()}

        ref_loss, ref = grads("none", 5)
        self.assertFalse(torch.equal(ref_loss, grads("none", 6)[0]), "dropout is active")
        for ac in ("full", "selective"):
            with self.subTest(ac):
                loss, got = grads(ac, 5)
                self.assertTrue(torch.equal(loss, ref_loss), ac)
                for name, g in ref.items():
                    self.assertTrue(torch.equal(got[name], g), f"{ac}: {name}")

    def test_the_last_tensor_a_recomputation_keeps_is_counted(self):
        """checkpoint's early stop ends a recomputation by raising from the pack of the last tensor the forward
        saved, after keeping it. Here that tensor is a bias-free linear's input (mm saves its weight, then its
        input), as the row-parallel c_proj's input, GELU's output, is under TP: the recomputation keeps x, GELU's
        input and GELU's output (the weights are excluded), and all three are counted."""
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint

        w1, w2 = torch.randn(32, 16, requires_grad=True), torch.randn(8, 32, requires_grad=True)
        x = torch.randn(4, 16, requires_grad=True)
        with SavedAndRecomputedBytes(exclude=[w1, w2]) as saved:
            checkpoint(lambda x: F.linear(F.gelu(F.linear(x, w1)), w2), x, use_reentrant=False).sum().backward()
        self.assertEqual(saved.peak, (4 * 16 + 4 * 32 + 4 * 32) * 4)


# ----------------------------------------------------------------------------- bad input


def expect_error_in_process(test: unittest.TestCase, flags: list[str], needle: str, env: dict | None = None):
    """train.main in this process, as one rank with no torchrun variables and only `env` set: exit code 2,
    exactly one line `train.py: error: ...` naming the problem, nothing written
    (tests/harness.expect_train_error_in_process)."""
    expect_train_error_in_process(
        test, RUNS.args("--max_steps", "2", *flags), needle, RUNS.path("bad_in_process"), env=env
    )


class TestBadFlagsOneRank(unittest.TestCase):
    def test_unknown_mode(self):
        expect_error_in_process(
            self,
            ["--activation_checkpointing", "bogus"],
            "argument --activation_checkpointing: invalid choice: 'bogus'",
        )

    def test_compile_without_a_cxx_compiler(self):
        """PATH is one empty directory and CXX is unset: inductor would have nothing to build with."""
        with tempfile.TemporaryDirectory() as empty:
            expect_error_in_process(self, ["--compile"], "--compile on CPU needs a C++ compiler", {"PATH": empty})


if __name__ == "__main__":
    unittest.main()
