"""The bench package without running a benchmark: the theory against hand-derived counts, the per-step
summary, the markdown, and that a failing layout is recorded while the bench goes on (the job runner is
mocked)."""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest
from dataclasses import replace
from unittest import mock

import bench.__main__ as cli
from bench import plots, report, runner
from bench.matrix import Layout, Setup, comm_theory, fit_heads, matrix, param_count
from bench.report import MiB
from bench.runner import JobResult
from model.gpt import GPT, GPTConfig
from runtime.metrics import read_jsonl

# Small enough to build for real: V=128, block 32, L=2, H=16 (2 heads)
CFG = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=16)


def make_setup(**kw) -> Setup:
    base = dict(
        model="tiny",
        config=CFG,
        seq_len=8,
        rows=8,
        micro_cap=8,
        warmup=2,
        steps=4,
        peak_flops=1e9,
        device="cpu",
        dataset="unused",
        timeout=60,
    )
    return Setup(**{**base, **kw})


def psi_by_hand(c: GPTConfig, tp: int = 1) -> int:
    """fp32 bytes of one rank's parameters: embeddings, per block 12C^2 + 13C, ln_f; under TP the vocab,
    q/k/v/fc (weight and bias) and the row-parallel weights are split, LayerNorms, wpe and the two
    row-parallel biases are not."""
    V, P, C, L = c.vocab_size, c.block_size, c.n_embd, c.n_layer
    per_block = (3 * (C * C + C) + 4 * C * C + 4 * C) // tp + (C * C + 4 * C * C) // tp + 2 * C + 4 * C
    return 4 * (V * C // tp + P * C + L * per_block + 2 * C)


def tp_by_hand(c: GPTConfig, B: int, T: int, matmul_bytes: int = 4) -> int:
    """All-reduce bytes of one TP micro-step on one rank (Megatron, no sequence parallelism, loss parallelism),
    with A = B*T*C elements of one activation. Per Block: forward, g after attn.c_proj and after mlp.c_proj
    (2 x A of the matmul output dtype); backward, f where attention and the MLP begin, after ln_1 and ln_2
    (2 x A fp32: the residual stream stays fp32). Once: the embedding's g forward and ln_f's f backward
    (2 x A fp32). The loss: max, target logit and sum-exp, 3 fp32 per token."""
    A = B * T * c.n_embd
    per_block = 2 * A * matmul_bytes + 2 * A * 4
    return c.n_layer * per_block + 2 * A * 4 + 3 * B * T * 4


def fsdp_root_by_hand(c: GPTConfig, tp: int = 1) -> int:
    """fp32 bytes of FSDP's root unit on one rank: wte (= lm_head, vocab split under TP), wpe, ln_f."""
    return 4 * (c.vocab_size * c.n_embd // tp + c.block_size * c.n_embd + 2 * c.n_embd)


class TestTheory(unittest.TestCase):
    def test_psi_counts_the_tied_weight_once(self):
        model = GPT(CFG)
        unique = {id(p): p.numel() for p in model.parameters()}
        self.assertEqual(param_count(CFG), sum(unique.values()))
        self.assertEqual(4 * param_count(CFG), psi_by_hand(CFG))

    def test_psi_of_a_tp_shard(self):
        self.assertEqual(4 * param_count(CFG, tp=2), psi_by_hand(CFG, tp=2))
        self.assertLess(param_count(CFG, tp=2), param_count(CFG))

    def test_fsdp_root_bytes(self):
        self.assertEqual(4 * param_count(CFG, root_only=True), fsdp_root_by_hand(CFG))
        self.assertEqual(4 * param_count(CFG, tp=2, root_only=True), fsdp_root_by_hand(CFG, tp=2))

    def test_ddp_is_psi_per_step_whatever_the_accumulation(self):
        for cap in (8, 1):  # grad_accum 1, then 4
            s = make_setup(micro_cap=cap)
            theory = comm_theory(Layout("ddp", "custom", dp=2), s)
            self.assertEqual(theory, {"all_reduce": psi_by_hand(CFG), "all_gather": 0, "reduce_scatter": 0, "p2p": 0})

    def test_fsdp_is_three_psi_less_the_root_per_micro_step(self):
        psi, root = psi_by_hand(CFG), fsdp_root_by_hand(CFG)
        s = make_setup(micro_cap=2)  # 8 rows over dp=2: micro 2, grad_accum 2
        self.assertEqual((s.micro_batch(2), s.grad_accum(2)), (2, 2))
        theory = comm_theory(Layout("fsdp", "custom", dp=2), s)
        self.assertEqual(
            theory, {"all_reduce": 0, "all_gather": (2 * psi - root) * 2, "reduce_scatter": psi * 2, "p2p": 0}
        )

    def test_fsdp_formula_without_reshard_and_in_bf16(self):
        from plan.theory import fsdp_comm_bytes_per_micro_step as fsdp

        # root 3 + blocks 10 elements, each gathered once, in 2-byte params; gradients reduced in fp32
        self.assertEqual(
            fsdp(3, 10, 2, reshard_after_forward=False, param_bytes=2), {"all_gather": 13 * 2, "reduce_scatter": 13 * 4}
        )
        self.assertEqual(fsdp(3, 10, 2), {"all_gather": (3 + 2 * 10) * 4, "reduce_scatter": 13 * 4})
        self.assertEqual(fsdp(3, 10, 1), {"all_gather": 0, "reduce_scatter": 0})

    def test_tp_is_megatron(self):
        s = make_setup()  # 8 rows, dp=1: micro 8, grad_accum 1
        theory = comm_theory(Layout("tp", "custom", tp=2), s)
        self.assertEqual(theory, {"all_reduce": tp_by_hand(CFG, 8, 8), "all_gather": 0, "reduce_scatter": 0, "p2p": 0})
        # (4L + 2) activations of 8*8*16 fp32 plus 3 fp32 per token, with L = 2
        self.assertEqual(tp_by_hand(CFG, 8, 8), (4 * 2 + 2) * 8 * 8 * 16 * 4 + 3 * 8 * 8 * 4)
        s = make_setup(micro_cap=2)  # micro 2, grad_accum 4: the per-micro-step count four times
        self.assertEqual(comm_theory(Layout("tp", "custom", tp=2), s)["all_reduce"], 4 * tp_by_hand(CFG, 2, 8))

    def test_tp_under_autocast_keeps_the_residual_stream_fp32(self):
        s = make_setup(dtype_bytes=2)  # only the g after c_proj carries 2-byte matmul outputs
        theory = comm_theory(Layout("tp", "custom", tp=2), s)
        self.assertEqual(theory["all_reduce"], tp_by_hand(CFG, 8, 8, matmul_bytes=2))
        self.assertLess(theory["all_reduce"], tp_by_hand(CFG, 8, 8))

    def test_2d_is_dp_on_the_shard_plus_tp(self):
        s = make_setup()  # 8 rows, dp=2: micro 4, grad_accum 1
        tp = tp_by_hand(CFG, 4, 8)
        ddp = comm_theory(Layout("2d-ddp", "custom", dp=2, tp=2), s)
        self.assertEqual(ddp, {"all_reduce": psi_by_hand(CFG, 2) + tp, "all_gather": 0, "reduce_scatter": 0, "p2p": 0})
        fsdp = comm_theory(Layout("2d-fsdp", "custom", dp=2, tp=2), s)
        self.assertEqual(
            fsdp,
            {
                "all_reduce": tp,
                "all_gather": 2 * psi_by_hand(CFG, 2) - fsdp_root_by_hand(CFG, 2),
                "reduce_scatter": psi_by_hand(CFG, 2),
                "p2p": 0,
            },
        )

    def test_comm_curves(self):
        from bench.matrix import comm_curves

        s = make_setup()  # 8 rows, micro_cap 8: one micro-step at any N >= 1
        curves = comm_curves(s, [2, 4])
        psi, root = psi_by_hand(CFG), fsdp_root_by_hand(CFG)
        self.assertEqual(curves["ddp"], [{"all_reduce": psi}] * 2)
        self.assertEqual(curves["fsdp"], [{"all_gather": 2 * psi - root, "reduce_scatter": psi}] * 2)
        # TP alone: the whole batch (B = 8) on every rank, so the payload does not depend on N
        self.assertEqual(
            curves["tp"], [{"all_reduce": tp_by_hand(CFG, 8, 8), "all_gather": 0, "reduce_scatter": 0}] * 2
        )


class TestPipelineTheory(unittest.TestCase):
    """Rank 0 under PP is pipeline stage 0 of 2: with CFG's 2 Blocks it holds wte (128 x 16 = 2048), wpe
    (32 x 16 = 512) and Block 0 (12C^2 + 13C = 3280 elements; 1688 of them on a tp=2 rank: the 3184 of
    q/k/v, c_fc and the two c_proj weights halved, plus 96 replicated: ln_1, ln_2 and the c_proj biases).
    8 rows of T=8: dp=1 gives micro-batch 2 and M=4; dp=2 micro-batch 1 and M=4 (M >= 2P either way).
    Expected bytes are written out here, not computed by the bench's functions."""

    def theory(self, name: str, dp: int = 1, tp: int = 1, **kw) -> dict[str, int]:
        return comm_theory(Layout(name, "custom", dp=dp, tp=tp, pp=2), make_setup(**kw))

    def test_pp_alone(self):
        # p2p: 4 micro-batches x (2, 8, 16) fp32 sent forward; AR: wte's 2048 fp32 gradient over [first, last]
        self.assertEqual(
            self.theory("pp"), {"all_reduce": 2048 * 4, "all_gather": 0, "reduce_scatter": 0, "p2p": 4 * 2 * 8 * 16 * 4}
        )

    def test_pp_dp(self):
        # DDP all-reduces stage 0's 2048 + 512 + 3280 = 5840 parameters once per step, besides the tied one
        self.assertEqual(
            self.theory("pp-dp", dp=2),
            {"all_reduce": 2048 * 4 + 5840 * 4, "all_gather": 0, "reduce_scatter": 0, "p2p": 4 * 1 * 8 * 16 * 4},
        )

    def test_pp_tp(self):
        # per micro-batch A = 2 x 8 x 16 = 256 elements, all-reduced 5 times on stage 0: ln_1 and ln_2
        # (backward), attn.c_proj and mlp.c_proj (forward), the embedding (forward); no ln_f, no loss
        self.assertEqual(
            self.theory("pp-tp", tp=2),
            {"all_reduce": 1024 * 4 + 4 * 5 * 256 * 4, "all_gather": 0, "reduce_scatter": 0, "p2p": 4 * 2 * 8 * 16 * 4},
        )

    def test_3d(self):
        # tied: wte's shard 1024; DDP: the stage's TP shard 1024 + 512 + 1688 = 3224; TP: 5 x A = 5 x 128
        self.assertEqual(
            self.theory("3d", dp=2, tp=2),
            {
                "all_reduce": 1024 * 4 + 3224 * 4 + 4 * 5 * 128 * 4,
                "all_gather": 0,
                "reduce_scatter": 0,
                "p2p": 4 * 1 * 8 * 16 * 4,
            },
        )

    def test_odd_layer_count_puts_the_extra_block_on_stage_0(self):
        # 3 Blocks over 2 stages: [0, 1] and [2], so stage 0 all-reduces 2 x 2 + 1 = 9 activations per micro-batch
        c3 = replace(CFG, n_layer=3)
        self.assertEqual(self.theory("pp-tp", tp=2, config=c3)["all_reduce"], 1024 * 4 + 4 * 9 * 256 * 4)
        # and DDP holds 2048 + 512 + 2 x 3280 parameters
        self.assertEqual(self.theory("pp-dp", dp=2, config=c3)["all_reduce"], 2048 * 4 + (2560 + 6560) * 4)

    def test_autocast_halves_only_the_matmul_exits(self):
        # bf16: attn.c_proj and mlp.c_proj outputs 2 bytes; the embedding, ln entries and activations sent stay fp32
        theory = self.theory("pp-tp", tp=2, dtype_bytes=2)
        self.assertEqual(theory["all_reduce"], 1024 * 4 + 4 * (3 * 256 * 4 + 2 * 256 * 2))
        self.assertEqual(theory["p2p"], 4 * 2 * 8 * 16 * 4)

    def test_stage_0_parameters(self):
        self.assertEqual(param_count(CFG, first_stage_of=2), 2048 + 512 + 3280)
        self.assertEqual(param_count(CFG, tp=2, first_stage_of=2), 1024 + 512 + 1688)


class TestMatrix(unittest.TestCase):
    def test_layouts(self):
        names = lambda lays: [lay.key for lay in lays]  # noqa: E731
        self.assertEqual(
            names(matrix(2, on_gpu=False, include_2d=False)),
            ["single", "ddp-custom", "ddp-pytorch", "fsdp-custom", "fsdp-pytorch", "tp-custom", "tp-pytorch"],
        )
        two_d = [lay for lay in matrix(2, on_gpu=False, include_2d=True) if lay.name.startswith("2d")]
        self.assertEqual({(lay.dp, lay.tp) for lay in two_d}, {(2, 2)})
        self.assertEqual(len(two_d), 4)
        self.assertEqual({(lay.dp, lay.tp) for lay in matrix(8, True, False) if lay.name == "2d-fsdp"}, {(4, 2)})
        self.assertEqual(names(matrix(1, True, True)), ["single"])
        self.assertEqual(names(matrix(4, False, False, ["single", "tp"])), ["single", "tp-custom", "tp-pytorch"])

    def test_train_flags(self):
        s = make_setup()
        args = s.train_args(Layout("2d-fsdp", "custom", dp=2, tp=2), "/x")
        joined = " ".join(args)
        for flag in (
            "--data_parallel_size 2",
            "--data_parallel_type fsdp",
            "--tensor_parallel_size 2",
            "--enable_loss_parallelism",
            "--deferred_init",
            "--max_steps 6",
            "--eval_interval 7",
            "--eval_iters 1",
            "--total_batch_size 64",
            "--micro_batch_size 4",
            "--implementation custom",
        ):
            self.assertIn(flag, joined)
        self.assertNotIn("--implementation", " ".join(s.train_args(Layout("single", "none"), "/x")))

    def test_pp_layouts(self):
        pp = lambda lays: [(lay.key, lay.nproc, lay.pp, lay.dp, lay.tp) for lay in lays if lay.pp > 1]  # noqa: E731
        self.assertEqual(pp(matrix(2, on_gpu=False, include_2d=False)), [])
        expected = [
            (f"{name}-{impl}", 2 * dp * tp, 2, dp, tp)
            for name, dp, tp in (("pp", 1, 1), ("pp-dp", 2, 1), ("pp-tp", 1, 2), ("3d", 2, 2))
            for impl in ("custom", "pytorch")
        ]
        self.assertEqual(pp(matrix(2, on_gpu=False, include_2d=False, include_pp=True)), expected)
        # on GPU only what fits on the GPUs present: 4 GPUs leave out the 8-rank 3d, 2 GPUs keep pp alone
        self.assertEqual(pp(matrix(4, on_gpu=True, include_2d=False, include_pp=True)), expected[:6])
        self.assertEqual(pp(matrix(2, on_gpu=True, include_2d=False, include_pp=True)), expected[:2])
        self.assertEqual(pp(matrix(8, on_gpu=True, include_2d=False, include_pp=True)), expected)
        self.assertEqual(
            [lay.key for lay in matrix(2, False, False, ["3d"], include_pp=True)], ["3d-custom", "3d-pytorch"]
        )

    def test_pp_flags(self):
        s = make_setup()
        for lay in matrix(2, False, False, ["pp", "pp-dp", "pp-tp", "3d"], include_pp=True):
            args = s.train_args(lay, "/x")
            self.assertEqual(args[args.index("--pipeline_parallel_size") + 1], "2")
            self.assertEqual(args[args.index("--implementation") + 1], lay.implementation)
            self.assertNotIn("--enable_loss_parallelism", args, lay.key)  # the pytorch twin refuses it under PP
            self.assertNotIn("--pp_schedule", args)  # the default, 1f1b
            self.assertEqual("--tensor_parallel_size" in args, lay.tp == 2, lay.key)
            if lay.dp == 2:
                self.assertIn("--data_parallel_size 2 --data_parallel_type ddp", " ".join(args))
        # without PP the TP layouts keep loss parallelism
        self.assertIn("--enable_loss_parallelism", s.train_args(Layout("tp", "pytorch", tp=2), "/x"))

    def test_pp_micro_batches(self):
        s = make_setup()  # 8 rows, micro_cap 8
        self.assertEqual((s.micro_batch(1), s.grad_accum(1)), (8, 1))  # without PP: unchanged
        self.assertEqual((s.micro_batch(1, pp=2), s.grad_accum(1, pp=2)), (2, 4))  # M = 4 >= 2P
        self.assertEqual((s.micro_batch(2, pp=2), s.grad_accum(2, pp=2)), (1, 4))
        self.assertEqual((s.micro_batch(1, pp=4), s.grad_accum(1, pp=4)), (1, 8))
        s16 = make_setup(rows=16)
        self.assertEqual((s16.micro_batch(1, pp=2), s16.grad_accum(1, pp=2)), (4, 4))  # the largest with M >= 4
        self.assertEqual(make_setup(rows=16, micro_cap=2).micro_batch(1, pp=2), 2)  # still <= micro_cap
        self.assertEqual(make_setup(rows=4).micro_batch(2, pp=2), 1)  # 2 rows per dp rank: M = 2 is the most
        args = s.train_args(Layout("pp", "custom", pp=2), "/x")
        self.assertIn("--micro_batch_size 2 --total_batch_size 64", " ".join(args))

    def test_fit_heads(self):
        small = GPTConfig(n_layer=6, n_head=6, n_embd=384)
        self.assertEqual(fit_heads(small, 2).n_head, 6)
        self.assertEqual(fit_heads(small, 8).n_head, 8)


def records(warmup: int = 2, comm: bool = True) -> list[dict]:
    """A metrics.jsonl as train.py writes it: val lines, slow warm-up steps, then 5 measured steps."""
    out = [{"step": 0, "val_loss": 10.0}]
    tps = [10.0, 20.0, 100.0, 300.0, 200.0, 500.0, 400.0]
    for i, t in enumerate(tps, start=1):
        r = {
            "step": i,
            "loss": 5.0,
            "tokens_per_sec": t,
            "mfu": t / 1000,
            "step_time_ms": 1000 / t,
            "peak_memory_bytes": 1000 + i,
            "state_bytes": 64,
        }
        if comm:
            r["comm_bytes"] = {"all_reduce": 10 * i, "all_gather": 0, "reduce_scatter": 1}
        out.append(r)
    out.append({"step": len(tps), "val_loss": 9.0})
    return out


class TestSummary(unittest.TestCase):
    def test_medians_after_warmup(self):
        s = runner.summarize(records(), warmup=2)
        self.assertEqual(s["measured_steps"], 5)
        self.assertEqual(s["tokens_per_sec"], 300.0)  # median of 100, 300, 200, 500, 400
        self.assertAlmostEqual(s["mfu"], 0.3)
        self.assertEqual(s["peak_memory_bytes"], 1007)
        self.assertEqual(s["state_bytes"], 64)
        self.assertEqual(s["comm_bytes_by_kind"], {"all_gather": 0, "all_reduce": 50, "reduce_scatter": 1})
        self.assertEqual(s["comm_bytes"], 51)  # median of per-step totals 31, 41, ..., 71

    def test_no_comm_and_no_steps(self):
        s = runner.summarize(records(comm=False), warmup=0)
        self.assertIsNone(s["comm_bytes"])
        self.assertEqual(s["tokens_per_sec"], 200.0)
        self.assertIsNone(runner.summarize(records(), warmup=7))

    def test_read_metrics_file(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "metrics.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in records()) + "\n")
            self.assertEqual(runner.summarize(read_jsonl(d), 2)["tokens_per_sec"], 300.0)

    def test_a_job_that_wrote_no_metrics_fails(self):
        with tempfile.TemporaryDirectory() as d:
            res = runner.run_layout(
                Layout("ddp", "custom", dp=2),
                make_setup(),
                d,
                0,
                runner=lambda cmd, log_path, timeout: JobResult(0, "", 0.1),
            )
        self.assertEqual(res["status"], "failed: no training steps after warm-up in metrics.jsonl")
        self.assertIsNone(res["summary"])

    def test_failure_line(self):
        torchrun = (
            '[rank1]: Traceback (most recent call last):\n[rank1]:   File "train.py", line 3\n'
            "[rank1]: RuntimeError: boom on rank 1\nE0101 elastic stuff\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \ntrain.py FAILED\n"
        )
        self.assertEqual(runner.failure_line(torchrun), "RuntimeError: boom on rank 1")
        self.assertEqual(runner.failure_line("train.py: error: --seq_len 9 exceeds\nmore"), "--seq_len 9 exceeds")
        self.assertEqual(runner.failure_line("just\nlast line\n"), "last line")
        # a rank crashed and another reported the lost peer: the crash is the reason
        lost = (
            "[rank0]: RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor\n"
            "train.py: error: rank 6: a collective failed at step 0: a peer rank was lost or stalled\n"
        )
        self.assertEqual(
            runner.failure_line(lost), "RuntimeError: aten.embedding.default got mixed torch.Tensor and DTensor"
        )
        self.assertEqual(
            runner.failure_line(lost.split("\n", 1)[1]),
            "rank 6: a collective failed at step 0: a peer rank was lost or stalled",
        )


def fake_row(layout, impl, tps, comm=None, theory=100, status="ok", nproc=2, dp=2, tp=1, pp=1) -> dict:
    return {
        "layout": layout,
        "implementation": impl,
        "nproc": nproc,
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "status": status,
        "tokens_per_sec": tps,
        "mfu": None if tps is None else 0.25,
        "peak_memory_bytes": 3 * MiB,
        "state_bytes": MiB,
        "comm_bytes": comm,
        "comm_bytes_by_kind": None if comm is None else {"all_reduce": comm},
        "comm_theory_bytes": theory,
        "comm_theory_by_kind": {"all_reduce": theory},
        "comm_ratio": comm / theory if comm is not None and theory else None,
        "model": "tiny",
        "seq_len": 64,
        "global_batch_tokens": 512,
        "device": "cpu",
        "peak_flops": 5e10,
    }


class TestMarkdown(unittest.TestCase):
    rows = [
        fake_row("single", "none", 1000.0, comm=0, theory=0, nproc=1, dp=1),
        fake_row("ddp", "custom", 1500.0, comm=120),
        fake_row("ddp", "pytorch", 1000.0),
        fake_row("fsdp", "custom", None, status="failed: timed out after 60 s"),
        fake_row("fsdp", "pytorch", 900.0),
    ]

    def test_tables(self):
        md = report.render_markdown(
            self.rows,
            {"command": "python -m bench --quick", "machine": "box", "params": 3.4e6, "steps": 8, "warmup": 2},
        )
        self.assertIn("python -m bench --quick", md)
        self.assertIn("| ddp | custom | 2 (2×1) | 1,500 | 25.0% | 3.0 | 1.0 |", md)
        self.assertIn("| 1.200 | ok |", md)  # measured / theory
        self.assertIn("| fsdp | custom | 2 (2×1) | — |", md)
        self.assertIn("failed: timed out after 60 s |", md)
        self.assertIn("| ddp | 1,500 | 1,000 | 1.50 |", md)  # custom / pytorch
        self.assertIn("| fsdp | — | 900 | — |", md)
        self.assertIn("50 GFLOP/s", md)

    def test_section(self):
        sec = report.render_section(self.rows, None)
        self.assertTrue(sec.startswith("### "))
        self.assertIn("| ddp | pytorch | 2 (2×1) | 1,000 | 25.0% | 3.0 MiB | 1.0 MiB | — (0.0 MiB) |", sec)
        self.assertIn("| fsdp | custom | 2 (2×1) | failed: timed out after 60 s |", sec)
        self.assertIn("ddp 1.50", sec)
        self.assertEqual(report.pair_ratios(self.rows)[0]["ratio"], 1.5)


PIPELINE_INFO = {
    "pp": 2,
    "micro": 8,
    "virtual": 2,
    "dir": "pipeline",
    "summary": {"1f1b": {"idle_fraction": 0.25, "idle_theory": 1 / 9, "span_s": 0.05, "peak_saved_bytes_max": 2 * MiB}},
}


class TestPipelineReport(unittest.TestCase):
    rows = [
        fake_row("3d", "custom", 800.0, comm=300, theory=300, nproc=8, dp=2, tp=2, pp=2),
        fake_row("3d", "pytorch", 1000.0, nproc=8, dp=2, tp=2, pp=2),
    ]
    rows[0]["comm_bytes_by_kind"] = {"all_reduce": 2 * MiB, "p2p": MiB // 2}

    def test_pp_rows(self):
        md = report.render_markdown(self.rows, {"pipeline": PIPELINE_INFO})
        self.assertIn("| 3d | custom | 8 (pp2×dp2×tp2) | 800 |", md)
        self.assertIn("AR 2.00 / P2P 0.50", md)
        self.assertIn("| 3d | 800 | 1,000 | 0.80 |", md)  # custom / pytorch
        self.assertIn("| 1f1b | 0.250 | 0.111 | 50.0 | 2.00 |", md)  # idle measured vs theory
        self.assertIn("![pipeline_timeline](pipeline/pipeline_timeline.png)", md)
        sec = report.render_section(self.rows, {"pipeline": PIPELINE_INFO})
        self.assertIn("| 3d | pytorch | 8 (pp2×dp2×tp2) | 1,000 |", sec)
        self.assertIn("1f1b 0.25 (0.11)", sec)
        self.assertIn("pipeline/pipeline_timeline.png", sec)
        self.assertIn("3d 0.80", sec)

    def test_failed_pipeline_job_is_said(self):
        md = report.render_markdown(self.rows, {"pipeline": {**PIPELINE_INFO, "error": "TimeoutExpired: x"}})
        self.assertIn("failed: TimeoutExpired: x", md)
        self.assertNotIn("pipeline_timeline.png", md)

    def test_plots_with_pp_rows(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(plots.write_plots(self.rows, make_setup(), d), ["throughput", "memory", "comm_vs_world"])


class TestBadInput(unittest.TestCase):
    def test_one_line_and_exit_2(self):
        for argv, message in (
            (["--layouts", "nope"], "unknown layouts ['nope']"),
            (["--repeats", "0"], "--repeats and --steps must be >= 1"),
            (["--layouts", "pp,3d"], "layouts pp,3d run only with --include_pp"),
            (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
        ):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(cli.main(argv), 2, argv)
            self.assertEqual(err.getvalue().count("\n"), 1, err.getvalue())
            self.assertTrue(err.getvalue().startswith("bench: error: "), err.getvalue())
            self.assertIn(message, err.getvalue())


class TestRunner(unittest.TestCase):
    """The matrix goes on past a layout that fails, raises or times out; rows record why."""

    def fake_runner(self, calls):
        def run(cmd, log_path, timeout):
            out_dir = cmd[cmd.index("--out_dir") + 1]
            impl = cmd[cmd.index("--implementation") + 1] if "--implementation" in cmd else "none"
            kind = "fsdp" if "fsdp" in cmd else ("ddp" if "ddp" in cmd else "single")
            calls.append(f"{kind}-{impl}")
            if kind == "fsdp" and impl == "custom":
                return JobResult(None, "", 1.0)  # killed at the timeout
            if kind == "fsdp":
                raise OSError("runner exploded")
            if kind == "ddp" and impl == "pytorch":
                return JobResult(1, "[rank0]: RuntimeError: gloo died\n", 1.0)
            with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in records()) + "\n")
            return JobResult(0, "fine", 1.0)

        return run

    def test_failures_are_recorded(self):
        calls: list[str] = []
        lays = matrix(2, False, False, ["single", "ddp", "fsdp"])
        with tempfile.TemporaryDirectory() as d:
            rows = runner.run_matrix(
                lays, make_setup(), d, repeats=2, runner=self.fake_runner(calls), log=lambda s: None
            )
        status = {(r["layout"], r["implementation"]): r["status"] for r in rows}
        self.assertEqual(
            status,
            {
                ("single", "none"): "ok",
                ("ddp", "custom"): "ok",
                ("ddp", "pytorch"): "failed: RuntimeError: gloo died",
                ("fsdp", "custom"): "failed: timed out after 60 s",
                ("fsdp", "pytorch"): "failed: OSError: runner exploded",
            },
        )
        # pairs back to back, order alternating across repeats
        self.assertEqual(
            calls,
            [
                "single-none",
                "ddp-custom",
                "ddp-pytorch",
                "fsdp-custom",
                "fsdp-pytorch",
                "single-none",
                "ddp-pytorch",
                "ddp-custom",
                "fsdp-pytorch",
                "fsdp-custom",
            ],
        )
        ddp = next(r for r in rows if r["layout"] == "ddp" and r["implementation"] == "custom")
        self.assertEqual(ddp["tokens_per_sec"], 300.0)
        self.assertEqual(ddp["comm_bytes"], 51)
        self.assertEqual(ddp["comm_theory_bytes"], psi_by_hand(CFG))
        self.assertAlmostEqual(ddp["comm_ratio"], 51 / psi_by_hand(CFG))
        self.assertEqual(ddp["tokens_per_sec_runs"], [300.0, 300.0])
        single = rows[0]
        self.assertEqual((single["comm_bytes"], single["comm_theory_bytes"], single["comm_ratio"]), (0, 0, None))
        failed = next(r for r in rows if r["status"].startswith("failed: OSError"))
        self.assertIsNone(failed["tokens_per_sec"])
        self.assertIsNone(failed["comm_bytes"])

    def test_main_exit_code_and_files(self):
        machine = {"device": "cpu", "count": 2, "name": "test cpu", "dtype_bytes": 4, "peak_flops": None}
        with tempfile.TemporaryDirectory() as d:
            with (
                mock.patch.object(runner, "probe_machine", return_value=machine),
                mock.patch.object(report, "write_plots", return_value=[]),
                mock.patch.object(runner, "run_job", return_value=JobResult(1, "KeyError: x", 0.1)),
            ):
                rc = cli.main(
                    ["--quick", "--out", d, "--peak_flops", "1e9", "--layouts", "single,ddp", "--dataset", "unused"]
                )
            self.assertEqual(rc, 1)  # every layout failed
            with open(os.path.join(d, "bench.json")) as f:
                rows = json.load(f)
            self.assertEqual([r["status"] for r in rows], ["failed: KeyError: x"] * 3)
            for key in (
                "layout",
                "implementation",
                "nproc",
                "tokens_per_sec",
                "mfu",
                "peak_memory_bytes",
                "state_bytes",
                "comm_bytes",
                "comm_bytes_by_kind",
                "comm_theory_bytes",
                "comm_ratio",
                "status",
            ):
                self.assertIn(key, rows[0])
            for name in ("bench.md", "results_section.md", "bench_meta.json"):
                self.assertTrue(os.path.exists(os.path.join(d, name)), name)
            with open(os.path.join(d, "bench_meta.json")) as f:
                self.assertTrue(json.load(f)["command"].startswith("python -m bench --quick --out "))

    def test_include_pp_runs_the_pipeline_bench(self):
        machine = {"device": "cpu", "count": 2, "name": "test cpu", "dtype_bytes": 4, "peak_flops": None}
        from bench import pipeline

        calls = []

        def fake_pipeline(out, pp, micro, virtual, **kw):
            calls.append((os.path.basename(out), pp, micro, virtual))
            return [
                {
                    "schedule": "1f1b",
                    "idle_fraction": 0.2,
                    "idle_theory": 1 / 9,
                    "span_s": 0.01,
                    "peak_saved_bytes": MiB,
                }
            ]

        with tempfile.TemporaryDirectory() as d:
            with (
                mock.patch.object(runner, "probe_machine", return_value=machine),
                mock.patch.object(report, "write_plots", return_value=[]),
                mock.patch.object(pipeline, "run", side_effect=fake_pipeline),
                mock.patch.object(runner, "run_job", return_value=JobResult(1, "KeyError: x", 0.1)),
            ):
                cli.main(
                    [
                        "--quick",
                        "--out",
                        d,
                        "--peak_flops",
                        "1e9",
                        "--layouts",
                        "pp",
                        "--include_pp",
                        "--dataset",
                        "unused",
                    ]
                )
            self.assertEqual(calls, [("pipeline", 2, 8, 2)])
            with open(os.path.join(d, "bench.json")) as f:
                rows = json.load(f)
            self.assertEqual(
                [(r["layout"], r["pp"], r["micro_batch_size"], r["grad_accum"]) for r in rows],
                [("pp", 2, 2, 4), ("pp", 2, 2, 4)],
            )  # quick: 8 rows; M = 4 >= 2P
            with open(os.path.join(d, "bench.md")) as f:
                md = f.read()
            self.assertIn("| 1f1b | 0.200 | 0.111 |", md)
            self.assertIn("pipeline/pipeline_timeline.png", md)


class TestPlots(unittest.TestCase):
    def test_missing_matplotlib_is_said_not_silent(self):
        out = io.StringIO()
        with (
            tempfile.TemporaryDirectory() as d,
            mock.patch.dict(sys.modules, {"matplotlib": None}),
            contextlib.redirect_stdout(out),
        ):
            written = plots.write_plots(TestMarkdown.rows, make_setup(), d)
            self.assertEqual(os.listdir(d), [])
        self.assertEqual(written, [])
        self.assertEqual(len(out.getvalue().splitlines()), 1)
        self.assertIn("plots skipped", out.getvalue())
        self.assertIn("matplotlib", out.getvalue())

    def test_three_plots(self):
        rows = TestMarkdown.rows
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(plots.write_plots(rows, make_setup(), d), ["throughput", "memory", "comm_vs_world"])
            self.assertEqual(sorted(os.listdir(d)), ["comm_vs_world.png", "memory.png", "throughput.png"])


# ----------------------------------------------------------------------------- mixture of experts (--include_moe)

# CFG's MoE twin: E = 8 experts, top-2, each C -> 4C/2 = 32 -> C, in both Blocks
E8, K2, H32 = 8, 2, 32
EXPERTS_BY_HAND = 2 * E8 * (16 * H32 + H32 + H32 * 16 + 16)  # 2 layers x 8 x (c_fc W, b; c_proj W, b) = 17152
DENSE_MLP = 16 * 64 + 64 + 64 * 16 + 16  # GPT-2's MLP per Block: 2128
ROUTER = 16 * E8  # C x E per MoE layer, no bias


def moe_rows() -> list[Layout]:
    return [
        Layout("moe", "none", experts=E8),
        Layout("moe-ep", "custom", dp=2, experts=E8, ep=2),
        Layout("dense-active", "none"),
    ]


class TestMoETheory(unittest.TestCase):
    def test_layouts(self):
        keys = lambda lays: [lay.key for lay in lays]  # noqa: E731
        self.assertEqual(
            keys(matrix(2, False, False, ["single", "ddp"], include_moe=True)),
            ["single", "ddp-custom", "ddp-pytorch", "moe", "moe-ep-custom", "dense-active"],
        )
        self.assertEqual(
            keys(matrix(2, False, False, ["single", "moe-ep"], include_moe=True)), ["single", "moe-ep-custom"]
        )  # naming one MoE layout picks among them
        self.assertEqual(
            keys(matrix(3, False, False, ["single"], include_moe=True)), ["single", "moe", "dense-active"]
        )  # 8 experts do not split over 3 ranks
        self.assertEqual(keys(matrix(1, True, False, include_moe=True)), ["single", "moe", "dense-active"])
        self.assertEqual(matrix(2, False, False), matrix(2, False, False, include_moe=False))
        ep = matrix(4, True, False, ["moe-ep"], include_moe=True)[0]
        self.assertEqual((ep.nproc, ep.dp, ep.ep, ep.experts, ep.dp_type), (4, 4, 4, 8, "ddp"))

    def test_train_flags(self):
        s = make_setup()
        moe, ep, dense = moe_rows()
        moe_flags = (
            "--moe_num_experts 8 --moe_top_k 2 --moe_ffn_hidden 32 --moe_aux_loss_coeff 0.01 "
            "--moe_bias_update_rate 0.001"
        )
        self.assertIn(moe_flags, " ".join(s.train_args(moe, "/x")))
        self.assertNotIn("--implementation", s.train_args(moe, "/x"))
        joined = " ".join(s.train_args(ep, "/x"))
        for flag in (
            moe_flags,
            "--implementation custom",
            "--data_parallel_size 2 --data_parallel_type ddp",
            "--expert_parallel_size 2",
            "--micro_batch_size 4",
        ):
            self.assertIn(flag, joined)
        self.assertEqual(s.train_args(dense, "/x"), s.train_args(Layout("single", "none"), "/x"))

    def test_the_moe_model(self):
        c = make_setup().moe_config(E8)
        self.assertEqual((c.moe_num_experts, c.moe_top_k, c.expert_hidden), (E8, K2, H32))
        self.assertEqual(make_setup(moe_top_k=4).moe_config(E8).expert_hidden, 16)  # 4C/K for any K
        self.assertEqual(make_setup().moe_config(0), CFG)
        from bench.matrix import expert_param_count

        self.assertEqual(expert_param_count(c), EXPERTS_BY_HAND)
        self.assertEqual(param_count(c), param_count(CFG) - 2 * DENSE_MLP + 2 * ROUTER + EXPERTS_BY_HAND)

    def test_one_process_moves_nothing(self):
        for lay in (moe_rows()[0], moe_rows()[2]):
            self.assertEqual(sum(comm_theory(lay, make_setup()).values()), 0, lay.key)

    def test_ep_theory(self):
        """EP = dp = 2, 8 rows of T = 8 over 2 ranks: micro-batch 4, N = 32 tokens a micro-step. all_reduce: DDP
        on the dense parameters only (each expert on one rank: nothing to reduce). all_to_all per MoE layer and
        micro-step: the 8E-byte counts, then N·k rows of C fp32 out and N·k back (balanced), twice (backward)."""
        dense = 4 * (param_count(CFG) - 2 * DENSE_MLP + 2 * ROUTER)
        per_layer = 8 * E8 + 2 * (32 * 2 + 32 * 2) * 16 * 4  # 64 + 16384
        self.assertEqual(
            comm_theory(moe_rows()[1], make_setup()),
            {"all_reduce": dense, "all_gather": 0, "reduce_scatter": 0, "p2p": 0, "all_to_all": 2 * per_layer},
        )
        # micro_cap 2: 2 micro-steps of N = 16; DDP still once per step
        per_layer = 8 * E8 + 2 * (16 * 2 + 16 * 2) * 16 * 4
        theory = comm_theory(moe_rows()[1], make_setup(micro_cap=2))
        self.assertEqual((theory["all_reduce"], theory["all_to_all"]), (dense, 2 * 2 * per_layer))
        # EP = 2 over dp = 4: each expert has 2 copies, reduced over them (its edp group)
        ep_dp4 = comm_theory(Layout("moe-ep", "custom", dp=4, experts=E8, ep=2), make_setup())
        self.assertEqual(ep_dp4["all_reduce"], dense + 4 * EXPERTS_BY_HAND // 2)

    def test_all_to_all_at_the_measured_load(self):
        from bench.matrix import ep_all_to_all_at_load

        s, ep = make_setup(), moe_rows()[1]
        balanced = {"1": [16] * 8, "0": [16] * 8}  # 64 tokens x k = 2 over 8 experts, both layers
        self.assertEqual(ep_all_to_all_at_load(ep, s, balanced), comm_theory(ep, s)["all_to_all"])
        # rank 0 holds experts 0-3: 100 + 30 of the step's rows reached them; each comes in forward and its
        # gradient goes out backward, and rank 0 sends its own 2 x 64 rows each way regardless
        skewed = {"0": [40, 30, 20, 10, 10, 10, 5, 3], "1": [10, 5, 10, 5, 40, 30, 20, 8]}
        own = 2 * (8 * E8 + 2 * 64 * 16 * 4)
        self.assertEqual(ep_all_to_all_at_load(ep, s, skewed), own + 2 * (100 + 30) * 16 * 4)
        self.assertIsNone(ep_all_to_all_at_load(Layout("moe-ep", "custom", dp=4, experts=E8, ep=2), s, skewed))


class TestActiveParameters(unittest.TestCase):
    """MFU's 6N counts what a token multiplies by: of each MoE layer only its K experts (metrics.active_params)."""

    def test_dense_is_every_parameter(self):
        from runtime.metrics import active_params

        model = GPT(CFG)
        self.assertEqual(active_params(CFG), model.num_params())
        self.assertEqual(active_params(CFG, non_embedding=True), model.num_params(non_embedding=True))

    def test_moe_counts_k_of_e_experts(self):
        """With hidden 4C/K the K active experts hold the dense MLP's weights; the MoE adds its router and K-1 more
        c_proj biases per layer, and nothing else."""
        from runtime.metrics import active_params

        moe = make_setup().moe_config(E8)
        self.assertEqual(active_params(moe), param_count(CFG) + 2 * (ROUTER + (K2 - 1) * 16))
        self.assertEqual(active_params(moe), GPT(moe).num_params() - EXPERTS_BY_HAND + EXPERTS_BY_HAND * K2 // E8)
        self.assertEqual(active_params(moe, non_embedding=True), active_params(moe) - 32 * 16)


def moe_records(step_count: int = 5, ep_layout: Layout | None = None, setup: Setup | None = None) -> list[dict]:
    """A MoE run's metrics.jsonl: tokens per expert per step (64 tokens x k=2 = 128 a layer), skewed more each
    step; under EP the all_to_all bytes the formula gives at that load (step 4: 1000 bytes more)."""
    from bench.matrix import ep_all_to_all_at_load

    out = []
    for i in range(1, step_count + 1):
        tokens = {"0": [16 + i, 16 - i, 16, 16, 16, 16, 16, 16], "1": [16] * 8}
        r = {
            "step": i,
            "loss": 5.0,
            "tokens_per_sec": 100.0 * i,
            "mfu": 0.01,
            "step_time_ms": 1.0,
            "peak_memory_bytes": 1,
            "state_bytes": 1,
            "expert_tokens": tokens,
            "expert_load_max_over_mean": {k: max(v) * 8 / sum(v) for k, v in tokens.items()},
        }
        if ep_layout is not None:
            r["comm_bytes"] = {
                "all_reduce": 7,
                "all_to_all": ep_all_to_all_at_load(ep_layout, setup, tokens) + 1000 * (i == 4),
            }
        out.append(r)
    return out


class TestMoERows(unittest.TestCase):
    def run_moe(self, repeats: int = 2) -> tuple[list[dict], list[str]]:
        setup, calls = make_setup(), []

        def run(cmd, log_path, timeout):
            out_dir = cmd[cmd.index("--out_dir") + 1]
            name = os.path.basename(out_dir).split("-r")[0]
            calls.append(name)
            ep = moe_rows()[1] if "--expert_parallel_size" in cmd else None
            recs = moe_records(ep_layout=ep, setup=setup) if "--moe_num_experts" in cmd else records()
            with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in recs) + "\n")
            return JobResult(0, "", 1.0)

        lays = matrix(2, False, False, ["single"], include_moe=True)
        with tempfile.TemporaryDirectory() as d:
            rows = runner.run_matrix(lays, setup, d, repeats=repeats, runner=run, log=lambda s: None)
        return rows, calls

    def test_rows(self):
        rows, calls = self.run_moe()
        # the three MoE layouts back to back, their order reversed on the second repeat
        self.assertEqual(
            calls, ["single", "moe", "moe-ep-custom", "dense-active", "single", "dense-active", "moe-ep-custom", "moe"]
        )
        single, moe, ep, dense = rows
        self.assertNotIn("moe", single)  # the existing rows keep their keys
        self.assertEqual(dense["moe"]["experts"], 0)
        self.assertIsNone(dense["moe"]["per_step"])
        m = ep["moe"]
        self.assertEqual((m["experts"], m["top_k"], m["expert_hidden"], m["ep"]), (E8, K2, H32, 2))
        self.assertEqual(m["params_active"], param_count(CFG) + 2 * (ROUTER + 16))
        # measured steps 3, 4, 5 of both repeats; step 4 sent 1000 bytes more than the formula at its load
        self.assertEqual(m["all_to_all_exact_steps"], [4, 6])
        self.assertEqual(m["per_step"]["steps"], [1, 2, 3, 4, 5])
        self.assertEqual(m["max_over_mean"], {"0": 20 * 8 / 128, "1": 1.0})  # median of steps 3-5: step 4's
        self.assertEqual(moe["moe"]["max_over_mean"], m["max_over_mean"])
        self.assertNotIn("all_to_all", moe["moe"]["per_step"])  # one process: no all_to_all
        self.assertEqual(
            ep["comm_theory_by_kind"]["all_to_all"], comm_theory(moe_rows()[1], make_setup())["all_to_all"]
        )

    def test_markdown_and_heatmap(self):
        rows, _ = self.run_moe(repeats=1)
        for row, tps in zip(rows[1:], (300.0, 600.0, 400.0)):  # moe, moe-ep, dense-active
            row["tokens_per_sec"] = tps
        md = report.render_markdown(rows, {"plots": ["moe_load"]})
        self.assertIn("## Mixture of experts", md)
        self.assertIn("| moe-ep | 2 (2×1, EP 2) | 8, 2, 32 |", md)
        self.assertIn("| 2.00 | 1.50 | — | ok |", md)  # moe-ep ÷ moe, ÷ dense-active; no ddp ran
        self.assertIn("| 2 of 3 |", md)  # steps exactly at the measured load
        self.assertIn("| 1 w | 1.06 | 1.00 | 1.06 | 1.00 |", md)  # step 1 max/mean, moe then moe-ep
        self.assertIn("![moe_load](moe_load.png)", md)
        self.assertIn("moe-ep on 2 ranks runs 2.00× moe, 1.50× dense-active", report.render_section(rows))
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(
                plots.write_plots(rows, make_setup(), d), ["throughput", "memory", "comm_vs_world", "moe_load"]
            )
            self.assertTrue(os.path.getsize(os.path.join(d, "moe_load.png")) > 0)
        labels, steps, grid = plots.load_matrix(rows[2]["moe"]["per_step"], ep=2)
        self.assertEqual((len(labels), steps), (16, [1, 2, 3, 4, 5]))
        self.assertEqual((labels[3], labels[4]), ("layer 0, expert 3, rank 0", "layer 0, expert 4, rank 1"))
        self.assertEqual(grid[0], [(16 + i) / 16 for i in range(1, 6)])  # tokens / (128 / 8)
        self.assertEqual(grid[1][4], 11 / 16)

    def test_no_moe_rows_no_heatmap(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertNotIn("moe_load", plots.write_plots(TestMarkdown.rows, make_setup(), d))
            self.assertNotIn("moe_load.png", os.listdir(d))
        self.assertNotIn("Mixture of experts", report.render_markdown(TestMarkdown.rows, {}))

    def test_moe_layouts_need_the_flag(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(cli.main(["--layouts", "moe-ep"]), 2)
        self.assertIn("layouts moe-ep run only with --include_moe", err.getvalue())


if __name__ == "__main__":
    unittest.main()
