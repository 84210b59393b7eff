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

Measurements beside assertions: a file registers functions run inside the ranks (`measures =
Measurements(N)`, `@measures.register(name)` on a function in the test class, right above the test that reads
`measures[name]`), and `measures.run()` in setUpClass runs them all in one run_distributed. A measurement that
raises fails only its own tests, with its traceback.

Whole runs: `launch` starts a script (train.py by default) as a user would, `python` for one rank and
`torchrun` for more, in an environment without this process's torchrun variables
(`launch.child_env`), on the CPU unless the test passes its own `--device`. `shared_run` trains a
run once per test session, whichever test file asks for it first, on ranks forked from bench.forkserver; `WholeRuns` is
the setup every whole-run
test file shares (its flags, scratch folder, corpus, and runs by name).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.launch import child_env, exit_process
from runtime.metrics import read_jsonl

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
    env = child_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.clear()  # no TORCHELASTIC_* from a surrounding torchrun: with TORCHELASTIC_USE_AGENT_STORE
    os.environ.update(env)  # rank 0 would wait for an agent's store instead of starting its own
    torch.set_num_threads(1)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, timeout=TIMEOUT)
    # A raise leaves the group up: the peers' collectives then fail ("Connection closed") only once this
    # process has exited, so its error, not a peer's, is the one spawn reports.
    torch.save(fn(rank, world_size, *args), os.path.join(result_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    exit_process(0)  # not through finalization, where a gloo thread still alive can abort the rank (SIGABRT)


def spawn(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Start `world_size` gloo ranks on a free port, run fn on each, return their results by rank."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _spawned, args=(world_size, free_port(), fn, args, d), nprocs=world_size, join=True, start_method="spawn"
        )
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


# ----------------------------------------------------------------------------- measurements beside assertions


class Outcome(NamedTuple):
    """What one measurement gave on one rank: its return value, or (error) the traceback of what it raised."""

    rank: int
    value: Any
    error: str | None


class MeasurementError(RuntimeError):
    """A measurement raised on some rank; the message carries each raising rank's traceback."""


_MEASURE_RUNS = itertools.count()  # names this process's runs apart in a store a torchrun keeps across them


def _measure_all(
    rank: int, world_size: int, functions: dict[str, Callable], peers_timeout: timedelta
) -> dict[str, Outcome]:
    """Every registered measurement on this rank, in registration order: name -> Outcome. One that raises is
    kept as its traceback and the next one runs, but only once every rank is done with it (a key per rank in
    the process group's store, outside its collectives): a rank that raised before a collective its peers
    then wait in leaves the ranks out of step, and is told so after `peers_timeout` by a RuntimeError that
    ends the whole run (and, under spawn, every rank), instead of later measurements pairing the wrong
    collectives."""
    store = dist.distributed_c10d._get_default_store() if world_size > 1 and dist.is_initialized() else None
    run = next(_MEASURE_RUNS)
    out: dict[str, Outcome] = {}
    for name, fn in functions.items():
        try:
            out[name] = Outcome(rank, fn(rank, world_size), None)
        except Exception:
            out[name] = Outcome(rank, None, traceback.format_exc())
        if store is None:
            continue
        key = f"tests.harness.measurements/{run}/{name}/"
        store.set(key + str(rank), "done")
        if out[name].error is not None:  # a rank that returned is in step: only one that raised waits
            try:
                store.wait([key + str(r) for r in range(world_size)], peers_timeout)
            except Exception:
                raise RuntimeError(
                    f"measurement {name!r} raised on rank {rank} and not every rank finished it "
                    f"within {peers_timeout}: the ranks are out of step, so no later measurement "
                    f"can run. Rank {rank}'s error:\n{out[name].error}"
                ) from None
    return out


class Measurements:
    """The measurements of a test file, each a function run inside the ranks and read by the test below it:

        measures = Measurements(world_size=2)

        class TestX(unittest.TestCase):
            @classmethod
            def setUpClass(cls):
                measures.run()

            @measures.register("loss")
            def measure_loss(rank, world_size):   # runs on every rank; returns what the test checks
                return train(...)

            def test_loss_falls(self):
                for r in measures["loss"]:        # every rank's return value (see run_distributed)
                    ...

    `run()` runs every function registered here in one run_distributed (registration order), once per
    process: spawning costs seconds, so a file starts its ranks once for all its classes. A function that
    raises fails only the tests that read it, with its traceback (MeasurementError); a failed start fails every
    class that runs it, with the same error, without starting again."""

    def __init__(self, world_size: int, peers_timeout: timedelta = timedelta(seconds=60)):
        self.world_size, self.peers_timeout = world_size, peers_timeout
        self.functions: dict[str, Callable] = {}
        self._results: list[dict[str, Outcome]] | BaseException | None = None

    def register(self, name: str) -> Callable:
        """Decorator: fn(rank, world_size) -> its measurement, registered as `name`; returned as a staticmethod,
        so it may sit in the test class, above the test that reads it."""

        def add(fn: Callable) -> staticmethod:
            assert name not in self.functions, f"measurement {name!r} registered twice"
            self.functions[name] = fn
            return staticmethod(fn)

        return add

    def run(self) -> None:
        """Run every registered measurement, unless this process already did (or failed to)."""
        if self._results is None:
            try:
                self._results = run_distributed(_measure_all, self.world_size, self.functions, self.peers_timeout)
            except Exception as e:
                self._results = e
        if isinstance(self._results, BaseException):
            raise self._results

    def __getitem__(self, name: str) -> list[Any]:
        """Every rank's return value of measurement `name` (as run_distributed returns them: under a torchrun
        of world_size ranks, this rank's); MeasurementError if it raised on any of those ranks."""
        if name not in self.functions:
            raise KeyError(f"no measurement {name!r} registered (registered: {sorted(self.functions)})")
        self.run()
        outcomes = [by_name[name] for by_name in self._results]
        errors = [f"rank {o.rank}:\n{o.error}" for o in outcomes if o.error is not None]
        if errors:
            raise MeasurementError(f"measurement {name!r} raised\n" + "\n".join(errors))
        return [o.value for o in outcomes]


# ----------------------------------------------------------------------------- whole training runs


def make_token_bins(directory: str, n_train: int = 60_000, n_val: int = 8_000, vocab: int = 512, seed: int = 0) -> str:
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


def _with_device(args: list[str], device: str | None) -> list[str]:
    """args + `--device device`, unless args name a device or device is None."""
    if device is not None and not any(a == "--device" or a.startswith("--device=") for a in args):
        return [*args, "--device", device]
    return list(args)


def launch(
    args: list[str],
    nproc: int = 1,
    env: dict | None = None,
    torchrun: list[str] | None = None,
    timeout: float = 600,
    wait: bool = True,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    script: str = "train.py",
    device: str | None = "cpu",
):
    """Run `script` as a user runs it: python for one rank, torchrun (--standalone unless `torchrun` says
    otherwise) for more. `env` is added to `child_env()` (so a test may set RANK etc. itself). `--device
    device` is appended unless args name a device or device is None. Returns the CompletedProcess (stdout
    and stderr apart), or the Popen (in its own session; `stdout`, `stderr` as given) when wait=False."""
    args = _with_device(args, device)
    full_env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if torchrun is None and nproc == 1:
        cmd = [sys.executable]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--monitor-interval",
            "0.2",
            *(torchrun or ["--standalone"]),
            f"--nproc_per_node={nproc}",
        ]
    cmd += [os.path.join(ROOT, script), *args]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
        )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too, not only the launcher
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch_ranks(
    args: list[str], nproc: int, env: dict | None = None, timeout: float = 300, script: str = "train.py"
) -> list[subprocess.CompletedProcess]:
    """Start `nproc` ranks of `script` by hand, as torchrun would (RANK, WORLD_SIZE, MASTER_* set), each with
    its own stdout/stderr, and wait for every one: one CompletedProcess per rank. Unlike torchrun, no agent
    SIGTERMs the other ranks when the first one exits, so each rank's own exit code and output are seen."""
    port = str(free_port())
    procs = [
        launch(
            args,
            1,
            env={
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                **(env or {}),
            },
            script=script,
            wait=False,
            stderr=subprocess.PIPE,
        )
        for r in range(nproc)
    ]
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


