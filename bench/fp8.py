"""FP8 against bf16 on the quick start's data: does FP8 training (parallel/fp8/) train, and how far is its loss from
bf16's at equal steps?

    python -m bench.fp8 --out results/fp8 [--steps 400] [--eval_interval 50] [--runs bf16,tensorwise,rowwise]

Every run is configs/quickstart.toml (shakespeare_char, 4 Blocks of width 128, 12 x 64 characters a step, 100
warm-up steps then cosine to --steps) on one process, fp32 master weights under bf16 autocast, built and stepped
by train.py's own `build`, `train_step` and `evaluate` (same seed, same batches); FP8 runs swap the Blocks' linears
with `convert_to_fp8` after the build (the parameters stay the same objects, so the optimizer is train.py's). One
thread per run, run one after the other. The FP8 GEMMs run as torch._scaled_mm's CPU kernel: the numbers, not the
speed, are the point here (tokens/s belong to a GPU).

Outputs in --out: fp8.json (the command, per run: val loss per eval step, train loss per step, seconds per step),
fp8.md (the table: val loss per eval step, and each FP8 run's gap to bf16), fp8.png (val loss against step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import torch

from bench.runner import ROOT
from parallel.fp8 import check_fp8, convert_to_fp8, linear_dims
from train import build, evaluate, train_step
from trainer.config import parse_args, validate

RUNS = ("bf16", "tensorwise", "rowwise")  # bf16: no FP8; the others: --fp8's recipes


def train_run(name: str, steps: int, eval_interval: int, out_dir: str, seed: int) -> dict:
    """One run: val loss at step 0 and every eval_interval steps and at the end, train loss every step."""
    argv = ["--config", os.path.join(ROOT, "configs", "quickstart.toml"), "--data_parallel_size", "1"]
    argv += ["--dtype", "bfloat16", "--max_steps", str(steps), "--seed", str(seed), "--out_dir", out_dir]
    spec = validate(parse_args(argv + ["--overwrite"]))
    trainer = build(spec)
    if name != "bf16":
        tokens = spec.args.micro_batch_size * spec.args.seq_len
        refusal = check_fp8(name, linear_dims(trainer.model), spec.dtype, tokens)
        if refusal:
            raise SystemExit(f"bench.fp8: {refusal}")
        convert_to_fp8(trainer.model, name)
    val, train, t0 = {0: evaluate(trainer)}, [], time.perf_counter()
    for step in range(steps):
        train.append(train_step(trainer, step)["loss"])
        if (step + 1) % eval_interval == 0 or step + 1 == steps:
            val[step + 1] = evaluate(trainer)
            print(f"[fp8] {name} step {step + 1} val {val[step + 1]:.4f}", flush=True)
    return {"name": name, "val": val, "train": train, "seconds_per_step": (time.perf_counter() - t0) / steps}


def render(rows: list[dict], meta: dict) -> str:
    """The table: val loss at each eval step per run, then each FP8 run's gap to bf16 (final and worst)."""
    names = [r["name"] for r in rows]
    steps = sorted(rows[0]["val"], key=int)
    out = [f"# FP8 against bf16 on the quick start ({meta['steps']} steps)", "", f"    {meta['command']}", ""]
    out += ["| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    out += [f"| {s} | " + " | ".join(f"{r['val'][s]:.4f}" for r in rows) + " |" for s in steps]
    base = next((r for r in rows if r["name"] == "bf16"), None)
    if base is not None:
        out += [
            "",
            "| run | final val | gap to bf16 | worst gap (any eval) | s/step (CPU, 1 thread) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in rows:
            gaps = [r["val"][s] - base["val"][s] for s in steps]
            worst = max(gaps, key=abs)
            out.append(
                f"| {r['name']} | {r['val'][steps[-1]]:.4f} | {gaps[-1]:+.4f} | {worst:+.4f} | "
                f"{r['seconds_per_step']:.2f} |"
            )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    """Val loss against step, and each run's gap to bf16 (where bf16 ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r["name"] == "bf16"), None)
    fig, axes = plt.subplots(1, 2 if base else 1, figsize=(11 if base else 6, 4), squeeze=False)
    for r in rows:
        steps = sorted(r["val"], key=int)
        axes[0][0].plot([int(s) for s in steps], [r["val"][s] for s in steps], marker=".", label=r["name"])
        if base:
            gaps = [r["val"][s] - base["val"][s] for s in steps]
            axes[0][1].plot([int(s) for s in steps], gaps, marker=".", label=r["name"])
    axes[0][0].set(xlabel="step", ylabel="val loss", title="quick start: FP8 (fp32 master, bf16 autocast) vs bf16")
    if base:
        axes[0][1].set(xlabel="step", ylabel="val loss - bf16's", title="gap to bf16")
    for ax in axes[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/fp8")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval_interval", type=int, default=50)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    command = "python -m bench.fp8 " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = []
    for name in args.runs.split(","):
        with tempfile.TemporaryDirectory() as out_dir:  # train.py's --out_dir: nothing is saved there
            rows.append(train_run(name, args.steps, args.eval_interval, out_dir, args.seed))
        # JSON keys are strings: keep the steps as strings throughout, so a reread file renders the same
        rows[-1]["val"] = {str(k): v for k, v in rows[-1]["val"].items()}
        meta = {"command": command, "steps": args.steps, "eval_interval": args.eval_interval, "seed": args.seed}
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            json.dump({"meta": meta, "runs": rows}, f, indent=1)
    text = render(rows, meta)
    with open(os.path.join(args.out, "fp8.md"), "w") as f:
        f.write(text)
    try:
        plot(rows, os.path.join(args.out, "fp8.png"))
    except ImportError:
        print("[fp8] no matplotlib: no plot", flush=True)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
