"""Muon against AdamW on the quick start's data: validation loss at equal steps, each optimizer at its best lr
out of a small sweep.

    python -m bench.muon_vs_adamw --out results/muon-vs-adamw [--steps 600] [--eval_interval 100]

Every run is configs/quickstart.toml (shakespeare_char, 4 Blocks of width 128, 12 x 64 characters a step, 100
warm-up steps then cosine to --steps) on one process (the same math as the quick start's DDP x2, one CPU core),
with --steps steps instead of 2000 so that the sweep fits minutes; only the optimizer and its lr change:
- adamw at each of ADAMW_LRS;
- muon with match_rms_adamw (the default: Moonlight's, so AdamW-scale lrs) at each of MUON_LRS (--muon_lr; the
  AdamW groups, embeddings, head, LayerNorms and biases, keep --lr 1e-3, the quick start's);
- muon with `original` (Keller Jordan's scale) at each of ORIGINAL_LRS.
Each run is its own train.py job (bench.runner.run_job: one thread). "Tuned" is the lr with the lowest final
validation loss within each optimizer's sweep; the table shows every lr, so a best lr at a sweep's edge is
visible as such.

Outputs in --out: muon_vs_adamw.json (the command, the config, per run: its flags, seconds, val loss per eval
step), muon_vs_adamw.md (the table), muon_vs_adamw.png (each optimizer's best run's val loss against step),
runs/<name>/ (each run's metrics.jsonl and log).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from bench.runner import ROOT, run_job
from runtime.metrics import read_jsonl

ADAMW_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
MUON_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
ORIGINAL_LRS = (0.02,)
BASE_LR = 1e-3  # the quick start's AdamW lr: what the non-matrix parameters keep under Muon


def runs(adamw_lrs=ADAMW_LRS, muon_lrs=MUON_LRS, original_lrs=ORIGINAL_LRS) -> list[dict]:
    """The sweep: {name, optimizer (the table's label), lr, flags} per run."""
    out = [
        {"name": f"adamw-lr{lr:g}", "optimizer": "adamw", "lr": lr, "flags": ["--lr", f"{lr:g}"]} for lr in adamw_lrs
    ]
    for adjust, lrs in (("match_rms_adamw", muon_lrs), ("original", original_lrs)):
        out += [
            {
                "name": f"muon-{adjust}-lr{lr:g}",
                "optimizer": f"muon ({adjust})",
                "lr": lr,
                "flags": [
                    "--lr",
                    f"{BASE_LR:g}",
                    "--optimizer",
                    "muon",
                    "--muon_lr",
                    f"{lr:g}",
                    "--muon_adjust_lr_fn",
                    adjust,
                ],
            }
            for lr in lrs
        ]
    return out


def command(run: dict, steps: int, eval_interval: int, out_dir: str) -> list[str]:
    config = os.path.join(ROOT, "configs", "quickstart.toml")
    return [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--config",
        config,
        "--data_parallel_size",
        "1",
        "--max_steps",
        str(steps),
        "--eval_interval",
        str(eval_interval),
        "--no_checkpoint",
        "--overwrite",
        "--out_dir",
        out_dir,
        *run["flags"],
    ]


def val_losses(records: list[dict]) -> dict[int, float]:
    """{step: val loss} of a run's metrics.jsonl."""
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def step_times(records: list[dict]) -> dict:
    """Medians over a run's training steps after the first 10: ms per step and, under Muon, rank 0's
    Newton-Schulz ms and its share of each step (train.py's muon_ns_ms)."""
    steps = [r for r in records if "loss" in r and r["step"] > 10]
    if not steps:
        return {}
    out = {"ms_per_step": statistics.median(r["step_time_ms"] for r in steps)}
    if all("muon_ns_ms" in r for r in steps):
        out["ns_ms"] = statistics.median(r["muon_ns_ms"] for r in steps)
        out["ns_share"] = statistics.median(r["muon_ns_ms"] / r["step_time_ms"] for r in steps)
    return out


def best(rows: list[dict]) -> dict[str, dict]:
    """Per optimizer label, the ok row with the lowest final val loss."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["status"] == "ok" and (r["optimizer"] not in out or r["final"] < out[r["optimizer"]]["final"]):
            out[r["optimizer"]] = r
    return out


def render(rows: list[dict], meta: dict) -> str:
    steps = sorted({s for r in rows if r["status"] == "ok" for s in r["val_loss"]})
    winners = {id(r) for r in best(rows).values()}
    lines = [
        f"Validation loss (mean over {meta['eval_iters']} fixed validation micro-batches) on shakespeare_char, "
        f"configs/quickstart.toml on one process for {meta['steps']} steps (warm-up 100, cosine to "
        f"{meta['steps']}): `{meta['command']}`. ** = the best lr of its optimizer (lowest final val loss). "
        f"Muon's rows step the Block matrices with Muon at the lr shown and the rest with AdamW at lr "
        f"{BASE_LR:g}. {meta['machine']}.",
        "",
        "| optimizer | lr | " + " | ".join(f"step {s}" for s in steps) + " | ms/step | NS share | s/run | status |",
        "|---|---:|" + "---:|" * len(steps) + "---:|---:|---:|---|",
    ]
    for r in rows:
        mark = "**" if id(r) in winners else ""
        vals = " | ".join(f"{mark}{r['val_loss'][s]:.4f}{mark}" if s in r["val_loss"] else "" for s in steps)
        ms = f"{r['ms_per_step']:.1f}" if "ms_per_step" in r else ""
        share = f"{100 * r['ns_share']:.1f}%" if "ns_share" in r else ""
        lines.append(
            f"| {r['optimizer']} | {r['lr']:g} | {vals} | {ms} | {share} | {r['seconds']:.0f} | {r['status']} |"
        )
    lines += [
        "",
        "ms/step: median over the steps after the first 10 (one thread); NS share: Newton-Schulz's median "
        "share of a step (train.py's muon_ns_ms); s/run: the job's wall time, start-up and evals included. "
        "ms/step and s/run move with the machine's load (other jobs may share its cores); NS share much less.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    """Each optimizer's best run: val loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in best(rows).items():
        steps = sorted(r["val_loss"])
        ax.plot(steps, [r["val_loss"][s] for s in steps], marker="o", label=f"{label}, lr {r['lr']:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.set_title("Muon vs AdamW, shakespeare_char (quick start), best lr each")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.muon_vs_adamw", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/muon-vs-adamw")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval_interval", type=int, default=100)
    p.add_argument("--only", default=None, help="comma list of run names (default: the whole sweep)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = p.parse_args(argv)
    if args.steps < 1 or args.eval_interval < 1:
        p.error("--steps and --eval_interval must be >= 1")
    out = os.path.abspath(args.out)
    sweep = runs()
    if args.only:
        unknown = set(args.only.split(",")) - {r["name"] for r in sweep}
        if unknown:
            p.error(f"unknown runs {sorted(unknown)}; choose from {','.join(r['name'] for r in sweep)}")
        sweep = [r for r in sweep if r["name"] in args.only.split(",")]
    rows = []
    for run in sweep:
        run_dir = os.path.join(out, "runs", run["name"])
        os.makedirs(run_dir, exist_ok=True)
        cmd = command(run, args.steps, args.eval_interval, run_dir)
        res = run_job(cmd, os.path.join(run_dir, "train.log"), args.timeout)
        ok = res.returncode == 0 and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
        records = read_jsonl(run_dir) if ok else []
        losses = val_losses(records)
        last = res.output.strip().splitlines()[-1][:200] if res.output.strip() else ""
        row = {
            **run,
            "command": shlex.join(cmd),
            "seconds": round(res.seconds, 1),
            "val_loss": losses,
            **step_times(records),
            "final": losses.get(args.steps),
            "status": "ok" if ok and args.steps in losses else f"failed (rc {res.returncode}): {last}",
        }
        rows.append(row)
        print(
            f"[muon_vs_adamw] {run['name']}: {row['status']}, final val {row['final']}, {res.seconds:.0f} s", flush=True
        )
    meta = {
        "command": shlex.join(["python", "-m", "bench.muon_vs_adamw", *(sys.argv[1:] if argv is None else argv)]),
        "steps": args.steps,
        "eval_interval": args.eval_interval,
        "eval_iters": 20,
        "machine": f"{os.cpu_count()} CPU cores, one thread per run, one run at a time",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    with open(os.path.join(out, "muon_vs_adamw.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "muon_vs_adamw.md"), "w") as f:
        f.write(render(rows, meta))
    try:
        plot(rows, os.path.join(out, "muon_vs_adamw.png"))
    except ImportError:
        print("[muon_vs_adamw] no matplotlib: no plot", flush=True)
    print(render(rows, meta), end="")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
