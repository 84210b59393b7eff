"""The flight recorder (debug/flight_recorder.py) and the hang doctor (`python -m debug hang`, debug/hang.py).

Fast: the ring (records, completion, wrap-around at K, the file a killed rank leaves) and the analysis on
synthetic dumps, one per kind of finding, plus bad input (exit 2, one line).

Slow: real 2-rank train.py runs (forked ranks, --timeout 3) with a fault injected by trainer/faults.py at step 2: a rank
that skips one DDP all-reduce, one that issues it on a different shape, a pipeline stage that skips a receive
(its peer's send is left without it), a SIGSTOPped rank. Each time the report must name the op, the group and
the faulty rank, and the test fails if it names others.
"""

import contextlib
import io
import json
import os
import tempfile
import unittest

import pytest

from debug import hang
from debug.flight_recorder import FlightRecorder, decode


class FakeRecorder(FlightRecorder):
    """A ring whose groups are given by name ("name:0,1"), so it runs without a process group."""

    def _group(self, group):
        return self._intern(group), tuple(int(r) for r in group.partition(":")[2].split(","))


class FakeTensor:
    def __init__(self, *shape, dtype="float32"):
        self.shape, self.dtype = shape, f"torch.{dtype}"

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return 4


def post(rec, op, shape, group="1:0,1", peer=-1, unit=None):
    return rec.post(op, FakeTensor(*shape), group, peer, unit=unit)


class TestRing(unittest.TestCase):
    def test_records_every_field_and_completion(self):
        """Each op keeps op, group, per-group seq, shape, dtype, bytes, peer, step, micro, call site, state."""
        rec = FakeRecorder(8)
        rec.step, rec.micro = 3, 1
        a = post(rec, "all_reduce", (5, 2))
        post(rec, "all_reduce", (7,), group="2:0")
        s = post(rec, "send", (4,), peer=1)
        rec.done(a)
        ops = decode(bytes(rec._buf))["ops"]
        self.assertEqual(
            [
                (
                    o["op"],
                    o["seq"],
                    o["group"],
                    o["group_name"],
                    o["shape"],
                    o["bytes"],
                    o["peer"],
                    o["step"],
                    o["micro"],
                    o["state"],
                )
                for o in ops
            ],
            [
                ("all_reduce", 0, [0, 1], "1", [5, 2], 40, -1, 3, 1, "completed"),
                ("all_reduce", 0, [0], "2", [7], 28, -1, 3, 1, "posted"),
                ("send", 0, [0, 1], "1", [4], 16, 1, 3, 1, "posted"),
            ],
        )
        # the caller of the comm wrapper (`post` plays comm.all_reduce here)
        self.assertEqual({o["site"] for o in ops}, {f"{__name__}.test_records_every_field_and_completion"})
        self.assertEqual(ops[0]["dtype"], "float32")
        self.assertEqual(s, 2)

    def test_the_unit_a_wrapper_moves_is_part_of_the_call_site(self):
        """`unit` (a DDP bucket, an FSDP unit) follows the caller's name in brackets: ops from one line of code
        that move different units have different sites, and an op without a unit has the caller's name alone."""
        rec = FakeRecorder(8)
        for unit in ("bucket 0", "bucket 1", "transformer.h.0", None, "bucket 0"):
            post(rec, "all_reduce", (3,), unit=unit)
        here = f"{__name__}.test_the_unit_a_wrapper_moves_is_part_of_the_call_site"
        self.assertEqual(
            [o["site"] for o in decode(bytes(rec._buf))["ops"]],
            [f"{here} [bucket 0]", f"{here} [bucket 1]", f"{here} [transformer.h.0]", here, f"{here} [bucket 0]"],
        )

    def test_ring_keeps_the_last_k(self):
        rec = FakeRecorder(4)
        handles = [post(rec, "all_reduce", (i + 1,)) for i in range(10)]
        rec.done(handles[2])  # overwritten long ago: must not touch the slot that now holds op 6
        ops = decode(bytes(rec._buf))["ops"]
        self.assertEqual([o["seq"] for o in ops], [6, 7, 8, 9])
        self.assertEqual({o["state"] for o in ops}, {"posted"})

    def test_off(self):
        rec = FakeRecorder(0)
        self.assertEqual(post(rec, "all_reduce", (3,)), -1)
        self.assertEqual(rec.read()["ops"], [])

    def test_the_file_holds_the_ring_without_a_dump(self):
        """What a SIGKILLed or stopped rank leaves: its .bin, read while the recorder is still open."""
        with tempfile.TemporaryDirectory() as d:
            rec = FakeRecorder(4)
            rec.open(os.path.join(d, "flight_recorder", "rank_1.bin"), rank=1, world=2)
            post(rec, "recv", (2, 3), peer=0)
            with open(os.path.join(d, "flight_recorder", "rank_1.bin"), "rb") as f:
                got = decode(f.read())
            rec.close()
        self.assertEqual((got["rank"], got["world_size"], [o["op"] for o in got["ops"]]), (1, 2, ["recv"]))

    def test_a_recorded_group_can_die(self):
        """The ring names a group without keeping it alive: a process group the recorder held would outlive
        destroy_process_group() with its gloo threads, and such a thread can abort the process at exit (SIGABRT
        in spawned test ranks; measured: 5-6 threads left per 2-rank process after destroy, 2 with this)."""
        import gc
        import weakref
        from unittest import mock

        class Group:  # stands in for a ProcessGroup: weak-referenceable, hashed by identity, named
            group_name = "7"

        rec, group = FlightRecorder(8), Group()
        with mock.patch("torch.distributed.get_process_group_ranks", return_value=[0, 1]):
            rec.post("all_reduce", FakeTensor(3), group)
        self.assertEqual(decode(bytes(rec._buf))["ops"][0]["group_name"], "7")
        alive = weakref.ref(group)
        del group
        gc.collect()
        self.assertIsNone(alive())


