"""tests/harness.py's run bookkeeping, without training: `shared_run` and `shared_data` are replaced by stubs, so
each case takes milliseconds.

A whole-run file asks for its runs by name (WholeRuns.run, and test_zero's `run` on top of it); a later caller
of a name gets the first caller's run. That is only right if the later caller asked for the same run: the same
run_key (ranks, and what train.py's parser makes of the flags). Asked for with other flags, the name fails
loudly instead of handing out a run of other flags.
"""
import unittest
from unittest import mock

from tests import harness, test_zero
from tests.harness import WholeRuns

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


if __name__ == "__main__":
    unittest.main()
