"""No host sync in the hot loop: a training step's only host syncs are its end-of-step scalars.

On CUDA a scalar read (`item()`, `float()`, `bool()`), a copy between host and device from pageable memory,
a tensor made from Python data on the device, or an op whose output size depends on the data blocks the host
until the device has caught up, so one inside the step (per micro-batch, per layer) serialises the launch
queue. A CPU run cannot feel that, but it runs the same code: here every such call made from our code (the
nearest frame in this repository, tests excluded) during steps 2 and 3 of each layout family is recorded on
every rank (debug/host_sync.py: a dispatch-level recorder of the aten ops that sync on CUDA, plus `item`,
`tolist`, `cpu`, `bool`), and anything beyond its `ALLOWED` fails. Step 1 is left out: one-time setup (AdamW's
lazy state, compile) may read the host.

Not seen here: a move of an existing host tensor to the device (on the CPU it dispatches nothing):
Parallelized.forward_backward moves a step's batches once, through device.to_device (pinned,
non-blocking on CUDA); scripts/gpu_check.sh runs the steps under torch.cuda.set_sync_debug_mode("error"),
where the same recorder also sees real host <-> device copies. `TheRecorder` holds the recorder itself to
what it must see (fast, no ranks).
"""

from __future__ import annotations

import os
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from debug.host_sync import ALLOWED, ROOT, recording, unallowed
from tests.harness import make_token_bins, run_distributed

FAMILIES = {  # name -> (ranks, flags)
    "plain": (1, []),
    "ddp": (2, ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]),
    "zero1": (2, ["--data_parallel_size", "2", "--data_parallel_type", "zero1"]),
    "zero2 bf16 copies": (
        2,
        [
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "zero2",
            "--dtype",
            "bfloat16",
            "--param_dtype",
            "bfloat16",
        ],
    ),
    "fsdp": (2, ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--deferred_init"]),
    "tp+sp": (2, ["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"]),
    "pp": (2, ["--pipeline_parallel_size", "2", "--micro_batch_size", "1"]),
    "cp": (2, ["--context_parallel_size", "2", "--data_parallel_type", "ddp"]),
    "ac": (2, ["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--activation_checkpointing", "full"]),
    # the split backward (WeightGradStore's W), interleaving's middle chunks, HSDP's replica all-reduce
    "pp zb_h1": (2, ["--pipeline_parallel_size", "2", "--pp_schedule", "zb_h1", "--micro_batch_size", "1"]),
    "pp interleaved": (
        2,
        [
            "--pipeline_parallel_size",
            "2",
            "--pp_schedule",
            "interleaved_1f1b",
            "--pp_virtual_stages",
            "2",
            "--n_layer",
            "4",
            "--micro_batch_size",
            "1",
        ],
    ),
    "hsdp": (4, ["--data_parallel_size", "4", "--data_parallel_type", "fsdp", "--data_parallel_replicate_size", "2"]),
    "moe ep2": (
        2,
        [
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "ddp",
            "--expert_parallel_size",
            "2",
            "--moe_num_experts",
            "4",
            "--moe_aux_loss_coeff",
            "0.01",
            "--moe_bias_update_rate",
            "1e-3",
        ],
    ),
}


def syncs_in_families(rank: int, world: int, data: str, families: dict[str, list[str]]) -> dict[str, list]:
    """syncs_in_steps for each family, one after another in these ranks (one start for all of them)."""
    return {name: syncs_in_steps(rank, world, data, flags, name) for name, flags in families.items()}


def syncs_in_steps(rank: int, world: int, data: str, flags: list[str], name: str = "run") -> list[tuple[str, str, str]]:
    """Build the run of `flags`, train step 1, then record every host sync from our code in steps 2 and 3
    (train_step and the preemption vote, as train.run calls them): [(file, function, kind)]."""
    import train
    from trainer import faults
    from trainer.config import parse_args, validate

    out = os.path.join(data, f"{name}-out{rank}")
    spec = validate(
        parse_args(
            [
                "--model",
                "tiny",
                "--vocab_size",
                "512",
                "--n_layer",
                "2",
                "--micro_batch_size",
                "2",
                "--seq_len",
                "32",
                "--total_batch_size",
                "256",
                "--dataset",
                data,
                "--device",
                "cpu",
                "--implementation",
                "custom",
                "--gradient_clipping",
                "--out_dir",
                out,
                *flags,
            ]
        )
    )
    trainer = train.build(spec)
    trainer.faults = faults.Faults(out, rank, 60.0, spec.device)
    train.train_step(trainer, 1)
    trainer.faults.preempted()
    seen: list[tuple[str, str, str]] = []
    with recording(seen):
        for step in (2, 3):
            train.train_step(trainer, step)
            trainer.faults.preempted()
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
                        self.assertEqual(extra, [], f"{family}, rank {rank}: host syncs inside the step")


