"""parallel/comm.py's all_to_all_single on 2 spawned gloo ranks: uneven splits land on the ranks and
rows they were sent to (the data), it is counted as this rank's input bytes, and the flight recorder holds it with its
unit and a
signature debug.hang's mismatch check accepts across ranks whose first dims differ."""

from __future__ import annotations

import unittest

import torch

from debug import flight_recorder, hang
from parallel import comm
from tests.harness import run_distributed

SPLITS = {0: [1, 3], 1: [2, 0]}  # rows rank r sends to rank 0, to rank 1


def rows(rank: int) -> torch.Tensor:
    """Rank `rank`'s input: (sum of its splits, 4), every value naming its rank and row."""
    return torch.arange(sum(SPLITS[rank]) * 4, dtype=torch.float32).view(-1, 4) + 100 * rank


def exchange(rank: int, world: int) -> dict:
    comm.COUNTER.reset()
    flight_recorder.install(None, rank, world)
    recv = [SPLITS[j][rank] for j in range(world)]
    out = torch.empty(sum(recv), 4)
    comm.all_to_all_single(out, rows(rank), recv, SPLITS[rank], unit="experts")
    # what rank j sent here: its rows rows(j).split(SPLITS[j])[rank], in rank order
    ref = torch.cat([rows(j).split(SPLITS[j])[rank] for j in range(world)])
    ops = comm.RECORDER.read()["ops"]
    return {
        "equal": torch.equal(out, ref),
        "bytes": comm.COUNTER.snapshot().get("all_to_all"),
        "calls": comm.COUNTER.snapshot_calls().get("all_to_all"),
        "ops": ops,
    }


class AllToAll(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.res = run_distributed(exchange, 2)

    def test_rows_land_where_torch_puts_them(self):
        self.assertTrue(all(r["equal"] for r in self.res))

    def test_counted_as_this_ranks_input(self):
        self.assertEqual([r["bytes"] for r in self.res], [sum(SPLITS[r]) * 4 * 4 for r in range(len(self.res))])
        self.assertEqual([r["calls"] for r in self.res], [1] * len(self.res))

    def test_recorded_completed_with_its_unit_and_one_signature(self):
        ops = [r["ops"] for r in self.res]
        self.assertEqual([[(o["op"], o["state"]) for o in r] for r in ops], [[("all_to_all", "completed")]] * len(ops))
        self.assertTrue(all(r[0]["site"].endswith("[experts]") for r in ops))
        self.assertEqual(len({hang._sig(r[0]) for r in ops}), 1)  # (4 rows, 4) and (2 rows, 4): one signature


if __name__ == "__main__":
    unittest.main()
