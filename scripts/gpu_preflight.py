"""The GPU check's process-group preflight: before any stage builds a process group in the check's own process,
a child process inits a one-rank group on the device (NCCL on CUDA, gloo on the CPU: parallel/mesh.backend_for)
and runs one all_reduce, within DEADLINE_S. No NCCL run has been recorded on the GPU machine; an NCCL that fails
or hangs there would otherwise fail, or hang, every stage that uses a group, and spend the GPU's whole budget.

    python scripts/gpu_preflight.py cuda      # prints one JSON line: backend, init_s, all_reduce_s, nccl
                                              # exit 0; 3 past the deadline; else the error's traceback, exit 1

The deadline counts the init and the all_reduce only: the child's `import torch` and the CUDA context come first
(a timeout of their own, IMPORT_S, bounds them from the parent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

DEADLINE_S = 30.0  # process-group init + one all_reduce: a slow but healthy NCCL init (several s) passes
IMPORT_S = 120.0  # the child's python start, import torch and CUDA context, before the deadline's clock starts


def command(device_type: str) -> list[str]:
    """The child's command line (a test replaces it with one that fails)."""
    return [sys.executable, os.path.abspath(__file__), device_type]


def run(device_type: str) -> tuple[bool, str]:
    """(passed, what the row says): the child's timings, or why it failed (its exit, its last stderr line)."""
    from gpu_harness import child_env, last_line

    try:
        proc = subprocess.run(
            command(device_type), capture_output=True, text=True, env=child_env(), timeout=IMPORT_S + DEADLINE_S
        )
    except subprocess.TimeoutExpired:
        return False, f"the child did not finish in {IMPORT_S + DEADLINE_S:.0f} s (import, CUDA context, init)"
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        return False, f"exit {proc.returncode}: {last_line(proc.stderr) or last_line(proc.stdout)}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return True, (
        f"{r['backend']}{' ' + r['nccl'] if r['nccl'] else ''}: one-rank init {r['init_s']:.2f} s + "
        f"one all_reduce {r['all_reduce_s'] * 1e3:.1f} ms (deadline {DEADLINE_S:g} s)"
    )


def _expire() -> None:
    sys.stderr.write(f"gpu_preflight: process-group init + one all_reduce took longer than {DEADLINE_S:g} s\n")
    sys.stderr.flush()
    os._exit(3)  # a hung NCCL init does not return: leave without running finalizers


def main(device_type: str) -> int:
    import torch
    import torch.distributed as dist
    from gpu_harness import init_one_rank_group  # the stages' own init (it puts the repository on sys.path)

    import parallel.mesh  # noqa: F401 -- what the init imports: loaded before the clock
    import tests.harness  # noqa: F401

    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.empty(1, device=device)  # the CUDA context: made before the clock (it is not the backend's)
    timer = threading.Timer(DEADLINE_S, _expire)
    timer.daemon = True
    timer.start()
    t0 = time.perf_counter()
    backend = init_one_rank_group(device)
    t1 = time.perf_counter()
    x = torch.full((1024,), 2.0, device=device)
    dist.all_reduce(x)
    ok = bool((x == 2.0).all())  # the host read waits for the all_reduce
    t2 = time.perf_counter()
    dist.destroy_process_group()
    timer.cancel()
    if not ok:
        sys.stderr.write("gpu_preflight: a one-rank all_reduce changed its input\n")
        return 1
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else ""
    print(
        json.dumps(
            {"backend": backend, "nccl": f"NCCL {nccl}" if nccl else "", "init_s": t1 - t0, "all_reduce_s": t2 - t1}
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
