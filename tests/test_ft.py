"""Replica groups on torchft (ft/, docs/fault-tolerance.md): lose a group mid-step, keep the math.

Whole runs (slow): a torchft lighthouse and R replica groups, each its own torchrun job (scripts/ft_launch.py's
pieces). Every group waits before step 1 until all R are live (GPT_FT_FULL_AT), the victim group SIGKILLs its
ranks in the middle of step KILL (GPT_SIGNAL_AT_STEP: after its backward, before the cross-group reduce) and is
relaunched at once with the command that started it; the survivors run on (never restarted), redo step KILL with
the victim's micro-batches, and wait before step BACK for the victim to rejoin, which it does by healing from a
live peer. Every logged loss, grad norm and val loss of every group, and the final parameters, equal one process's
uninterrupted run of the same flags within RTOL; the metrics show the uncommitted step, the lost group, its heal and
its return, and `ft_replicas` every step.

    3 groups x 1 rank (DDP across groups), the victim group 2 (a group that writes no checkpoints);
    2 groups x 2 ranks (FSDP inside), the victim group 0: the checkpoint writer, whose role group 1 takes while
    it is away; relaunched, it loads its own checkpoint (step 3) and heals past it from group 1.

The step's M = 5 micro-steps per group layout do not split evenly between 2 or 3 groups (2 + 3, 1 + 2 + 2): a
reduction that weighs groups equally (torchft's average over the groups that answered) would be off after the
loss, as would one that keeps each group's own data slice (its global batch shrinks). Both were seen failing here.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from checkpoints import checkpoint
from ft import flags
from runtime.metrics import read_jsonl
from scripts.ft_launch import Group, Lighthouse, group_command
from tests.harness import (
    checkpoint_params,
    evals_of,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    forked,
    make_token_bins,
    run_distributed,
    steps_of,
)

# One process reorders no sum; R groups sum their shares' fp32 gradients in another order than one process's
# accumulation: the data-parallel tolerance of the layout sweep (bench/sweep.py FP32_RTOL; measured here <= 2e-7).
RTOL = 1e-5
NOISE = "attn.c_k.bias"  # a parameter whose gradient is rounding noise (test_the_final_parameters_equal_one_process)
STEPS, KILL, BACK = 10, 4, 7  # the victim dies in step KILL; the survivors wait for it before step BACK
KILL_ENV = {"GPT_SIGNAL_AT_STEP": str(KILL), "GPT_SIGNAL": "KILL", "GPT_SIGNAL_RANK": "all"}  # trainer/faults.py
BASE = [
    "--model", "tiny", "--vocab_size", "512", "--micro_batch_size", "2", "--seq_len", "32", "--max_steps", str(STEPS),
    "--eval_interval", "5", "--eval_iters", "2", "--warmup_steps", "2", "--lr", "1e-3", "--gradient_clipping",
    "--device", "cpu", "--timeout", "120",
]  # fmt: skip


def _events(out: str) -> dict[str, list[int]]:
    """event -> the steps it was logged at, in order (metrics.jsonl's `ft_event` records)."""
    out_events: dict[str, list[int]] = {}
    for r in read_jsonl(out):
        if "ft_event" in r:
            out_events.setdefault(r["ft_event"], []).append(r["step"])
    return out_events


def ft_job(tmp: str, data: str, groups: int, nproc: int, layout: list[str], victim: int, extra: list[str]) -> dict:
    """Run the job (the module docstring); returns what the checks read: each group's out_dir and log, and how
    many times each group was started and how it exited."""
    args = [*BASE, "--dataset", data, *layout, *extra]  # extra: the same flags as one process's
    out = os.path.join(tmp, "job")
    full = {"GPT_FT_FULL_AT": f"1,{BACK}"}
    with Lighthouse(heartbeat_ms=1000, log=os.path.join(tmp, "lighthouse.log")) as lighthouse:
        jobs = []
        for g in range(groups):
            cmd = group_command(args, g, groups, nproc, lighthouse.url, out)
            jobs.append(Group(g, cmd, os.path.join(tmp, f"group_{g}.log")))
            jobs[-1].start({**full, **(KILL_ENV if g == victim else {})})
        killed = jobs[victim].wait(timeout=600)
        jobs[victim].start(full)  # the command that started it, without the test hook
        codes = [j.wait(timeout=600) for j in jobs]
    logs = [open(j.log).read() for j in jobs]
    return {"out": [os.path.join(out, f"group_{g}") for g in range(groups)], "logs": logs, "killed": killed,
            "codes": codes, "starts": [len(j.starts) for j in jobs]}  # fmt: skip


def reference(tmp: str, data: str, extra: list[str]) -> str:
    """One process, the same flags less the layout and the replica groups."""
    out = os.path.join(tmp, "one_process")
    run = forked([*BASE, "--dataset", data, *extra, "--out_dir", out])
    assert run.returncode == 0, run.stderr
    return out


class FaultTolerantRun:
    """The checks of one job against one process (the module docstring); subclasses name the job."""

    GROUPS = NPROC = VICTIM = 0
    LAYOUT: list[str] = []
    EXTRA: list[str] = []

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=20_000, n_val=4_000)
        cls.job = ft_job(cls.tmp.name, data, cls.GROUPS, cls.NPROC, cls.LAYOUT, cls.VICTIM, cls.EXTRA)
        cls.ref = reference(cls.tmp.name, data, cls.EXTRA)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def survivors(self) -> list[int]:
        return [g for g in range(self.GROUPS) if g != self.VICTIM]

    def test_the_victim_died_mid_step_and_the_others_never_restarted(self):
        job = self.job
        self.assertEqual(job["killed"], 1, job["logs"][self.VICTIM][-3000:])  # torchrun: a worker died (SIGKILL)
        self.assertIn(f"GPT_SIGNAL_AT_STEP={KILL}: rank 0 sends itself SIGKILL", job["logs"][self.VICTIM])
        self.assertEqual(job["codes"], [0] * self.GROUPS, "\n".join(log[-3000:] for log in job["logs"]))
        self.assertEqual([job["starts"][g] for g in self.survivors()], [1] * (self.GROUPS - 1))
        self.assertEqual(job["starts"][self.VICTIM], 2)

    def test_every_loss_equals_one_process(self):
        want, want_evals = steps_of(self.ref), evals_of(self.ref)
        for g, out in enumerate(self.job["out"]):
            got = steps_of(out)
            steps = list(range(1, STEPS + 1)) if g != self.VICTIM else [*range(1, KILL), *range(BACK, STEPS + 1)]
            self.assertEqual(sorted(got), steps, f"group {g}")
            for s in steps:
                for key in ("loss", "grad_norm"):
                    self.assertLessEqual(
                        abs(got[s][key] - want[s][key]), RTOL * abs(want[s][key]), f"group {g} step {s} {key}"
                    )
            for s, v in evals_of(out).items():
                self.assertLessEqual(abs(v - want_evals[s]), RTOL * abs(want_evals[s]), f"group {g} val loss at {s}")

    def test_the_final_parameters_equal_one_process(self):
        """||a - b|| <= RTOL ||b|| per tensor, but the attention key biases: their gradient is zero in exact arithmetic
        (softmax ignores a constant added to every score of a query), so AdamW moves them by rounding noise, which
        another order of the sums redraws; they are held to RTOL of the whole model's norm (as tests/test_tp.py)."""
        final = checkpoint.newest(self.job["out"][0])  # group 0 writes at the end: the first live group
        self.assertEqual(final, checkpoint.step_dir(self.job["out"][0], STEPS))
        got, want = checkpoint_params(final), checkpoint_params(checkpoint.newest(self.ref))
        self.assertEqual(got.keys(), want.keys())
        whole = sum(float(w.double().norm() ** 2) for w in want.values()) ** 0.5
        for name, p in got.items():
            scale = whole if NOISE in name else float(want[name].double().norm())
            self.assertLessEqual(float((p - want[name]).double().norm()), RTOL * scale, name)

    def test_the_metrics_show_the_loss_and_the_return(self):
        live = {s: self.GROUPS - (KILL <= s < BACK) for s in range(1, STEPS + 1)}
        runs = [steps_of(out) for out in self.job["out"]]
        for s in range(1, STEPS + 1):  # the live groups' shares make up the step's 5 micro-steps
            self.assertEqual(sum(run[s]["ft_micro_steps"] for run in runs if s in run), 5, f"step {s}")
        for g in self.survivors():
            self.assertEqual({s: r["ft_replicas"] for s, r in runs[g].items()}, live, f"group {g}")
            events = _events(self.job["out"][g])
            self.assertEqual(events.get("uncommitted"), [KILL], f"group {g}: {events}")
            self.assertEqual(events.get("lost"), [KILL], f"group {g}: {events}")
            self.assertEqual(events.get("joined")[-1], BACK, f"group {g}: {events}")
        events = _events(self.job["out"][self.VICTIM])
        self.assertEqual(events.get("healed"), [BACK], events)
        self.assertIn("ft: replica group", self.job["logs"][self.VICTIM])


