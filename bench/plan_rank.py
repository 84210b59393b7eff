"""The planner's step-time model held against measured runs on this CPU, as a ranking (issue #25).

    python -m bench.plan_rank                       # 2- and 4-rank layouts, 3 repeats: results/plan/
    python -m bench.plan_rank --worlds 2 --repeats 5 --out /tmp/rank

For each world size N (2, 4) a set of the planner's own candidates (plan.search.candidates: its flags, its
names) on one model (`tiny` widened to 4 Blocks of n_embd 128, 512-token vocabulary, 16 rows of 64 tokens per
step, fp32), each trained `--steps` steps by bench.forkserver (forked ranks, one thread each). Every repeat
runs the one-process references (SINGLE, SMALL) and all layouts, in reverse order on odd repeats (ABBA: a slow
drift of the shared machine's load hits early and late layouts alike). A run's time is the median of its steps'
step_time_ms after the first two (step 1 also measures saved activations); a layout's measured time is the median
over its repeats, its noise the spread (max - min) of those repeats. A step's time is train.py's (data, forward
and backward, clipping, optimizer, the loss's all-reduce), the planner's has no optimizer or data term.

The planner predicts each layout with a CPU "cluster" calibrated by measurement, not by guessing
(`calibrate`, one torchrun job of N ranks per world size, plus the one-process reference):
- overhead (Cluster.overhead, seconds per compute action: one F or B of a chunk on a micro-batch) and compute
  from the one-process reference at two micro-batches of the same 16 rows per step (`fit_overhead`): mb=16 in
  one micro-step (2 actions) and mb=4 in four (8 actions, plan.search.compute_actions); overhead = (t_mb4 -
  t_mb16) / (8 - 2), and the achieved FLOP/s = plan.predict.step_flops / (t_mb16 - 2 x overhead), so the planner
  (`--efficiency` 1) reproduces both runs: what a rank achieves alone, Python and non-matmul kernels included,
  split into a part per FLOP and a part per action (Python, autograd, dispatch: what makes many small
  micro-batches and zero-bubble's split backwards slower than their FLOPs say; smaller matmuls' lower rate
  lands in it too); the overhead runs on the same contended core as the FLOPs, so it is scaled like
  `peak_flops` below (x one process's FLOP/s / peak_flops);
  times the contention factor of N ranks on this machine's cores: the rate (calls x FLOPs over a 3 s window)
  of a (B·T, C) x (C, 4C) matmul while N ranks run it at once, over the rate of one alone;
- no overlap (Cluster.overlap False): gloo reduces on the cores that compute, so DDP's and ZeRO's traffic,
  hidden behind compute on a GPU, adds here;
- links: every group inside one "node" (gpus_per_node = N); bandwidth the bus bandwidth of a gloo all-reduce
  of the model's gradient size among the N ranks, bytes x 2(N-1)/N over its median time: the ring factor
  plan.search.step_time applies, so the planner's time for that all-reduce is the measured one;
- latency (Cluster.latency, charged per collective call and p2p message): the median time of a one-element gloo
  all-reduce among the N ranks (`--latency_reduces` of them, each after a barrier): what TP's many small
  per-Block collectives cost beyond their bytes;
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
PLAN = ["--model", "tiny", "--n_layer", str(N_LAYER), "--n_embd", str(C), "--vocab_size", str(VOCAB),
        "--seq_len", str(T), "--total_batch_size", str(ROWS * T), "--dtype", "float32"]
RUN = ["--eval_interval", "1000", "--eval_iters", "1", "--warmup_steps", "1", "--no_checkpoint", "--device", "cpu",
       "--peak_flops", "1e12", "--timeout", "120"]
SKIP = 2  # steps left out of a run's median: step 1 also measures saved activations, step 2 the CPU's allocated peak (both profiled)
SINGLE = "ac=none mb=16"
SMALL = "ac=none mb=4"  # the one-process reference in 4 micro-steps: the overhead's calibration (fit_overhead)
# The planner's names (plan.search.layout_name); micro-batches: one per dp rank without a pipeline, 2P
# per pipeline (4 at P = 2: the zero-bubble schedules' M >= P, dualpipev's 2P hold)
LAYOUTS = {
    2: ["dp=2(ddp) ac=none mb=8", "dp=2(zero1) ac=none mb=8", "dp=2(zero2) ac=none mb=8", "dp=2(fsdp) ac=none mb=8",
        "dp=2(ddp) ac=full mb=8", "tp=2 ac=none mb=16", "dp=1(ddp) cp=2 ac=none mb=16",
        "pp=2(1f1b) ac=none mb=4", "pp=2(gpipe) ac=none mb=4", "pp=2(interleaved_1f1b,V=2) ac=none mb=4",
        "pp=2(zb_h1) ac=none mb=4", "pp=2(zbv,V=2) ac=none mb=4"],
    4: ["dp=4(ddp) ac=none mb=4", "dp=4(fsdp) ac=none mb=4", "dp=2(ddp) tp=2 ac=none mb=8",
        "dp=2(fsdp) tp=2 ac=none mb=8", "tp=4 ac=none mb=16", "dp=2(ddp) cp=2 ac=none mb=8",
        "pp=2(1f1b) dp=2(ddp) ac=none mb=2", "pp=2(1f1b) dp=2(fsdp) ac=none mb=2", "pp=4(1f1b) ac=none mb=2",
        "pp=2(1f1b) tp=2 ac=none mb=4"],
}


# ----------------------------------------------------------------------------- pure logic (tests/test_plan_rank.py)

def run_seconds(records: list[dict], skip: int = SKIP) -> float | None:
    """A run's step time: the median step_time_ms (in s) of its steps after the first `skip`."""
    times = [r["step_time_ms"] / 1e3 for r in records if "loss" in r and r["step"] > skip]
    return statistics.median(times) if times else None


