"""Every numeric flag is range-checked before any work, and a path that cannot serve its role is refused:
one line `train.py: error: ...`, exit 2, nothing written (train.main in this process: no ranks, no data read
past validation). Whole-run and multi-rank bad-input cases are in test_train.py, test_pipeline_train.py and
test_zero.py."""
import os
import tempfile
import unittest

from tests.harness import expect_train_error_in_process, make_token_bins

BASE = ["--model", "tiny", "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "64",
        "--max_steps", "2"]

# flag value -> the words the one line must contain
CASES = {
    ("--lr", "nan"): "--lr must be a finite number > 0, got nan",
    ("--lr", "-1e-3"): "--lr must be a finite number > 0",
    ("--lr", "0"): "--lr must be a finite number > 0",
    ("--weight_decay", "inf"): "--weight_decay must be a finite number >= 0, got inf",
    ("--weight_decay", "-0.1"): "--weight_decay must be a finite number >= 0",
    ("--timeout", "0"): "--timeout must be a finite number > 0",
    ("--timeout", "-inf"): "--timeout must be a finite number > 0",
    ("--peak_flops", "nan"): "--peak_flops must be a finite number > 0",
    ("--bucket_cap_mb", "0"): "--bucket_cap_mb must be a finite number > 0",
    ("--warmup_steps", "-1"): "--warmup_steps must be >= 0",
    ("--checkpoint_interval", "-2"): "--checkpoint_interval must be >= 0",
    ("--profile", "-1"): "--profile must be >= 0",
    ("--keep_checkpoints", "0"): "--keep_checkpoints must be >= 1",
    ("--n_layer", "0"): "--n_layer must be >= 1",
    ("--n_embd", "-64"): "--n_embd must be >= 1",
    ("--block_size", "0"): "--block_size must be >= 1",
    ("--ac_every", "0"): "--ac_every must be >= 1",
    ("--eval_iters", "0"): "--eval_iters must be >= 1",
    ("--seq_len", "0"): "--seq_len must be >= 1",
    ("--lr", "fast"): "argument --lr: invalid float value: 'fast'",
    ("--activation_checkpointing", "some"): "argument --activation_checkpointing: invalid choice",
}


class TestRangesAndPaths(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=2000, n_val=500)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_numeric_flags(self):
        for (flag, value), words in CASES.items():
            with self.subTest(f"{flag} {value}"):
                expect_train_error_in_process(self, [*BASE, "--dataset", self.data, f"{flag}={value}"], words,
                                              os.path.join(self.tmp.name, "out"))

    def test_out_dir_that_is_a_file(self):
        path = os.path.join(self.tmp.name, "a_file")
        open(path, "w").write("not a directory")
        expect_train_error_in_process(self, [*BASE, "--dataset", self.data], "is a file, not a directory", path,
                                      fresh=False)
        self.assertTrue(os.path.isfile(path))  # untouched

    def test_dataset_that_is_a_file(self):
        expect_train_error_in_process(self, [*BASE, "--dataset", os.path.join(self.data, "train.bin")],
                                      "dataset", os.path.join(self.tmp.name, "out"))


if __name__ == "__main__":
    unittest.main()
