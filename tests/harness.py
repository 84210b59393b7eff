"""The one place tests start ranks and whole runs from.

In-process ranks: `run_distributed(fn, N)` runs a test body on N distributed ranks, whichever way the
test suite was launched. Test bodies build CPU models, so their group is always gloo on the CPU, on a
GPU machine too.
- Under `torchrun --nproc_per_node=N -m unittest tests/test_x.py` (how the suite runs on GPU nodes),
  `run_distributed(fn, N)` joins the torchrun group and calls fn on every rank in-process.
- Under plain pytest (CI, CPU only) it spawns N fresh processes that form a gloo group on a free
  loopback port, runs fn on each, and re-raises the first failure with its traceback. A rank that dies
  takes the others down, so a failing test never hangs.
- If torchrun gave a different world size than the test needs (a 4-rank test under a 2-rank torchrun),
  rank 0 spawns the N ranks itself and broadcasts their results, so every torchrun rank checks all of them.

fn(rank, world_size, *args) runs with the default process group initialised; its return values come
back as a list indexed by rank.

Whole runs: `launch` starts a script (train.py by default) as a user would, `python` for one rank and
`torchrun` for more, in an environment without this process's torchrun variables
(`parallel.mesh.child_env`), on the CPU unless the test passes its own `--device`.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrics import read_jsonl
from parallel.mesh import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = timedelta(seconds=300)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


BACKEND = "gloo"  # test bodies build CPU tensors: gloo, even where CUDA exists


def _spawned(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result_dir: str) -> None:
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.clear()  # no TORCHELASTIC_* from a surrounding torchrun: with TORCHELASTIC_USE_AGENT_STORE
    os.environ.update(env)  # rank 0 would wait for an agent's store instead of starting its own
    torch.set_num_threads(1)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Start `world_size` gloo ranks on a free port, run fn on each, return their results by rank."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_spawned, args=(world_size, free_port(), fn, args, d), nprocs=world_size,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any] | None:
    """Run fn(rank, world_size, *args) on `world_size` ranks (see module docstring).

    Returns every rank's result under spawn and under a torchrun of another size (on every torchrun rank);
    under a matching torchrun, [this rank's result] on each rank (each rank checks its own). Never None:
    no rank is left with nothing to assert."""
    if under_torchrun():
        if not dist.is_initialized():
            dist.init_process_group(BACKEND, timeout=TIMEOUT)
        if dist.get_world_size() == world_size:
            return [fn(dist.get_rank(), world_size, *args)]
        out = [spawn(fn, world_size, *args) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(out, src=0)
        return out[0]
    return spawn(fn, world_size, *args)




# ----------------------------------------------------------------------------- whole training runs

def make_token_bins(directory: str, n_train: int = 60_000, n_val: int = 8_000, vocab: int = 512,
                    seed: int = 0) -> str:
    """Write train.bin/val.bin of a learnable stand-in corpus: a noisy first-order chain over the
    first `vocab` token ids (next = 31*prev + small noise), so a model's loss falls quickly."""
    import numpy as np
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, n in (("train", n_train), ("val", n_val)):
        noise = rng.integers(0, 4, n)
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = 1
        for i in range(1, n):
            tokens[i] = (31 * tokens[i - 1] + noise[i]) % vocab
        tokens.astype(np.uint16).tofile(os.path.join(directory, f"{name}.bin"))
    return directory


def launch(args: list[str], nproc: int = 1, env: dict | None = None, torchrun: list[str] | None = None,
           timeout: float = 600, wait: bool = True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
           script: str = "train.py", device: str | None = "cpu"):
    """Run `script` as a user runs it: python for one rank, torchrun (--standalone unless `torchrun` says
    otherwise) for more. `env` is added to `child_env()` (so a test may set RANK etc. itself). `--device
    device` is appended unless args name a device or device is None. Returns the CompletedProcess (stdout
    and stderr apart), or the Popen (in its own session; `stdout`, `stderr` as given) when wait=False."""
    if device is not None and not any(a == "--device" or a.startswith("--device=") for a in args):
        args = [*args, "--device", device]
    full_env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if torchrun is None and nproc == 1:
        cmd = [sys.executable]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.2",
               *(torchrun or ["--standalone"]), f"--nproc_per_node={nproc}"]
    cmd += [os.path.join(ROOT, script), *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=stdout, stderr=stderr,
                                text=True, start_new_session=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too, not only the launcher
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch_ranks(args: list[str], nproc: int, env: dict | None = None, timeout: float = 300,
                 script: str = "train.py") -> list[subprocess.CompletedProcess]:
    """Start `nproc` ranks of `script` by hand, as torchrun would (RANK, WORLD_SIZE, MASTER_* set), each with
    its own stdout/stderr, and wait for every one: one CompletedProcess per rank. Unlike torchrun, no agent
    SIGTERMs the other ranks when the first one exits, so each rank's own exit code and output are seen."""
    port = str(free_port())
    procs = [launch(args, 1, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nproc),
                                  "LOCAL_WORLD_SIZE": str(nproc), "RANK": str(r), "LOCAL_RANK": str(r),
                                  **(env or {})}, script=script, wait=False, stderr=subprocess.PIPE)
             for r in range(nproc)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return done


