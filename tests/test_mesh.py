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
    from config import parse_args, validate
    out = os.path.join(data, f"out{rank}")
    plan = validate(parse_args(["--model", "tiny", "--vocab_size", "512", "--n_layer", "2", "--micro_batch_size", "1",
                                "--seq_len", "16", "--total_batch_size", "32", "--dataset", data, "--device", "cpu",
                                "--pipeline_parallel_size", "2", "--data_parallel_size", "2",
                                "--data_parallel_type", "fsdp", "--data_parallel_replicate_size", "2",
                                "--async_checkpoint", "--timeout", str(TIMEOUT_S), "--out_dir", out]))
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
