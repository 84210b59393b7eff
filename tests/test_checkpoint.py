"""Checkpoints: a killed run resumes bit for bit in every layout, a checkpoint loads into any other layout,
saves are atomic, and failures (NaN, a lost or stalled peer, a restarted rank) end cleanly.

Every run is a real `python train.py` / `torchrun train.py` on the stand-in corpus of tests/harness.py.
Kill and resume, per layout: run K trains STEPS steps with a checkpoint every 2 and SIGKILLs itself after
step KILL (and its checkpoint); that checkpoint is moved aside, so the resumed run R starts from the one
before and recomputes steps KILL-1 and KILL. R's losses for those steps and its state at step KILL
(parameters, both AdamW moments, step count) must equal K's bit for bit: K is the uninterrupted run.

Adding a layout is one line in LAYOUTS (it then joins the kill-and-resume tests and the load-into-every-layout
table).
"""

import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import unittest.mock
import weakref

import pytest
import torch

from checkpoints import checkpoint
from checkpoints import entries as checkpoint_entries
from runtime.memory import LargestTensor
from runtime.metrics import read_jsonl as read_metrics
from tests.harness import (
    forked,
    forked_ranks,
    free_port,
    launch,
    make_token_bins,
    rank0_only,
    spawn,
    train_losses,
    under_torchrun,
)


def _is_int64(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64


STEPS, KILL, EVERY = 6, 4, 2
BASE = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "256",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "4",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    "--checkpoint_interval",
    str(EVERY),
    "--keep_checkpoints",
    "2",
]
KINDS = ("param", "exp_avg", "exp_avg_sq")
DP2 = ["--data_parallel_size", "2"]
TP2 = ["--tensor_parallel_size", "2"]

# name: (ranks, flags)
LAYOUTS = {
    "single": (1, []),
    "ddp_custom": (2, ["--implementation", "custom", *DP2, "--data_parallel_type", "ddp"]),
    "ddp_pytorch": (2, ["--implementation", "pytorch", *DP2, "--data_parallel_type", "ddp"]),
    "fsdp_custom": (2, ["--implementation", "custom", *DP2, "--data_parallel_type", "fsdp"]),
    "fsdp_pytorch": (2, ["--implementation", "pytorch", *DP2, "--data_parallel_type", "fsdp"]),
    "tp_custom": (2, ["--implementation", "custom", *TP2]),
    "tp_pytorch": (2, ["--implementation", "pytorch", *TP2]),
    "2d_pytorch": (4, ["--implementation", "pytorch", *TP2, *DP2, "--data_parallel_type", "fsdp"]),
}


def state_of(path: str) -> tuple[dict, float]:
    """A checkpoint's full tensors (every kind) and AdamW step count."""
    return checkpoint.consolidate(path, KINDS), checkpoint.read_manifest(path)["optimizer"]["step"]


def assert_same_state(test: unittest.TestCase, a: str, b: str, what: str) -> None:
    (sa, step_a), (sb, step_b) = state_of(a), state_of(b)
    test.assertEqual(step_a, step_b, what)
    test.assertEqual(sa.keys(), sb.keys(), what)
    for name in sa:
        for kind in KINDS:
            test.assertTrue(torch.equal(sa[name][kind], sb[name][kind]), f"{what}: {name} {kind} differs")


def steps_of(out_dir: str) -> list[int]:
    return [s for s, _ in checkpoint.list_checkpoints(out_dir)]


TMP = None


def setUpModule():
    global TMP
    TMP = tempfile.TemporaryDirectory()
    make_token_bins(os.path.join(TMP.name, "data"))


def tearDownModule():
    TMP.cleanup()


def data_dir() -> str:
    return os.path.join(TMP.name, "data")


