"""The planner's step-time model held against measured runs on this CPU, as a ranking (issue #25).

    python -m bench.plan_rank                       # 2- and 4-rank layouts, 5 repeats: results/plan/ (~4 min)
    python -m bench.plan_rank --worlds 2 --repeats 3 --out /tmp/rank

For each world size N (2, 4) a set of the planner's own candidates (plan.search.candidates: its flags, its
names) on one model (`tiny` widened to 4 Blocks of n_embd 128, 512-token vocabulary, 16 rows of 64 tokens per
step, fp32), each trained `--steps` steps by bench.forkserver (forked ranks, one thread each). Every repeat
runs the one-process references (SINGLE, SMALL) and all layouts, in reverse order on odd repeats (ABBA: a slow
drift of the shared machine's load hits early and late layouts alike). A run's time is the median (`--stat`: or
the min) of its steps' step_time_ms after the first two (step 1 also measures saved activations); a layout's
measured time is the median over its repeats, its noise the spread (max - min) of those repeats; the report gives
noise / time for both statistics from the same runs (`relative_noise`). A step's time is train.py's (data, forward
and backward, clipping, optimizer, the loss's all-reduce), the planner's has no optimizer or data term.

The planner predicts each layout with a CPU "cluster" calibrated by measurement, not by guessing
(`calibrate`, one torchrun job of N ranks per world size, plus the one-process reference):
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

Pairwise verdict (`pairwise`): two layouts are ordered by the measurement when their medians differ by more
than the sum of their noises; then the planner agrees when it predicts the same order, a tie when it
predicts the same time, and disagrees otherwise; pairs within the
noise get no verdict.

Writes plan_rank.json (calibration, runs, rows, verdicts) and plan_rank.md (the tables) in --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, T, C, VOCAB, N_LAYER = 16, 64, 128, 512, 4
PLAN = [
    "--model",
    "tiny",
    "--n_layer",
    str(N_LAYER),
    "--n_embd",
    str(C),
    "--vocab_size",
    str(VOCAB),
    "--seq_len",
    str(T),
    "--total_batch_size",
    str(ROWS * T),
    "--dtype",
    "float32",
]
RUN = [
    "--eval_interval",
    "1000",
    "--eval_iters",
    "1",
    "--warmup_steps",
    "1",
    "--no_checkpoint",
    "--device",
    "cpu",
    "--peak_flops",
    "1e12",
    "--timeout",
    "120",
]
# steps left out of a run's median: step 1 also measures saved activations, step 2 the CPU's allocated peak (both
# profiled)
SKIP = 2
SINGLE = "ac=none mb=16"
SMALL = "ac=none mb=4"  # the one-process reference in 4 micro-steps: the overhead's calibration (fit_overhead)
# The planner's names (plan.search.layout_name); micro-batches: one per dp rank without a pipeline, 2P
# per pipeline (4 at P = 2: the zero-bubble schedules' M >= P, dualpipev's 2P hold)
LAYOUTS = {
    2: [
        "dp=2(ddp) ac=none mb=8",
        "dp=2(zero1) ac=none mb=8",
        "dp=2(zero2) ac=none mb=8",
        "dp=2(fsdp) ac=none mb=8",
        "dp=2(ddp) ac=full mb=8",
        "tp=2 ac=none mb=16",
        "dp=1(ddp) cp=2 ac=none mb=16",
        "pp=2(1f1b) ac=none mb=4",
        "pp=2(gpipe) ac=none mb=4",
        "pp=2(interleaved_1f1b,V=2) ac=none mb=4",
        "pp=2(zb_h1) ac=none mb=4",
        "pp=2(zbv,V=2) ac=none mb=4",
    ],
    4: [
        "dp=4(ddp) ac=none mb=4",
        "dp=4(fsdp) ac=none mb=4",
        "dp=2(ddp) tp=2 ac=none mb=8",
        "dp=2(fsdp) tp=2 ac=none mb=8",
        "tp=4 ac=none mb=16",
        "dp=2(ddp) cp=2 ac=none mb=8",
        "pp=2(1f1b) dp=2(ddp) ac=none mb=2",
        "pp=2(1f1b) dp=2(fsdp) ac=none mb=2",
        "pp=4(1f1b) ac=none mb=2",
        "pp=2(1f1b) tp=2 ac=none mb=4",
    ],
}


# ----------------------------------------------------------------------------- pure logic (tests/test_plan_rank.py)

STATS = {"median": statistics.median, "min": min}  # what a run's time is of its steps (`--stat`)


def step_seconds(records: list[dict], skip: int = SKIP) -> list[float]:
    """A run's step times (s) after the first `skip` steps."""
    return [r["step_time_ms"] / 1e3 for r in records if "loss" in r and r["step"] > skip]


