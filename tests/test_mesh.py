"""parallel/mesh.py: every process group a run holds has the run's --timeout.

DeviceMesh builds its dims' and flattened dims' groups, and dist.new_group its groups, with the backend's
default timeout (30 min on gloo, 10 on NCCL), not the world group's. The check reads each group's own
backend options, on 4 spawned ranks, after train.build of a layout with every kind of group: pp (with the
[first, last] embedding groups), HSDP's replicate and shard dims and their flattening, and the async
checkpoint saver's gloo group.
"""

from __future__ import annotations

import os
import tempfile
import unittest

import pytest
import torch

from tests.harness import make_token_bins, run_distributed

TIMEOUT_S = 37.0


def groups_after_build(rank: int, world: int, data: str) -> list[float]:
    from torch.distributed import distributed_c10d as c10d

    import train
    from trainer.config import parse_args, validate

    out = os.path.join(data, f"out{rank}")
    plan = validate(
        parse_args(
            [
                "--model",
                "tiny",
                "--vocab_size",
                "512",
                "--n_layer",
                "2",
                "--micro_batch_size",
                "1",
                "--seq_len",
                "16",
                "--total_batch_size",
                "32",
                "--dataset",
                data,
                "--device",
                "cpu",
                "--pipeline_parallel_size",
                "2",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "fsdp",
                "--data_parallel_replicate_size",
                "2",
                "--async_checkpoint",
                "--timeout",
                str(TIMEOUT_S),
                "--out_dir",
                out,
            ]
        )
    )
    train.build(plan)
    mine = [g for g in c10d._world.pg_map if not c10d._rank_not_in_group(g)]
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in mine]


@pytest.mark.slow
class EveryGroupHasTheRunsTimeout(unittest.TestCase):
    def test_after_build(self):
        with tempfile.TemporaryDirectory() as d:
            make_token_bins(d, n_train=4000, n_val=1000)
            per_rank = run_distributed(groups_after_build, 4, d)
        for timeouts in per_rank:
            self.assertGreaterEqual(len(timeouts), 6)  # world, pp, dp_replicate, dp_shard, tp, dp, embed, saver
            self.assertEqual(timeouts, [TIMEOUT_S] * len(timeouts))


class InitGroupCalls(unittest.TestCase):
    """sim.startup.init_group_calls on torch's fake backend, against counts derived by hand. A layout's groups:
    DeviceMesh's five dims, one group per instance of each (a dim of size 1 too: W one-rank groups), plus a
    flattened dim per FLATTENED entry spanning two dims of size > 1; the expert dims (ep: W/ep groups, edp:
    W/(dp·cp/ep)); on NCCL the link groups (`link_groups(n)` colours of every pp and cp group: 2 for an even
    ring, 3 for an odd one); and with pp > 1 the pipelines' [first, last] embedding groups (none under a V
    schedule). On NCCL (eager) every family is one split_group, one world-wide call; on gloo every group is one
    new_group."""

    def count(self, backend: str, v_shape: bool = False, **dims):
        import torch.distributed as dist

        from parallel.mesh import ParallelDims
        from sim.startup import init_group_calls

        if dist.is_initialized():
            self.skipTest("counts on a fake process group of its own; this process already has one (torchrun)")
        got = init_group_calls(ParallelDims(**dims), backend, v_shape)
        return got.world_calls, got.groups, got.by_phase, got.ranks.get("embedding")

    def test_pp2_dp2_tp2(self):
        # dims: pp 8/2 = 4, dp_replicate 8, dp_shard 4, cp 8, tp 4 -> 28; links 2 x 4; embedding 4 pipelines
        embed = [[0, 4], [1, 5], [2, 6], [3, 7]]
        self.assertEqual(
            self.count("nccl", pp=2, dp=2, tp=2, world_size=8),
            (8, 40, {"mesh": (0, 5, 28), "links": (0, 2, 8), "embedding": (0, 1, 4)}, embed),
        )
        self.assertEqual(
            self.count("gloo", pp=2, dp=2, tp=2, world_size=8),
            (32, 32, {"mesh": (28, 0, 28), "embedding": (4, 0, 4)}, embed),
        )

    def test_odd_pp_with_cp(self):
        # dims: pp 12/3 = 4, dp_replicate 12, dp_shard 6, cp 6, tp 12 -> 40, + loss and fsdp flattened (dp_shard x
        # cp, 3 groups each) -> 46 by 7 splits; links: pp of 3 -> 3 colours x 4, cp of 2 -> 2 colours x 6
        embed = [[0, 8], [1, 9], [2, 10], [3, 11]]
        dims = {"pp": 3, "dp": 2, "cp": 2, "tp": 1, "world_size": 12}
        self.assertEqual(
            self.count("nccl", **dims),
            (13, 74, {"mesh": (0, 7, 46), "links": (0, 5, 24), "embedding": (0, 1, 4)}, embed),
        )
        self.assertEqual(self.count("gloo", **dims), (50, 50, {"mesh": (46, 0, 46), "embedding": (4, 0, 4)}, embed))
        self.assertEqual(
            self.count("nccl", v_shape=True, **dims), (12, 70, {"mesh": (0, 7, 46), "links": (0, 5, 24)}, None)
        )

    def test_expert_dims(self):
        # dims: 4 + 4 + 2 + 4 + 2 = 16; ep: one group of 2 per tp rank (2), edp: 2 per tp rank (4)
        self.assertEqual(self.count("nccl", dp=2, tp=2, ep=2, world_size=4), (7, 22, {"mesh": (0, 7, 22)}, None))
        self.assertEqual(self.count("gloo", dp=2, tp=2, ep=2, world_size=4), (22, 22, {"mesh": (22, 0, 22)}, None))
