"""scripts/gpu_check.sh, on the CPU: what must hold before it meets the one GPU it gets.

- The dry run, as CI runs it: every stage runs on CPU and the table has every row and no FAIL (the overlap rows
  include their canary: a read before wait() must see the unwritten buffer). About 60 s on this 2-core box,
  most of it starting Python processes and building one-rank trainers: hence `slow`.
- The script starts $PYTHON, else python3 (the GPU machine's venv has python3, and maybe no `python`).
- SIGTERM stops it within 10 s, with the finished rows on disk (a `timeout` around the check).
- A failing process-group preflight is one row, and the stages that build a group are skipped.
- Between builds: the earlier trainers are collected, each compiled build starts from a fresh dynamo, and the
  DDP path meant for the multi-rank branch takes it (the fresh-bucket multiply into the bucket's view).
"""

import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

import pytest

from tests.harness import ROOT, make_token_bins, rank0_only, spawn

SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)  # the check's modules (gpu_check, gpu_measure, ...), here and in spawned ranks
REAL_SIZE_ROWS = ("plain", "fsdp", "ddp multi-rank branch", "pp zb_h1", "moe", "ep dispatch", "muon")
ROWS = [
    "process group preflight",
    *(f"real size {p}" for p in REAL_SIZE_ROWS),  # first: what a GPU run is for, kept by a run cut short
    "train.py --compile recipe",
    "goal recipe peak within 15% of the planner's",
    "ddp vs cpu fp32",
    "ddp collectives issued",
    "fsdp vs cpu fp32",
    "fsdp collectives issued",
    "tp vs cpu fp32",
    "tp collectives issued",
    "cp ring vs sdpa",
    "cp torch twin",
    "fp16 + GradScaler",
    "fused AdamW",
    "checkpoint + --resume",
    "gpu tests",
    *(
        f"sync audit {p}"
        for p in (
            "plain",
            "ddp",
            "ddp multi-rank branch",
            "zero1",
            "zero2 bf16 copies",
            "fsdp",
            "tp+sp",
            "cp ring",
            "pp V=2",
            "pp zb_h1",
            "pp zb_h1 moe",
            "ac",
            "compile",
            "moe",
            "ep dispatch",
        )
    ),
    "overlap ddp",
    "overlap fsdp",
    "fp8",
    "goal MFU >= 45% (compile)",
    "goal fsdp >= 0.95 x plain",
    "goal ddp multi-rank branch >= 0.95 x plain",
    "goal pp zb_h1 >= 0.95 x plain",
    "goal ep dispatch >= 0.95 x moe",
    "goal reserved <= 1.15 x allocated",
]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's variables (the check starts its own process group)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTHON")
    }
    return {**env, **extra}


def table_rows(stdout: str) -> dict[str, str]:
    """The final table's {check: result}."""
    lines = stdout[stdout.index("GPU check (dry run on CPU)") :].splitlines()[3:]
    end = next(i for i, line in enumerate(lines) if re.match(r"\d+ checks: ", line))
    return dict(re.split(r"\s{2,}", line, maxsplit=2)[:2] for line in lines[:end])


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: run once, not on every torchrun rank")
class TestGpuCheckDryRun(unittest.TestCase):
    def test_every_stage_runs_and_none_fails(self):
        import torch

        proc = subprocess.run(
            ["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--dry-run"],
            cwd=ROOT,
            env=clean_env(PYTHON=sys.executable),
            capture_output=True,
            text=True,
            timeout=1500,
        )
        tail = f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        self.assertEqual(proc.returncode, 0, tail)
        self.assertTrue(proc.stdout.startswith(f"gpu_check: torch {torch.__version__} "), proc.stdout[:200])
        self.assertIn(f"GPU check (dry run on CPU), torch {torch.__version__}: ", proc.stdout)
        rows = table_rows(proc.stdout)
        self.assertEqual(list(rows), ROWS, tail)
        self.assertNotIn("FAIL", rows.values(), tail)
        self.assertEqual(rows["process group preflight"], "ok")  # gloo on the CPU, NCCL on a GPU
        self.assertEqual(rows["fused AdamW"], "ok")  # torch 2.11 and 2.13 fuse AdamW on the CPU too
        self.assertEqual(rows["gpu tests"], "skip")
        self.assertEqual(rows["cp torch twin"], "skip")
        self.assertEqual(rows["sync audit compile"], "skip")  # a CPU compile costs ~30 s: CUDA only
        self.assertEqual(rows["goal MFU >= 45% (compile)"], "skip")
        self.assertEqual(rows["goal recipe peak within 15% of the planner's"], "skip")  # CPU: RSS, not the device's
        self.assertEqual(rows["fp8"], "skip")  # not built: the row says so, it does not pass
        self.assertRegex(proc.stdout, r"real size muon +ok +.*Newton-Schulz [\d.]+ ms of a")
        self.assertRegex(proc.stdout, r"fp16 \+ GradScaler +ok +vocab 2048, 64 rows a micro-batch")
        self.assertIn(rows["goal fsdp >= 0.95 x plain"], ("met", "missed"))  # reported, never failing
        self.assertEqual(rows["goal reserved <= 1.15 x allocated"], "met")  # the CPU reserves what it allocates
        self.assertIn("46 checks: 35 ok, 0 FAIL, 6 skipped; goals ", proc.stdout)