@pytest.mark.slow
class TestThreeGroupsOfOneRank(FaultTolerantRun, unittest.TestCase):
    """3 groups x 1 rank; group 2 (not the writer) is lost and comes back; group 0 writes every checkpoint."""

    GROUPS, NPROC, VICTIM = 3, 1, 2
    EXTRA = ["--total_batch_size", "320"]  # 5 micro-batches of 2 x 32 tokens

    def test_only_the_first_live_group_writes_checkpoints(self):
        self.assertEqual([s for s, _ in checkpoint.list_checkpoints(self.job["out"][0])], [STEPS])
        for out in self.job["out"][1:]:
            self.assertEqual(checkpoint.list_checkpoints(out), [])


@pytest.mark.slow
class TestTwoGroupsOfTwoFsdpRanks(FaultTolerantRun, unittest.TestCase):
    """2 groups x 2 ranks of FSDP; group 0, the checkpoint writer, is lost: group 1 writes while it is away."""

    GROUPS, NPROC, VICTIM = 2, 2, 0
    LAYOUT = ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"]
    EXTRA = ["--total_batch_size", "640", "--checkpoint_interval", "3"]  # 5 micro-steps of 2 ranks x 2 x 32 tokens

    def test_the_writer_role_moves_to_a_live_group_and_back(self):
        self.assertEqual([s for s, _ in checkpoint.list_checkpoints(self.job["out"][0])], [3, 9, STEPS])
        self.assertEqual([s for s, _ in checkpoint.list_checkpoints(self.job["out"][1])], [6])
        log = self.job["logs"][0]
        self.assertIn("resuming from", log)  # its own checkpoint of step 3, then the heal past it
        self.assertLess(log.index("resuming from"), log.index("healed with step"))