class TestCompletionOnTheDevice(unittest.TestCase):
    """On NCCL the host returns from an op (enqueued, or its work's wait()) before the GPU has run it: the ring
    holds the op as in flight until its work reports completion (is_completed(); for a blocking op, a marker on
    the current stream after it). On host tensors (gloo) the return still marks it, as before."""

    class DeviceTensor(FakeTensor):
        is_cpu, device = False, type("Device", (), {"type": "cuda"})()

    class Work:
        def __init__(self):
            self.finished = False

        def wait(self) -> bool:  # NCCL: the current stream waits; the host returns at once
            return True

        def is_completed(self) -> bool:
            return self.finished

    def states(self, rec):
        return [o["state"] for o in rec.read()["ops"]]

    def test_a_device_op_stays_in_flight_until_its_work_completes(self):
        from unittest import mock

        rec, work, marker = FakeRecorder(8), self.Work(), self.Work()
        with mock.patch("runtime.device.stream_marker", return_value=marker.is_completed):
            a = rec.post("all_reduce", self.DeviceTensor(8), "1:0,1")
            handle = rec.issued(a, work, async_op=True)  # DDP's bucket: posted, then waited on
            handle.wait()
            self.assertFalse(handle.is_completed())
            b = rec.post("all_reduce", self.DeviceTensor(1), "1:0,1")
            rec.issued(b, None, async_op=False)  # the grad-norm all-reduce: blocking, no work from torch
            rec.done(rec.post("broadcast", self.DeviceTensor(2), "1:0,1"))  # comm.broadcast's own done()
            self.assertEqual(self.states(rec), ["posted", "posted", "posted"])
            work.finished = True
            self.assertEqual(self.states(rec), ["completed", "posted", "posted"])
            marker.finished = True
            rec.post("all_reduce", self.DeviceTensor(8), "1:0,1")  # a post polls the ops still in flight
            self.assertEqual(self.states(rec), ["completed", "completed", "completed", "posted"])

    def test_a_host_op_completes_when_the_host_returns(self):
        rec, work = FakeRecorder(8), self.Work()
        rec.issued(rec.post("all_reduce", FakeTensor(8), "1:0,1"), work, async_op=True).wait()
        rec.issued(rec.post("all_reduce", FakeTensor(1), "1:0,1"), None, async_op=False)
        self.assertEqual(self.states(rec), ["completed", "completed"])

    def test_the_hang_doctor_names_the_op_the_gpu_never_finished(self):
        """Rank 0's second all-reduce was enqueued and waited on, but its work never completed (rank 1 never
        issued it): `python -m debug hang` must say that rank 0 waits in it, not that it is in no comm op."""
        from unittest import mock

        work = self.Work()
        with tempfile.TemporaryDirectory() as d, mock.patch("runtime.device.stream_marker", return_value=lambda: True):
            for rank in (0, 1):
                rec = FakeRecorder(8)
                rec.open(os.path.join(d, "flight_recorder", f"rank_{rank}.bin"), rank=rank, world=2)
                rec.issued(rec.post("all_reduce", self.DeviceTensor(8), "1:0,1"), None, async_op=False)
                if rank == 0:
                    rec.issued(rec.post("all_reduce", self.DeviceTensor(4), "1:0,1"), work, async_op=True).wait()
                rec.dump(os.path.join(d, "hang", f"rank_{rank}.json"), "test")
                rec.close()
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = hang.main([d])
        text = out.getvalue()
        self.assertEqual(code, 1, text)
        self.assertIn("rank 0 (its dump): waits in all_reduce #1 float32 (4,)", text)
        self.assertIn("rank 1 never issued all_reduce #1", text)
        self.assertIn("rank(s) [0] wait in it", text)