@unittest.skipUnless(rank0_only(), "whole-job test: run once, not on every torchrun rank")
class TestTheScript(unittest.TestCase):
    def test_it_runs_PYTHON_else_python3(self):
        """The GPU machine's torch is its venv's python3; `python` may be missing there, or another interpreter."""
        with tempfile.TemporaryDirectory() as d:
            used = os.path.join(d, "used")
            for name in ("python3", "chosen"):  # shims that say they ran, then run this interpreter
                path = os.path.join(d, name)
                with open(path, "w") as f:
                    f.write(f'#!/bin/sh\necho {name} >> "{used}"\nexec "{sys.executable}" "$@"\n')
                os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
            script = os.path.join(SCRIPTS, "gpu_check.sh")
            path_env = d + os.pathsep + os.environ["PATH"]
            for env, want in (
                (clean_env(PATH=path_env), "python3"),
                (clean_env(PATH=path_env, PYTHON=os.path.join(d, "chosen")), "chosen"),
            ):
                open(used, "w").close()
                proc = subprocess.run(
                    ["bash", script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
                )
                self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
                self.assertIn("--dry-run", proc.stdout)
                with open(used) as f:
                    self.assertEqual(f.read().split(), [want])


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: run once, not on every torchrun rank")
class TestSigterm(unittest.TestCase):
    def test_sigterm_stops_it_within_10s_with_the_finished_rows_on_disk(self):
        """SIGTERM after the sync audit's first rows: the audit's trainers install faults.Preemption, whose handler
        only asks a training run to stop after its step; the check must still stop, and its rows be on disk."""
        with tempfile.TemporaryDirectory() as d:
            report = os.path.join(d, "gpu_check.md")
            proc = subprocess.Popen(
                [
                    "bash",
                    os.path.join(SCRIPTS, "gpu_check.sh"),
                    "--dry-run",
                    "--only",
                    "sync audit",
                    "overlap",
                    "--report",
                    d,
                ],
                cwd=ROOT,
                env=clean_env(PYTHON=sys.executable),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            try:
                finished = []
                deadline = time.monotonic() + 900
                while len(finished) < 2 and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                    if os.path.exists(report):
                        with open(report) as f:
                            lines = f.readlines()
                        if lines and "in progress" in lines[0]:  # not yet the final report, written whole at the end
                            finished = [ln for ln in lines if ln.startswith("| sync audit ")]
                self.assertGreaterEqual(len(finished), 2, "no sync-audit rows on disk while the check ran")
                proc.send_signal(signal.SIGTERM)
                try:
                    out, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    self.fail("the check ran on for more than 10 s after SIGTERM")
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            self.assertEqual(proc.returncode, 128 + signal.SIGTERM, err[-3000:])
            with open(report) as f:
                text = f.read()
            for row in finished:
                self.assertIn(row, text)
            self.assertIn("| stopped | FAIL | SIGTERM after ", text)
            self.assertNotIn("overlap", text)  # stopped in the audit: the stage after it never ran
            self.assertIn("GPU check (dry run on CPU)", out)  # the table of the finished rows


@unittest.skipUnless(rank0_only(), "whole-job test: run once, not on every torchrun rank")
class TestPreflight(unittest.TestCase):
    def test_a_failing_preflight_is_one_row_and_skips_the_group_stages(self):
        import gpu_check
        import gpu_preflight
        import torch.distributed as dist

        failing = [sys.executable, "-c", "import sys; sys.exit('NCCL error: unhandled system error (test)')"]
        with (
            tempfile.TemporaryDirectory() as d,
            mock.patch.object(gpu_preflight, "command", lambda device_type: failing),
            mock.patch("sys.stdout", new_callable=__import__("io").StringIO) as out,
        ):
            code = gpu_check.main(["--dry-run", "--only", "wrappers", "sync audit", "goals", "--report", d])
            with open(os.path.join(d, "gpu_check.md")) as f:
                report = f.read()
        self.assertEqual(code, 1)
        self.assertFalse(dist.is_initialized())  # no stage built a group
        rows = table_rows(out.getvalue())
        self.assertEqual(list(rows), ["process group preflight", "goals"], out.getvalue())
        self.assertEqual(rows["process group preflight"], "FAIL")
        self.assertIn("NCCL error: unhandled system error (test); skipped: wrappers, sync audit", report)
        self.assertIn("== sync audit: skipped (the process group preflight failed)", out.getvalue())


class TestEfficiency(unittest.TestCase):
    """The planner's efficiency: the GPU check's recipe row writes the measured one into <report>/efficiency.json
    under the GPU's preset, and `python -m plan` then uses it and says where it came from; without the file it
    uses 0.5 and says that it is assumed."""

    PLAN = ["--gpus", "1", "--gpus_per_node", "1", "--micro_batch_size", "64", "--total_batch_size", "65536"]
    PLAN += ["--ac", "none", "--tp", "1", "--pp", "1", "--no_cp", "--top", "1"]

    def plan(self, measured: str, *extra: str) -> list[str]:
        import contextlib
        import io

        from plan import __main__ as cli
        from plan import cluster

        out = io.StringIO()
        with (
            mock.patch.object(cluster.efficiency_for, "__defaults__", (measured,)),
            contextlib.redirect_stdout(out),
        ):
            self.assertEqual(cli.main([*self.PLAN, *extra]), 0)
        return out.getvalue().splitlines()

    def test_the_planner_uses_what_the_check_measured_and_names_it(self):
        import gpu_harness
        import gpu_measure

        with tempfile.TemporaryDirectory() as d:
            ctx = gpu_harness.Context(gpu_harness.GPU, d, "unused", report_md=os.path.join(d, "gpu_check.md"))
            path = gpu_measure.write_efficiency(ctx, "NVIDIA H100 80GB HBM3", 0.4, [{"step": 4}, {"step": 12}])
            self.assertEqual(path, os.path.join(d, "efficiency.json"))
            measured = self.plan(path)
            self.assertIn("; compute at 0.4 of peak FLOP/s (measured on NVIDIA H100 80GB HBM3, ", measured[0])
            self.assertIn(path, measured[0])
            self.assertEqual(measured[1:], self.plan(path, "--efficiency", "0.4")[1:])  # the same table
            self.assertNotEqual(measured[1:], self.plan(path, "--efficiency", "0.5")[1:])
            assumed = self.plan(os.path.join(d, "none.json"))
            self.assertIn(
                "; compute at 0.5 of peak FLOP/s (assumed, not measured: plan/cluster.py EFFICIENCY", assumed[0]
            )
            self.assertEqual(assumed[1:], self.plan(path, "--efficiency", "0.5")[1:])
            other = self.plan(path, "--gpu", "a100-80gb")  # measured on an H100: not the A100's number
            self.assertIn("compute at 0.5 of peak FLOP/s (assumed", other[0])

    def test_device_names_map_to_the_planners_presets(self):
        from plan.cluster import preset_of

        names = {
            "NVIDIA H100 80GB HBM3": "h100-sxm",
            "NVIDIA H100 PCIe": None,
            "NVIDIA H100 NVL": None,
            "NVIDIA H200": "h200",
            "NVIDIA A100-SXM4-80GB": "a100-80gb",
            "NVIDIA A100-SXM4-40GB": "a100-40gb",
            "NVIDIA L4": None,
        }
        self.assertEqual({n: preset_of(n) for n in names}, names)


def _builds_body(rank: int, world: int, data: str, tmp: str) -> dict:
    """In a fresh process (one gloo rank): the check's builds, measured (see TestBuilds)."""
    import functools
    import weakref

    import gpu_harness
    import gpu_measure
    import torch
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import train
    from model.gpt import Block

    ctx = gpu_harness.Context(gpu_harness.DRY, tmp, data)
    out = {}
    # DDP's multi-rank branch: each fresh bucket's gradient multiplied by 1/N into the bucket's view
    name = "ddp multi-rank branch"
    with gpu_measure.path_collectives(name, "real size"):
        trainer = gpu_measure.build_path(ctx, name, ctx.setup.small, "float32", 2)
        buffers = {b.buffer.untyped_storage().data_ptr() for b in trainer.parallelized.model.buckets}
        into_views, real_mul = [], torch.mul

        def mul(*args, **kwargs):
            o = kwargs.get("out")
            if o is not None:
                into_views.append(o.untyped_storage().data_ptr() in buffers)
            return real_mul(*args, **kwargs)

        with mock.patch.object(torch, "mul", mul):
            train.train_step(trainer, 1)
        out["ddp_world_size"], out["mul_into_views"] = trainer.parallelized.model.world_size, into_views
        del trainer
    # every build starts with the earlier trainers collected
    trainers, alive = [], []
    real_build = train.build

    def build(plan):
        alive.append(sum(ref() is not None for ref in trainers))
        made = real_build(plan)
        trainers.append(weakref.ref(made))
        return made

    with mock.patch.object(train, "build", build):
        gpu_measure.stage_real_size(ctx)
    out["alive_at_build"], out["real_size_rows"] = alive, [(r.check, r.status) for r in ctx.rows]
    # a compiled build at other shapes than the last one compiles afresh (an eager backend: no inductor cost)
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend="eager")):
        for flags in (ctx.setup.small, ctx.setup.throughput):  # seq_len 32, then 64
            trainer = gpu_measure.build_path(ctx, "compile", flags, "float32", 1)
            train.train_step(trainer, 1)
            del trainer
    out["block_cache_entries"] = len(_debug_get_cache_entry_list(Block.forward.__code__))
    return out