@functools.lru_cache(maxsize=None)
def kill_and_resume(layout: str) -> dict:
    """Run K (killed after step KILL) and R (--resume) for a layout; see the module docstring."""
    nproc, flags = LAYOUTS[layout]
    out = os.path.join(TMP.name, "kr", layout)
    args = BASE + flags + ["--dataset", data_dir(), "--out_dir", out]
    t0 = time.perf_counter()
    k = forked(args, nproc, env={"GPT_KILL_AT_STEP": str(KILL)})  # forked ranks: no interpreter start each
    if not os.path.isdir(checkpoint.step_dir(out, KILL)):
        raise AssertionError(f"{layout}: K did not save step {KILL}:\n{k.stdout[-3000:]}\n{k.stderr}")
    killed = [r for r in read_metrics(out) if "loss" in r]
    aside = os.path.join(TMP.name, "kr", f"{layout}-step{KILL}")
    shutil.move(checkpoint.step_dir(out, KILL), aside)  # as if K had died before saving step KILL
    first = os.path.join(TMP.name, "kr", f"{layout}-step{EVERY}")
    shutil.copytree(checkpoint.step_dir(out, EVERY), first)  # R's keep-2 pruning deletes it
    before = steps_of(out)
    r = forked(args + ["--resume"], nproc)
    return {
        "out": out,
        "k": k,
        "r": r,
        "killed": killed,
        "aside": aside,
        "first": first,
        "before": before,
        "seconds": time.perf_counter() - t0,
    }


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestKillAndResume(unittest.TestCase):
    """SIGKILLed after step KILL, resumed: the same losses and state as the uninterrupted run, bit for bit."""

    def check(self, layout: str):
        run = kill_and_resume(layout)
        k, r, out = run["k"], run["r"], run["out"]
        self.assertNotEqual(k.returncode, 0, f"{layout}: K was not killed:\n{k.stdout[-2000:]}{k.stderr}")
        self.assertIn("sends itself SIGKILL", k.stdout)
        self.assertEqual(run["before"], [EVERY])
        self.assertEqual(r.returncode, 0, f"{layout}: resume failed:\n{r.stdout[-2000:]}\n{r.stderr}")
        self.assertIn(f"resuming from {checkpoint.step_dir(out, EVERY)}", r.stdout)
        records = [rec for rec in read_metrics(out) if "loss" in rec]
        resumed = records[len(run["killed"]) :]
        self.assertEqual([rec["step"] for rec in resumed], list(range(EVERY + 1, STEPS + 1)))
        for old in run["killed"][EVERY:]:  # the steps both runs computed: identical bits
            new = resumed[old["step"] - EVERY - 1]
            self.assertEqual(
                (new["loss"], new["grad_norm"]), (old["loss"], old["grad_norm"]), f"{layout} step {old['step']}"
            )
        self.assertEqual(len(train_losses(out)), STEPS)
        evals = [rec["step"] for rec in read_metrics(out) if "val_loss" in rec]
        self.assertEqual(evals, [0, 4, 4, 6])  # step 4 was run twice; no second step-0 eval after the resume
        assert_same_state(self, checkpoint.step_dir(out, KILL), run["aside"], f"{layout} state at step {KILL}")
        self.assertEqual(steps_of(out), [KILL, STEPS])  # --keep_checkpoints 2 pruned step 2
        self.assertEqual(
            sorted(os.listdir(os.path.join(out, "checkpoints"))), [f"step_{KILL:06d}", f"step_{STEPS:06d}"]
        )  # no temporary leftovers
        print(f"\n  {layout}: kill + resume {run['seconds']:.1f}s", file=sys.stderr)


for _name in LAYOUTS:
    setattr(TestKillAndResume, f"test_{_name}", lambda self, _n=_name: self.check(_n))


