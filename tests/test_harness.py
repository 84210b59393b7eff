"""tests/harness.py's bookkeeping, without training: `shared_run` and `shared_data` are replaced by stubs, and
Measurements' ranks run one after another in this process, so each case takes milliseconds (but the two that
start real ranks, marked slow).

A whole-run file asks for its runs by name (WholeRuns.run, and test_zero's `run` on top of it); a later caller
of a name gets the first caller's run. That is only right if the later caller asked for the same run: the same
run_key (ranks, and what train.py's parser makes of the flags). Asked for with other flags, the name fails
loudly instead of handing out a run of other flags.
"""

import atexit
import os
import tempfile
import unittest
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from tests import harness, test_zero
from tests.harness import MeasurementError, Measurements, WholeRuns

BASE = ["--model", "tiny", "--max_steps", "2"]


class RunsByName(unittest.TestCase):
    def setUp(self):
        self.trained: list[tuple[list[str], int, str]] = []

        def shared_run(args, nproc, name="run"):
            self.trained.append((list(args), nproc, name))
            return f"/runs/{len(self.trained)}-{name}"

        for target, stub in (("shared_run", shared_run), ("shared_data", lambda: "/data")):
            patcher = mock.patch.object(harness, target, stub)
            patcher.start()
            self.addCleanup(patcher.stop)

    def test_same_flags_reuse_the_run(self):
        """Flag order and a default spelled out (--seed 1337) do not make another run."""
        runs = WholeRuns(BASE)
        first = runs.run("a", ["--lr", "1e-3", "--no_checkpoint"], 2)
        self.assertEqual(runs.run("a", ["--no_checkpoint", "--lr", "1e-3", "--seed", "1337"], 2), first)
        self.assertEqual((runs["a"], len(self.trained)), (first, 1))
        self.assertEqual(runs.argv["a"], [*BASE, "--dataset", "/data", "--lr", "1e-3", "--no_checkpoint"])

    def test_other_flags_under_the_same_name_fail(self):
        runs = WholeRuns(BASE)
        runs.run("a", ["--lr", "1e-3"], 2)
        with self.assertRaisesRegex(AssertionError, r"run 'a' asked for with other flags.*'lr', '0\.002'"):
            runs.run("a", ["--lr", "2e-3"], 2)
        with self.assertRaisesRegex(AssertionError, "2 ranks vs 4"):
            runs.run("a", ["--lr", "1e-3"], 4)
        self.assertEqual(len(self.trained), 1)

    def test_another_name_may_share_the_run_key(self):
        """Two names with the same flags both go to shared_run, which trains the key once (per session)."""
        runs = WholeRuns(BASE)
        runs.run("a", ["--lr", "1e-3"], 2)
        runs.run("b", ["--lr", "1e-3"], 2)
        self.assertEqual([name for *_, name in self.trained], ["a", "b"])

    def test_zero_run_by_name_with_other_flags_fails(self):
        """test_zero's `run`: a name alone returns the finished run; a name with other flags is refused."""
        with mock.patch.object(test_zero, "RUNS", WholeRuns(test_zero.BASE)):
            out = test_zero.run("ddp", test_zero.dp("ddp"), 2)
            self.assertEqual(test_zero.run("ddp"), out)
            with self.assertRaisesRegex(AssertionError, "run 'ddp' asked for with other flags"):
                test_zero.run("ddp", test_zero.dp("zero1"), 2)
        self.assertEqual(len(self.trained), 1)