# ----------------------------------------------------------------------------- synthetic dumps


def op(
    seq,
    name="all_reduce",
    shape=(8,),
    group=(0, 1),
    gname="1",
    site="parallel.data_parallel.ddp._launch",
    step=1,
    micro=-1,
    state="completed",
    peer=-1,
    dtype="float32",
):
    return {
        "seq": seq,
        "op": name,
        "shape": list(shape),
        "group": list(group),
        "group_name": gname,
        "site": site,
        "step": step,
        "micro": micro,
        "state": state,
        "peer": peer,
        "dtype": dtype,
        "bytes": 0,
    }


STEP = [
    ("parallel.data_parallel.ddp._launch", (8,)),
    ("parallel.data_parallel.ddp._launch", (4,)),
    ("parallel.grads.clip_grad_norm_", ()),
]


def steps(n, skip=None, shape=None, posted_from=None):
    """Rank ops for n steps of STEP's three all-reduces on group [0, 1]; `skip`/`shape`: (step, index) of an op
    left out / issued on one element fewer; ops from seq `posted_from` on are posted."""
    out = []
    for s in range(1, n + 1):
        for i, (site, sh) in enumerate(STEP):
            if (s, i) == skip:
                continue
            if (s, i) == shape:
                sh = (sh[0] - 1,)
            out.append(op(len(out), site=site, shape=sh, step=s))
    for o in out[posted_from:] if posted_from is not None else []:
        o["state"] = "posted"
    return out


def dump(rank, ops, source="dump", world=2):
    return {"rank": rank, "world_size": world, "source": source, "ops": ops}


class TestAnalysis(unittest.TestCase):
    def findings(self, dumps):
        return hang.analyze(dumps).findings

    def test_agreeing_ranks_have_no_finding(self):
        self.assertEqual(self.findings({0: dump(0, steps(3)), 1: dump(1, steps(3))}), [])

    def test_a_skipped_all_reduce_names_the_skipping_rank(self):
        """Rank 1 leaves out the first all-reduce of step 3: at that seq it issued the op that follows it."""
        f = self.findings({0: dump(0, steps(3, posted_from=6)), 1: dump(1, steps(3, skip=(3, 0), posted_from=6))})
        self.assertEqual(
            [(x.kind, x.op, x.group, x.ranks, x.seq) for x in f][:1], [("mismatch", "all_reduce", (0, 1), (1,), 6)]
        )
        self.assertIn("skipped it", f[0].text)

    def test_a_different_shape_names_the_rank_whose_shape_is_new(self):
        f = self.findings({0: dump(0, steps(3, posted_from=7)), 1: dump(1, steps(3, shape=(3, 1), posted_from=7))})
        self.assertEqual(
            [(x.kind, x.op, x.group, x.ranks, x.seq) for x in f][:1], [("mismatch", "all_reduce", (0, 1), (1,), 7)]
        )
        self.assertIn("(3,)", f[0].text)

    def test_a_send_without_its_receive(self):
        """Rank 0 sent micro-batches 0..3 to rank 1, which skipped the receive of micro 1."""
        sends = [
            op(
                m,
                "send",
                (2, 4),
                site="parallel.pipeline.runner.step",
                micro=m,
                peer=1,
                gname="3",
                state="posted" if m == 3 else "completed",
            )
            for m in range(4)
        ]
        recvs = [
            op(k, "recv", (2, 4), site="parallel.pipeline.runner.step", micro=m, peer=0, gname="3")
            for k, m in enumerate([0, 2, 3])
        ]
        f = self.findings({0: dump(0, sends), 1: dump(1, recvs)})
        self.assertEqual(
            [(x.kind, x.op, x.group, x.ranks, x.seq) for x in f], [("unmatched_send", "send", (0, 1), (1,), 3)]
        )
        self.assertIn("skipped a receive", f[0].text)

    def test_a_receive_without_its_send(self):
        recvs = [
            op(k, "recv", (2, 4), micro=k, peer=0, gname="3", state="posted" if k == 2 else "completed")
            for k in range(3)
        ]
        sends = [op(k, "send", (2, 4), micro=k, peer=1, gname="3") for k in range(2)]
        f = self.findings({0: dump(0, sends), 1: dump(1, recvs)})
        self.assertEqual([(x.kind, x.ranks, x.seq) for x in f], [("unmatched_recv", (0, 1), 2)])

    def test_a_stopped_rank_never_reached_the_op(self):
        """Rank 1 stopped after step 2: only its ring (no dump at the hang), which ends 3 ops earlier."""
        f = self.findings({0: dump(0, steps(3, posted_from=6)), 1: dump(1, steps(2), source="ring")})
        self.assertEqual(
            [(x.kind, x.op, x.group, x.ranks, x.seq) for x in f], [("not_reached", "all_reduce", (0, 1), (1,), 6)]
        )
        self.assertIn("rank(s) [0] wait in it", f[0].text)

    def test_a_rank_without_any_file(self):
        f = self.findings({0: dump(0, steps(3, posted_from=6))})
        self.assertEqual([(x.kind, x.ranks, x.seq) for x in f], [("not_reached", (1,), 6)])

    def test_a_live_rank_waiting_elsewhere_is_behind(self):
        theirs = steps(2, posted_from=3)
        mine = steps(1) + [op(0, group=(1,), gname="9", site="elsewhere", step=2, state="posted")]
        f = self.findings({0: dump(0, theirs), 1: dump(1, mine)})
        self.assertEqual([(x.kind, x.group, x.ranks, x.seq) for x in f], [("behind", (0, 1), (1,), 3)])
        self.assertIn("it waits in all_reduce #0 ", f[0].text)


