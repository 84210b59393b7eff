"""The global batch of step s is a pure function of (seed, split, s), however it is split over ranks."""

import os
import tempfile
import unittest

import torch

from data.batches import BatchSource, micro_batch_chunk
from tests.harness import make_token_bins


class TestBatches(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = make_token_bins(os.path.join(cls.tmp.name, "d"), n_train=5000, n_val=1000)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def source(self, seed: int = 1337) -> BatchSource:
        return BatchSource(self.dir, seq_len=32, vocab_size=50304, seed=seed)

    def global_batch(self, step: int, dp: int, mb: int, rows: int = 16, seed: int = 1337, split="train"):
        """Concatenate what every (micro-step, dp rank) of a dp-way layout reads, in global row order."""
        src = self.source(seed)
        grad_accum = rows // (mb * dp)
        chunks = sorted(micro_batch_chunk(m, r, dp) for m in range(grad_accum) for r in range(dp))
        xs, ys = zip(*[src.get(split, step, rows, c, mb) for c in chunks])
        return torch.cat(xs), torch.cat(ys)

    def test_same_tokens_for_every_dp_split(self):
        """Over the (micro-step, dp rank) pairs of a layout, the chunks the trainer reads
        (data.batches.micro_batch_chunk) cover each row of the global batch exactly once, and the rows in
        global order are the one-process batch."""
        rows, step = 16, 5
        src = self.source()
        whole_x, whole_y = src.get("train", step, rows, 0, rows)
        for dp, mb in ((1, 16), (1, 2), (2, 8), (2, 4), (2, 1), (4, 1), (4, 2), (8, 2), (16, 1)):
            grad_accum = rows // (mb * dp)
            got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for m in range(grad_accum):
                for r in range(dp):
                    chunk = micro_batch_chunk(m, r, dp)
                    x, y = src.get("train", step, rows, chunk, mb)
                    self.assertEqual(tuple(x.shape), (mb, 32), (dp, mb))
                    for i in range(mb):
                        row = chunk * mb + i
                        self.assertNotIn(row, got, f"dp={dp} mb={mb}: row {row} read twice")
                        got[row] = (x[i], y[i])
            self.assertEqual(sorted(got), list(range(rows)), f"dp={dp} mb={mb}: rows not covered exactly once")
            x = torch.stack([got[i][0] for i in range(rows)])
            y = torch.stack([got[i][1] for i in range(rows)])
            self.assertTrue(torch.equal(x, whole_x) and torch.equal(y, whole_y), (dp, mb))

    def test_targets_are_next_tokens(self):
        x, y = self.global_batch(0, dp=1, mb=16)
        self.assertTrue(torch.equal(x[:, 1:], y[:, :-1]))
        self.assertEqual(x.dtype, torch.int64)

    def test_pure_function_of_seed_step_split(self):
        a, _ = self.global_batch(3, dp=2, mb=2)
        b, _ = self.global_batch(3, dp=2, mb=2)
        self.assertTrue(torch.equal(a, b))
        for other in (
            self.global_batch(4, dp=2, mb=2)[0],
            self.global_batch(3, dp=2, mb=2, seed=1)[0],
            self.global_batch(3, dp=2, mb=2, split="val")[0],
        ):
            self.assertFalse(torch.equal(a, other))


if __name__ == "__main__":
    unittest.main()