@pytest.mark.slow
class TestLauncher(unittest.TestCase):
    """scripts/ft_launch.py: the lighthouse and 2 groups; the first rank to reach the middle of step KILL SIGKILLs
    itself (once: GPT_SIGNAL_MARKER); the launcher relaunches its group with its command, and it heals."""

    def test_a_dead_group_is_relaunched_and_heals(self):
        from scripts import ft_launch

        with tempfile.TemporaryDirectory() as tmp:
            data = make_token_bins(os.path.join(tmp, "data"), n_train=20_000, n_val=4_000)
            env = {**KILL_ENV, "GPT_SIGNAL_MARKER": os.path.join(tmp, "killed"), "GPT_FT_FULL_AT": f"1,{BACK}"}
            argv = ["--groups", "2", "--out_dir", os.path.join(tmp, "job"), "--heartbeat_ms", "1000", "--"]
            before = {sig: signal.getsignal(sig) for sig in ft_launch.SIGNALS}
            with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(io.StringIO()) as out:
                code = ft_launch.main([*argv, *BASE, "--dataset", data, "--total_batch_size", "320"])
            self.assertEqual(code, 0, out.getvalue())
            # its handlers are the job's only: left installed, this process ignores SIGTERM, and so does every
            # process it forks after (a FineWeb pool's workers then outlive the pool's terminate: a hang)
            self.assertEqual({sig: signal.getsignal(sig) for sig in ft_launch.SIGNALS}, before)
            self.assertIn("exited 1: relaunching it (1)", out.getvalue())
            healed = [_events(os.path.join(tmp, "job", f"group_{g}")).get("healed") for g in (0, 1)]
            self.assertIn([BACK], healed, out.getvalue())


# ----------------------------------------------------------------------------- without a job


class TestShares(unittest.TestCase):
    def test_every_micro_step_goes_to_exactly_one_group(self):
        for units in range(1, 17):
            for live in range(1, units + 1):
                cut = flags.shares(units, live)
                self.assertEqual([m for s in cut for m in s], list(range(units)))
                self.assertLessEqual(max(map(len, cut)) - min(map(len, cut)), 1)


def heal_round_trip(rank: int, world: int, data: str, out: str, layout: list[str], optimizer: str) -> dict:
    """Group A trains 2 steps; group B (the same flags), which trained step 1 on its own (a group healed mid-run, its
    ZeRO-2 full copies gathered), takes A's state as a peer sends it (ft/heal.py); both then train step 3: what
    each rank's loss, grad norm and parameters are after it."""
    import train
    from ft import heal
    from trainer.config import parse_args, validate

    args = [*HEAL_BASE, "--dataset", data, "--out_dir", out, "--optimizer", optimizer, *layout, "--no_checkpoint"]
    a, b = (train.build(validate(parse_args(args))) for _ in range(2))
    for step in (1, 2):
        train.train_step(a, step)
    train.train_step(b, 1)
    train.evaluate(b)  # a forward after the step, as a step that then does not commit: ZeRO-2 gathers its copies
    heal.load(heal.state(a.parallelized, a.optimizer, 2, 0), b.parallelized, b.optimizer)
    out = {}
    for name, t in (("a", a), ("b", b)):
        m = train.train_step(t, 3)
        params = [p.detach().clone() for p in t.model.parameters()]
        out[name] = (m["loss"], m["grad_norm"], params)
    return out


