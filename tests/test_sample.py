"""sample.py and export.py on a checkpoint made here: deterministic sampling, a clear offline error, and an
export that transformers' GPT2LMHeadModel loads and GPT.from_hf_state_dict reads back.

The checkpoint comes from one in-process training step of the `tiny` preset (no process group needed);
checkpoints saved by other layouts assemble through the same loader (tests/test_checkpoint.py).
"""

import contextlib
import io
import os
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from checkpoints import checkpoint
from runtime.launch import child_env
from tests.harness import launch, make_token_bins
from trainer import resume


def setUpModule():
    global TMP, RUN
    TMP = tempfile.TemporaryDirectory()
    data = make_token_bins(os.path.join(TMP.name, "data"), n_train=20_000, n_val=4_000)
    RUN = os.path.join(TMP.name, "run")
    import train
    from trainer import config

    with mock.patch.dict(os.environ, clear=True), contextlib.redirect_stdout(io.StringIO()):
        os.environ.update(child_env())  # one process, even when the suite runs under torchrun
        args = config.parse_args(
            [
                "--model",
                "tiny",
                "--micro_batch_size",
                "2",
                "--seq_len",
                "64",
                "--total_batch_size",
                "128",
                "--max_steps",
                "1",
                "--lr",
                "3e-3",
                "--dataset",
                data,
                "--out_dir",
                RUN,
                "--checkpoint_interval",
                "1",
                "--peak_flops",
                "1e12",
                "--device",
                "cpu",
            ]
        )
        trainer = train.build(config.validate(args))
        train.train_step(trainer, 1)
        resume.save_trainer(trainer, 1)


def tearDownModule():
    TMP.cleanup()


def run_sample(*flags: str) -> str:
    import sample

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = sample.main(
            ["--out_dir", RUN, "--device", "cpu", "--num_samples", "2", "--max_new_tokens", "12", *flags]
        )
    assert code == 0, code
    return out.getvalue()


class TestSample(unittest.TestCase):
    def test_same_seed_same_text_other_seed_other_text(self):
        a, b, c = (
            run_sample("--seed", "7", "--start", "Hello"),
            run_sample("--seed", "7", "--start", "Hello"),
            run_sample("--seed", "8", "--start", "Hello"),
        )
        self.assertEqual(a, b)
        self.assertNotEqual(a, c)
        samples = a.split("---------------\n")[:-1]
        self.assertEqual(len(samples), 2)
        self.assertTrue(all(s.startswith("Hello") for s in samples), a)
        self.assertNotEqual(samples[0], samples[1])  # one generator runs on across samples

    def test_prompt_from_file_and_greedy(self):
        path = os.path.join(TMP.name, "prompt.txt")
        with open(path, "w") as f:
            f.write("To be, or not")
        greedy = run_sample("--start", f"FILE:{path}", "--temperature", "0", "--seed", "1")
        self.assertTrue(greedy.startswith("To be, or not"))
        self.assertEqual(greedy, run_sample("--start", f"FILE:{path}", "--temperature", "0", "--seed", "2"))

    def test_missing_checkpoint_is_a_one_line_error(self):
        import sample

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(sample.main(["--out_dir", os.path.join(TMP.name, "nowhere")]), 2)
        self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
        self.assertTrue(err.getvalue().startswith("sample.py: error: no intact checkpoint"), err.getvalue())

    @pytest.mark.slow
    def test_offline_hub_is_a_one_line_error(self):
        with tempfile.TemporaryDirectory() as empty:  # an empty hub cache, offline: whatever ~/.cache holds
            proc = launch(
                ["--init_from", "gpt2"],
                script="sample.py",
                timeout=120,
                env={
                    "HF_HOME": empty,
                    "HF_HUB_CACHE": empty,
                    "HUGGINGFACE_HUB_CACHE": empty,
                    "TRANSFORMERS_CACHE": empty,
                    "HF_HUB_OFFLINE": "1",
                },
            )
        self.assertEqual(proc.returncode, 2, proc.stderr[-2000:])
        self.assertEqual(len(proc.stderr.splitlines()), 1, proc.stderr[-2000:])
        self.assertTrue(
            proc.stderr.startswith("sample.py: error: --init_from gpt2: could not fetch the weights"),
            proc.stderr[-2000:],
        )


class TestExport(unittest.TestCase):
    def test_transformers_loads_it_and_it_round_trips(self):
        from safetensors.torch import load_file
        from transformers import GPT2LMHeadModel

        import export
        from model.gpt import GPT

        with contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(export.main(["--out_dir", RUN]), 0)
        hf_dir = os.path.join(RUN, "hf")
        self.assertEqual(sorted(os.listdir(hf_dir)), ["config.json", "model.safetensors"])
        ours = checkpoint.load_model(checkpoint.newest(RUN)).eval()
        hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
        self.assertEqual(hf.lm_head.weight.data_ptr(), hf.transformer.wte.weight.data_ptr())  # re-tied
        idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(hf(idx).logits, ours(idx)[0][..., :50257], rtol=1e-5, atol=1e-5)
        sd = load_file(os.path.join(hf_dir, "model.safetensors"))
        self.assertNotIn("lm_head.weight", sd)
        back = GPT.from_hf_state_dict(sd, vocab_size=ours.config.vocab_size, n_head=ours.config.n_head)
        self.assertEqual(back.config, ours.config)
        mine = dict(ours.named_parameters())
        for name, p in back.named_parameters():
            want = mine[name][:50257] if name == "transformer.wte.weight" else mine[name]
            got = p[:50257] if name == "transformer.wte.weight" else p
            self.assertTrue(torch.equal(got, want), name)


if __name__ == "__main__":
    unittest.main()