def run_train(args: list[str], nproc: int = 1, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """train.py on `nproc` ranks (see launch)."""
    return launch(args, nproc, timeout=timeout, **kw)


def train_losses(out_dir: str) -> list[float]:
    """Per-step training losses; a step logged twice (after a resume) counts as its last record."""
    by_step = {r["step"]: r["loss"] for r in read_jsonl(out_dir) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def rank0_only() -> bool:
    """True on the process that should run whole-job tests: every process outside torchrun, rank 0 inside
    (whole training runs launch their own ranks; running them from every torchrun rank would repeat them)."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def expect_train_error_in_process(test, args: list[str], needle: str, out_dir: str, fresh: bool = True) -> None:
    """train.main(args + --out_dir out_dir --device cpu) in this process, as one rank with no torchrun
    variables: exit code 2, exactly one line `train.py: error: ...` containing `needle`, and (`fresh`) out_dir
    never created (nothing written before the refusal)."""
    import contextlib
    import io
    from unittest import mock

    import train
    err = io.StringIO()
    with mock.patch.dict(os.environ, clear=True), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        os.environ.update(child_env())
        code = train.main([*args, "--out_dir", out_dir, "--device", "cpu"])
    lines = err.getvalue().splitlines()
    test.assertEqual(code, 2, err.getvalue())
    test.assertEqual(len(lines), 1, err.getvalue())
    test.assertTrue(lines[0].startswith("train.py: error: "), lines[0])
    test.assertIn(needle, lines[0])
    if fresh:
        test.assertFalse(os.path.exists(out_dir))


def steps_of(out_dir: str) -> dict[int, dict]:
    """step -> its training record in out_dir's metrics.jsonl (a step logged twice, before and after a
    resume, counts as its last)."""
    return {r["step"]: r for r in read_jsonl(out_dir) if "loss" in r}


def evals_of(out_dir: str) -> dict[int, float]:
    """step -> val_loss in out_dir's metrics.jsonl."""
    return {r["step"]: r["val_loss"] for r in read_jsonl(out_dir) if "val_loss" in r}


def assert_close(test, got: dict, ref: dict, key: str | None, rtol: float, what: str, steps=None) -> None:
    """got[s][key] (or got[s]) within rtol of ref's, for every step of `got` (or `steps`); rtol 0: equal bits."""
    steps = sorted(got) if steps is None else list(steps)
    test.assertTrue(steps and set(steps) <= set(got) and set(steps) <= set(ref), f"{what}: steps {sorted(got)}")
    for s in steps:
        a, b = (got[s][key], ref[s][key]) if key else (got[s], ref[s])
        test.assertLessEqual(abs(a - b), rtol * abs(b), f"{what}: step {s} {key or 'val_loss'} {a} vs {b}")