HEAL_BASE = [
    "--model", "tiny", "--vocab_size", "512", "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size",
    "128", "--max_steps", "4", "--warmup_steps", "1", "--eval_iters", "1", "--device", "cpu", "--peak_flops", "1e12",
]  # fmt: skip


class TestHeal(unittest.TestCase):
    """A healed group continues as the peer it healed from, bit for bit: parameters, AdamW's moments and step count
    (or Muon's momentum), all in the layout's own sharding, and ZeRO-2's kept full copies refreshed. Dropping any
    of them changes step 3."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=4000, n_val=1000)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check(self, results: list[dict]) -> None:
        for r in results:
            self.assertEqual(r["a"][:2], r["b"][:2])
            for pa, pb in zip(r["a"][2], r["b"][2]):
                self.assertTrue(torch.equal(pa, pb))

    def test_one_process(self):
        for optimizer in ("adamw", "muon"):
            with self.subTest(optimizer), mock.patch.dict(os.environ, clear=True):
                out = os.path.join(self.tmp.name, f"one_{optimizer}")
                self.check([heal_round_trip(0, 1, self.data, out, [], optimizer)])

    @pytest.mark.slow
    def test_sharded_ranks(self):
        for dp_type, optimizer in (("fsdp", "adamw"), ("zero2", "muon")):
            with self.subTest(f"{dp_type} {optimizer}"):
                out = os.path.join(self.tmp.name, f"{dp_type}_{optimizer}")
                layout = ["--data_parallel_size", "2", "--data_parallel_type", dp_type]
                self.check(run_distributed(heal_round_trip, 2, self.data, out, layout, optimizer))


class TestBadInput(unittest.TestCase):
    """One line `train.py: error: ...`, exit 2, before any work (nothing written), on every rank."""

    BAD = ["--model", "tiny", "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "256"]

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=2000, n_val=500)
        cls.silent = socket.socket()  # accepts connections and never answers: a lighthouse that hangs
        cls.silent.bind(("127.0.0.1", 0))
        cls.silent.listen(8)

    @classmethod
    def tearDownClass(cls):
        cls.silent.close()
        cls.tmp.cleanup()

    def expect(self, extra: list[str], needle: str, name: str) -> None:
        expect_train_error_in_process(
            self, [*self.BAD, "--dataset", self.data, *extra], needle, os.path.join(self.tmp.name, name)
        )

    def test_replica_group_flags_without_a_lighthouse(self):
        self.expect(["--ft_replica_group", "0", "--ft_replica_groups", "2"], "it needs --ft_lighthouse", "a")

    def test_a_group_outside_the_groups(self):
        port = self.silent.getsockname()[1]
        extra = ["--ft_lighthouse", f"http://127.0.0.1:{port}", "--ft_replica_group", "2", "--ft_replica_groups", "2"]
        self.expect(extra, "--ft_replica_group 2 is outside the 2 groups", "b")

    def test_a_lighthouse_that_never_answers(self):
        port = self.silent.getsockname()[1]
        extra = ["--ft_lighthouse", f"http://127.0.0.1:{port}", "--ft_replica_group", "0", "--ft_replica_groups", "2"]
        self.expect([*extra, "--ft_connect_timeout", "0.5"], "no answer within --ft_connect_timeout 0.5s", "c")

    def test_fewer_micro_steps_than_groups(self):
        port = self.silent.getsockname()[1]
        extra = ["--ft_lighthouse", f"http://127.0.0.1:{port}", "--ft_replica_group", "0", "--ft_replica_groups", "5"]
        self.expect(extra, "needs at least 5 micro-steps per step", "d")

    @pytest.mark.slow
    def test_on_every_rank(self):
        url = f"http://127.0.0.1:{self.silent.getsockname()[1]}"
        cases = {
            "it needs --ft_lighthouse": ["--ft_replica_groups", "2"],
            "is outside": ["--ft_lighthouse", url, "--ft_replica_group", "3", "--ft_replica_groups", "2"],
            "no answer within": [
                *("--ft_lighthouse", url, "--ft_replica_group", "0", "--ft_replica_groups", "2"),
                *("--ft_connect_timeout", "0.5"),
            ],
        }
        for i, (needle, extra) in enumerate(cases.items()):
            args = [*self.BAD, "--dataset", self.data, "--data_parallel_size", "2", "--data_parallel_type", "ddp"]
            expect_train_error_on_ranks(self, [*args, *extra], needle, 2, os.path.join(self.tmp.name, f"ranks_{i}"))


if __name__ == "__main__":
    unittest.main()