def run_seconds(records: list[dict], skip: int = SKIP, stat: str = "median") -> float | None:
    """A run's step time: the `stat` (STATS: median or min) of its step times after the first `skip`."""
    times = step_seconds(records, skip)
    return STATS[stat](times) if times else None


def measured(repeats: list[float]) -> tuple[float, float]:
    """(median, noise) of a layout's repeats: noise = max - min, the run-to-run spread."""
    return statistics.median(repeats), max(repeats) - min(repeats)


def relative_noise(steps: dict) -> dict[str, float]:
    """For each of STATS, the median over layouts of noise / measured (`measured` of the runs' `stat` of their
    steps): how far apart repeats land, relative to the time, by statistic, from the same runs."""
    out = {}
    for stat, fn in STATS.items():
        spreads = []
        for runs in steps.values():
            med, noise = measured([fn(r) for r in runs])
            spreads.append(noise / med)
        out[stat] = statistics.median(spreads)
    return out


def ranks(values: list[float]) -> list[int]:
    """1 for the smallest value, ties share the better rank (competition ranking: 1, 1, 3)."""
    return [1 + sum(w < v for w in values) for v in values]


def verdict(pred: tuple[float, float], meas: tuple[float, float], noise: tuple[float, float]) -> str:
    """One pair: "noise" (the medians differ by no more than the two noises together: no measured order),
    else "agree" / "disagree" with the predicted order, or "tie" (the same predicted time)."""
    if abs(meas[0] - meas[1]) <= noise[0] + noise[1]:
        return "noise"
    if math.isclose(pred[0], pred[1], rel_tol=1e-9):
        return "tie"
    return "agree" if (pred[0] < pred[1]) == (meas[0] < meas[1]) else "disagree"


def pairwise(rows: list[dict]) -> list[dict]:
    """Every pair of rows ({layout, predicted_s, measured_s, noise_s}), with its verdict."""
    out = []
    for a, b in itertools.combinations(rows, 2):
        v = verdict(
            (a["predicted_s"], b["predicted_s"]), (a["measured_s"], b["measured_s"]), (a["noise_s"], b["noise_s"])
        )
        out.append({"a": a["layout"], "b": b["layout"], "verdict": v})
    return out


def tally(pairs: list[dict]) -> dict[str, int]:
    return {k: sum(p["verdict"] == k for p in pairs) for k in ("agree", "disagree", "tie", "noise")}


