"""No host sync in the hot loop: a training step's only device -> host reads are its end-of-step scalars.

On CUDA `Tensor.item()`, `tolist()`, `cpu()` and `bool(tensor)` block the host until the device has caught up,
so one inside the step (per micro-batch, per layer) serialises the launch queue. A CPU run cannot feel that,
but it runs the same code: here every such call made from our code (the nearest frame in this repository,
tests excluded) during steps 2 and 3 of each layout family is recorded on every rank (debug/host_sync.py),
and anything beyond its `ALLOWED` fails. Step 1 is left out: one-time setup (AdamW's lazy state, compile) may
read the host.

Not seen here: host -> device copies of unpinned memory (on the CPU every tensor is on the "device"):
Parallelized.forward_backward moves a step's batches once, through parallel.mesh.to_device (pinned,
non-blocking on CUDA); scripts/gpu_check.sh runs the steps under torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import os
import sys
import tempfile
import unittest

import pytest
import torch

from debug.host_sync import ours, recording, unallowed
from tests.harness import make_token_bins, run_distributed

FAMILIES = {  # name -> (ranks, flags)
    "plain": (1, []),
    "ddp": (2, ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]),
    "zero1": (2, ["--data_parallel_size", "2", "--data_parallel_type", "zero1"]),
    "zero2 bf16 copies": (2, ["--data_parallel_size", "2", "--data_parallel_type", "zero2", "--dtype", "bfloat16",
                              "--param_dtype", "bfloat16"]),
    "fsdp": (2, ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--deferred_init"]),
    "tp+sp": (2, ["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"]),
    "pp": (2, ["--pipeline_parallel_size", "2", "--micro_batch_size", "1"]),
    "cp": (2, ["--context_parallel_size", "2", "--data_parallel_type", "ddp"]),
    "ac": (2, ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--activation_checkpointing", "full"]),
}


def syncs_in_families(rank: int, world: int, data: str, families: dict[str, list[str]]) -> dict[str, list]:
    """syncs_in_steps for each family, one after another in these ranks (one start for all of them)."""
    return {name: syncs_in_steps(rank, world, data, flags, name) for name, flags in families.items()}


def syncs_in_steps(rank: int, world: int, data: str, flags: list[str], name: str = "run"
                   ) -> list[tuple[str, str, str]]:
    """Build the run of `flags`, train step 1, then record every host read from our code in steps 2 and 3
    (train_step and the preemption vote, as train.run calls them): [(file, function, kind)]."""
    import faults
    import train
    from config import parse_args, validate
    out = os.path.join(data, f"{name}-out{rank}")
    plan = validate(parse_args(["--model", "tiny", "--vocab_size", "512", "--n_layer", "2", "--micro_batch_size", "2",
                                "--seq_len", "32", "--total_batch_size", "256", "--dataset", data, "--device", "cpu",
                                "--implementation", "custom", "--gradient_clipping", "--out_dir", out, *flags]))
    t = train.build(plan)
    t.faults = faults.Faults(out, rank, 60.0, plan.device)
    train.train_step(t, 1)
    t.faults.preempted()
    seen: list[tuple[str, str, str]] = []
    with recording(seen):
        for step in (2, 3):
            train.train_step(t, step)
            t.faults.preempted()
    return seen


@pytest.mark.slow
class NoHostSyncInTheStep(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(cls.tmp.name, n_train=20_000, n_val=4_000)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_only_the_end_of_step_scalars(self):
        by_world: dict[int, dict[str, list[str]]] = {}
        for family, (world, flags) in FAMILIES.items():
            by_world.setdefault(world, {})[family] = flags
        for world, families in by_world.items():  # one start of the ranks per world size
            for rank, per_family in enumerate(run_distributed(syncs_in_families, world, self.data, families)):
                for family, seen in per_family.items():
                    with self.subTest(family=family, rank=rank):
                        extra = unallowed(seen)
                        self.assertEqual(extra, [], f"{family}, rank {rank}: host reads inside the step")

    def test_the_recorder_sees_a_sync_in_our_code(self):
        """The recorder itself: an .item() called from a function in our code is seen, with its place."""
        import faults
        flag = faults.Preemption.__new__(faults.Preemption)  # no signal handlers installed in the test process
        flag.device, flag.signal, flag._flag, flag._work = torch.device("cpu"), None, None, None
        real = torch.Tensor.item
        seen = []
        torch.Tensor.item = lambda self: (seen.append(ours(sys._getframe(1))), real(self))[1]
        try:
            flag.agreed()
        finally:
            torch.Tensor.item = real
        self.assertIn(("faults.py", "agreed"), seen)
