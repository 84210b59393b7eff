"""The CPU "cluster" on which bench.plan_rank's planner predicts each layout, calibrated by measurement, not by
guessing: one torchrun job of N ranks per world size (`calibrate`, each rank running `worker`) and the one-process
reference runs (`fit_overhead`), made into a plan.cluster.Cluster by `cpu_cluster`.

Its figures:
- overhead (Cluster.overhead, seconds per compute action: one F or B of a chunk on a micro-batch) and compute
  from the one-process reference at two micro-batches of the same 16 rows per step (`fit_overhead`): mb=16 in
  one micro-step (2 actions) and mb=4 in four (8 actions, plan.search.compute_actions); overhead = (t_mb4 -
  t_mb16) / (8 - 2), and the achieved FLOP/s = plan.counts.step_flops / (t_mb16 - 2 x overhead), so the planner
  (`--efficiency` 1) reproduces both runs: what a rank achieves alone, Python and non-matmul kernels included,
  split into a part per FLOP and a part per action (Python, autograd, dispatch: what makes many small
  micro-batches and zero-bubble's split backwards slower than their FLOPs say; smaller matmuls' lower rate
  lands in it too); the overhead runs on the same contended core as the FLOPs, so it is scaled like
  `peak_flops` below (x one process's FLOP/s / peak_flops);
  times the contention factor of N ranks on this machine's cores: the rate (calls x FLOPs over a 3 s window)
  of a (B·T, C) x (C, 4C) matmul while N ranks run it at once, over the rate of one alone;
- no overlap (Cluster.overlap False): gloo reduces on the cores that compute, so DDP's and ZeRO's traffic,
  hidden behind compute on a GPU, adds here;
- hop (Cluster.hop, charged per hop of each call: plan.search.HOPS, 2(n-1) for an all-reduce over n ranks): a
  gloo all-reduce of HOP_NUMEL elements a rank among the N ranks, issued between two matmuls as TP issues its
  calls (`--hop_reduces` of them, less the matmuls' time: `_between`), / its 2(N-1) hops. No per-call latency
  (Cluster.latency 0): the one-element all-reduce that measured it before times a degenerate ring (gloo skips
  the empty segments' messages: N - 1 of N with one element). The report holds the hop against every kind over
  every group size so measured (`comm_probes`' calls);
- links: every group inside one "node" (gpus_per_node = N); bandwidth the bus bandwidth of a gloo all-reduce
  of the model's gradient size among the N ranks, bytes x 2(N-1)/N over its time less its hops' (floored at a
  tenth of it), between matmuls too: the ring factor plan.search.step_time applies, so the planner's time for
  that all-reduce (bytes and hops) is the measured one;
- cores (Cluster.cores): this process's CPUs (os.sched_getaffinity). With fewer cores than ranks a rank idle in
  the pipeline bubble frees its core, so the planner runs a busy rank at min(1, cores / busy) of `peak_flops`,
  busy = N(1 - bubble); the contention was measured with all N ranks busy, so `peak_flops` = one process's
  FLOP/s x contention / min(1, cores / N): one rank's rate on a core of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOP_NUMEL = 64  # elements a rank in the hop probe's all-reduce: every ring segment holds some, 256 B: no bandwidth


def _median_time(fn, times: int) -> float:
    """The median seconds of `times` calls of fn(), each after a barrier (every rank starts it together), after 3
    untimed ones."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    ts = []
    for _ in range(times):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _between(fn, compute, times: int) -> float:
    """Seconds per call of fn() issued between computations, as training issues its calls (TP between its
    matmuls): `times` x (compute(); fn()) less `times` x compute() alone, each loop timed whole after a barrier,
    with no barrier between calls (after 3 untimed ones)."""
    import torch.distributed as dist

    for _ in range(3):
        compute()
        fn()

    def loop(body) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(times):
            body()
        return time.perf_counter() - t0

    return (loop(lambda: (compute(), fn())) - loop(compute)) / times