def markdown(world: int, rows: list[dict], pairs: list[dict], cal: dict) -> str:
    """One world size's table, its verdict counts and every pair that is not "agree" or "noise"."""
    pr, mr = ranks([r["predicted_s"] for r in rows]), ranks([r["measured_s"] for r in rows])
    head = (
        f"### {world} ranks: compute {cal['compute_flops']:.3g} FLOP/s per rank (one process "
        f"{cal['single_flops']:.3g} x contention {cal['contention']:.2f}; {cal['cores']} cores), all-reduce bus "
        f"bandwidth {cal['bus_bw']:.3g} B/s beyond the hops, {cal['hop'] * 1e3:.3f} ms per hop, overhead "
        f"{cal.get('overhead', 0) * 1e6:.0f} us per compute action"
    )
    lines = [
        head,
        "",
        probes(cal, world),
        "",
        "| layout | predicted s | measured median s | noise s | rank predicted | rank measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r, p, m in zip(rows, pr, mr):
        lines.append(
            f"| {r['layout']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {r['noise_s']:.4f} | {p} | {m} |"
        )
    t = tally(pairs)
    lines += [
        "",
        (
            f"Pairs: {len(pairs)}; ordered by the measurement (medians apart by more than the two "
            f"noises): {len(pairs) - t['noise']}; the planner agrees on {t['agree']}, disagrees on "
            f"{t['disagree']}, predicts a tie on {t['tie']}."
        ),
    ]
    for p in pairs:
        if p["verdict"] in ("disagree", "tie"):
            lines.append(f"- {p['verdict']}: {p['a']} vs {p['b']}")
    return "\n".join(lines) + "\n"


def probes(cal: dict, world: int) -> str:
    """The calibration's call probes as a table: each kind over each group size between two matmuls, measured and
    as the model charges it (Cluster.hop x plan.search.HOPS; the HOP_NUMEL-element payloads' bytes are
    negligible), then the world's all-reduce between matmuls (the hop's measure), aligned, and with one element."""
    from plan.search import HOPS

    lines = [
        "| call between matmuls (n ranks, all groups at once) | measured ms | hops | model ms (hops x hop) |",
        "|---|---:|---:|---:|",
    ]
    for key, took in cal["calls"].items():
        kind, n = key.split(" n=")
        h = HOPS[kind](int(n))
        lines.append(f"| {key} | {took * 1e3:.2f} | {h} | {h * cal['hop'] * 1e3:.2f} |")
    lines += [
        "",
        (
            f"The hop's probe, an all-reduce over the {world} ranks between two matmuls: "
            f"{cal['hop'] * HOPS['all_reduce'](world) * 1e3:.2f} ms; the same call aligned by a barrier: "
            f"{cal['aligned'] * 1e3:.2f} ms; a one-element all-reduce so aligned (the latency probe before; "
            f"gloo's ring skips its empty segments): {cal['one_element'] * 1e3:.2f} ms."
        ),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- calibration

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
    world: int, numel: int, seconds: float = 3.0, reduces: int = 10, hop_reduces: int = 200, call_probes: int = 50
) -> dict:
    """The calibration job on `world` ranks (one thread each): {matmul_flops (per rank)} and with more than one
    rank comm_probes' {hop, bus_bw, aligned, one_element, calls}."""
    from runtime.launch import child_env

    with tempfile.TemporaryDirectory() as d:
        spec = {
            "rows": ROWS * T,
            "n_embd": C,
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
            "bench.plan_rank",
            f"--worker={json.dumps(spec)}",
        ]
        subprocess.run(
            cmd, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), check=True, timeout=300, stdout=subprocess.DEVNULL
        )
        with open(spec["out"]) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- the bench