def expect_train_error_in_process(
    test, args: list[str], needle: str, out_dir: str, fresh: bool = True, env: dict | None = None
) -> None:
    """train.main(args + --out_dir out_dir --device cpu) in this process, as one rank with no torchrun
    variables and nothing else of this process's environment but `env`: exit code 2, exactly one line
    `train.py: error: ...` containing `needle`, and (`fresh`) out_dir never created (nothing written before
    the refusal)."""
    import contextlib
    import io
    from unittest import mock

    import train

    err = io.StringIO()
    with (
        mock.patch.dict(os.environ, clear=True),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        os.environ.update(child_env(**(env or {})))
        code = train.main([*args, "--out_dir", out_dir, "--device", "cpu"])
    lines = err.getvalue().splitlines()
    test.assertEqual(code, 2, err.getvalue())
    test.assertEqual(len(lines), 1, err.getvalue())
    test.assertTrue(lines[0].startswith("train.py: error: "), lines[0])
    test.assertIn(needle, lines[0])
    if fresh:
        test.assertFalse(os.path.exists(out_dir))


def forked(args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600):
    """train.py's main with `args` (+ --device cpu) on `nproc` ranks forked from the session's fork_server, each
    rank's exit code and stderr apart (bench.forkserver.RunResult): as torchrun's ranks, without the interpreter
    start per rank (2.5 s each here) and with no agent that stops the others when one exits."""
    return fork_server().run(_with_device(args, "cpu"), nproc, env=env, timeout=timeout)


def forked_ranks(
    args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """`forked`, as one CompletedProcess per rank (its exit code and stderr; stdout, every rank's, on rank 0's)."""
    run = forked(args, nproc, env, timeout)
    return [
        subprocess.CompletedProcess(args, code, run.stdout if r == 0 else "", err)
        for r, (code, err) in enumerate(zip(run.codes, run.stderr))
    ]


def expect_train_error_on_ranks(test, args: list[str], needle: str, nproc: int, out_dir: str) -> None:
    """train.py args + --out_dir out_dir on `nproc` forked ranks (`forked`): every rank exits 2 with exactly its
    one line `train.py: error: ...` containing `needle`, before any work (out_dir never created)."""
    run = forked([*args, "--out_dir", out_dir], nproc)
    for rank, (code, stderr) in enumerate(zip(run.codes, run.stderr)):
        test.assertEqual(code, 2, f"rank {rank}: {stderr}")
        lines = stderr.splitlines()
        test.assertEqual(len(lines), 1, f"rank {rank}: {stderr}")
        test.assertTrue(lines[0].startswith("train.py: error: "), f"rank {rank}: {lines[0]}")
        test.assertIn(needle, lines[0], f"rank {rank}")
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


def check_against(
    test, out: str, ref: str, steps: int, evals: list[int], rtol: float, p2p: int | None = None
) -> dict[int, dict]:
    """The run in `out` against the run in `ref` (out_dirs, same steps and data): it logged steps 1..steps and
    val losses at exactly `evals`; every loss, grad_norm and val_loss is within rtol (relative) of ref's; and,
    given `p2p`, rank 0 sent that many p2p bytes every step. Returns out's steps."""
    got, name = steps_of(out), os.path.basename(out)
    test.assertEqual(sorted(got), list(range(1, steps + 1)), name)
    want = steps_of(ref)
    assert_close(test, got, want, "loss", rtol, name)
    assert_close(test, got, want, "grad_norm", rtol, name)
    got_evals = evals_of(out)
    test.assertEqual(sorted(got_evals), evals, name)
    assert_close(test, got_evals, evals_of(ref), None, rtol, name)
    if p2p is not None:
        test.assertGreater(p2p, 0)
        test.assertEqual([got[s]["comm_bytes"]["p2p"] for s in got], [p2p] * steps, f"{name}: p2p bytes")
    return got


def checkpoint_params(path: str) -> dict[str, torch.Tensor]:
    """name -> full parameter tensor of the checkpoint at `path` (checkpoint.consolidate)."""
    from checkpoints import checkpoint

    return {name: kinds["param"] for name, kinds in checkpoint.consolidate(path).items()}


# ----------------------------------------------------------------------------- runs shared by test files

_SESSION: str | None = None
_DATA: str | None = None
_FINISHED: dict[tuple, str] = {}  # run_key -> out_dir of a run that exited 0
_ATTEMPTS = itertools.count()
SHARED: dict[tuple, list[str]] = {}  # run_key -> the names it was asked for under (conftest's summary line)


def session_dir() -> str:
    """A scratch folder for this test session (this process), deleted when the process exits."""
    global _SESSION
    if _SESSION is None:
        _SESSION = tempfile.mkdtemp(prefix="gpt-tests-")
        atexit.register(shutil.rmtree, _SESSION, True)
    return _SESSION


def shared_data() -> str:
    """The stand-in corpus of make_token_bins' defaults, written once per session. The whole-run files train
    on this one folder, so runs of two files can have identical arguments, and be trained once (shared_run)."""
    global _DATA
    if _DATA is None:
        _DATA = make_token_bins(os.path.join(session_dir(), "data"))
    return _DATA


def run_key(args: list[str], nproc: int) -> tuple:
    """What makes two runs of train.py one run: the rank count and everything train.py's own parser makes of
    `args` but --out_dir (so neither the order of the flags nor a default spelled out matters). Args the parser
    refuses are keyed by their text (such a run fails, and a failed run is never registered)."""
    from trainer import config

    try:
        parsed = vars(config.parse_args(list(args)))
    except config.UsageError:
        return nproc, tuple(args)
    parsed.pop("out_dir")
    return nproc, tuple(sorted((k, repr(v)) for k, v in parsed.items()))


def shared_run(args: list[str], nproc: int, name: str = "run") -> str:
    """train.py with `args` (no --out_dir: this picks it) on `nproc` ranks (forked: fork_server), trained once per test
    session: a later call with the same run_key, from any test file, gets the finished run's out_dir. A run is
    registered only after it exited 0, and every attempt writes a fresh out_dir, so a failed or half-written run
    is never handed out (a failure raises; the next caller trains it again). Callers only read what it wrote."""
    args = _with_device(args, "cpu")
    assert not any(a == "--out_dir" or a.startswith("--out_dir=") for a in args), "shared_run picks the out_dir"
    key = run_key(args, nproc)
    SHARED.setdefault(key, []).append(name)
    if key not in _FINISHED:
        out = os.path.join(session_dir(), "runs", f"{next(_ATTEMPTS)}-{name}")
        proc = fork_server().run([*args, "--out_dir", out], nproc, timeout=600)
        assert proc.returncode == 0, f"{name} failed ({proc.codes}):\n{proc.stdout[-2000:]}\n" + "\n".join(
            f"rank {r}: {e[-3000:]}" for r, e in enumerate(proc.stderr) if e
        )
        _FINISHED[key] = out
    return _FINISHED[key]


_SERVER = None


def fork_server():
    """The session's bench.forkserver.ForkServer: shared, killed-and-resumed and refused runs fork their ranks
    from one process that imported torch and train.py once (2.5 s per rank saved). How a user starts them, with
    python and torchrun, is tested where the launcher matters (test_checkpoint.TestLaunchers, test_preemption,
    test_train's CLI tests)."""
    global _SERVER
    if _SERVER is None:
        from bench.forkserver import ForkServer

        _SERVER = ForkServer()
        atexit.register(_SERVER.close)
    return _SERVER


class WholeRuns:
    """The setup of a whole-run test file: its `base` flags, a scratch folder of its own (`path(name)`; made by
    set_up and deleted by tear_down, the file's setUpModule and tearDownModule), the session's corpus (`data`),
    and `run(name, args, nproc)`: base + --dataset data + args, trained once per name through shared_run (so a
    run identical to one of another file, or of this file under another name, is not trained again). A name
    asked for again with another run_key (other flags or ranks) is an error, never the first run's out_dir.
    `RUNS[name]` is the out_dir of the finished run `name`, `RUNS.argv[name]` its train.py args.

        RUNS = WholeRuns(BASE)
        setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down
    """

    def __init__(self, base: list[str]):
        self.base, self.runs, self._tmp = list(base), {}, None
        self.keys: dict[str, tuple] = {}  # name -> the run_key it was trained with
        self.argv: dict[str, list[str]] = {}  # name -> the train.py args it was trained with (less --out_dir)

    def set_up(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()

    def tear_down(self) -> None:
        self._tmp.cleanup()

    @property
    def data(self) -> str:
        return shared_data()

    def path(self, name: str) -> str:
        """`name` in this file's scratch folder: for what is not shared (killed, resumed and refused runs)."""
        return os.path.join(self._tmp.name, name)

    def args(self, *args: str) -> list[str]:
        """base + --dataset data + args."""
        return [*self.base, "--dataset", self.data, *args]

    def run(self, name: str, args: list[str], nproc: int) -> str:
        args = self.args(*args)
        key = run_key(_with_device(args, "cpu"), nproc)  # as shared_run keys it
        if name in self.keys and self.keys[name] != key:
            (n0, old), (n1, new) = self.keys[name], key
            diff = sorted(set(old) ^ set(new)) if n0 == n1 else f"{n0} ranks vs {n1}"
            raise AssertionError(f"run {name!r} asked for with other flags than it was trained with: {diff}")
        if name not in self.runs:
            self.runs[name] = shared_run(args, nproc, name)
            self.keys[name], self.argv[name] = key, args
        return self.runs[name]

    def __getitem__(self, name: str) -> str:
        return self.runs[name]

    def __contains__(self, name: str) -> bool:
        return name in self.runs


def check_kill_and_resume(
    test,
    args: list[str],
    nproc: int,
    out: str,
    ref: str,
    steps: int,
    kill_at: int,
    kill_rank: int,
    every: int,
    final_state: bool = True,
) -> None:
    """Kill + --resume is bit-equal to `ref`, the out_dir of the uninterrupted `steps`-step run of the same args.
    train.py args + --out_dir out + a checkpoint every `every` steps, on nproc ranks: rank `kill_rank` SIGKILLs
    itself after step `kill_at` (trainer/faults.py: GPT_KILL_AT_STEP), leaving the checkpoint of step `saved` (kill_at
    rounded down to a multiple of every) the newest; --resume continues from it and recomputes steps saved + 1
    to kill_at. Every step's loss and grad_norm and every val_loss equal ref's bits, and (final_state) so do
    the final checkpoint's parameters."""
    from checkpoints import checkpoint

    saved = kill_at - kill_at % every
    args = [*args, "--out_dir", out, "--checkpoint_interval", str(every)]
    k = forked(args, nproc, env={"GPT_KILL_AT_STEP": str(kill_at), "GPT_KILL_RANK": str(kill_rank)})
    test.assertEqual(k.codes[kill_rank], -signal.SIGKILL, f"not killed:\n{k.stdout[-2000:]}\n{k.stderr}")
    test.assertIn(f"rank {kill_rank} sends itself SIGKILL", k.stdout)
    test.assertEqual([s for s, _ in checkpoint.list_checkpoints(out)], [saved])
    r = forked([*args, "--resume"], nproc)
    test.assertEqual(r.returncode, 0, f"resume:\n{r.stdout[-2000:]}\n" + "\n".join(e[-3000:] for e in r.stderr))
    test.assertIn(f"resuming from {checkpoint.step_dir(out, saved)}", r.stdout)
    got, want = steps_of(out), steps_of(ref)
    test.assertEqual(sorted(got), list(range(1, steps + 1)))
    test.assertEqual(
        [(got[s]["loss"], got[s]["grad_norm"]) for s in got], [(want[s]["loss"], want[s]["grad_norm"]) for s in got]
    )
    test.assertEqual(evals_of(out), evals_of(ref))
    if final_state:
        final, wanted = checkpoint_params(checkpoint.newest(out)), checkpoint_params(checkpoint.newest(ref))
        test.assertEqual(final.keys(), wanted.keys())
        for name, p in final.items():
            test.assertTrue(torch.equal(p, wanted[name]), name)


def check_resume_from(
    test, source: str, step: int, args: list[str], nproc: int, out: str, steps: int, saved_by: str = ""
) -> None:
    """A fresh out_dir `out` holding only the step-`step` checkpoint of the run in `source`, resumed by train.py
    args + --out_dir out --resume --no_checkpoint on nproc ranks: it exits 0, says it resumes from that
    checkpoint (`saved_by`: how the note after the path starts, naming the saving layout), notes no argument
    differing from the checkpoint's run, and logs steps step + 1 to `steps`."""
    from checkpoints import checkpoint

    shutil.copytree(checkpoint.step_dir(source, step), checkpoint.step_dir(out, step))
    proc = forked([*args, "--out_dir", out, "--resume", "--no_checkpoint"], nproc)
    name = os.path.basename(out)
    test.assertEqual(
        proc.returncode, 0, f"{name}:\n{proc.stdout[-2000:]}\n" + "\n".join(e[-3000:] for e in proc.stderr)
    )
    test.assertIn(
        f"resuming from {checkpoint.step_dir(out, step)}" + (f" ({saved_by}" if saved_by else ""), proc.stdout
    )
    test.assertNotIn("arguments differ", proc.stdout)
    test.assertEqual(sorted(steps_of(out)), list(range(step + 1, steps + 1)), name)