def _load_everything(
    rank: int, world: int, targets: dict[str, list[str]], sources: dict[str, str], out: str
) -> list[str]:
    """Build every target layout (all of this world size) and load each source checkpoint into each. After
    each load every element this rank holds (replicas included: parameter and both moments) must equal the
    source's full tensor at that element's position, and the AdamW step must be the source's. Once per
    target: every element has exactly one designated writer over all ranks. Returns the mismatches."""
    import torch.distributed as dist

    import train
    from trainer import config

    bad, trainers = [], {}
    for target, flags in targets.items():
        args = config.parse_args(
            BASE
            + flags
            + [
                "--dataset",
                os.path.join(os.path.dirname(out), "data"),
                "--out_dir",
                os.path.join(out, target),
                "--device",
                "cpu",
            ]
        )
        trainer = trainers[target] = train.build(config.validate(args))
        entries = checkpoint_entries.entries(trainer.parallelized, trainer.optimizer)
        count = {e.name: torch.zeros(torch.Size(e.shape).numel()) for e in entries}
        for e in entries:
            count[e.name][checkpoint._positions(e.runs())] += float(e.write)
        for name, c in count.items():
            if world > 1:
                dist.all_reduce(c)
            if not bool((c == 1).all()):
                bad.append(f"{target}: {name} has elements without exactly one writer")
    for src_name, src in sources.items():
        expect = checkpoint.consolidate(src, KINDS)
        saved_step = checkpoint.read_manifest(src)["optimizer"]["step"]
        for target, trainer in trainers.items():
            what = f"{src_name} -> {target}"
            checkpoint.load(
                src,
                checkpoint_entries.entries(trainer.parallelized, trainer.optimizer),
                trainer.optimizer,
                rank=rank,
                world_size=world,
            )
            if {float(s["step"]) for s in trainer.optimizer.state.values()} != {saved_step}:
                bad.append(f"{what}: AdamW step not restored")
            for e in checkpoint_entries.entries(trainer.parallelized, trainer.optimizer):
                index = checkpoint._positions(e.runs())
                for kind in KINDS:
                    if not torch.equal(e.tensors[kind].detach().cpu(), expect[e.name][kind].reshape(-1)[index]):
                        bad.append(f"{what}: rank {rank} {e.name} {kind} differs")
    return bad


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestResharding(unittest.TestCase):
    def test_every_layout_loads_every_layouts_checkpoint(self):
        """Each available layout's step-KILL checkpoint, loaded into each available layout, gives every rank
        exactly the source's bits (and AdamW step). One set of processes per world size."""
        sources = {name: kill_and_resume(name)["aside"] for name in LAYOUTS}
        out = os.path.join(TMP.name, "load-into")
        t0 = time.perf_counter()
        by_world: dict[int, dict[str, list[str]]] = {}
        for target, (nproc, flags) in LAYOUTS.items():
            by_world.setdefault(nproc, {})[target] = flags
        for nproc, targets in by_world.items():
            if nproc == 1 and not under_torchrun():
                bad = _load_everything(0, 1, targets, sources, out)
            else:
                bad = [m for rank_bad in spawn(_load_everything, nproc, targets, sources, out) for m in rank_bad]
            self.assertEqual(bad, [], f"loading into {', '.join(targets)}")
        print(
            f"\n  {len(sources)} checkpoints x {len(LAYOUTS)} layouts loaded in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )

    def test_training_continues_across_layouts(self):
        """DDP x2 saves step 2 -> FSDP x2 trains step 3 -> TP x2 trains step 4 -> one process trains 5, 6:
        every step's loss matches the uninterrupted one-process run (1e-5 relative, 1e-4 once TP is in)."""
        ref = train_losses(kill_and_resume("single")["out"])
        out = os.path.join(TMP.name, "chain")
        shutil.copytree(kill_and_resume("ddp_custom")["first"], checkpoint.step_dir(out, EVERY))
        for layout, kill_at in (("fsdp_pytorch", EVERY + 1), ("tp_pytorch", EVERY + 2), ("single", None)):
            nproc, flags = LAYOUTS[layout]
            proc = forked(
                BASE + flags + ["--dataset", data_dir(), "--out_dir", out, "--resume", "--checkpoint_interval", "1"],
                nproc,
                env={"GPT_KILL_AT_STEP": str(kill_at)} if kill_at else None,
            )
            self.assertIn("resuming from", proc.stdout, f"{layout}:\n{proc.stdout[-2000:]}{proc.stderr[0][-3000:]}")
        losses = train_losses(out)
        self.assertEqual([r["step"] for r in read_metrics(out) if "loss" in r], list(range(EVERY + 1, STEPS + 1)))
        for step, loss in enumerate(losses, start=EVERY + 1):
            rtol = 1e-5 if step == EVERY + 1 else 1e-4
            self.assertLessEqual(abs(loss - ref[step - 1]), rtol * abs(ref[step - 1]), f"step {step}")


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestFailures(unittest.TestCase):
    def run_single(self, name: str, extra: list[str], env: dict | None = None):
        out = os.path.join(TMP.name, name)
        return out, forked_ranks(BASE + ["--dataset", data_dir(), "--out_dir", out] + extra, env=env)[0]

    def test_interrupted_save_leaves_previous_checkpoint(self):
        """The save of step 4 dies after its rank file (before the manifest and the rename): step 2 stays the
        newest checkpoint, --resume continues from it, clears the leftover and keeps only the last one."""
        out, proc = self.run_single("interrupted", [], {"GPT_CKPT_FAIL_AFTER_FILES": "3"})  # 2 files per save
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("GPT_CKPT_FAIL_AFTER_FILES=3: injected failure", proc.stderr)
        self.assertEqual(steps_of(out), [2])
        self.assertIn("step_000004.tmp-saving", os.listdir(os.path.join(out, "checkpoints")))
        _, proc = self.run_single("interrupted", ["--resume", "--keep_checkpoints", "1"])
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn(f"resuming from {checkpoint.step_dir(out, 2)}", proc.stdout)
        self.assertEqual(os.listdir(os.path.join(out, "checkpoints")), [f"step_{STEPS:06d}"])
        self.assertEqual(train_losses(out), train_losses(kill_and_resume("single")["out"]))

    def test_nan_loss_stops_without_saving(self):
        out, proc = self.run_single("nan", [], {"GPT_INJECT_NAN_AT_STEP": "3"})
        self.assertEqual(proc.returncode, 3, proc.stderr[-3000:])
        lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertIn("step 3: loss nan", lines[0])
        self.assertIn("not finite", lines[0])
        self.assertEqual(steps_of(out), [2])
        state = checkpoint.consolidate(checkpoint.newest(out), KINDS)
        self.assertTrue(all(bool(t.isfinite().all()) for kinds in state.values() for t in kinds.values()))

    def test_other_model_config_is_refused_in_one_line(self):
        out = os.path.join(TMP.name, "mismatch")
        shutil.copytree(kill_and_resume("single")["aside"], checkpoint.step_dir(out, KILL))
        proc = forked_ranks(BASE + ["--dataset", data_dir(), "--out_dir", out, "--resume", "--n_layer", "3"])[0]
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(len(proc.stderr.strip().splitlines()), 1, proc.stderr)
        self.assertIn("train.py: error: --resume: checkpoint", proc.stderr)
        self.assertIn("another model config (n_layer 2 (checkpoint) vs 3)", proc.stderr)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestLaunchers(unittest.TestCase):
    def reference(self) -> dict:
        return kill_and_resume("ddp_custom")

    def check_like_ddp(self, out: str):
        ref = self.reference()["out"]
        self.assertEqual(train_losses(out), train_losses(ref))
        assert_same_state(self, checkpoint.newest(out), checkpoint.newest(ref), "final state")

    def test_torchrun_restart_resumes(self):
        """torchrun --max-restarts=1, every attempt with --resume: rank 1 dies after step 3 once; the
        restarted job resumes from step 2 and ends exactly like the uninterrupted run. (Without
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torch 2.13's restarted gloo group can read the dead attempt's
        addresses from the shared rendezvous store: train.py warns about it.)"""
        out = os.path.join(TMP.name, "restart")
        marker = os.path.join(TMP.name, "restart.marker")
        proc = launch(
            BASE + LAYOUTS["ddp_custom"][1] + ["--dataset", data_dir(), "--out_dir", out, "--resume"],
            2,
            env={
                "GPT_KILL_AT_STEP": "3",
                "GPT_KILL_RANK": "1",
                "GPT_KILL_MARKER": marker,
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            },  # a fresh store per attempt (README)
            torchrun=["--standalone", "--max-restarts=1"],
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
        self.assertTrue(os.path.exists(marker))
        self.assertIn("no intact checkpoint", proc.stdout)
        self.assertIn(f"resuming from {checkpoint.step_dir(out, 2)}", proc.stdout)
        self.check_like_ddp(out)

    def test_two_nodes_on_loopback(self):
        """Two torchrun 'nodes' of one rank each, c10d rendezvous on 127.0.0.1, train as DDP x2 does."""
        out = os.path.join(TMP.name, "two-nodes")
        rdzv = [
            "--nnodes=2",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            "--rdzv_id=loopback",
            "--local-addr=127.0.0.1",
        ]
        args = BASE + LAYOUTS["ddp_custom"][1] + ["--dataset", data_dir(), "--out_dir", out]
        nodes = [launch(args, 1, torchrun=rdzv, wait=False) for _ in range(2)]
        try:
            outputs = [node.communicate(timeout=300)[0] for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
        for node, text in zip(nodes, outputs):
            self.assertEqual(node.returncode, 0, text[-4000:])
        self.check_like_ddp(out)
        single = train_losses(kill_and_resume("single")["out"])
        for a, b in zip(train_losses(out), single):
            self.assertLessEqual(abs(a - b), 1e-5 * abs(b))

    def test_lost_or_stalled_peer_ends_the_run_within_timeout(self):
        """Two ranks started by hand (no torchrun agent to clean up): rank 1 is SIGKILLed, or SIGSTOPped
        (alive but silent), after step 2. Rank 0 must exit with a clear message within --timeout; with the
        silent peer, its step overruns --timeout first and rank 0 writes its stacks to hang/rank_0.txt."""
        timeout, runs = 5, {}
        for sig in ("KILL", "STOP"):
            out, port = os.path.join(TMP.name, f"peer-{sig}"), free_port()
            args = (
                BASE + LAYOUTS["ddp_custom"][1] + ["--dataset", data_dir(), "--out_dir", out, "--timeout", str(timeout)]
            )
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "GPT_KILL_AT_STEP": "2",
                "GPT_KILL_RANK": "1",
                "GPT_KILL_SIGNAL": sig,
            }
            log1 = os.path.join(TMP.name, f"peer-{sig}.rank1.log")
            with open(log1, "w") as f:
                procs = [
                    launch(
                        args,
                        1,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        wait=False,
                        stdout=subprocess.PIPE if r == 0 else f,
                    )
                    for r in range(2)
                ]
            runs[sig] = (*procs, log1)
        hooked, exited = {}, {}
        try:
            deadline = time.monotonic() + 240
            while len(exited) < len(runs) and time.monotonic() < deadline:
                for sig, (rank0, _, log1) in runs.items():
                    if sig not in hooked and "sends itself" in open(log1).read():
                        hooked[sig] = time.monotonic()
                    if sig not in exited and rank0.poll() is not None:
                        exited[sig] = time.monotonic()
                time.sleep(0.05)
            for sig, (rank0, _, log1) in runs.items():
                text0 = rank0.communicate(timeout=10)[0]
                self.assertIn(f"sends itself SIG{sig}", open(log1).read())
                self.assertEqual(rank0.returncode, 4, text0[-3000:])
                lines = [line for line in text0.splitlines() if line.startswith("train.py: error:")]
                self.assertEqual(len(lines), 1, text0[-3000:])
                self.assertIn("rank 0: a collective failed at step 3", lines[0])
                self.assertIn("a peer rank was lost or stalled; restart with --resume", lines[0])
                if sig == "STOP":  # the stalled step explains itself: rank 0's stack, waiting in DDP's all-reduce
                    stack = os.path.join(TMP.name, f"peer-{sig}", "hang", "rank_0.txt")
                    pointer = [ln for ln in text0.splitlines() if "has run for more than --timeout" in ln]
                    self.assertEqual(len(pointer), 1, text0[-3000:])
                    self.assertIn(stack, pointer[0])
                    text = open(stack).read()
                    self.assertIn('parallel/data_parallel/ddp.py", line', text)
                    self.assertIn("in _wait_all", text)  # the all-reduce wait at the end of backward
                waited = exited[sig] - hooked[sig]
                self.assertLess(waited, timeout + 10, f"SIG{sig}: rank 0 took {waited:.1f}s")  # + a loaded box
                print(f"\n  peer SIG{sig}: rank 0 exited {waited:.1f}s after it", file=sys.stderr)
        finally:
            for rank0, rank1, _ in runs.values():
                for p in (rank0, rank1):
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


class TestFormat(unittest.TestCase):
    def test_runs_round_trip(self):
        """(start, length) runs store any index compactly and decode to exactly the same positions."""
        full = torch.arange(48 * 20).view(48, 20)
        cases = {
            "whole": full.reshape(-1),
            "rows": full[8:24].reshape(-1),
            "columns": full[:, 5:15].reshape(-1),
            "strided": full[::3, 2:4].reshape(-1),
            "shuffled": torch.randperm(960),
            "empty": torch.zeros(0, dtype=torch.int64),
        }
        for name, index in cases.items():
            runs = checkpoint._runs(index)
            self.assertTrue(torch.equal(checkpoint._positions(runs), index), name)
        self.assertEqual(checkpoint._runs(cases["rows"]).tolist(), [[160, 320]])
        self.assertEqual(len(checkpoint._runs(cases["columns"])), 48)

    def _trained(self):
        """A one-Block model after one AdamW step, and its entries (one process)."""
        from checkpoints.entries import entries_for
        from model.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
        model.init_weights(seed=0)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
        opt.step()
        return model, opt, entries_for(list(model.named_parameters()), opt)

    def _snap(self, opt, entries) -> dict:
        return checkpoint.snapshot("unused", 1, entries, opt, {}, rank=0, world_size=1, keep=1)

    @staticmethod
    def _materialized(shard: dict) -> dict:
        return {k: (v.copy() if isinstance(v, checkpoint.Lazy) else v) for k, v in shard.items()}

    def test_a_streamed_rank_file_is_torch_saves_bytes_with_one_value_made_at_a_time(self):
        """The rank file a save streams (checkpoints/streaming.py) is byte for byte torch.save's of the whole
        dict, for every dtype a file holds (runs int64, values fp32 and bf16, RNG uint8), and the save holds at
        most one made value at a time: none is kept once its record is written."""
        import io
        import weakref

        _, opt, entries = self._trained()
        shard = self._snap(opt, entries)["shard"]
        shard["bf16::param"] = checkpoint.Lazy([torch.randn(7).bfloat16(), torch.randn(5).bfloat16()])
        whole = io.BytesIO()
        torch.save(self._materialized(shard), whole)
        alive, most = weakref.WeakSet(), [0]
        for lazy in (v for v in shard.values() if isinstance(v, checkpoint.Lazy)):
            make = lazy.make

            def counted(make=make):
                value = make()
                alive.add(value)
                most[0] = max(most[0], len(alive))
                return value

            lazy.make = counted
        streamed = io.BytesIO()
        checkpoint.save_streamed(shard, streamed)
        self.assertEqual(streamed.getvalue(), whole.getvalue())
        self.assertEqual(most[0], 1)

    def test_async_staging_is_bounded_reused_and_copies_the_values(self):
        """An async save stages its values in at most the saver's budget of host blocks (a value larger than the
        budget alone), waiting for the writer to give blocks back; the file is a synchronous save's, later
        changes to the live state do not reach it, and the next save reuses the blocks (no new host memory)."""
        model, opt, entries = self._trained()
        values = [v for v in self._snap(opt, entries)["shard"].values() if isinstance(v, checkpoint.Lazy)]
        largest, total = max(v.nbytes for v in values), sum(v.nbytes for v in values)
        budget = 3 * largest
        self.assertLess(budget, total)  # so the staging must wait for the writer
        with tempfile.TemporaryDirectory() as d:
            sync = checkpoint.write({**self._snap(opt, entries), "out_dir": os.path.join(d, "sync")})
            saver = checkpoint.AsyncSaver(torch.device("cpu"), staging_bytes=budget)
            blocks, most = [], [0]  # every block handed out (weakly), and the most bytes of them alive at once
            take = saver.staging.take

            def counted(nbytes):
                block = take(nbytes)
                blocks.append(weakref.ref(block))
                most[0] = max(most[0], sum({b().data_ptr(): b().numel() for b in blocks if b() is not None}.values()))
                return block

            with unittest.mock.patch.object(saver.staging, "take", counted):
                saver.save({**self._snap(opt, entries), "out_dir": os.path.join(d, "async")})
                before = model.lm_head.weight.detach().clone()
                with torch.no_grad():
                    model.lm_head.weight.add_(1.0)  # training goes on while the writer writes
                saver.wait()
            self.assertLessEqual(saver.staging.peak, budget)
            self.assertLessEqual(most[0], budget)  # blocks the staging dropped are freed, not kept by a value
            name = checkpoint.rank_file(0)
            with open(os.path.join(sync, name), "rb") as f, open(os.path.join(saver.path, name), "rb") as g:
                self.assertEqual(f.read(), g.read())
            with torch.no_grad():
                model.lm_head.weight.copy_(before)
            roomy = checkpoint.AsyncSaver(torch.device("cpu"), staging_bytes=total)  # every value staged at once
            staged, real_write = threading.Event(), checkpoint.write

            def write_once_staged(snap, group=None):  # no block comes back before the last is staged
                staged.wait()
                return real_write(snap, group)

            blocks = []
            for again in ("first", "second"):
                staged.clear()
                with unittest.mock.patch.object(checkpoint, "write", write_once_staged):
                    roomy.save({**self._snap(opt, entries), "out_dir": os.path.join(d, again)})
                    staged.set()
                    roomy.wait()
                blocks.append({b.data_ptr() for b in roomy.staging.free})
                with open(os.path.join(sync, name), "rb") as f, open(os.path.join(roomy.path, name), "rb") as g:
                    self.assertEqual(f.read(), g.read())
            self.assertEqual(len(blocks[0]), len(values))
            self.assertEqual(blocks[0], blocks[1])

    def test_a_failed_async_write_neither_hangs_training_nor_passes_silently(self):
        """The writer fails before it writes a value: the training thread, waiting for staging room, is let go,
        and the error comes back at the next wait."""
        _, opt, entries = self._trained()
        values = [v for v in self._snap(opt, entries)["shard"].values() if isinstance(v, checkpoint.Lazy)]
        saver = checkpoint.AsyncSaver(torch.device("cpu"), staging_bytes=max(v.nbytes for v in values))
        with unittest.mock.patch.object(checkpoint, "save_streamed", side_effect=OSError("disk full")):
            with tempfile.TemporaryDirectory() as d:
                saver.save({**self._snap(opt, entries), "out_dir": d})
                with self.assertRaisesRegex(OSError, "disk full"):
                    saver.wait()

    def test_rank_files_are_not_unpickled(self):
        """A rank file holding anything but tensors is refused (torch.load weights_only=True)."""
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, checkpoint.MANIFEST), "w") as f:
                json.dump(
                    {
                        "format": checkpoint.FORMAT,
                        "version": checkpoint.VERSION,
                        "files": ["rank_00000.pt"],
                        "tensors": {},
                    },
                    f,
                )
            torch.save({"x": subprocess.Popen}, os.path.join(d, "rank_00000.pt"))
            with self.assertRaisesRegex(checkpoint.CheckpointError, "cannot read rank_00000.pt"):
                checkpoint.consolidate(d)