def _call(kind: str, numel: int, group, size: int):
    """One blocking call of `kind` over `group` (of `size` ranks) on `numel` elements a rank; p2p: a message to the
    pair's other rank and one back (pairs of consecutive ranks), whose time is then two hops."""
    import torch

    from parallel import comm

    x = torch.zeros(numel)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(x, group, counted=False)
    if kind == "all_gather":
        out = torch.zeros(numel * size)
        return lambda: comm.all_gather_into_tensor(out, x, group)
    if kind == "reduce_scatter":
        full = torch.zeros(numel * size)
        return lambda: comm.reduce_scatter_tensor(x, full, group)
    first = comm.rank(group) == 0

    def ping_pong() -> None:
        if first:
            comm.send(x, 1, group).wait()
            comm.recv(x, 1, group).wait()
        else:
            comm.recv(x, 0, group).wait()
            comm.send(x, 0, group).wait()

    return ping_pong


def comm_probes(spec: dict, a, b) -> dict:
    """This rank's communication figures (every rank runs them together; the caller takes medians over ranks),
    each call issued between two matmuls of the contention probe (`a @ b`, ~0.9 ms alone: TP's ~0.7 ms of compute
    per call in these layouts) and timed less the matmul (`_between`):
    - hop: an all-reduce of HOP_NUMEL elements a rank over the world, / its 2(N-1) hops (plan.search.HOPS): the
      model's Cluster.hop;
    - bus_bw: spec['numel'] elements (the model's gradient) all-reduced, bytes x 2(N-1)/N over its time less its
      hops': the bandwidth beyond the hops;
    - calls: each kind over each group size g (2 .. N, all N/g groups at once) on HOP_NUMEL elements a rank, and
      a p2p message (a ping-pong between pairs, / 2): what `hop` x HOPS predicts, held in the report;
    - aligned: the hop probe's all-reduce timed alone after a barrier (median), and one_element: a one-element
      all-reduce so timed, the latency the bench used before (gloo's ring splits a tensor in N segments and skips
      the empty ones' messages: with one element N - 1 of them)."""
    import torch
    import torch.distributed as dist

    from parallel import comm
    from plan.search import HOPS

    n, rank = dist.get_world_size(), dist.get_rank()

    def compute() -> None:
        a @ b

    x, g = torch.zeros(HOP_NUMEL * n), torch.zeros(spec["numel"])

    def reduce() -> None:
        comm.all_reduce(x, counted=False)

    hop = _between(reduce, compute, spec["hop_reduces"]) / HOPS["all_reduce"](n)
    t = _between(lambda: comm.all_reduce(g, counted=False), compute, spec["reduces"])
    out = {
        "hop": hop,
        "bus_bw": spec["numel"] * 4 * 2 * (n - 1) / n / max(t - HOPS["all_reduce"](n) * hop, t / 10),
        "aligned": _median_time(reduce, 100),
        "one_element": _median_time(lambda: comm.all_reduce(torch.zeros(1), counted=False), 100),
        "calls": {},
    }
    for size in (k for k in range(2, n + 1) if n % k == 0):
        groups = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)]  # every rank makes each
        group = groups[rank // size]
        for kind in ("all_reduce", "all_gather", "reduce_scatter") + (("p2p",) if size == 2 else ()):
            took = _between(_call(kind, HOP_NUMEL, group, size), compute, spec["call_probes"])
            out["calls"][f"{kind} n={size}"] = took / 2 if kind == "p2p" else took
    return out


def _medians(got: list):
    """The median over ranks of each number of a (nested) dict of figures."""
    if isinstance(got[0], dict):
        return {k: _medians([g[k] for g in got]) for k in got[0]}
    return statistics.median(got)


def worker(spec: dict) -> None:
    """Every rank of the calibration job: the matmul rate while all ranks run it at once, then (N > 1)
    `comm_probes`; rank 0 writes the medians over the ranks to spec['out']."""
    import torch
    import torch.distributed as dist

    from runtime.device import backend_for

    torch.set_num_threads(1)
    dist.init_process_group(backend_for(torch.device("cpu")))
    n = dist.get_world_size()
    rows, c = spec["rows"], spec["n_embd"]
    a, b = torch.randn(rows, c), torch.randn(c, 4 * c)
    for _ in range(3):
        a @ b
    dist.barrier()
    calls, t0 = 0, time.perf_counter()  # throughput over the window: a call's own time misses preemption
    while calls < 5 or time.perf_counter() < t0 + spec["seconds"]:
        a @ b
        calls += 1
    mine = {"matmul_flops": calls * 2 * rows * c * 4 * c / (time.perf_counter() - t0)}
    if n > 1:
        mine |= comm_probes(spec, a, b)
    got = [None] * n
    dist.all_gather_object(got, mine)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(_medians(got), f)
    dist.barrier()  # no rank tears its groups down while another is still in the last collective
    dist.destroy_process_group()


def fit_overhead(flops: float, big: tuple[float, float], small: tuple[float, float]) -> tuple[float, float]:
    """(seconds per compute action, FLOP/s) from two one-process runs of the same `flops` per step, each
    (seconds, compute actions): the line t = flops / rate + overhead x actions through both. A negative slope
    (the small micro-batches measured faster: noise) is taken as no overhead."""
    (t_big, n_big), (t_small, n_small) = big, small
    overhead = max(0.0, (t_small - t_big) / (n_small - n_big))
    return overhead, flops / (t_big - overhead * n_big)


def cpu_cluster(world: int, single_flops: float, cal: dict, cal_1: dict, cores: int, overhead: float = 0.0):
    """The calibrated CPU cluster on `world` ranks (the module docstring) and its figures; `overhead` is one
    process's seconds per compute action, scaled like the FLOP/s (x single_flops / peak_flops)."""
    from plan.cluster import Cluster

    contention = cal["matmul_flops"] / cal_1["matmul_flops"]
    peak = single_flops * contention / min(1.0, cores / world)
    c = {
        "single_flops": single_flops,
        "contention": contention,
        "compute_flops": single_flops * contention,
        "peak_flops": peak,
        "cores": cores,
        "single_overhead": overhead,
        "overhead": overhead * single_flops / peak,
        **cal,
    }
    # a gloo call costs its hops (the one-element all-reduce that measured `latency` before skips most of them):
    # no separate per-call latency
    return Cluster(
        world,
        world,
        2**40,
        peak,
        cal["bus_bw"],
        cal["bus_bw"],
        "cpu-calibrated",
        overlap=False,
        latency=0.0,
        cores=cores if cores < world else None,
        overhead=c["overhead"],
        hop=cal["hop"],
    ), c


def calibrate(
    world: int,
    numel: int,
    rows: int,
    n_embd: int,
    seconds: float = 3.0,
    reduces: int = 10,
    hop_reduces: int = 200,
    call_probes: int = 50,
) -> dict:
    """The calibration job on `world` ranks (one thread each): {matmul_flops (per rank)} of a (rows, n_embd) x
    (n_embd, 4 n_embd) matmul, and with more than one rank comm_probes' {hop, bus_bw, aligned, one_element, calls}
    (`numel`: the all-reduce the bus bandwidth is measured on, the model's gradient)."""
    from runtime.launch import child_env

    with tempfile.TemporaryDirectory() as d:
        spec = {
            "rows": rows,
            "n_embd": n_embd,
            "numel": numel,
            "seconds": seconds,
            "reduces": reduces,
            "hop_reduces": hop_reduces,
            "call_probes": call_probes,
            "out": os.path.join(d, "cal.json"),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            "-m",
            "bench.calibration",
            f"--worker={json.dumps(spec)}",
        ]
        subprocess.run(
            cmd, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), check=True, timeout=300, stdout=subprocess.DEVNULL
        )
        with open(spec["out"]) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """One rank of the calibration job (`calibrate` starts N under torchrun): `worker`, then exit."""
    from runtime.launch import exit_process

    p = argparse.ArgumentParser(prog="python -m bench.calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, help="the job's spec, as JSON (`calibrate` writes it)")
    worker(json.loads(p.parse_args(argv).worker))
    exit_process(0)  # the group is destroyed: skip finalization (launch.exit_process)


if __name__ == "__main__":
    raise SystemExit(main())