def planned(world: int, cluster) -> dict:
    """The planner's candidates on `world` ranks for PLAN, by name."""
    from plan import __main__ as cli
    from plan.search import candidates, model_flags

    a = cli.parser().parse_args([*PLAN, "--gpus", str(world), "--gpus_per_node", str(world)])
    return {c.name: c for c in candidates(model_flags(a), cluster, cli.check_batch(a), {}, efficiency=1.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hop_reduces", type=int, default=200, help="timed small all-reduces (Cluster.hop)")
    p.add_argument("--stat", default="median", choices=sorted(STATS), help="a run's time of its steps")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "plan"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from runtime.launch import exit_process

        worker(json.loads(args.worker))
        exit_process(0)  # the group is destroyed: skip finalization (launch.exit_process)
    sys.path.insert(0, ROOT)
    from bench.forkserver import ForkServer
    from plan.cluster import Cluster
    from plan.counts import local_params, step_flops
    from plan.search import compute_actions
    from runtime.metrics import read_jsonl
    from tests.harness import make_token_bins

    t_start = time.perf_counter()
    worlds = [int(w) for w in args.worlds.split(",")]
    ones = planned(1, Cluster(1, 1, 2**40, 1e12, 1e9, 1e9))
    probe, small = ones[SINGLE], ones[SMALL]
    grad_numel = sum(n for _, n, _ in local_params(probe.setup))
    cal = {1: calibrate(1, grad_numel)} | {w: calibrate(w, grad_numel, hop_reduces=args.hop_reduces) for w in worlds}
    cores = len(os.sched_getaffinity(0))
    print(f"[plan_rank] calibration: {json.dumps(cal)}", flush=True)
    todo = [(1, SINGLE), (1, SMALL)] + [(w, n) for w in worlds for n in LAYOUTS[w]]
    flags = {(1, SINGLE): probe.flags, (1, SMALL): small.flags}
    for w in worlds:  # the flags do not depend on the cluster's figures
        cands = planned(w, Cluster(w, w, 2**40, 1e12, 1e9, 1e9))
        flags |= {(w, n): cands[n].flags for n in LAYOUTS[w]}
    runs: dict[tuple[int, str], list[float]] = {k: [] for k in todo}
    steps: dict[tuple[int, str], list[list[float]]] = {k: [] for k in todo}  # every run's step times, kept
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ForkServer() as server:
        data = make_token_bins(os.path.join(tmp, "data"), vocab=VOCAB)
        for r in range(args.repeats):
            for k in todo if r % 2 == 0 else todo[::-1]:
                out = os.path.join(tmp, f"{k[0]}-{k[1].replace(' ', '_')}-{r}")
                res = server.run(
                    [*flags[k], *RUN, "--max_steps", str(args.steps), "--dataset", data, "--out_dir", out],
                    k[0],
                    timeout=300,
                )
                recs = read_jsonl(out) if res.returncode == 0 else []
                s = run_seconds(recs, stat=args.stat)
                if s is None:
                    raise RuntimeError(f"{k}: exit codes {res.codes}: {res.stderr[0][-500:]}")
                runs[k].append(s)
                steps[k].append(step_seconds(recs))
                print(f"[plan_rank] repeat {r} {k[0]} ranks {k[1]}: {s * 1e3:.1f} ms/step", flush=True)
    single_s, small_s = measured(runs[(1, SINGLE)]), measured(runs[(1, SMALL)])
    overhead, single_flops = fit_overhead(
        step_flops(probe.setup), (single_s[0], compute_actions(probe.setup)), (small_s[0], compute_actions(small.setup))
    )
    report = {
        "config": {
            "plan": PLAN,
            "run": RUN,
            "steps": args.steps,
            "skip": SKIP,
            "repeats": args.repeats,
            "stat": args.stat,
            "cpu_count": os.cpu_count(),
            "cores": cores,
            "calibration_s": t0 - t_start,
            "runs_s": time.perf_counter() - t0,
        },
        "noise": relative_noise(steps),
        "single": {
            "layout": SINGLE,
            "measured_s": single_s[0],
            "noise_s": single_s[1],
            "flops": single_flops,
            "repeats": runs[(1, SINGLE)],
            "overhead": overhead,
        },
        "small": {"layout": SMALL, "measured_s": small_s[0], "noise_s": small_s[1], "repeats": runs[(1, SMALL)]},
        "worlds": {},
    }
    md = [
        (
            f"Single process ({SINGLE}): {single_s[0]:.4f} s/step (noise {single_s[1]:.4f}); {SMALL}: "
            f"{small_s[0]:.4f} s/step (noise {small_s[1]:.4f}): {overhead * 1e6:.0f} us per compute action, "
            f"{single_flops:.3g} FLOP/s achieved; one-rank matmul {cal[1]['matmul_flops']:.3g} FLOP/s."
        ),
        "",
        (
            f"A run's time is the {args.stat} of its steps {SKIP + 1} to {args.steps}; {args.repeats} repeats in ABBA "
            f"order; a layout's noise is the spread (max - min) of its repeats. Noise / time, median over the "
            f"layouts, from these runs: "
            + ", ".join(f"{k} of steps {v:.1%}" for k, v in report["noise"].items())
            + f". Calibration {report['config']['calibration_s']:.0f} s, runs {report['config']['runs_s']:.0f} s."
        ),
        "",
    ]
    for w in worlds:
        cluster, c = cpu_cluster(w, single_flops, cal[w], cal[1], cores, overhead)
        cands = planned(w, cluster)
        rows = []
        for n in LAYOUTS[w]:
            med, noise = measured(runs[(w, n)])
            times = cands[n].times  # plan.search.step_time on the calibrated cluster, efficiency 1
            rows.append(
                {
                    "layout": n,
                    "predicted_s": times["total"],
                    "times": times,
                    "measured_s": med,
                    "noise_s": noise,
                    "repeats": runs[(w, n)],
                    "steps": steps[(w, n)],
                    "flags": flags[(w, n)],
                }
            )
        pairs = pairwise(rows)
        report["worlds"][str(w)] = {"calibration": c, "rows": rows, "pairs": pairs, "tally": tally(pairs)}
        md.append(markdown(w, rows, pairs, c))
        print(md[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_rank.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "plan_rank.md"), "w") as f:
        f.write("\n".join(md))
    print(f"[plan_rank] wrote {args.out}/plan_rank.json, plan_rank.md ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