class MeasurementsInOneRun(unittest.TestCase):
    """Measurements with run_distributed stubbed: the ranks run one after another in this process (no process
    group, so no store check), as a spawned run would hand their results back."""

    def setUp(self):
        self.starts: list[int] = []

        def run_distributed(fn, world_size, *args):
            self.starts.append(world_size)
            return [fn(rank, world_size, *args) for rank in range(world_size)]

        patcher = mock.patch.object(harness, "run_distributed", run_distributed)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_every_result_under_its_name_and_a_raise_fails_only_its_own(self):
        measures = Measurements(2)

        class Case:
            @measures.register("first")
            def measure_first(rank, world_size):
                return {"rank": rank, "of": world_size}

            @measures.register("raises")
            def measure_raises(rank, world_size):
                if rank == 1:
                    raise ValueError(f"no value on rank {rank}")
                return 0.5

            @measures.register("nothing")
            def measure_nothing(rank, world_size):
                return None

            @measures.register("after")
            def measure_after(rank, world_size):
                return [rank] * 3

        measures.run()
        measures.run()
        self.assertEqual(self.starts, [2])  # one start for every measurement, and only once
        self.assertEqual(Case.measure_first(1, 2), {"rank": 1, "of": 2})  # still a function of the class
        self.assertEqual(measures["first"], [{"rank": 0, "of": 2}, {"rank": 1, "of": 2}])
        self.assertEqual(measures["nothing"], [None, None])
        self.assertEqual(measures["after"], [[0, 0, 0], [1, 1, 1]])  # the one after a raise ran and came back
        with self.assertRaises(MeasurementError) as raised:
            measures["raises"]
        self.assertRegex(
            str(raised.exception),
            r"(?s)^measurement 'raises' raised\nrank 1:\nTraceback.*measure_raises"
            r".*ValueError: no value on rank 1\n$",
        )
        self.assertNotIn("rank 0", str(raised.exception))
        with self.assertRaisesRegex(KeyError, "no measurement 'unknown' registered"):
            measures["unknown"]
        with self.assertRaisesRegex(AssertionError, "'first' registered twice"):
            measures.register("first")(lambda rank, world_size: None)

    def test_a_failed_start_fails_every_reader_without_starting_again(self):
        measures = Measurements(2)
        measures.register("x")(lambda rank, world_size: rank)
        with mock.patch.object(harness, "run_distributed", side_effect=RuntimeError("rank 1 died")) as start:
            for _ in range(2):
                with self.assertRaisesRegex(RuntimeError, "rank 1 died"):
                    measures.run()
            with self.assertRaisesRegex(RuntimeError, "rank 1 died"):
                measures["x"]
        self.assertEqual(start.call_count, 1)


# Measured on 2 spawned ranks (module level: the ranks import this file to find them).
IN_STEP = Measurements(2)
OUT_OF_STEP = Measurements(2, peers_timeout=timedelta(seconds=2))


class _Spawned:
    @IN_STEP.register("raises_everywhere")
    def measure_raises_everywhere(rank, world_size):
        raise ValueError(f"rank {rank} raised")

    @IN_STEP.register("sum_of_ranks")
    def measure_sum_of_ranks(rank, world_size):  # a collective after a raise: the ranks are still in step
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    @IN_STEP.register("registers_an_exit_handler")
    def measure_registers_an_exit_handler(rank, world_size):
        atexit.register(open, exit_marker(os.getppid(), rank), "w")  # runs only if the rank's interpreter finalizes

    @OUT_OF_STEP.register("raises_before_a_collective")
    def measure_raises_before_a_collective(rank, world_size):
        if rank == 0:
            raise ValueError("rank 0 left before the all-reduce")
        dist.all_reduce(torch.zeros(1))  # rank 1 waits here for rank 0, which never comes

    @OUT_OF_STEP.register("never_run")
    def measure_never_run(rank, world_size):
        dist.all_reduce(torch.zeros(1))


def exit_marker(spawner: int, rank: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"harness-exit-{spawner}-{rank}")


@pytest.mark.slow
class MeasurementsOnSpawnedRanks(unittest.TestCase):
    def test_a_raise_on_every_rank_keeps_the_ranks_in_step(self):
        with self.assertRaisesRegex(MeasurementError, r"(?s)rank 0:.*rank 0 raised.*rank 1:.*rank 1 raised"):
            IN_STEP["raises_everywhere"]
        self.assertEqual(IN_STEP["sum_of_ranks"], [1.0, 1.0])

    @unittest.skipIf(harness.under_torchrun(), "torchrun's ranks are not the harness's to end")
    def test_a_spawned_rank_ends_without_finalization(self):
        """A spawned rank ends by os._exit once its group is destroyed: gloo threads that outlive
        destroy_process_group() (torch's caches can hold a group) would otherwise run into the interpreter's
        finalization, where one that drops a Python-owned tensor aborts the rank (SIGABRT; seen in CI)."""
        IN_STEP["registers_an_exit_handler"]
        for rank in range(2):
            self.assertFalse(os.path.exists(exit_marker(os.getpid(), rank)))

    @unittest.skipIf(harness.under_torchrun(), "a torchrun's rank 1 would wait in its all-reduce until the timeout")
    def test_a_raise_that_leaves_the_ranks_out_of_step_ends_the_run(self):
        """Rank 0 waits 2 s for rank 1 to finish the measurement, then ends the run (spawn then ends rank 1)
        with its error, instead of pairing rank 1's all-reduce with the next measurement's."""
        with self.assertRaisesRegex(
            ProcessRaisedException,
            r"(?s)'raises_before_a_collective' raised on rank 0 "
            r"and not every rank finished it.*out of step.*rank 0 left before",
        ):
            OUT_OF_STEP.run()


if __name__ == "__main__":
    unittest.main()
