"""The pipeline schedules measured: per-rank F/B timelines, idle fraction against theory, saved activations.

    python -m bench.pipeline --out out/pipeline [--pp 4] [--micro 8] [--virtual 2] [--model tiny]

One torchrun job (gloo, CPU, one thread per rank) runs gpipe, 1f1b and interleaved_1f1b (V = --virtual) on
the same GPT, cut into P·V chunks (n_layer defaults to P·V, one Block per interleaved chunk). Per schedule:
--warmup steps, then --repeats measured steps, each after a dist.barrier; each rank's action times are taken
relative to its own perf_counter just after the barrier and gathered, and the step with the shortest span
is kept (on a shared machine other load only adds time).

Per rank: busy = sum of its F, B and W intervals; span = max end - min start of any action over all ranks;
idle = 1 - busy/span. The schedule's idle (mean over ranks, i.e. 1 - sum busy/(P·span)) sits next to
`bubble_fraction`, which assumes equal stages and free messages. The Blocks are split as train.py splits
them, by cost (parallel/pipeline/partition.py: FLOPs, or with `--balance time` rank 0's timings of a Block,
the embedding and the head, or with `--balance step` the ranks' own times in 1F1B steps on the FLOP split,
taken before the schedules run; `--layers_per_stage` sets the split of the
one-chunk schedules by hand), but whole Blocks cannot balance chunk 0's embedding against the last chunk's
lm_head and loss exactly, and P ranks share the cores, so expect a gap.

Saved activations: bytes of distinct storages that autograd holds for backward (saved_tensors_hooks; a
storage saved by several ops counts once, parameters are excluded), tracked live: a storage counts from
its first save until autograd frees the last reference to it. The hooks cost time, so the peak comes from
one more step of its own, run before the timed ones.

Outputs in --out: pipeline.json (config, summary per schedule, one row per schedule and rank),
pipeline.md, pipeline_timeline.png, pipeline_timelines.json (the raw gathered timelines).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from parallel.pipeline.parts import GPT_PARTS
from parallel.pipeline.record import StepRecord
from parallel.pipeline.schedule import ALL_SCHEDULES, COMPUTE, V_SCHEDULES, B, F, W
from parallel.pipeline.zero_bubble import split_backward
from plan.theory import bubble_fraction
from plan.timeline import simulate_schedule
from runtime.launch import exit_process
from runtime.memory import SavedBytes  # noqa: F401 -- measured here; it lives in runtime/memory.py (train.py uses it too)

if TYPE_CHECKING:  # the worker imports them itself, after torchrun has started it
    from model.gpt import GPTConfig
    from parallel.pipeline.partition import StageCosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ("gpipe", "1f1b", "interleaved_1f1b")
MiB = 2**20


# ---- from timelines to numbers ---------------------------------------------------------------------------


def idle_stats(ranks: list[list[tuple[str, float, float]]]) -> tuple[list[float], float, list[float]]:
    """(busy per rank, span, idle fraction per rank) from each rank's (kind, start, end) actions, all on one
    clock. busy: F and B only; span: max end - min start over every action of every rank."""
    starts = [t0 for acts in ranks for _, t0, _ in acts]
    span = max(t1 for acts in ranks for _, _, t1 in acts) - min(starts)
    busy = [sum(t1 - t0 for kind, t0, t1 in acts if kind in COMPUTE) for acts in ranks]
    return busy, span, [1 - b / span for b in busy]


def pipeline_rows(raw: dict) -> list[dict]:
    """One row per schedule and rank from the gathered raw timelines (the worker's pipeline_timelines.json)."""
    P, M, V = raw["pp"], raw["micro"], raw["virtual"]
    rows = []
    for name, ranks in raw["schedules"].items():
        v = chunks_per_rank(name, V)
        sim = simulate_schedule(
            ALL_SCHEDULES[name](P, M, v),
            P,
            v,
            M,
            p2p="async",  # the runner uses isend
            v_shape=name in V_SCHEDULES,
        )
        busy, span, idle = idle_stats([[(a[0], a[3], a[4]) for a in r["timeline"]] for r in ranks])
        for rank, r in enumerate(ranks):
            dur = {k: [a[4] - a[3] for a in r["timeline"] if a[0] == k] for k in COMPUTE}
            rows.append(
                {
                    "schedule": name,
                    "rank": rank,
                    "pp": P,
                    "micro": M,
                    "virtual": v,
                    "busy_s": busy[rank],
                    "span_s": span,
                    "idle_fraction": idle[rank],
                    "idle_theory": bubble_fraction(name, P, M, v),
                    "peak_in_flight": r["peak_in_flight"],
                    "peak_in_flight_theory": sim.max_in_flight[rank],
                    "peak_saved_bytes": r["peak_saved_bytes"],
                    "mean_f_ms": 1e3 * sum(dur[F]) / max(len(dur[F]), 1),
                    "mean_b_ms": 1e3 * sum(dur[B]) / max(len(dur[B]), 1),
                    "mean_w_ms": 1e3 * sum(dur[W]) / max(len(dur[W]), 1),
                }
            )
    return rows


def chunks_per_rank(name: str, virtual: int) -> int:
    """V of schedule `name` in a run with --virtual `virtual`: interleaved takes it, the V schedules 2."""
    return virtual if name == "interleaved_1f1b" else 2 if name in V_SCHEDULES else 1


def summary(rows: list[dict]) -> dict[str, dict]:
    """Per schedule: idle over all ranks (mean of the ranks' idle), theory, span, largest saved bytes."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["schedule"] for r in rows):
        rs = [r for r in rows if r["schedule"] == name]
        out[name] = {
            "idle_fraction": sum(r["idle_fraction"] for r in rs) / len(rs),
            "idle_theory": rs[0]["idle_theory"],
            "span_s": rs[0]["span_s"],
            "peak_saved_bytes_max": max(r["peak_saved_bytes"] for r in rs),
        }
    return out


def markdown(rows: list[dict], cores: int | None = None, split: dict[str, list[int]] | None = None) -> str:
    """The per-rank table, one line per schedule with idle measured vs theory (and `split`[schedule], its Blocks
    per chunk), and a note when the P ranks outnumber `cores`."""
    lines = [
        "| schedule | rank | F / B mean (ms) | busy (ms) | span (ms) | idle measured | idle theory "
        "| in flight (theory) | peak saved (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['rank']} | {r['mean_f_ms']:.1f} / {r['mean_b_ms']:.1f} "
            f"| {1e3 * r['busy_s']:.1f} | {1e3 * r['span_s']:.1f} "
            f"| {r['idle_fraction']:.3f} | {r['idle_theory']:.3f} | {r['peak_in_flight']} "
            f"({r['peak_in_flight_theory']}) | {r['peak_saved_bytes'] / MiB:.2f} |"
        )
    lines.append("")
    for name, s in summary(rows).items():
        blocks = f"; Blocks per chunk {split[name]}" if split and name in split else ""
        lines.append(
            f"- {name}: idle {s['idle_fraction']:.3f} measured (all ranks) vs {s['idle_theory']:.3f} "
            f"theory; span {1e3 * s['span_s']:.1f} ms{blocks}"
        )
    if cores is not None and rows and rows[0]["pp"] > cores:
        lines.append(
            f"- {rows[0]['pp']} ranks on {cores} CPU cores: an F or B stretches while more ranks compute "
            "at once, so idle here mixes the bubble with contention (and p2p latency, stage imbalance)"
        )
    return "\n".join(lines) + "\n"


def plot(raw: dict, rows: list[dict], path: str) -> None:
    """One subplot per schedule: y = rank, x = ms; F blue, B green, W orange (darker: the rank's first chunk), micro
    index inside each bar; grey = the rank is not computing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    P = raw["pp"]
    names = list(raw["schedules"])
    stats = summary(rows)
    span = max(s["span_s"] for s in stats.values()) * 1e3
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 1.0 + 0.55 * P * len(names)), sharex=True, squeeze=False)
    colours = {F: ("#1f4e9c", "#7fa7e0"), B: ("#1c7a3c", "#8fd19e"), W: ("#b35900", "#f0a860")}
    for ax, name in zip(axes[:, 0], names):
        ranks = raw["schedules"][name]
        t0 = min(a[3] for r in ranks for a in r["timeline"])
        for rank, r in enumerate(ranks):
            end = max(a[4] for a in r["timeline"]) - t0
            ax.broken_barh([(0, 1e3 * end)], (rank - 0.4, 0.8), color="#e4e4e4")
            for kind, chunk, micro, a0, a1 in r["timeline"]:
                if kind not in COMPUTE:
                    continue
                x, w = 1e3 * (a0 - t0), 1e3 * (a1 - a0)
                ax.broken_barh(
                    [(x, w)], (rank - 0.4, 0.8), color=colours[kind][chunk >= P], edgecolor="white", linewidth=0.4
                )
                if w > span / 120:
                    ax.text(x + w / 2, rank, str(micro), ha="center", va="center", fontsize=6, color="white")
        s = stats[name]
        ax.set_title(
            f"{name} (V={rows[[r['schedule'] for r in rows].index(name)]['virtual']}): idle "
            f"{s['idle_fraction']:.1%} measured vs {s['idle_theory']:.1%} theory",
            fontsize=10,
        )
        ax.set_yticks(range(P), [f"rank {r}" for r in range(P)])
        ax.set_ylim(P - 0.5, -0.5)  # rank 0 on top, as in the Megatron figure
    axes[-1, 0].set_xlabel("time since the barrier (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colours[F], *colours[B], *colours[W], "#e4e4e4")]
    fig.legend(
        handles,
        ["F", "F (2nd+ chunk)", "B", "B (2nd+ chunk)", "W (split)", "W (2nd+ chunk)", "idle / p2p"],
        loc="upper right",
        ncol=7,
        fontsize=8,
    )
    fig.suptitle(
        f"Pipeline schedules measured: P={P}, M={raw['micro']} (bar label: micro-batch)", x=0.02, ha="left", fontsize=11
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---- the torchrun worker ---------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Every rank: each schedule, warm-up steps, barrier, one measured step; rank 0 writes the raw timelines."""
    import torch.distributed as dist

    from model.gpt import make_config
    from parallel.pipeline.partition import measure_costs, stage_costs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    cfg = make_config(
        args.model, n_layer=args.n_layer or P * args.virtual, vocab_size=args.vocab_size, block_size=args.seq_len
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro, args.micro_batch_size, args.seq_len + 1), generator=g)
    batches = [(t[:, :-1].clone(), t[:, 1:].clone()) for t in tokens]  # own storages, as a loader's batches
    raw = {
        "pp": P,
        "micro": args.micro,
        "virtual": args.virtual,
        "model": args.model,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "balance": args.balance,
        "split": {},
        "schedules": {},
    }
    costs = [stage_costs(cfg, args.seq_len)]
    if args.balance == "time":  # every rank cuts by rank 0's timings
        costs = [measure_costs(cfg, args.seq_len, args.micro_batch_size) if rank == 0 else None]
        dist.broadcast_object_list(costs, src=0)
    elif args.balance == "step":  # every rank cuts by the same gathered times of 1F1B steps on the FLOP split
        costs = [step_costs(cfg, rank, P, batches, costs[0], args.warmup)]
    raw["costs"] = dict(vars(costs[0]))  # FLOPs per token, or nanoseconds per micro-batch
    for name in args.schedules.split(","):
        raw["split"][name], raw["schedules"][name] = run_schedule(name, cfg, rank, P, batches, costs[0], args)
    if rank == 0:
        with open(os.path.join(args.out, "pipeline_timelines.json"), "w") as f:
            json.dump(raw, f)
    dist.destroy_process_group()


def run_schedule(
    name: str, cfg: GPTConfig, rank: int, P: int, batches: list, costs: StageCosts, args: argparse.Namespace
) -> tuple[list[int], list[dict]]:
    """One schedule on this rank: the Blocks split by `costs` (or --layers_per_stage), --warmup steps, one step
    under SavedBytes (its hooks cost time), then --repeats steps each after a barrier. (Blocks per chunk, every
    rank's timeline, peak in flight and saved bytes of the repeat with the shortest span: the machine's other load
    only adds time.)"""
    import torch.distributed as dist

    from model.gpt import GPT
    from parallel.pipeline.partition import layers_for
    from parallel.pipeline.runner import PipelineRunner, PipelineStage

    v = chunks_per_rank(name, args.virtual)
    counts = tuple(int(n) for n in args.layers_per_stage.split(",")) if args.layers_per_stage and v == 1 else None
    counts = tuple(len(r) for r in layers_for(cfg, P, v, counts=counts, costs=costs, v_shape=name in V_SCHEDULES))
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, P, v, counts, v_shape=name in V_SCHEDULES, parts=GPT_PARTS)
    stage.materialize(seed=0)
    runner = PipelineRunner(stage, record=StepRecord(torch.device("cpu")), split_backward=split_backward)
    for _ in range(args.warmup):
        runner.step(batches, name)
        stage.zero_grad(set_to_none=True)
    with SavedBytes(exclude=stage.parameters()) as saved:
        runner.step(batches, name)
    stage.zero_grad(set_to_none=True)
    best = None
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        runner.step(batches, name)
        stage.zero_grad(set_to_none=True)
        mine = {
            "timeline": [(a.kind, a.chunk, a.micro, s - t0, e - t0) for a, s, e in runner.record.timeline],
            "peak_in_flight": runner.record.peak_in_flight,
            "peak_saved_bytes": saved.peak,
        }
        gathered = [None] * P
        dist.all_gather_object(gathered, mine)
        span = idle_stats([[(a[0], a[3], a[4]) for a in r["timeline"]] for r in gathered])[1]
        if best is None or span < best[0]:
            best = (span, gathered)
    return list(counts), best[1]


def step_costs(
    cfg: GPTConfig, rank: int, P: int, batches: list, flops: StageCosts, warmup: int, steps: int = 5
) -> StageCosts:
    """StageCosts from 1F1B steps on the FLOP split (pipeline_partition.costs_from_step): each rank's median over
    `steps` of its F + B time per micro-batch, gathered, so every rank computes the same split."""
    import statistics

    import torch.distributed as dist

    from model.gpt import GPT
    from parallel.pipeline.partition import costs_from_step, layers_for
    from parallel.pipeline.runner import PipelineRunner, PipelineStage

    counts = tuple(len(r) for r in layers_for(cfg, P, costs=flops))
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, P, 1, counts, parts=GPT_PARTS)
    stage.materialize(seed=0)
    runner, times = PipelineRunner(stage, record=StepRecord(torch.device("cpu"))), []
    for i in range(warmup + steps):
        dist.barrier()
        runner.step(batches, "1f1b")
        stage.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(sum(e - s for a, s, e in runner.record.timeline if a.kind in (F, B)) / len(batches))
    gathered = [None] * P
    dist.all_gather_object(gathered, statistics.median(times))
    return costs_from_step(counts, gathered, flops)


# ---- the launcher ----------------------------------------------------------------------------------------


def run(
    out: str, pp: int = 4, micro: int = 8, virtual: int = 2, model: str = "tiny", timeout: float = 900, **options
) -> list[dict]:
    """Launch the torchrun job, then write pipeline.json, pipeline.md and pipeline_timeline.png; the rows.
    `options`: any other flag of parse_args by its dest (vocab_size=256, warmup=1, ...)."""
    from runtime.launch import child_env

    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    spec = {**vars(parse_args(["--out", out])), "pp": pp, "micro": micro, "virtual": virtual, "model": model, **options}
    # the worker's flags travel as one JSON value: torchrun's parser would take --virtual for its own
    # --virtual-local-rank (argparse prefix matching), even after the module name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={pp}",
        "-m",
        "bench.pipeline",
        f"--worker={json.dumps(spec)}",
    ]
    subprocess.run(cmd, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), check=True, timeout=timeout)
    with open(os.path.join(out, "pipeline_timelines.json")) as f:
        raw = json.load(f)
    rows = pipeline_rows(raw)
    config = {k: v for k, v in raw.items() if k != "schedules"}
    with open(os.path.join(out, "pipeline.json"), "w") as f:
        json.dump({"config": config, "summary": summary(rows), "rows": rows}, f, indent=1)
    with open(os.path.join(out, "pipeline.md"), "w") as f:
        f.write(markdown(rows, raw["cpu_count"], raw.get("split")))
    plot(raw, rows, os.path.join(out, "pipeline_timeline.png"))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", default=None, help="output directory (required)")
    a("--pp", type=int, default=4, help="pipeline ranks (gloo processes)")
    a("--micro", type=int, default=8, help="micro-batches per step (M)")
    a("--virtual", type=int, default=2, help="chunks per rank for interleaved_1f1b (V)")
    a("--model", default="tiny")
    a("--n_layer", type=int, default=None, help="default P·V: one Block per interleaved chunk")
    a("--vocab_size", type=int, default=512, help="small, so lm_head costs about one Block")
    a(
        "--balance",
        choices=["flops", "time", "step"],
        default="flops",
        help="split by the FLOP cost model (train.py's), by rank 0's timings of a Block, the embedding, the head "
        "(time), or by the ranks' times in 1F1B steps on the FLOP split (step)",
    )
    a(
        "--layers_per_stage",
        default=None,
        metavar="A,B,...",
        help="gpipe and 1f1b: Blocks per stage, P counts (default: train.py's split by cost)",
    )
    a("--seq_len", type=int, default=128)
    a("--micro_batch_size", type=int, default=8)
    a("--warmup", type=int, default=2)
    a("--repeats", type=int, default=3, help="measured steps; the one with the shortest span is kept")
    a("--schedules", default=",".join(ORDER))
    a("--timeout", type=float, default=900)
    a("--worker", default=None, help=argparse.SUPPRESS)  # JSON of every flag: run this rank
    args = p.parse_args(argv)
    if args.worker:
        return argparse.Namespace(**{**json.loads(args.worker), "worker": True})
    if args.out is None:
        p.error("--out is required")
    if "interleaved_1f1b" in args.schedules.split(",") and args.micro % args.pp:
        p.error(f"interleaved_1f1b needs --micro divisible by --pp; got {args.micro}, {args.pp}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        exit_process(0)  # the group is destroyed: skip finalization (launch.exit_process)
    opts = {
        k: v for k, v in vars(args).items() if k not in ("out", "pp", "micro", "virtual", "model", "timeout", "worker")
    }
    run(args.out, args.pp, args.micro, args.virtual, args.model, args.timeout, **opts)
    with open(os.path.join(os.path.abspath(args.out), "pipeline.md")) as f:
        print(f.read(), end="")
    print(f"[bench.pipeline] wrote {os.path.abspath(args.out)}/pipeline.json, pipeline.md, pipeline_timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