def _fake_group(rank: int, world: int) -> None:
    """A process group of `world` ranks in which this process is `rank` and collectives do nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _no_group() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized()  # under torchrun the job's own group is up: a fake one cannot join


class TestIndexMemory(unittest.TestCase):
    """Where a rank's elements sit costs memory in the number of (start, length) runs, never one int64 per
    element: checkpoints used to build an `arange` over every full parameter on every rank (8 bytes per
    model element, about 1 GB for gpt2 and 12.5 GB for gpt2-xl, all alive at once during a save)."""

    def test_entry_runs_are_the_runs_of_its_positions(self):
        """Blocks given by per-dim positions (whole, a range, strided, with gaps) and a span of them: runs()
        equals the runs of the explicit index, and `_pieces` decodes them in chunks of any size."""
        from checkpoints.entries import Entry

        cases = []
        for shape in [(24, 10), (6, 5, 7)]:
            full = torch.arange(torch.Size(shape).numel()).view(shape)
            choices = [
                [range(n), range(n // 3, n), torch.arange(0, n, 2), torch.tensor([i for i in range(n) if i % 3 != 1])]
                for n in shape
            ]
            for axes in itertools.product(*choices):
                block = full
                for d, axis in enumerate(axes):
                    block = block.index_select(d, torch.as_tensor(list(axis) if isinstance(axis, range) else axis))
                flat = block.reshape(-1)
                for lo, hi in [(0, len(flat)), (len(flat) // 3, len(flat) - 2), (5, 5)]:
                    entry = Entry("x", shape, axes, (lo, hi), {}, True)
                    cases.append((f"{shape} {axes} [{lo}, {hi})", entry.runs(), flat[lo:hi]))
                    self.assertTrue(torch.equal(cases[-1][1], checkpoint._runs(flat[lo:hi])), cases[-1][0])
        for chunk in (1, 7, checkpoint._INDEX_CHUNK):
            with unittest.mock.patch.object(checkpoint, "_INDEX_CHUNK", chunk):
                for what, runs, positions in cases:
                    got = [
                        torch.arange(w.start, w.stop) if isinstance(w, slice) else w
                        for _, _, w in checkpoint._pieces(runs)
                    ]
                    self.assertTrue(torch.equal(torch.cat(got) if got else positions, positions), f"{what} {chunk}")

    @unittest.skipUnless(_no_group(), "needs to start its own (fake) process group")
    def test_dtensor_positions_are_those_of_a_distributed_arange(self):
        """Each rank's positions of a DTensor on a 2 x 2 mesh (even and uneven shards, two shardings of one
        dim, FSDP2's _StridedShard over TP) are those distributing an arange of the full tensor gives."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        from checkpoints.entries import Entry, _axes

        layouts = [
            (Shard(0), Shard(1)),
            (Shard(0), Shard(0)),
            (_StridedShard(0, split_factor=2), Shard(0)),
            (Replicate(), Shard(1)),
            (Shard(1), Replicate()),
        ]
        for rank in range(4):
            _fake_group(rank, 4)
            try:
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
                for shape, placements in itertools.product([(8, 6), (7, 5)], layouts):
                    full = torch.arange(torch.Size(shape).numel()).view(shape)
                    local = distribute_tensor(full, mesh, placements, src_data_rank=None)
                    entry = Entry("x", shape, _axes(local), (0, local.to_local().numel()), {}, True)
                    self.assertTrue(
                        torch.equal(checkpoint._positions(entry.runs()), local.to_local().reshape(-1)),
                        f"rank {rank} {shape} {placements}",
                    )
            finally:
                dist.destroy_process_group()

    @unittest.skipUnless(_no_group(), "needs to start its own (fake) process group")
    def test_fsdp_rank_saves_and_loads_without_a_full_index(self):
        """Rank 3 of 8 under our FSDP (a fake group: no peers needed) loads a one-process checkpoint of the
        tiny GPT and saves its own file. No int64 tensor made meanwhile comes near the elements it holds
        of one parameter (the embedding's slice, ~400k): the old full `arange`s had 3.2M, a per-element
        index 400k; runs need a handful, and loading makes positions at most 2 * _INDEX_CHUNK at a time."""
        import torch.distributed as dist

        from checkpoints.entries import entries_for, entries_for_fsdp
        from model.gpt import GPT, PRESETS
        from parallel.data_parallel.fsdp import FullyShardedDataParallel

        config = PRESETS["tiny"]
        torch.manual_seed(0)
        source = GPT(config)
        adam = torch.optim.AdamW(source.parameters())
        extra = {"config": {"model": dataclasses.asdict(config), "train": {}}, "layout": {"world_size": 1}}
        with tempfile.TemporaryDirectory() as d, LargestTensor(_is_int64) as one_process:
            path = checkpoint.save(
                d, 1, entries_for(list(source.named_parameters()), adam), adam, extra, rank=0, world_size=1, keep=2
            )
            self.assertLessEqual(one_process.numel, 16)  # one run per parameter
            _fake_group(3, 8)
            try:
                torch.manual_seed(1)
                fsdp = FullyShardedDataParallel(GPT(config))
                optimizer = torch.optim.AdamW(fsdp.param_groups(0.1))
                held = max(e.numel for e in entries_for_fsdp(fsdp, optimizer, 0))
                self.assertGreater(held, 300_000)
                with unittest.mock.patch.object(checkpoint, "_INDEX_CHUNK", 1024), LargestTensor(_is_int64) as load:
                    checkpoint.load(path, entries_for_fsdp(fsdp, optimizer, 0), optimizer, rank=3, world_size=8)
                for name, piece in fsdp.sharded_state_dict().items():  # the right elements arrived
                    want = source.get_parameter(name).detach().reshape(-1)[piece.offset :]
                    self.assertTrue(torch.equal(piece.flat, want[: piece.flat.numel()]), name)
                os.makedirs(checkpoint.step_dir(d, 2) + ".tmp-saving")  # rank 0's part of the save
                with LargestTensor(_is_int64) as save:
                    checkpoint.save(
                        d, 2, entries_for_fsdp(fsdp, optimizer, 0), optimizer, {}, rank=3, world_size=8, keep=2
                    )
            finally:
                dist.destroy_process_group()
        self.assertLessEqual(save.numel, 16, f"saving made an int64 tensor of {save.numel} elements")
        self.assertLessEqual(load.numel, 2 * 1024, f"loading made an int64 tensor of {load.numel} elements")


if __name__ == "__main__":
    unittest.main()
