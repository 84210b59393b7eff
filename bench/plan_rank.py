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

The planner predicts each layout with a CPU "cluster" calibrated by measurement, not by guessing: one torchrun
job of N ranks per world size and the one-process references (bench/calibration.py says what each figure is and
how it is measured).

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
import sys
import tempfile
import time

from bench.calibration import calibrate, cpu_cluster, fit_overhead

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


# ----------------------------------------------------------------------------- the bench


def planned(world: int, cluster) -> dict:
    """The planner's candidates on `world` ranks for PLAN, by name."""
    from plan import __main__ as cli
    from plan.search import candidates, model_flags

    a = cli.parser().parse_args([*PLAN, "--gpus", str(world), "--gpus_per_node", str(world)])
    return {c.name: c for c in candidates(model_flags(a), cluster, cli.check_batch(a), {}, efficiency=1.0)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.plan_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hop_reduces", type=int, default=200, help="timed small all-reduces (Cluster.hop)")
    p.add_argument("--stat", default="median", choices=sorted(STATS), help="a run's time of its steps")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "plan"))
    return p


def main(argv: list[str] | None = None) -> int:
    """Calibrate, run every layout `--repeats` times, fit the one-process references, then per world size predict
    each layout on its calibrated cluster and write plan_rank.json and plan_rank.md."""
    args = parser().parse_args(argv)
    sys.path.insert(0, ROOT)
    from plan.cluster import Cluster
    from plan.counts import local_params, step_flops
    from plan.search import compute_actions

    t_start = time.perf_counter()
    worlds = [int(w) for w in args.worlds.split(",")]
    ones = planned(1, Cluster(1, 1, 2**40, 1e12, 1e9, 1e9))
    probe, small = ones[SINGLE], ones[SMALL]
    grad_numel = sum(n for _, n, _ in local_params(probe.setup))
    cal = {1: calibrate(1, grad_numel, ROWS * T, C)} | {
        w: calibrate(w, grad_numel, ROWS * T, C, hop_reduces=args.hop_reduces) for w in worlds
    }
    cores = len(os.sched_getaffinity(0))
    print(f"[plan_rank] calibration: {json.dumps(cal)}", flush=True)
    todo = [(1, SINGLE), (1, SMALL)] + [(w, n) for w in worlds for n in LAYOUTS[w]]
    flags = {(1, SINGLE): probe.flags, (1, SMALL): small.flags}
    for w in worlds:  # the flags do not depend on the cluster's figures
        cands = planned(w, Cluster(w, w, 2**40, 1e12, 1e9, 1e9))
        flags |= {(w, n): cands[n].flags for n in LAYOUTS[w]}
    t0 = time.perf_counter()
    runs, steps = run_layouts(todo, flags, args)
    single_s, small_s = measured(runs[(1, SINGLE)]), measured(runs[(1, SMALL)])
    overhead, single_flops = fit_overhead(
        step_flops(probe.setup), (single_s[0], compute_actions(probe.setup)), (small_s[0], compute_actions(small.setup))
    )
    timing = {"cores": cores, "calibration_s": t0 - t_start, "runs_s": time.perf_counter() - t0}
    report = single_report(args, timing, runs, steps, overhead, single_flops)
    md = single_markdown(args, report, cal[1])
    for w in worlds:
        cluster, c = cpu_cluster(w, single_flops, cal[w], cal[1], cores, overhead)
        rows = world_rows(w, planned(w, cluster), runs, steps, flags)
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


def run_layouts(todo: list[tuple[int, str]], flags: dict, args) -> tuple[dict, dict]:
    """Every (world, layout) of `todo` trained `--steps` steps, `--repeats` times, in reverse order on odd repeats
    (ABBA), by a fork server: ({key: each repeat's time (`run_seconds`)}, {key: each repeat's step times})."""
    from bench.forkserver import ForkServer
    from runtime.metrics import read_jsonl
    from tests.harness import make_token_bins

    runs: dict[tuple[int, str], list[float]] = {k: [] for k in todo}
    steps: dict[tuple[int, str], list[list[float]]] = {k: [] for k in todo}  # every run's step times, kept
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
    return runs, steps


def single_report(args, timing: dict, runs: dict, steps: dict, overhead: float, single_flops: float) -> dict:
    """plan_rank.json before its world sizes: the configuration and timing, the noise of every run, and the
    one-process references with the fit (`fit_overhead`) made from them."""
    single_s, small_s = measured(runs[(1, SINGLE)]), measured(runs[(1, SMALL)])
    return {
        "config": {
            "plan": PLAN,
            "run": RUN,
            "steps": args.steps,
            "skip": SKIP,
            "repeats": args.repeats,
            "stat": args.stat,
            "cpu_count": os.cpu_count(),
            "cores": timing["cores"],
            "calibration_s": timing["calibration_s"],
            "runs_s": timing["runs_s"],
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


def single_markdown(args, report: dict, cal_1: dict) -> list[str]:
    """plan_rank.md's opening: the one-process references and the fit, how a run is timed, the noise."""
    single, small, config = report["single"], report["small"], report["config"]
    return [
        (
            f"Single process ({SINGLE}): {single['measured_s']:.4f} s/step (noise {single['noise_s']:.4f}); {SMALL}: "
            f"{small['measured_s']:.4f} s/step (noise {small['noise_s']:.4f}): {single['overhead'] * 1e6:.0f} us per "
            f"compute action, {single['flops']:.3g} FLOP/s achieved; one-rank matmul {cal_1['matmul_flops']:.3g} "
            "FLOP/s."
        ),
        "",
        (
            f"A run's time is the {args.stat} of its steps {SKIP + 1} to {args.steps}; {args.repeats} repeats in ABBA "
            f"order; a layout's noise is the spread (max - min) of its repeats. Noise / time, median over the "
            f"layouts, from these runs: "
            + ", ".join(f"{k} of steps {v:.1%}" for k, v in report["noise"].items())
            + f". Calibration {config['calibration_s']:.0f} s, runs {config['runs_s']:.0f} s."
        ),
        "",
    ]


def world_rows(w: int, cands: dict, runs: dict, steps: dict, flags: dict) -> list[dict]:
    """World size w's rows, one a layout of LAYOUTS[w]: its predicted time (plan.search.step_time on the calibrated
    cluster, efficiency 1: `cands`) beside its measured median and noise, its repeats, step times and flags."""
    rows = []
    for n in LAYOUTS[w]:
        med, noise = measured(runs[(w, n)])
        times = cands[n].times
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
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
