"""Launch a fault-tolerant job on one machine: torchft's lighthouse and R replica groups, each its own torchrun job
(docs/fault-tolerance.md), and relaunch a group that dies with the command that started it: it rejoins and heals
from a live peer while the others train on.

    python scripts/ft_launch.py --groups 3 --nproc 1 --out_dir runs/ft -- --model tiny --dataset shakespeare_char ...
    python scripts/ft_launch.py --groups 2 --nproc 2 --out_dir runs/ft -- --data_parallel_size 2 \\
        --data_parallel_type fsdp ...

Everything after `--` goes to train.py as it is. Group I writes <out_dir>/group_I (metrics.jsonl, TensorBoard,
checkpoints while it is the first live group) and its console to <out_dir>/group_I.log; this prints each group's
steps and fault-tolerance events, prefixed `[group I]`. `--relaunch N` relaunches a dead group up to N times
(default 3), until a group finishes (then the job is done: a group relaunched after the others finished would train
the job again, alone). `--port` is the lighthouse's (default: a free one); `--lighthouse URL` joins a running one.
SIGINT/SIGTERM stop every group (each saves a checkpoint if it is the writer: train.py's preemption) and the
lighthouse. Exit code: 0 when a group finished the job, else the last failure's.

On several machines, start `torchft_lighthouse` on one and on each machine run its groups with
`--lighthouse http://HOST:PORT --group_ids I,J` (this launches only those ids): torchrun's store must then be
reachable from the other machines (--rdzv_endpoint, see the docs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOWN = ("step ", "ft: ", "train.py: error", "GPT_FT_")  # the console lines worth a user's eye
SIGNALS = (signal.SIGINT, signal.SIGTERM)  # passed on to every group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighthouse:
    """torchft's lighthouse on `port` of this machine, as the issue starts it: a quorum of at least 1 group, checked
    every 100 ms, stragglers waited for 2 s; a group whose heartbeat is `heartbeat_ms` old is dead."""

    def __init__(self, port: int | None = None, heartbeat_ms: int = 5000, log: str | None = None):
        self.port = port or free_port()
        self.url = f"http://localhost:{self.port}"
        binary = shutil.which("torchft_lighthouse")
        if binary is None:
            raise RuntimeError("torchft_lighthouse is not on PATH: pip install torchft==0.2.0")
        cmd = [binary, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "2000"]
        cmd += ["--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"[::]:{self.port}"]
        self._log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while True:  # it answers its status page once it serves
            try:
                urllib.request.urlopen(self.url + "/status", timeout=1).read(1)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.close()
                    raise RuntimeError(f"torchft_lighthouse did not start on port {self.port}") from None
                time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def group_command(
    train_args: list[str], group: int, groups: int, nproc: int, lighthouse: str, out_dir: str
) -> list[str]:
    """Replica group `group`'s command: its own torchrun job (--standalone: a free rendezvous port of its own)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "0.2"]
    return [
        *run,
        f"--nproc_per_node={nproc}",
        os.path.join(ROOT, "train.py"),
        *train_args,
        "--out_dir",
        os.path.join(out_dir, f"group_{group}"),
        "--ft_lighthouse",
        lighthouse,
        "--ft_replica_group",
        str(group),
        "--ft_replica_groups",
        str(groups),
    ]


class Group:
    """One replica group's torchrun job: started, and restarted with the same command. Its console (stdout and
    stderr) goes to `log`, each line also handed to `on_line(group, seconds since the epoch, line)`."""

    def __init__(self, group: int, cmd: list[str], log: str, on_line=None):
        self.group, self.cmd, self.log, self.on_line = group, cmd, log, on_line
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []
        self._reader: threading.Thread | None = None

    def start(self, env: dict | None = None) -> None:
        full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.starts.append(time.time())
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.log, "a") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if self.on_line is not None:
                    self.on_line(self.group, time.time(), line.rstrip("\n"))

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self._reader is not None:
            self._reader.join()  # every line read before the exit is reported
        return code

    def wait(self, timeout: float | None = None) -> int:
        self.proc.wait(timeout)
        return self.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="ft_launch.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, required=True, metavar="R", help="replica groups in the job")
    p.add_argument("--nproc", type=int, default=1, metavar="K", help="ranks per group (torchrun --nproc_per_node)")
    p.add_argument("--out_dir", required=True, help="the job's folder: group I writes <out_dir>/group_I")
    p.add_argument("--group_ids", default=None, metavar="I,J", help="launch only these groups (default: all R)")
    p.add_argument("--lighthouse", default=None, metavar="URL", help="join this lighthouse instead of starting one")
    p.add_argument("--port", type=int, default=None, help="the lighthouse's port (default: a free one)")
    p.add_argument("--heartbeat_ms", type=int, default=5000, help="a group silent this long is lost (default 5000)")
    p.add_argument("--relaunch", type=int, default=3, metavar="N", help="relaunch a dead group up to N times")
    return p.parse_args(argv[:cut]), argv[cut + 1 :]


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    ids = [int(i) for i in args.group_ids.split(",")] if args.group_ids else list(range(args.groups))
    os.makedirs(args.out_dir, exist_ok=True)
    lighthouse = None
    if args.lighthouse is None:
        log = os.path.join(args.out_dir, "lighthouse.log")
        lighthouse = Lighthouse(args.port, args.heartbeat_ms, log)
        print(f"ft_launch: lighthouse {lighthouse.url} (log: {log})", flush=True)
    url = args.lighthouse or lighthouse.url

    def show(group: int, at: float, line: str) -> None:
        if line.startswith(SHOWN):
            print(f"[group {group}] {line}", flush=True)

    groups = []
    for i in ids:
        cmd = group_command(train_args, i, args.groups, args.nproc, url, args.out_dir)
        groups.append(Group(i, cmd, os.path.join(args.out_dir, f"group_{i}.log"), show))
        groups[-1].start()
    stop = []
    # passed on to the groups while the job runs; the caller's handlers come back after (a process that called
    # main() and then forks, a test runner's pool workers, must not inherit a handler that swallows SIGTERM)
    saved = {sig: signal.signal(sig, lambda s, f: (stop.append(s), [g.signal(s) for g in groups])) for sig in SIGNALS}
    code, left, relaunches, finished = 0, list(groups), {g.group: 0 for g in groups}, False
    try:
        while left:
            time.sleep(0.2)
            for g in list(left):
                rc = g.poll()
                if rc is None:
                    continue
                done = any(d.poll() == 0 for d in groups)  # a group finished: the job is done, nothing to rejoin
                if rc != 0 and not stop and not done and relaunches[g.group] < args.relaunch:
                    relaunches[g.group] += 1
                    print(f"ft_launch: group {g.group} exited {rc}: relaunching it ({relaunches[g.group]})", flush=True)
                    g.start()
                    continue
                left.remove(g)
                finished = finished or rc == 0
                code = rc or code
                print(f"ft_launch: group {g.group} finished (exit {rc})", flush=True)
    finally:
        for g in left:
            g.signal(signal.SIGTERM)
        if lighthouse is not None:
            lighthouse.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 0 if finished and not stop else code


if __name__ == "__main__":
    sys.exit(main())
