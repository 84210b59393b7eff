"""Activation checkpointing x torch.compile, measured: throughput, saved activations and peak memory per cell.

    python -m bench.ac --out out/ac [--model small] [--steps N] [--warmup W] [--quick]

The grid: --activation_checkpointing none / full / selective (every 2nd Block) x eager / --compile, for one
process (`python train.py`) and for our FSDP x2 (`torchrun`, 2 gloo ranks, --implementation custom); each
cell is its own real train.py job (bench.runner.run_job: the caller's torchrun variables dropped, one thread
per rank), --warmup steps (they include compilation) then --steps measured ones. From each job's
metrics.jsonl (bench.runner.summarize): median tokens/s over the measured steps and the largest
peak_memory_bytes, which on CPU is rank 0's peak resident set (VmHWM, reset every step): the whole process,
parameters, optimizer and allocator slack included.

Saved activations are measured apart, in this process, eagerly: one forward + backward of the same model
on one micro-batch under `SavedAndRecomputedBytes` (saved_tensors_hooks, plus the tensors checkpoint
recomputes in backward), peak over the step. The hooks do not see inside a compiled graph (inductor saves
what its own partitioner picks), so a compiled cell shows its eager twin's number, marked so. A rank of
FSDP x2 runs the same micro-batch through the same Blocks (FSDP shards parameters, not activations), so its
activations are the one-process number.

Outputs in --out: ac.json (config and one row per cell), ac.md (the table, and compiled/eager speed ratios:
what compile buys on this machine, measured), ac.png (tokens/s and saved bytes per cell), runs/<cell>/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.utils.checkpoint

from runtime.memory import SavedAndRecomputedBytes  # noqa: F401 -- lives in runtime/memory.py (train.py uses it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "full", "selective")
LAYOUTS = {"single": 1, "fsdp2": 2}  # name -> ranks
MiB = 2**20


def saved_bytes(config, ac: str, every: int, micro_batch: int, seq_len: int) -> tuple[int, int]:
    """(forward peak, forward + backward peak) of saved + recomputed bytes for one eager micro-batch."""
    from model.gpt import GPT
    from runtime.blocks import apply_activation_checkpointing

    model = GPT(config)
    model.init_weights(0)
    if ac != "none":
        apply_activation_checkpointing(model, ac, every)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=g) for _ in range(2))
    with SavedAndRecomputedBytes(exclude=model.parameters()) as saved:
        _, loss = model(x, y)
        forward = saved.peak
        loss.backward()
    return forward, saved.peak


# ---- the grid ------------------------------------------------------------------------------------------


def cells() -> list[dict]:
    return [
        {"layout": lay, "nproc": n, "ac": ac, "compiled": c}
        for lay, n in LAYOUTS.items()
        for c in (False, True)
        for ac in MODES
    ]


def key(cell: dict) -> str:
    return f"{cell['layout']}-{cell['ac']}-{'compiled' if cell['compiled'] else 'eager'}"


def command(cell: dict, a: argparse.Namespace, data: str, out_dir: str) -> list[str]:
    train = os.path.join(ROOT, "train.py")
    args = [
        train,
        "--model",
        a.model,
        "--seq_len",
        str(a.seq_len),
        "--micro_batch_size",
        str(a.micro_batch_size),
        "--total_batch_size",
        str(a.rows * a.seq_len),
        "--max_steps",
        str(a.warmup + a.steps),
        "--warmup_steps",
        "1",
        "--eval_interval",
        str(10**6),
        "--eval_iters",
        "1",
        "--no_checkpoint",
        "--dataset",
        data,
        "--out_dir",
        out_dir,
        "--device",
        "cpu",
        "--implementation",
        "custom",
        "--activation_checkpointing",
        cell["ac"],
        "--ac_every",
        str(a.ac_every),
        "--peak_flops",
        "1e12",
        "--overwrite",
    ]
    if a.n_layer:
        args += ["--n_layer", str(a.n_layer)]
    if cell["compiled"]:
        args.append("--compile")
    if cell["nproc"] > 1:
        args += ["--data_parallel_size", str(cell["nproc"]), "--data_parallel_type", "fsdp"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={cell['nproc']}",
            *args,
        ]
    return [sys.executable, *args]


def run(a: argparse.Namespace, log=print) -> list[dict]:
    """Every cell as a job, then the in-process saved-bytes measurement; writes ac.json, ac.md, ac.png."""
    from bench.__main__ import ensure_dataset
    from bench.runner import classify, run_job, summarize
    from model.gpt import make_config
    from runtime.metrics import read_jsonl

    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    config = make_config(a.model, n_layer=a.n_layer, block_size=max(a.seq_len, 64))
    data = ensure_dataset(a.dataset, out, config.vocab_size)
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1)
    saved = {ac: saved_bytes(config, ac, a.ac_every, a.micro_batch_size, a.seq_len) for ac in MODES}
    rows, load_start = [], os.getloadavg()[0]
    for cell in cells():
        out_dir = os.path.join(out, "runs", key(cell))
        os.makedirs(out_dir, exist_ok=True)
        res = run_job(command(cell, a, data, out_dir), os.path.join(out_dir, "bench.log"), a.timeout)
        summary = summarize(read_jsonl(out_dir), a.warmup) if res.returncode == 0 else None
        status = classify(res, summary, a.timeout)
        rows.append(
            {
                **cell,
                "status": status,
                "seconds": round(res.seconds, 1),
                "tokens_per_sec": summary and summary["tokens_per_sec"],
                "step_time_ms": summary and summary["step_time_ms"],
                "peak_memory_bytes": summary and summary["peak_memory_bytes"],
                "saved_bytes_peak": saved[cell["ac"]][1],
                "saved_bytes_forward": saved[cell["ac"]][0],
                "saved_bytes_source": "eager twin (hooks do not see compiled graphs)"
                if cell["compiled"]
                else "eager, in-process",
                "out_dir": out_dir,
            }
        )
        tps = rows[-1]["tokens_per_sec"]
        log(f"[bench.ac] {key(cell):<26} {status}" + (f", {tps:,.0f} tok/s" if tps else "") + f" ({res.seconds:.0f} s)")
    meta = {
        "model": a.model,
        "n_layer": config.n_layer,
        "n_embd": config.n_embd,
        "vocab_size": config.vocab_size,
        "seq_len": a.seq_len,
        "micro_batch_size": a.micro_batch_size,
        "rows": a.rows,
        "warmup": a.warmup,
        "steps": a.steps,
        "ac_every": a.ac_every,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": [load_start, os.getloadavg()[0]],
    }
    with open(os.path.join(out, "ac.json"), "w") as f:
        json.dump({"config": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, "ac.md"), "w") as f:
        f.write(markdown(rows, meta))
    plot(rows, os.path.join(out, "ac.png"), log)
    return rows


# ---- the report ----------------------------------------------------------------------------------------


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:.2f}"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"{meta['model']} (n_layer {meta['n_layer']}, n_embd {meta['n_embd']}, vocab {meta['vocab_size']}), "
        f"seq_len {meta['seq_len']}, micro-batch {meta['micro_batch_size']}, {meta['rows']} sequences per step, "
        f"fp32 CPU, {meta['warmup']} warm-up + {meta['steps']} measured steps, selective = every "
        f"{meta['ac_every']} Blocks, {meta['cpu_count']} CPU cores (1-minute load average "
        f"{meta['load_average'][0]:.1f} at the start, {meta['load_average'][1]:.1f} at the end: above the core "
        "count, other work shared them and tokens/s is noisy).",
        "",
        "| layout | AC | mode | tokens/s | saved activations (MiB) | peak RSS rank 0 (MiB) | status |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        tps = "-" if r["tokens_per_sec"] is None else f"{r['tokens_per_sec']:,.0f}"
        mark = " *" if r["compiled"] else ""
        lines.append(
            f"| {r['layout']} | {r['ac']} | {'compiled' if r['compiled'] else 'eager'} | {tps} "
            f"| {_mib(r['saved_bytes_peak'])}{mark} | {_mib(r['peak_memory_bytes'])} | {r['status']} |"
        )
    lines += [
        "",
        "\\* eager measurement (saved_tensors_hooks do not see inside compiled graphs).",
        "",
        "Saved activations: peak over one micro-batch's forward + backward, per rank, parameters excluded, "
        "recomputed tensors included. Peak RSS: the whole process (parameters, optimizer, allocator).",
        "",
        "What compile buys on CPU, measured (compiled / eager tokens/s):",
        "",
    ]
    by = {(r["layout"], r["ac"], r["compiled"]): r["tokens_per_sec"] for r in rows}
    for lay in dict.fromkeys(r["layout"] for r in rows):
        parts = []
        for ac in MODES:
            e, c = by.get((lay, ac, False)), by.get((lay, ac, True))
            parts.append(f"{ac} {c / e:.2f}x" if e and c else f"{ac} -")
        lines.append(f"- {lay}: " + ", ".join(parts))
    lines += ["", "What AC costs (tokens/s relative to none, same mode):", ""]
    for lay in dict.fromkeys(r["layout"] for r in rows):
        for c in (False, True):
            base = by.get((lay, "none", c))
            parts = [
                f"{ac} {by[(lay, ac, c)] / base:.2f}x" if base and by.get((lay, ac, c)) else f"{ac} -"
                for ac in MODES[1:]
            ]
            lines.append(f"- {lay} {'compiled' if c else 'eager'}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, log=print) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"[bench.ac] ac.png skipped: {e}")
        return
    labels = [f"{r['layout']}\n{r['ac']}\n{'comp' if r['compiled'] else 'eager'}" for r in rows]
    colours = ["#d98c3a" if r["compiled"] else "#3a6fd9" for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    ax1.bar(range(len(rows)), [r["tokens_per_sec"] or 0 for r in rows], color=colours)
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput per cell (blue: eager, orange: compiled)")
    ax2.bar(range(len(rows)), [r["saved_bytes_peak"] / MiB for r in rows], color=colours)
    for i, r in enumerate(rows):
        if r["compiled"]:
            ax2.bar(i, r["saved_bytes_peak"] / MiB, color="none", edgecolor="black", hatch="//", linewidth=0)
    ax2.set_ylabel("saved activations (MiB)")
    ax2.set_title("peak saved activations per rank, one micro-batch (hatched: the eager number)")
    ax2.set_xticks(range(len(rows)), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ac", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", required=True, help="output directory")
    a("--quick", action="store_true", help="tiny preset, 4 Blocks, seq_len 64: a smaller config")
    a("--model", default=None, help="preset (default small; tiny with --quick)")
    a("--n_layer", type=int, default=None)
    a("--seq_len", type=int, default=None, help="default 128 (64 with --quick)")
    a("--micro_batch_size", type=int, default=2)
    a("--rows", type=int, default=4, help="sequences per global batch (2 micro-steps of 2 at one process)")
    a("--warmup", type=int, default=3, help="steps before the measured ones (compilation happens here)")
    a("--steps", type=int, default=8, help="measured steps")
    a("--ac_every", type=int, default=2, help="selective: every K-th Block")
    a("--dataset", default=None, help="default: shakespeare if prepared, else random tokens in <out>/data")
    a("--timeout", type=float, default=600, help="seconds per job")
    args = p.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "small")
    args.n_layer = args.n_layer or (4 if args.quick else None)
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    with open(os.path.join(os.path.abspath(args.out), "ac.md")) as f:
        print(f.read(), end="")
    print(f"[bench.ac] wrote {os.path.abspath(args.out)}/ac.json, ac.md, ac.png ({len(rows)} cells)")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