@pytest.mark.slow  # a spawned rank building 9 tiny trainers
@unittest.skipUnless(rank0_only(), "whole-job test: run once, not on every torchrun rank")
class TestBuilds(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        data = make_token_bins(os.path.join(cls.tmp.name, "data"), n_train=20_000, n_val=4_000)
        cls.out = spawn(_builds_body, 1, data, cls.tmp.name)[0]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_ddp_multi_rank_branch_multiplies_into_the_bucket_views(self):
        self.assertEqual(self.out["ddp_world_size"], 2)
        self.assertTrue(self.out["mul_into_views"])  # torch.mul(grad, 1/N, out=view): one per parameter
        self.assertTrue(all(self.out["mul_into_views"]))

    def test_each_build_starts_with_the_earlier_trainers_collected(self):
        n = len(REAL_SIZE_ROWS)
        self.assertEqual([s for _, s in self.out["real_size_rows"]], ["ok"] * n, self.out["real_size_rows"])
        self.assertEqual(self.out["alive_at_build"], [0] * n)

    def test_a_compiled_build_compiles_afresh(self):
        """Without dynamo's reset, Block.forward would hold the first shapes' entry and a dynamic-shape one."""
        self.assertEqual(self.out["block_cache_entries"], 1)


if __name__ == "__main__":
    unittest.main()
