"""Start train.py's ranks by forking them from a server that imported torch and train.py once.

A `torchrun train.py` pays for a fresh interpreter per rank: about 2.5 s to import torch and this package on
this 2-core machine, 7.7 s for 4 ranks, against ~0.2 s per step of the tiny model. Many short runs (the layout
sweep, the whole-run tests) spend most of their time there. The server imports once; each run forks its N
ranks from it, with the environment torchrun would give them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
on a free loopback port; none of them for a one-rank run, as `python train.py`), and calls `train.main(args)`.

Fork safety: the server runs no torch op, so no OpenMP or gloo thread exists at a fork. Like torchrun, when
one rank exits non-zero the server waits `grace` seconds, then kills the rest (a crashed peer otherwise leaves
them waiting in a collective until --timeout).

    with ForkServer() as server:
        result = server.run(["--model", "tiny", ...], nproc=4)   # RunResult: per-rank exit codes and output

The protocol is one JSON line per request and per reply on the server's stdin/stdout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class RunResult:
    codes: list[int]  # each rank's exit code; -N: killed by signal N
    stdout: str  # every rank's stdout, rank 0's first
    stderr: list[str]  # each rank's stderr
    seconds: float

    @property
    def returncode(self) -> int:
        """0 when every rank exited 0, else the first non-zero code (as torchrun reports a failed job)."""
        return next((c for c in self.codes if c != 0), 0)


class ForkServer:
    """A server process (started on first use) that forks train.py ranks; see the module docstring."""

    def __init__(self, env: dict[str, str] | None = None):
        self._env, self._proc = env, None

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        from runtime.launch import child_env

        env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(self._env or {}))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.forkserver"],
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"bench.forkserver did not start: {ready!r}")

    def run(
        self,
        args: list[str],
        nproc: int = 1,
        env: dict[str, str] | None = None,
        timeout: float = 600,
        grace: float = 5.0,
    ) -> RunResult:
        """train.main(args) on `nproc` forked ranks; `env` is added to each rank's environment."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        request = {"args": list(args), "nproc": nproc, "env": env or {}, "timeout": timeout, "grace": grace}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._proc.stdout.readline()
        if not reply:
            raise RuntimeError("bench.forkserver died")
        return RunResult(**json.loads(reply))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None


# ----------------------------------------------------------------------------- the server side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: become one rank and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a kill of the rank reaches whatever it starts
        fd_out, fd_err = os.open(out, os.O_WRONLY | os.O_CREAT), os.open(err, os.O_WRONLY | os.O_CREAT)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fd_out, 1)
        os.dup2(fd_err, 2)
        sys.stdin = open(os.devnull)
        sys.stdout, sys.stderr = os.fdopen(1, "w", buffering=1), os.fdopen(2, "w", buffering=1)
        os.environ.clear()
        os.environ.update(env)
        import torch

        import train

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        code = train.main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank's crash is its output, as under torchrun
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_one(req: dict) -> dict:
    nproc, t0 = req["nproc"], time.perf_counter()
    base = {**os.environ, **req["env"]}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(k, None)
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as d:
        pids = []
        for r in range(nproc):
            env = dict(base)
            if nproc > 1:
                env.update(
                    RANK=str(r),
                    LOCAL_RANK=str(r),
                    WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    **req["env"],
                )
            pid = os.fork()
            if pid == 0:
                _rank(req["args"], env, os.path.join(d, f"{r}.out"), os.path.join(d, f"{r}.err"))
            pids.append(pid)
        codes: dict[int, int] = {}
        deadline, failed_at = t0 + req["timeout"], None
        while len(codes) < nproc:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                now = time.perf_counter()
                if now > deadline or (failed_at is not None and now > failed_at + req["grace"]):
                    for p in pids:
                        if p not in codes:
                            try:
                                os.killpg(p, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                time.sleep(0.02)
                continue
            if pid in pids:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.perf_counter()

        def read(path: str) -> str:
            with open(path, errors="replace") as f:
                return f.read()

        return {
            "codes": [codes[p] for p in pids],
            "stdout": "".join(read(os.path.join(d, f"{r}.out")) for r in range(nproc)),
            "stderr": [read(os.path.join(d, f"{r}.err")) for r in range(nproc)],
            "seconds": time.perf_counter() - t0,
        }


def serve() -> None:
    """Import once, then fork a run per request line until stdin closes."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch  # noqa: F401 - imported here once, so the forked ranks start warm
    import torch.distributed.fsdp  # noqa: F401 - what the wrappers import lazily
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import train  # noqa: F401

    try:  # metrics.Logger's writer: tensorboard pulls ~350 modules (protobuf, fsspec, boto3) on first use
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(_serve_one(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
