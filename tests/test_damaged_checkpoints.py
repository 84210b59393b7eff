"""Damaged checkpoints never load garbage and never need a person to clean up.

One real one-process run saves steps 1..4 (a checkpoint every step, all kept). Each test copies that run,
damages its newest checkpoint (or more) one way, and checks:
- `checkpoint.verify` names the damaged file and what is wrong with it (size, CRC-32, missing, manifest);
- `--resume` says so in one line and falls back to the newest intact checkpoint; its losses from there on
  equal the undamaged run's bit for bit (resume is bit-equal, and the fallback is an ordinary resume);
- with every checkpoint damaged, `--resume` says so and starts fresh (its losses equal the original run's);
- sample.py and export.py skip the damaged one the same way.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import pytest
import torch

from checkpoints import checkpoint
from tests.harness import ROOT, checkpoint_params, forked_ranks, make_token_bins, rank0_only, train_losses

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
    "128",
    "--eval_interval",
    "10",
    "--eval_iters",
    "1",
    "--warmup_steps",
    "1",
    "--checkpoint_interval",
    "1",
    "--keep_checkpoints",
    "10",
    "--peak_flops",
    "1e12",
]
STEPS = 4

TMP = None
ORIGINAL = None  # out_dir of the undamaged 4-step run


def setUpModule():
    global TMP, ORIGINAL
    TMP = tempfile.TemporaryDirectory()
    make_token_bins(os.path.join(TMP.name, "data"))
    ORIGINAL = os.path.join(TMP.name, "original")
    proc = forked_ranks(
        BASE + ["--max_steps", str(STEPS), "--dataset", os.path.join(TMP.name, "data"), "--out_dir", ORIGINAL]
    )[0]
    assert proc.returncode == 0, proc.stderr[-3000:]


def tearDownModule():
    TMP.cleanup()


def copy_run(name: str) -> str:
    out = os.path.join(TMP.name, name)
    shutil.copytree(ORIGINAL, out)
    return out


def exported_params(path: str, source: str) -> dict[str, torch.Tensor]:
    """name -> parameter of the safetensors file export.py wrote at `path`, read back as our GPT (the model
    config of checkpoint `source`); lm_head.weight (tied, not exported) left out."""
    from safetensors.torch import load_file

    from model.gpt import GPT

    config, sd = checkpoint.load_model(source).config, load_file(path)
    back = GPT.from_hf_state_dict(sd, vocab_size=config.vocab_size, n_head=config.n_head)
    rows = sd["transformer.wte.weight"].shape[0]  # GPT-2's 50257: export drops the padding rows
    return {
        name: p.detach()[:rows] if name == "transformer.wte.weight" else p.detach()
        for name, p in back.named_parameters()
        if name != "lm_head.weight"
    }


def same(p: torch.Tensor, full: torch.Tensor) -> bool:
    """p equals the leading p.numel() elements of `full` (a checkpoint's parameter; wte's unpadded rows)."""
    return torch.equal(p, full.reshape(-1)[: p.numel()].view(p.shape))


def ckpt(out: str, step: int) -> str:
    return checkpoint.step_dir(out, step)


def flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


DAMAGES = {  # name: (how, the words verify's message must contain)
    "truncated": (lambda d: os.truncate(os.path.join(d, "rank_00000.pt"), 1000), "is truncated"),
    "missing": (lambda d: os.remove(os.path.join(d, "rank_00000.pt")), "is missing"),
    "flipped_byte": (lambda d: flip_byte(os.path.join(d, "rank_00000.pt")), "CRC-32"),
    "garbled_manifest": (
        lambda d: open(os.path.join(d, checkpoint.MANIFEST), "w").write("{not json"),
        "cannot read manifest.json",
    ),
}


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own runs")
class TestDamagedCheckpoints(unittest.TestCase):
    def test_manifest_records_size_and_crc(self):
        path = ckpt(ORIGINAL, STEPS)
        manifest = checkpoint.read_manifest(path)
        self.assertEqual(
            manifest["file_checks"], {"rank_00000.pt": checkpoint.file_check(os.path.join(path, "rank_00000.pt"))}
        )
        self.assertEqual(checkpoint.verify(path)["step"], STEPS)

    def test_verify_names_each_damage(self):
        for name, (damage, words) in DAMAGES.items():
            with self.subTest(name):
                out = copy_run(f"verify_{name}")
                damage(ckpt(out, STEPS))
                with self.assertRaises(checkpoint.CheckpointError) as e:
                    checkpoint.verify(ckpt(out, STEPS))
                self.assertIn(words, str(e.exception))
                lines = []
                self.assertEqual(checkpoint.newest_intact(out, lines.append), ckpt(out, STEPS - 1))
                self.assertEqual(len(lines), 1, lines)

    def test_resume_falls_back_bit_equal(self):
        """Each damage to step 4: --resume names it in one line, continues from step 3, and recomputes step 4
        to the original's bits."""
        want = train_losses(ORIGINAL)
        for name, (damage, words) in DAMAGES.items():
            with self.subTest(name):
                out = copy_run(f"resume_{name}")
                damage(ckpt(out, STEPS))
                proc = forked_ranks(
                    BASE
                    + [
                        "--max_steps",
                        str(STEPS),
                        "--dataset",
                        os.path.join(TMP.name, "data"),
                        "--out_dir",
                        out,
                        "--resume",
                    ]
                )[0]
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                skipped = [ln for ln in proc.stdout.splitlines() if "skipping damaged checkpoint" in ln]
                self.assertEqual(len(skipped), 1, proc.stdout)
                self.assertIn(words, skipped[0])
                self.assertIn(f"step_{STEPS - 1:06d} ", proc.stdout)  # "resuming from .../step_000003 (...)"
                self.assertEqual(train_losses(out), want)
                self.assertEqual(checkpoint.verify(ckpt(out, STEPS))["step"], STEPS)  # re-saved intact

    def test_every_checkpoint_damaged_starts_fresh(self):
        out = copy_run("all_damaged")
        for step in range(1, STEPS + 1):
            flip_byte(os.path.join(ckpt(out, step), "rank_00000.pt"))
        proc = forked_ranks(
            BASE
            + ["--max_steps", str(STEPS), "--dataset", os.path.join(TMP.name, "data"), "--out_dir", out, "--resume"]
        )[0]
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(sum("skipping damaged checkpoint" in ln for ln in proc.stdout.splitlines()), STEPS)
        self.assertIn("no intact checkpoint", proc.stdout)
        self.assertEqual(train_losses(out), train_losses(ORIGINAL))

    def test_sample_and_export_skip_a_damaged_checkpoint(self):
        out = copy_run("sample_export")
        flip_byte(os.path.join(ckpt(out, STEPS), "rank_00000.pt"))
        for script, extra in (
            ("sample.py", ["--max_new_tokens", "4", "--num_samples", "1", "--device", "cpu"]),
            ("export.py", []),
        ):
            with self.subTest(script):
                proc = subprocess.run(
                    [sys.executable, os.path.join(ROOT, script), "--out_dir", out, *extra],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
                lines = [ln for ln in proc.stderr.splitlines() if "skipping damaged checkpoint" in ln]
                self.assertEqual(len(lines), 1, proc.stderr)
                self.assertIn(f"step_{STEPS:06d}", lines[0])
                if script == "export.py":
                    self.assertIn(f"exported {ckpt(out, STEPS - 1)} -> ", proc.stdout)
        with open(os.path.join(out, "hf", "config.json")) as f:
            self.assertIn("n_layer", json.dumps(json.load(f)))
        # the exported weights are step 3's (the intact one), which differ from step 4's
        exported = exported_params(os.path.join(out, "hf", "model.safetensors"), ckpt(out, STEPS - 1))
        older, newer = checkpoint_params(ckpt(out, STEPS - 1)), checkpoint_params(ckpt(ORIGINAL, STEPS))
        self.assertEqual(exported.keys(), older.keys())
        for name, p in exported.items():
            self.assertTrue(same(p, older[name]), name)
        self.assertFalse(all(same(p, newer[name]) for name, p in exported.items()))

    def test_named_damaged_checkpoint_is_refused_in_one_line(self):
        """export.py --checkpoint DIR names a checkpoint: a damaged one is refused (exit 2), not replaced."""
        out = copy_run("named")
        flip_byte(os.path.join(ckpt(out, STEPS), "rank_00000.pt"))
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "export.py"), "--out_dir", out, "--checkpoint", ckpt(out, STEPS)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
        self.assertIn("CRC-32", proc.stderr)


if __name__ == "__main__":
    unittest.main()
