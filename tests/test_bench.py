"""bench.py without running a benchmark: the theory against hand-derived counts, the per-step summary, the
markdown, and that a failing layout is recorded while the bench goes on (the job runner is mocked)."""
import json
import os
import tempfile
import unittest
from unittest import mock

import bench
from bench import JobResult, Layout, Setup
from model import GPT, GPTConfig

# Small enough to build for real: V=128, block 32, L=2, H=16 (2 heads)
CFG = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=16)


def make_setup(**kw) -> Setup:
    base = dict(model="tiny", config=CFG, seq_len=8, rows=8, micro_cap=8, warmup=2, steps=4, peak_flops=1e9,
                device="cpu", dataset="unused", timeout=60)
    return Setup(**{**base, **kw})


def psi_by_hand(c: GPTConfig, tp: int = 1) -> int:
    """fp32 bytes of one rank's parameters: embeddings, per block 12C^2 + 13C, ln_f; under TP the vocab,
    q/k/v/fc (weight and bias) and the row-parallel weights are split, LayerNorms, wpe and the two
    row-parallel biases are not."""
    V, P, C, L = c.vocab_size, c.block_size, c.n_embd, c.n_layer
    per_block = (3 * (C * C + C) + 4 * C * C + 4 * C) // tp + (C * C + 4 * C * C) // tp + 2 * C + 4 * C
    return 4 * (V * C // tp + P * C + L * per_block + 2 * C)


class TestTheory(unittest.TestCase):
    def test_psi_counts_the_tied_weight_once(self):
        model = GPT(CFG)
        unique = {id(p): p.numel() for p in model.parameters()}
        self.assertEqual(bench.param_bytes(CFG), 4 * sum(unique.values()))
        self.assertEqual(bench.param_bytes(CFG), psi_by_hand(CFG))

    def test_psi_of_a_tp_shard(self):
        self.assertEqual(bench.param_bytes(CFG, tp=2), psi_by_hand(CFG, tp=2))
        self.assertLess(bench.param_bytes(CFG, tp=2), bench.param_bytes(CFG))

    def test_ddp_is_psi_per_step_whatever_the_accumulation(self):
        for cap in (8, 1):  # grad_accum 1, then 4
            s = make_setup(micro_cap=cap)
            theory, _ = bench.comm_theory(Layout("ddp", "custom", dp=2), s)
            self.assertEqual(theory, {"all_reduce": psi_by_hand(CFG), "all_gather": 0, "reduce_scatter": 0})

    def test_fsdp_is_three_psi_less_the_root_per_micro_step(self):
        psi = psi_by_hand(CFG)
        root = 4 * (CFG.vocab_size * CFG.n_embd + CFG.block_size * CFG.n_embd + 2 * CFG.n_embd)
        s = make_setup(micro_cap=2)  # 8 rows over dp=2: micro 2, grad_accum 2
        self.assertEqual((s.micro_batch(2), s.grad_accum(2)), (2, 2))
        theory, _ = bench.comm_theory(Layout("fsdp", "custom", dp=2), s)
        self.assertEqual(theory, {"all_reduce": 0, "all_gather": (2 * psi - root) * 2, "reduce_scatter": psi * 2})

    def test_tp_fallback_is_megatron(self):
        B, T, C, L, V = 4, 8, CFG.n_embd, CFG.n_layer, CFG.vocab_size
        lp = bench.tp_bytes_fallback(CFG, B, T, 2, loss_parallel=True)
        self.assertEqual(lp, {"all_reduce": 4 * ((4 * L + 2) * B * T * C + 3 * B * T), "all_gather": 0,
                              "reduce_scatter": 0})
        full = bench.tp_bytes_fallback(CFG, B, T, 2, loss_parallel=False)
        self.assertEqual(full["all_gather"], 4 * B * T * V)
        self.assertEqual(sum(bench.tp_bytes_fallback(CFG, B, T, 1, True).values()), 0)

    def test_tp_fallback_agrees_with_the_tp_module(self):
        from parallel.tensor_parallel import tp_comm_bytes_per_micro_step as fn
        for lp in (True, False):
            got = fn(CFG, 4, 8, 2, lp, False, dtype_bytes=4)
            self.assertEqual({k: got.get(k, 0) for k in bench.KINDS}, bench.tp_bytes_fallback(CFG, 4, 8, 2, lp))

    def test_2d_is_dp_on_the_shard_plus_tp(self):
        s = make_setup()  # 8 rows, dp=2: micro 4, grad_accum 1
        tp, _ = bench.tp_bytes_per_micro_step(CFG, 4, 8, 2, True)
        ddp, _ = bench.comm_theory(Layout("2d-ddp", "custom", dp=2, tp=2), s)
        self.assertEqual(ddp["all_reduce"], psi_by_hand(CFG, 2) + tp["all_reduce"])
        fsdp, _ = bench.comm_theory(Layout("2d-fsdp", "custom", dp=2, tp=2), s)
        root_tp2 = 4 * (CFG.vocab_size * CFG.n_embd // 2 + CFG.block_size * CFG.n_embd + 2 * CFG.n_embd)
        self.assertEqual(fsdp["all_gather"], 2 * psi_by_hand(CFG, 2) - root_tp2 + tp["all_gather"])
        self.assertEqual(fsdp["reduce_scatter"], psi_by_hand(CFG, 2) + tp["reduce_scatter"])

    def test_fsdp_root_bytes(self):
        C = CFG.n_embd
        root = CFG.vocab_size * C + CFG.block_size * C + 2 * C  # wte (= lm_head), wpe, ln_f
        self.assertEqual(bench.param_bytes(CFG, root_only=True), 4 * root)


class TestMatrix(unittest.TestCase):
    def test_layouts(self):
        names = lambda lays: [lay.key for lay in lays]  # noqa: E731
        self.assertEqual(names(bench.matrix(2, on_gpu=False, include_2d=False)),
                         ["single", "ddp-custom", "ddp-pytorch", "fsdp-custom", "fsdp-pytorch", "tp-custom",
                          "tp-pytorch"])
        two_d = [lay for lay in bench.matrix(2, on_gpu=False, include_2d=True) if lay.name.startswith("2d")]
        self.assertEqual({(lay.dp, lay.tp) for lay in two_d}, {(2, 2)})
        self.assertEqual(len(two_d), 4)
        self.assertEqual({(lay.dp, lay.tp) for lay in bench.matrix(8, True, False) if lay.name == "2d-fsdp"},
                         {(4, 2)})
        self.assertEqual(names(bench.matrix(1, True, True)), ["single"])
        self.assertEqual(names(bench.matrix(4, False, False, ["single", "tp"])), ["single", "tp-custom", "tp-pytorch"])

    def test_train_flags(self):
        s = make_setup()
        args = s.train_args(Layout("2d-fsdp", "custom", dp=2, tp=2), "/x")
        joined = " ".join(args)
        for flag in ("--data_parallel_size 2", "--data_parallel_type fsdp", "--tensor_parallel_size 2",
                     "--enable_loss_parallelism", "--deferred_init", "--max_steps 6", "--eval_interval 7",
                     "--eval_iters 1", "--total_batch_size 64", "--micro_batch_size 4", "--implementation custom"):
            self.assertIn(flag, joined)
        self.assertNotIn("--implementation", " ".join(s.train_args(Layout("single", "none"), "/x")))

    def test_fit_heads(self):
        small = GPTConfig(n_layer=6, n_head=6, n_embd=384)
        self.assertEqual(bench.fit_heads(small, 2).n_head, 6)
        self.assertEqual(bench.fit_heads(small, 8).n_head, 8)


def records(warmup: int = 2, comm: bool = True) -> list[dict]:
    """A metrics.jsonl as train.py writes it: val lines, slow warm-up steps, then 5 measured steps."""
    out = [{"step": 0, "val_loss": 10.0}]
    tps = [10.0, 20.0, 100.0, 300.0, 200.0, 500.0, 400.0]
    for i, t in enumerate(tps, start=1):
        r = {"step": i, "loss": 5.0, "tokens_per_sec": t, "mfu": t / 1000, "step_time_ms": 1000 / t,
             "peak_memory_bytes": 1000 + i, "state_bytes": 64}
        if comm:
            r["comm_bytes"] = {"all_reduce": 10 * i, "all_gather": 0, "reduce_scatter": 1}
        out.append(r)
    out.append({"step": len(tps), "val_loss": 9.0})
    return out


class TestSummary(unittest.TestCase):
    def test_medians_after_warmup(self):
        s = bench.summarize(records(), warmup=2)
        self.assertEqual(s["measured_steps"], 5)
        self.assertEqual(s["tokens_per_sec"], 300.0)  # median of 100, 300, 200, 500, 400
        self.assertAlmostEqual(s["mfu"], 0.3)
        self.assertEqual(s["peak_memory_bytes"], 1007)
        self.assertEqual(s["state_bytes"], 64)
        self.assertEqual(s["comm_bytes_by_kind"], {"all_gather": 0, "all_reduce": 50, "reduce_scatter": 1})
        self.assertEqual(s["comm_bytes"], 51)  # median of per-step totals 31, 41, ..., 71

    def test_no_comm_and_no_steps(self):
        s = bench.summarize(records(comm=False), warmup=0)
        self.assertIsNone(s["comm_bytes"])
        self.assertEqual(s["tokens_per_sec"], 200.0)
        self.assertIsNone(bench.summarize(records(), warmup=7))

    def test_read_metrics_file(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "metrics.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in records()) + "\n")
            self.assertEqual(bench.summarize(bench.read_metrics(d), 2)["tokens_per_sec"], 300.0)
            self.assertEqual(bench.read_metrics(os.path.join(d, "none")), [])

    def test_failure_line(self):
        torchrun = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 3\n"
                    "[rank1]: RuntimeError: boom on rank 1\nE0101 elastic stuff\n"
                    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \ntrain.py FAILED\n")
        self.assertEqual(bench.failure_line(torchrun), "RuntimeError: boom on rank 1")
        self.assertEqual(bench.failure_line("train.py: error: --seq_len 9 exceeds\nmore"), "--seq_len 9 exceeds")
        self.assertEqual(bench.failure_line("just\nlast line\n"), "last line")


def fake_row(layout, impl, tps, comm=None, theory=100, status="ok", nproc=2, dp=2, tp=1) -> dict:
    return {"layout": layout, "implementation": impl, "nproc": nproc, "dp": dp, "tp": tp, "status": status,
            "tokens_per_sec": tps, "mfu": None if tps is None else 0.25, "peak_memory_bytes": 3 * bench.MiB,
            "state_bytes": bench.MiB, "comm_bytes": comm,
            "comm_bytes_by_kind": None if comm is None else {"all_reduce": comm},
            "comm_theory_bytes": theory, "comm_theory_by_kind": {"all_reduce": theory},
            "comm_ratio": comm / theory if comm is not None and theory else None, "tp_theory_source": None,
            "model": "tiny", "seq_len": 64, "global_batch_tokens": 512, "device": "cpu", "peak_flops": 5e10}


class TestMarkdown(unittest.TestCase):
    rows = [fake_row("single", "none", 1000.0, comm=0, theory=0, nproc=1, dp=1),
            fake_row("ddp", "custom", 1500.0, comm=120), fake_row("ddp", "pytorch", 1000.0),
            fake_row("fsdp", "custom", None, status="not implemented"), fake_row("fsdp", "pytorch", 900.0)]

    def test_tables(self):
        md = bench.render_markdown(self.rows, {"command": "python bench.py --quick", "machine": "box",
                                               "params": 3.4e6, "steps": 8, "warmup": 2})
        self.assertIn("python bench.py --quick", md)
        self.assertIn("| ddp | custom | 2 (2×1) | 1,500 | 25.0% | 3.0 | 1.0 |", md)
        self.assertIn("| 1.200 | ok |", md)  # measured / theory
        self.assertIn("| fsdp | custom | 2 (2×1) | — |", md)
        self.assertIn("not implemented |", md)
        self.assertIn("| ddp | 1,500 | 1,000 | 1.50 |", md)  # custom / pytorch
        self.assertIn("| fsdp | — | 900 | — |", md)
        self.assertIn("50 GFLOP/s", md)

    def test_section(self):
        sec = bench.render_section(self.rows, None)
        self.assertTrue(sec.startswith("### "))
        self.assertIn("| ddp | pytorch | 2 (2×1) | 1,000 | 25.0% | 3.0 MiB | 1.0 MiB | — (0.0 MiB) |", sec)
        self.assertIn("| fsdp | custom | 2 (2×1) | not implemented |", sec)
        self.assertIn("ddp 1.50", sec)
        self.assertEqual(bench.pair_ratios(self.rows)[0]["ratio"], 1.5)


class TestRunner(unittest.TestCase):
    """The matrix goes on past a layout that fails, raises or is not implemented; rows record why."""

    def fake_runner(self, calls):
        def run(cmd, log_path, timeout):
            out_dir = cmd[cmd.index("--out_dir") + 1]
            impl = cmd[cmd.index("--implementation") + 1] if "--implementation" in cmd else "none"
            kind = "fsdp" if "fsdp" in cmd else ("ddp" if "ddp" in cmd else "single")
            calls.append(f"{kind}-{impl}")
            if kind == "fsdp" and impl == "custom":
                return JobResult(2, "train.py: error: --implementation custom is not implemented yet for fsdp", 1.0)
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
        lays = bench.matrix(2, False, False, ["single", "ddp", "fsdp"])
        with tempfile.TemporaryDirectory() as d:
            rows = bench.run_matrix(lays, make_setup(), d, repeats=2, runner=self.fake_runner(calls),
                                    log=lambda s: None)
        status = {(r["layout"], r["implementation"]): r["status"] for r in rows}
        self.assertEqual(status, {("single", "none"): "ok", ("ddp", "custom"): "ok",
                                  ("ddp", "pytorch"): "failed: RuntimeError: gloo died",
                                  ("fsdp", "custom"): "not implemented",
                                  ("fsdp", "pytorch"): "failed: OSError: runner exploded"})
        # pairs back to back, order alternating across repeats
        self.assertEqual(calls, ["single-none", "ddp-custom", "ddp-pytorch", "fsdp-custom", "fsdp-pytorch",
                                 "single-none", "ddp-pytorch", "ddp-custom", "fsdp-pytorch", "fsdp-custom"])
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
            with mock.patch.object(bench, "probe_machine", return_value=machine), \
                    mock.patch.object(bench, "write_plots", return_value=[]), \
                    mock.patch.object(bench, "run_job", return_value=JobResult(1, "KeyError: x", 0.1)):
                rc = bench.main(["--quick", "--out", d, "--peak_flops", "1e9", "--layouts", "single,ddp",
                                 "--dataset", "unused"])
            self.assertEqual(rc, 1)  # every layout failed
            with open(os.path.join(d, "bench.json")) as f:
                rows = json.load(f)
            self.assertEqual([r["status"] for r in rows], ["failed: KeyError: x"] * 3)
            for key in ("layout", "implementation", "nproc", "tokens_per_sec", "mfu", "peak_memory_bytes",
                        "state_bytes", "comm_bytes", "comm_bytes_by_kind", "comm_theory_bytes", "comm_ratio",
                        "status"):
                self.assertIn(key, rows[0])
            for name in ("bench.md", "results_section.md", "bench_meta.json"):
                self.assertTrue(os.path.exists(os.path.join(d, name)), name)


if __name__ == "__main__":
    unittest.main()
