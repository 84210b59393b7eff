"""The global batch of step s is a pure function of (seed, split, s), however it is split over ranks."""
import os
import tempfile
import unittest

import torch

from data.batches import BatchSource
from tests.harness import make_token_bins


class TestBatches(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = make_token_bins(os.path.join(cls.tmp.name, "d"), n_train=5000, n_val=1000)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def global_batch(self, step: int, dp: int, mb: int, rows: int = 16, seed: int = 1337, split="train"):
        """Concatenate what every (micro-step, dp rank) of a dp-way layout reads, in global row order."""
        src = BatchSource(self.dir, seq_len=32, vocab_size=50304, seed=seed)
        grad_accum = rows // (mb * dp)
        xs, ys = zip(*[src.get(split, step, rows, m * dp + r, mb) for m in range(grad_accum) for r in range(dp)])
        return torch.cat(xs), torch.cat(ys)

    def test_same_tokens_for_every_dp_split(self):
        x1, y1 = self.global_batch(5, dp=1, mb=16)
        for dp, mb in ((1, 2), (2, 4), (4, 1), (8, 2)):
            x, y = self.global_batch(5, dp=dp, mb=mb)
            self.assertTrue(torch.equal(x, x1) and torch.equal(y, y1), (dp, mb))

    def test_targets_are_next_tokens(self):
        x, y = self.global_batch(0, dp=1, mb=16)
        self.assertTrue(torch.equal(x[:, 1:], y[:, :-1]))
        self.assertEqual(x.dtype, torch.int64)

    def test_pure_function_of_seed_step_split(self):
        a, _ = self.global_batch(3, dp=2, mb=2)
        b, _ = self.global_batch(3, dp=2, mb=2)
        self.assertTrue(torch.equal(a, b))
        for other in (self.global_batch(4, dp=2, mb=2)[0], self.global_batch(3, dp=2, mb=2, seed=1)[0],
                      self.global_batch(3, dp=2, mb=2, split="val")[0]):
            self.assertFalse(torch.equal(a, other))


if __name__ == "__main__":
    unittest.main()