class TestCommandLine(unittest.TestCase):
    def run_main(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = hang.main(list(argv))
        return code, out.getvalue(), err.getvalue()

    def write(self, d, rank, ops):
        os.makedirs(os.path.join(d, "hang"), exist_ok=True)
        with open(os.path.join(d, "hang", f"rank_{rank}.json"), "w") as f:
            json.dump({"format": "gpt-flight-recorder/1", "rank": rank, "world_size": 2, "ops": ops}, f)

    def test_exit_codes(self):
        with tempfile.TemporaryDirectory() as d:
            self.write(d, 0, steps(2))
            self.write(d, 1, steps(2))
            code, out, _ = self.run_main(d)
            self.assertEqual(code, 0, out)
            self.assertIn("no finding", out)
            self.write(d, 1, steps(2, shape=(2, 0)))
            code, out, _ = self.run_main(os.path.join(d, "hang"))  # the hang/ folder itself works too
            self.assertEqual(code, 1, out)
            self.assertIn("finding: mismatched collective #3 on group [0, 1]: rank(s) [1]", out)

    def test_an_out_dir_named_hang(self):
        """runs/hang is a run (its dumps in runs/hang/hang/): read as the run, not as some run's hang/ folder, whose
        parent (runs/) holds no dumps; its own hang/ folder still leads to it."""
        with tempfile.TemporaryDirectory() as d:
            run = os.path.join(d, "hang")
            self.write(run, 0, steps(2))
            self.write(run, 1, steps(2, shape=(2, 0)))
            for path in (run, os.path.join(run, "hang")):
                code, out, err = self.run_main(path)
                self.assertEqual(code, 1, out + err)
                self.assertIn("finding: mismatched collective #3 on group [0, 1]: rank(s) [1]", out)

    def test_bad_input_is_one_line_and_exit_2(self):
        with tempfile.TemporaryDirectory() as d:
            cases = {"empty": d, "missing": os.path.join(d, "nope")}
            for name, path in cases.items():
                code, out, err = self.run_main(path)
                self.assertEqual((code, out, len(err.splitlines())), (2, "", 1), f"{name}: {err}")
                self.assertTrue(err.startswith("debug hang: error: "), err)
            os.makedirs(os.path.join(d, "hang"))
            with open(os.path.join(d, "hang", "rank_0.json"), "w") as f:
                f.write("{not json")
            code, out, err = self.run_main(d)
            self.assertEqual((code, len(err.splitlines())), (2, 1), err)
            self.assertIn("rank_0.json: not a flight-recorder dump", err)

    def test_python_m_debug_hang(self):
        """The command a user types, in a fresh interpreter: it needs no torch (reads dumps anywhere)."""
        import subprocess
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with tempfile.TemporaryDirectory() as d:
            self.write(d, 0, steps(2))
            self.write(d, 1, steps(2, skip=(2, 0)))
            proc = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys, runpy; sys.argv = ['debug', 'hang', sys.argv[1]];"
                    " sys.modules['torch'] = None; runpy.run_module('debug', run_name='__main__')",
                    d,
                ],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=60,
            )
        self.assertEqual(proc.returncode, 1, proc.stderr)
        self.assertIn("finding: mismatched collective #3 on group [0, 1]: rank(s) [1] skipped it", proc.stdout)


