"""`--trace_step` + `python -m debug diff` on real train.py runs: clean runs of other layouts agree with one
process, and a fault injected in one place (trainer/faults.py's wrong-math hooks) is named first, each time.

Five runs of the tiny model, one step each (8 rows of 64 tokens: 4 micro-batches in one process, 2 per dp rank):
one process; FSDP x2, clean; TP x2 + sequence parallelism with one TP shard of one Block's MLP bias gradient
perturbed (every other record must agree, so it is TP + SP's clean check too); DDP x2 (small buckets) with one
micro-batch's gradients dropped from one bucket on one rank; PP x2 whose last stage draws its copy of the tied
embedding under the wrong name.
"""

from __future__ import annotations

import io
import os
import tempfile
import unittest

import pytest
import torch

from debug import diff
from model.gpt import GPT, PRESETS
from parallel.data_parallel.ddp import build_buckets
from tests.harness import forked, rank0_only, shared_data

BASE = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "512",
    "--max_steps",
    "1",
    "--trace_step",
    "1",
    "--eval_iters",
    "1",
    "--warmup_steps",
    "1",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--no_checkpoint",
    "--peak_flops",
    "1e12",
    "--implementation",
    "custom",
]
TP_SP = ["--tensor_parallel_size", "2", "--sequence_parallel"]
BUCKET_MB, DROPPED = 0.25, 1  # DDP: buckets of at most 0.25 MiB; the fault drops bucket 1 (Block 0's parameters,
# but for mlp.c_proj.bias, which closes bucket 0)
DDP = ["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--bucket_cap_mb", str(BUCKET_MB)]
BIAS = "transformer.h.1.mlp.c_fc.bias"
RUNS = {
    "single": ([], 1, {}),
    "fsdp": (["--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 2, {}),
    "tp_sp_bias": (TP_SP, 2, {"GPT_FAULT_GRAD": BIAS, "GPT_FAULT_RANK": "1"}),
    "ddp_drop": (DDP, 2, {"GPT_FAULT_DDP_DROP_BUCKET": str(DROPPED), "GPT_FAULT_RANK": "1"}),
    "pp_tied": (["--pipeline_parallel_size", "2"], 2, {"GPT_FAULT_TIED_COPY": "1"}),
}


def bucket_names(k: int) -> set[str]:
    """The parameters of our DDP's bucket k for the tiny model at BUCKET_MB (the buckets every rank builds)."""
    with torch.device("meta"):
        named = [(n, p) for n, p in GPT(PRESETS["tiny"]).named_parameters()]
    return set(build_buckets(named, int(BUCKET_MB * 1024 * 1024))[k].names)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestDiffNamesTheFault(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = {}
        for name, (flags, nproc, env) in RUNS.items():
            out = os.path.join(cls.tmp.name, name)
            proc = forked([*BASE, *flags, "--dataset", shared_data(), "--out_dir", out], nproc, env=env)
            assert proc.returncode == 0, f"{name}: {proc.codes}\n" + "\n".join(proc.stderr)
            cls.out[name] = out

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def diff(self, run: str) -> tuple[int, list[str]]:
        text = io.StringIO()
        code = diff.diff(self.out["single"], self.out[run], out=text)
        return code, text.getvalue().splitlines()

    def first(self, lines: list[str]) -> str:
        return next(line for line in lines if line.startswith("first divergence")).split(": ", 1)[1]

    def test_a_clean_layout_agrees_with_one_process(self):
        code, lines = self.diff("fsdp")
        self.assertEqual(code, 0, "\n".join(lines))
        self.assertIn("tolerance 1e-05 relative", lines[2])
        # every record of one process is compared: 4 micro-batches x (32 module outputs + the loss), 36 gradients
        self.assertEqual(lines[-1], "agree: 132 forward records and 36 gradients within tolerance")

    def test_a_perturbed_tp_shard_of_a_bias_gradient_is_named_first_and_alone(self):
        """Also the clean TP x2 + SP layout's test: every other record (all outputs, 35 gradients) agrees."""
        code, lines = self.diff("tp_sp_bias")
        self.assertEqual(code, 1)
        self.assertEqual(self.first(lines), f"gradient  {BIAS}", "\n".join(lines))
        self.assertEqual(lines[-1], "1 of 168 records differ (0 forward, 1 gradients)")
        self.assertIn("128 of 256 elements differ", lines[lines.index(f"first divergence: gradient  {BIAS}") + 1])

    def test_a_dropped_ddp_bucket_is_named_by_its_first_gradient_in_backward_order(self):
        code, lines = self.diff("ddp_drop")
        self.assertEqual(code, 1)
        bucket = bucket_names(DROPPED)
        self.assertIn("transformer.h.0.mlp.c_proj.weight", bucket)
        self.assertEqual(self.first(lines), "gradient  transformer.h.0.mlp.c_proj.weight", "\n".join(lines))
        named = [line.split("gradient  ")[1] for line in lines if line.startswith(("first divergence", "then"))]
        self.assertTrue(set(named) <= bucket, f"{named} vs bucket {sorted(bucket)}")
        # every gradient of the bucket parts but c_k's bias, which is zero in exact arithmetic (softmax ignores a
        # key bias): the dropped micro-batch's share of it is rounding noise, below the floor (debug/diff.py)
        n = len(bucket) - 1
        self.assertEqual(lines[-1], f"{n} of 168 records differ (0 forward, {n} gradients)")

    def test_the_wrong_tied_copy_on_the_last_stage_is_named_at_lm_head(self):
        code, lines = self.diff("pp_tied")
        self.assertEqual(code, 1)
        self.assertEqual(self.first(lines), "forward   micro-batch 0  lm_head  (its loss)", "\n".join(lines))
        # every loss and every gradient but c_k's two biases (zero in exact arithmetic: rounding noise either way)
        self.assertTrue(lines[-1].endswith("(4 forward, 34 gradients)"), lines[-1])