def measured(repeats: list[float]) -> tuple[float, float]:
    """(median, noise) of a layout's repeats: noise = max - min, the run-to-run spread."""
    return statistics.median(repeats), max(repeats) - min(repeats)


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
        v = verdict((a["predicted_s"], b["predicted_s"]), (a["measured_s"], b["measured_s"]),
                    (a["noise_s"], b["noise_s"]))
        out.append({"a": a["layout"], "b": b["layout"], "verdict": v})
    return out


def tally(pairs: list[dict]) -> dict[str, int]:
    return {k: sum(p["verdict"] == k for p in pairs) for k in ("agree", "disagree", "tie", "noise")}


def markdown(world: int, rows: list[dict], pairs: list[dict], cal: dict) -> str:
    """One world size's table, its verdict counts and every pair that is not "agree" or "noise"."""
    pr, mr = ranks([r["predicted_s"] for r in rows]), ranks([r["measured_s"] for r in rows])
    head = (f"### {world} ranks: compute {cal['compute_flops']:.3g} FLOP/s per rank (one process "
            f"{cal['single_flops']:.3g} x contention {cal['contention']:.2f}; {cal['cores']} cores), all-reduce bus "
            f"bandwidth {cal['bus_bw']:.3g} B/s, latency {cal['latency'] * 1e6:.0f} us per call, overhead "
            f"{cal.get('overhead', 0) * 1e6:.0f} us per compute action")
    lines = [head, "",
             "| layout | predicted s | measured median s | noise s | rank predicted | rank measured |",
             "|---|---:|---:|---:|---:|---:|"]
    for r, p, m in zip(rows, pr, mr):
        lines.append(f"| {r['layout']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | {r['noise_s']:.4f} "
                     f"| {p} | {m} |")
    t = tally(pairs)
    lines += ["", (f"Pairs: {len(pairs)}; ordered by the measurement (medians apart by more than the two "
                   f"noises): {len(pairs) - t['noise']}; the planner agrees on {t['agree']}, disagrees on "
                   f"{t['disagree']}, predicts a tie on {t['tie']}.")]
    for p in pairs:
        if p["verdict"] in ("disagree", "tie"):
            lines.append(f"- {p['verdict']}: {p['a']} vs {p['b']}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- calibration

def worker(spec: dict) -> None:
    """Every rank of the calibration job: the matmul rate while all ranks run it at once, then a timed gloo
    all-reduce of spec['numel'] fp32 elements; rank 0 writes both (medians over the ranks) to spec['out']."""
    import torch
    import torch.distributed as dist

    from parallel import comm
    from parallel.mesh import backend_for

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
    mm = calls * 2 * rows * c * 4 * c / (time.perf_counter() - t0)
    bw = None
    if n > 1:
        x = torch.zeros(spec["numel"])
        for _ in range(2):
            comm.all_reduce(x, counted=False)
        ts = []
        for _ in range(spec["reduces"]):
            dist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(x, counted=False)
            ts.append(time.perf_counter() - t0)
        bw = x.numel() * 4 * 2 * (n - 1) / n / statistics.median(ts)
    lat = latency(spec["latency_reduces"]) if n > 1 else None
    got = [None] * n
    dist.all_gather_object(got, (mm, bw, lat))
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump({"matmul_flops": statistics.median(g[0] for g in got),
                       "bus_bw": statistics.median(g[1] for g in got) if n > 1 else None,
                       "latency": statistics.median(g[2] for g in got) if n > 1 else None}, f)
    dist.destroy_process_group()


def latency(reduces: int) -> float:
    """Seconds per call: the median time of `reduces` one-element all-reduces over the world (each after a barrier,
    so every rank starts it together), after 5 untimed ones."""
    import torch
    import torch.distributed as dist

    from parallel import comm
    x = torch.zeros(1)
    for _ in range(5):
        comm.all_reduce(x, counted=False)
    ts = []
    for _ in range(reduces):
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(x, counted=False)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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
    c = {"single_flops": single_flops, "contention": contention, "compute_flops": single_flops * contention,
         "peak_flops": peak, "cores": cores, "single_overhead": overhead, "overhead": overhead * single_flops / peak,
         **cal}
    return Cluster(world, world, 2 ** 40, peak, cal["bus_bw"], cal["bus_bw"], "cpu-calibrated", overlap=False,
                   latency=cal["latency"], cores=cores if cores < world else None, overhead=c["overhead"]), c


def calibrate(world: int, numel: int, seconds: float = 3.0, reduces: int = 10, latency_reduces: int = 200) -> dict:
    """The calibration job on `world` ranks (one thread each): {matmul_flops (per rank), bus_bw, latency}."""
    from parallel.mesh import child_env
    with tempfile.TemporaryDirectory() as d:
        spec = {"rows": ROWS * T, "n_embd": C, "numel": numel, "seconds": seconds, "reduces": reduces,
                "latency_reduces": latency_reduces, "out": os.path.join(d, "cal.json")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "bench.plan_rank", f"--worker={json.dumps(spec)}"]
        subprocess.run(cmd, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), check=True, timeout=300,
                       stdout=subprocess.DEVNULL)
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--latency_reduces", type=int, default=200, help="timed one-element all-reduces (latency)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "plan"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path.insert(0, ROOT)
    from bench.forkserver import ForkServer
    from metrics import read_jsonl
    from plan.cluster import Cluster
    from plan.predict import local_params, step_flops
    from plan.search import compute_actions
    from tests.harness import make_token_bins

    worlds = [int(w) for w in args.worlds.split(",")]
    ones = planned(1, Cluster(1, 1, 2 ** 40, 1e12, 1e9, 1e9))
    probe, small = ones[SINGLE], ones[SMALL]
    grad_numel = sum(n for _, n, _ in local_params(probe.setup))
    cal = {1: calibrate(1, grad_numel)} | {w: calibrate(w, grad_numel, latency_reduces=args.latency_reduces)
                                           for w in worlds}
    cores = len(os.sched_getaffinity(0))
    print(f"[plan_rank] calibration: {json.dumps(cal)}", flush=True)
    todo = [(1, SINGLE), (1, SMALL)] + [(w, n) for w in worlds for n in LAYOUTS[w]]
    flags = {(1, SINGLE): probe.flags, (1, SMALL): small.flags}
    for w in worlds:  # the flags do not depend on the cluster's figures
        cands = planned(w, Cluster(w, w, 2 ** 40, 1e12, 1e9, 1e9))
        flags |= {(w, n): cands[n].flags for n in LAYOUTS[w]}
    runs: dict[tuple[int, str], list[float]] = {k: [] for k in todo}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ForkServer() as server:
        data = make_token_bins(os.path.join(tmp, "data"), vocab=VOCAB)
        for r in range(args.repeats):
            for k in (todo if r % 2 == 0 else todo[::-1]):
                out = os.path.join(tmp, f"{k[0]}-{k[1].replace(' ', '_')}-{r}")
                res = server.run([*flags[k], *RUN, "--max_steps", str(args.steps), "--dataset", data,
                                  "--out_dir", out], k[0], timeout=300)
                s = run_seconds(read_jsonl(out)) if res.returncode == 0 else None
                if s is None:
                    raise RuntimeError(f"{k}: exit codes {res.codes}: {res.stderr[0][-500:]}")
                runs[k].append(s)
                print(f"[plan_rank] repeat {r} {k[0]} ranks {k[1]}: {s * 1e3:.1f} ms/step", flush=True)
    single_s, small_s = measured(runs[(1, SINGLE)]), measured(runs[(1, SMALL)])
    overhead, single_flops = fit_overhead(step_flops(probe.setup), (single_s[0], compute_actions(probe.setup)),
                                          (small_s[0], compute_actions(small.setup)))
    report = {"config": {"plan": PLAN, "run": RUN, "steps": args.steps, "skip": SKIP, "repeats": args.repeats,
                         "cpu_count": os.cpu_count(), "cores": cores, "wall_s": time.perf_counter() - t0},
              "single": {"layout": SINGLE, "measured_s": single_s[0], "noise_s": single_s[1],
                         "flops": single_flops, "repeats": runs[(1, SINGLE)], "overhead": overhead},
              "small": {"layout": SMALL, "measured_s": small_s[0], "noise_s": small_s[1],
                        "repeats": runs[(1, SMALL)]}, "worlds": {}}
    md = [(f"Single process ({SINGLE}): {single_s[0]:.4f} s/step (noise {single_s[1]:.4f}); {SMALL}: "
           f"{small_s[0]:.4f} s/step (noise {small_s[1]:.4f}): {overhead * 1e6:.0f} us per compute action, "
           f"{single_flops:.3g} FLOP/s achieved; one-rank matmul {cal[1]['matmul_flops']:.3g} FLOP/s."), ""]
    for w in worlds:
        cluster, c = cpu_cluster(w, single_flops, cal[w], cal[1], cores, overhead)
        cands = planned(w, cluster)
        rows = []
        for n in LAYOUTS[w]:
            med, noise = measured(runs[(w, n)])
            times = cands[n].times  # plan.search.step_time on the calibrated cluster, efficiency 1
            rows.append({"layout": n, "predicted_s": times["total"], "times": times, "measured_s": med,
                         "noise_s": noise, "repeats": runs[(w, n)], "flags": flags[(w, n)]})
        pairs = pairwise(rows)
        report["worlds"][str(w)] = {"calibration": c, "rows": rows, "pairs": pairs, "tally": tally(pairs)}
        md.append(markdown(w, rows, pairs, c))
        print(md[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_rank.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "plan_rank.md"), "w") as f:
        f.write("\n".join(md))
    print(f"[plan_rank] wrote {args.out}/plan_rank.json, plan_rank.md ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