def as_ours(fn, path: str = "train.py", name: str = "train_step"):
    """`fn`, as if it were function `name` of our file `path`: the recorder places a call by its frame's code."""
    fn.__code__ = fn.__code__.replace(co_filename=os.path.join(ROOT, path), co_name=name)
    return fn


class TheRecorder(unittest.TestCase):
    """debug/host_sync.recording on one process: what it records, where, and the CUDA debugger it switches off."""

    def test_an_item_in_our_code_is_seen_once_with_its_place(self):
        from trainer import faults

        flag = faults.Preemption.__new__(faults.Preemption)  # no signal handlers installed in the test process
        flag.device, flag.signal, flag._flag, flag._work = torch.device("cpu"), None, None, None
        flag.vote()
        seen = []
        with recording(seen):
            flag.agreed()
        self.assertEqual(seen, [("trainer/faults.py", "agreed", "item")])  # its _local_scalar_dense not counted again

    def test_the_preemption_vote_makes_no_sync(self):
        """The vote's flag is filled on the device: no tensor from host data (a blocking copy on CUDA)."""
        from trainer import faults

        flag = faults.Preemption.__new__(faults.Preemption)
        flag.device, flag.signal, flag._flag, flag._work = torch.device("cpu"), "SIGTERM", None, None
        seen = []
        with recording(seen):
            flag.vote()
        self.assertEqual(seen, [])
        self.assertTrue(flag.agreed())

    def test_scalar_reads_without_a_patched_method(self):
        """float() and int() read through aten._local_scalar_dense: the dispatch-level recorder sees them
        (train_step's float(norm) did not show to the item/tolist/cpu/bool patches)."""
        t = torch.ones(2)
        seen = []
        with recording(seen):
            as_ours(lambda: (float(t[0]), int(t[1])), "parallel/grads.py", "somewhere")()
        self.assertEqual(seen, [("parallel/grads.py", "somewhere", "_local_scalar_dense")] * 2)

    def test_tensors_from_host_data_and_data_dependent_shapes(self):
        t = torch.arange(4.0)
        seen = []
        with recording(seen):
            as_ours(
                lambda: (torch.tensor([1, 2]), t[t > 1], t.nonzero(), torch.full((1,), 3.0), torch.zeros(2) + 1),
                "trainer/faults.py",
                "vote",
            )()
        self.assertEqual([k for *_, k in seen], ["lift_fresh", "index with a boolean mask", "nonzero"])

    def test_blocking_host_to_device_copies(self):
        """On a run whose device is not the CPU (meta stands in for one): a copy from pageable host memory is a
        blocking host -> device copy; ops on host tensors are not the device's syncs."""
        meta, host = torch.device("meta"), torch.ones(3)
        seen = []
        with recording(seen, device=meta):
            as_ours(
                lambda: (
                    host.to(meta),
                    torch.empty(3, device=meta).copy_(host),
                    host.sum().item(),
                    host[host > 0],
                    torch.ones(3, device=meta) * 2,
                ),
                "parallel/data_parallel/fsdp.py",
                "finish",
            )()
        self.assertEqual(
            seen,
            [("parallel/data_parallel/fsdp.py", "finish", "host-to-device copy")] * 2
            + [("parallel/data_parallel/fsdp.py", "finish", "item")],
        )  # the Python patch records every item()

    def test_audit_runs_only_allowed_places_with_the_debugger_off(self):
        """With `audit`, a sync from an ALLOWED place runs with CUDA's sync debugger off (and back on after);
        one from anywhere else runs under it, so the debugger raises on a GPU."""
        modes = []
        fake = mock.patch.multiple(torch.cuda, get_sync_debug_mode=lambda: 2, set_sync_debug_mode=modes.append)
        t = torch.ones(1)
        self.assertIn(("train.py", "train_step"), ALLOWED)
        seen = []
        with fake, recording(seen, audit=True):
            as_ours(lambda: float(t), "train.py", "train_step")()
            self.assertEqual(modes, [0, 2])
            as_ours(lambda: (float(t), t.item()), "parallel/pipeline/zero_bubble.py", "flush")()
            self.assertEqual(modes, [0, 2])
        self.assertEqual(
            unallowed(seen),
            [
                ("parallel/pipeline/zero_bubble.py", "flush", "_local_scalar_dense"),
                ("parallel/pipeline/zero_bubble.py", "flush", "item"),
            ],
        )