# ----------------------------------------------------------------------------- real hangs

# TIMEOUT: what a step may take before the watchdog calls it a hang. 3 s fired on healthy steps of the stopped
# case when the machine ran 10 processes on 2 cores (a step of rank 0 took longer, rank 1 dumped first): the
# finding was then rank 0 "behind" instead of rank 1 stopped. 8 s is ~30x a healthy step at that load.
STEPS, FAULT_AT, TIMEOUT = 4, 2, 8
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "32",
    "--total_batch_size",
    "256",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "100",
    "--eval_iters",
    "1",
    "--warmup_steps",
    "1",
    "--peak_flops",
    "1e12",
    "--no_checkpoint",
    "--timeout",
    str(TIMEOUT),
]
DDP = ["--implementation", "custom", "--data_parallel_size", "2", "--data_parallel_type", "ddp"]
PP = ["--pipeline_parallel_size", "2"]  # 4 micro-batches of 2 rows
# name: (layout, the trainer/faults.py hook's environment)
CASES = {
    "skip": (DDP, {"GPT_COMM_FAULT": "skip", "GPT_COMM_FAULT_RANK": "1", "GPT_COMM_FAULT_STEP": str(FAULT_AT)}),
    "shape": (DDP, {"GPT_COMM_FAULT": "shape", "GPT_COMM_FAULT_RANK": "1", "GPT_COMM_FAULT_STEP": str(FAULT_AT)}),
    "no_recv": (
        PP,
        {
            "GPT_COMM_FAULT": "skip",
            "GPT_COMM_FAULT_OP": "recv",
            "GPT_COMM_FAULT_RANK": "1",
            "GPT_COMM_FAULT_STEP": str(FAULT_AT),
        },
    ),
    "stopped": (DDP, {"GPT_KILL_AT_STEP": str(FAULT_AT), "GPT_KILL_RANK": "1", "GPT_KILL_SIGNAL": "STOP"}),
}


@pytest.mark.slow
class TestHangDoctor(unittest.TestCase):
    """Each case: a 2-rank run whose rank 1 goes wrong at step 2 (CASES), then the doctor on its out_dir."""

    @classmethod
    def setUpClass(cls):
        from tests.harness import forked, shared_data

        cls.tmp = tempfile.TemporaryDirectory()
        cls.runs, cls.reports = {}, {}
        for name, (layout, env) in CASES.items():
            out = os.path.join(cls.tmp.name, name)
            cls.runs[name] = forked(
                [*BASE, *layout, "--dataset", shared_data(), "--out_dir", out], 2, env=env, timeout=120
            )
            cls.reports[name] = hang.analyze(hang.load(out))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def first(self, name):
        run, report = self.runs[name], self.reports[name]
        context = f"{name}: codes {run.codes}\n{report.text()}\n" + "\n".join(e[-1500:] for e in run.stderr)
        self.assertNotEqual(run.codes, [0, 0], context)  # it went wrong
        self.assertTrue(report.findings, context)
        return report.findings[0], context

    def test_skipped_all_reduce(self):
        f, context = self.first("skip")
        self.assertIn("GPT_COMM_FAULT=skip: rank 1 skips its all_reduce #0 of step 2", self.runs["skip"].stdout)
        self.assertEqual((f.kind, f.op, f.group, f.ranks), ("mismatch", "all_reduce", (0, 1), (1,)), context)
        self.assertIn("skipped it", f.text, context)

    def test_different_shape(self):
        f, context = self.first("shape")
        self.assertEqual((f.kind, f.op, f.group, f.ranks), ("mismatch", "all_reduce", (0, 1), (1,)), context)
        self.assertIn("issued another op", f.text, context)

    def test_send_without_receive(self):
        f, context = self.first("no_recv")
        self.assertEqual((f.kind, f.op, f.group, f.ranks), ("unmatched_send", "send", (0, 1), (1,)), context)
        self.assertIn("rank 1 skipped a receive", f.text, context)

    def test_stopped_rank(self):
        f, context = self.first("stopped")
        self.assertEqual((f.kind, f.op, f.group, f.ranks), ("not_reached", "all_reduce", (0, 1), (1,)), context)
        self.assertIn("rank(s) [0] wait in it", f.text, context)
        self.assertTrue(os.path.exists(os.path.join(self.tmp.name, "stopped", "hang", "rank_0.json")))
