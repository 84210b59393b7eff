"""Benchmark every parallel layout on this machine: throughput, MFU, memory and communication vs theory.

    python -m bench --quick --out out/bench            # tiny model, a few steps: minutes on 2 CPU cores
    python -m bench --out out/bench                    # `small` for longer: the numbers to publish
    python -m bench --quick --include_pp --out out/bench  # also the pipeline layouts and schedules
    python -m bench --quick --include_moe --layouts single,ddp --out out/bench  # and MoE: 1 process, EP, dense
    python -m bench --section out/bench                # the short table (results_section.md) from bench.json
    python -m bench --quick --optimizer muon --include_zero --layouts single,ddp,zero2,fsdp,tp --out out/bench-muon
    python -m bench --quick --optimizer muon --layouts single,ddp --n_layer 4 --n_head 4 --n_embd 128 \
        --vocab_size 128 --rows 12 --out out/bench-muon-quickstart  # the quick start's model and batch

Run it from the repository root. The matrix (bench/matrix.py) is single; ddp, fsdp and tp (tp with loss
parallelism), each with `--implementation custom` and `pytorch`; and with >= 4 ranks 2d-ddp and 2d-fsdp
(tp=2 x dp=N/2). Ranks are the GPUs present, or `--nproc` gloo ranks on CPU (2D: `--nproc 4`, or
`--include_2d` for 4 ranks besides 2). `--include_pp` adds the pipeline layouts pp, pp-dp, pp-tp and 3d
(pp=2 alone, x dp=2, x tp=2, x dp=2 x tp=2: 2, 4, 4, 8 ranks; on GPU those that fit), 1F1B schedule, no
loss parallelism (the pytorch twin refuses it under PP), and runs bench.pipeline once into <out>/pipeline/
(P=2 on CPU, min(4, GPUs) on GPU; M=8, V=2): per-stage timelines, pipeline_timeline.png and the
schedules' idle fraction measured against theory. `--include_moe` adds moe (the preset with every Block's MLP
replaced by E = 8 experts, top-2, each of hidden width 2C: a token's experts hold the dense MLP's weights), moe-ep
(it under expert parallelism, dp = EP = nproc, DDP) and dense-active (the dense preset on one process: the model
of equal active parameters), run back to back; bench.md gets their tokens/s and MFU ratios, rank 0's all_to_all
bytes against the formula at balanced and at measured load, the experts' max/mean load per step, and
moe_load.png. Every layout trains the same model on the same global
batch, each as its own job (bench/runner.py) under <out>/runs/. The micro-batch is rows/dp, capped at
--micro_batch_size on GPU (then gradient accumulation makes up the rest); under PP it is also small
enough that the step has M >= 2P micro-batches.

Peak matmul FLOP/s is measured once (CPU: one thread, as torchrun gives each rank; GPU: the datasheet,
see metrics.peak_flops) and passed to every job, so MFU is comparable. Throughput is the median
tokens/s over the steps after --warmup. Communication is what parallel/comm.COUNTER saw on rank 0 per
step (custom layouts only), next to theory from the formulas beside each parallelism (docs/benchmarks.md).

Outputs in --out (bench/report.py): bench.json (one row per layout x implementation), bench_meta.json
(command, machine), bench.md, results_section.md, and throughput.png, memory.png, comm_vs_world.png;
with --include_pp also pipeline/ (pipeline.json, pipeline.md, pipeline_timeline.png); with --include_moe
moe_load.png. With --optimizer muon, bench.md and the snippet also carry rank 0's Newton-Schulz time and share
of the step and the Muon exchange's all_to_all bytes, measured against the plan (bench.report.muon_markdown).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, replace

import torch

from bench import report, runner
from bench.matrix import LAYOUTS, MOE_EXPERTS, MOE_LAYOUTS, PP_LAYOUTS, ZERO_LAYOUTS, Layout, Setup, fit_heads, matrix
from model.gpt import GPT, make_config
from runtime.metrics import active_params
from trainer.config import Parser, UsageError, error_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(prog="python -m bench", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", default="out/bench", help="directory for bench.json, bench.md, plots and runs/")
    a("--quick", action="store_true", help="tiny model, few steps: a few minutes on 2 CPU cores")
    a("--nproc", type=int, default=None, help="ranks (default: the GPUs present, or 2 on CPU)")
    a("--include_2d", action="store_true", help="CPU with < 4 ranks: also run the 2D layouts on 4 ranks")
    a(
        "--include_pp",
        action="store_true",
        help="also the pipeline layouts (pp, pp-dp, pp-tp, 3d: 2/4/4/8 ranks) and bench.pipeline into <out>/pipeline",
    )
    a(
        "--include_zero",
        action="store_true",
        help="also the ZeRO ladder (zero1, zero2 over all ranks; hsdp: 2 replicas, 4 ranks on CPU) "
        "and memory_ladder.png",
    )
    a(
        "--include_moe",
        action="store_true",
        help=f"also moe (E={MOE_EXPERTS} experts, top-2, 1 process), moe-ep (EP = dp = all ranks) and dense-active "
        "(the dense model of equal active parameters), and moe_load.png",
    )
    a(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: every layout with --optimizer muon (custom only): Newton-Schulz's share of the step and the "
        "exchange's bytes, measured against Exchange.sent_bytes (docs/muon.md)",
    )
    a("--peak_flops", type=float, default=None, help="per device (default: measured / datasheet once)")
    a("--layouts", default=None, help=f"comma list out of {','.join(LAYOUTS)}")
    a("--repeats", type=int, default=1)
    a("--steps", type=int, default=None, help="measured steps (quick 8; else 30 on GPU, 12 on CPU)")
    a("--warmup", type=int, default=None, help="steps before measuring (quick 2; else 5 on GPU, 3 on CPU)")
    a("--model", default=None, help="preset (quick: tiny; else small)")
    for dim in ("n_layer", "n_head", "n_embd", "vocab_size"):  # the quick start's: 4, 4, 128, 128
        a(f"--{dim}", type=int, default=None, help=f"override the preset's {dim}")
    a("--seq_len", type=int, default=None, help="quick 64; else 1024 on GPU, 128 on CPU")
    a("--rows", type=int, default=None, help="sequences per global batch (default: 4 per rank, 8 on GPU)")
    a("--micro_batch_size", type=int, default=None, help="largest micro-batch per rank (default: none on CPU, 8 GPU)")
    a("--dataset", default=None, help="default: shakespeare if prepared, else random tokens in <out>/data")
    a("--timeout", type=float, default=None, help="seconds per job (quick 300, else 3600)")
    a("--section", metavar="DIR", default=None, help="print the short table (results_section.md) from DIR/bench.json")
    args = p.parse_args(argv)
    if args.layouts:
        unknown = set(args.layouts.split(",")) - set(LAYOUTS)
        if unknown:
            p.error(f"unknown layouts {sorted(unknown)}; choose from {','.join(LAYOUTS)}")
        pp = [name for name in args.layouts.split(",") if name in PP_LAYOUTS]
        if pp and not args.include_pp:
            p.error(f"layouts {','.join(pp)} run only with --include_pp")
        zero = [name for name in args.layouts.split(",") if name in ZERO_LAYOUTS]
        if zero and not args.include_zero:
            p.error(f"layouts {','.join(zero)} run only with --include_zero")
        moe = [name for name in args.layouts.split(",") if name in MOE_LAYOUTS]
        if moe and not args.include_moe:
            p.error(f"layouts {','.join(moe)} run only with --include_moe")
    if args.repeats < 1 or (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        p.error("--repeats and --steps must be >= 1, --warmup >= 0")
    return args


def make_setup(
    args: argparse.Namespace, machine: dict, nproc: int, layouts: list[Layout], peak: float, dataset: str = ""
) -> Setup:
    gpu = machine["device"] == "cuda"
    model = args.model or ("tiny" if args.quick else "small")
    shape = {k: getattr(args, k, None) for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
    config = make_config(model, **shape)
    for tp in {lay.tp for lay in layouts}:
        config = fit_heads(config, tp)
    dp_all = [lay.dp for lay in layouts] or [1]
    lcm = math.lcm(*dp_all)
    rows = args.rows or (8 if gpu else 4) * max(nproc, lcm)
    seq = args.seq_len or (64 if args.quick else (1024 if gpu else 128))
    return Setup(
        model=model,
        config=config,
        seq_len=seq,
        rows=rows,
        micro_cap=args.micro_batch_size or (8 if gpu else rows),
        warmup=args.warmup if args.warmup is not None else (2 if args.quick else (5 if gpu else 3)),
        steps=args.steps or (8 if args.quick else (30 if gpu else 12)),
        peak_flops=peak,
        device=machine["device"],
        dataset=dataset,
        timeout=args.timeout or (300 if args.quick else 3600),
        dtype_bytes=machine.get("dtype_bytes", 4),
        residual_bytes=4,
    )


def ensure_dataset(requested: str, out: str, vocab_size: int) -> str:
    """`requested` if given, else Shakespeare when prepared and the vocabulary holds GPT-2's token ids, else uniform
    random tokens below `vocab_size` written to <out>/data (throughput does not depend on what the tokens are)."""
    if requested:
        return requested
    shakespeare = os.path.join(runner.ROOT, "data", "shakespeare")
    if vocab_size >= 50257 and all(os.path.exists(os.path.join(shakespeare, f"{s}.bin")) for s in ("train", "val")):
        return "shakespeare"
    import numpy as np

    d = os.path.join(out, "data")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 2_000_000), ("val", 200_000)):
        path = os.path.join(d, f"{split}.bin")
        if not os.path.exists(path):
            rng.integers(0, min(vocab_size, 50257), n, dtype=np.uint16).tofile(path + ".tmp")
            os.replace(path + ".tmp", path)
    return d


def run_pipeline(out: str, pp: int, timeout: float, micro: int = 8, virtual: int = 2) -> dict:
    """bench.pipeline's three schedules on `pp` ranks into `out` (pipeline_timeline.png, pipeline.md):
    {pp, micro, virtual, dir, summary, rows} for bench.md, or {..., error} if the job failed (the layout
    rows stand without it)."""
    from bench import pipeline

    info = {"pp": pp, "micro": micro, "virtual": virtual, "dir": "pipeline"}
    print(f"[bench] bench.pipeline P={pp} M={micro} V={virtual} into {out}", flush=True)
    try:
        rows = pipeline.run(out, pp=pp, micro=micro, virtual=virtual, timeout=timeout)
    except Exception as e:  # noqa: BLE001 -- the matrix's results are written whatever this job does
        info["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"[bench] bench.pipeline failed: {info['error']}", flush=True)
        return info
    return {**info, "summary": pipeline.summary(rows), "rows": rows}


def moe_note(setup: Setup, experts: int, nproc: int) -> str:
    """bench.md's note on the MoE layouts: the model, its parameters in all and active, and the dense model's."""
    moe, dense = setup.moe_config(experts), setup.config
    with torch.device("meta"):
        total, dense_total = GPT(moe).num_params(), GPT(dense).num_params()
    active = active_params(moe)
    missing = "" if experts % nproc == 0 and nproc >= 2 else f"; no moe-ep: E = {experts} over {nproc} ranks"
    return (
        f"MoE layouts: every Block's MLP replaced by E = {moe.moe_num_experts} experts, top K = {moe.moe_top_k}, "
        f"each C -> {moe.expert_hidden} -> C (C = {moe.n_embd}), dropless, balanced by the auxiliary loss "
        f"({moe.moe_aux_loss_coeff}) and the bias rule ({moe.moe_bias_update_rate}); "
        f"{total:,} parameters, {active:,} active per token (the experts' K/E share; MFU counts these, "
        f"metrics.active_params); dense-active is the dense model of equal active parameters, {dense_total:,} "
        f"(the MoE adds each layer's router, C·E, and K-1 c_proj biases). moe-ep: EP = dp = {nproc}, DDP; "
        "its all_to_all theory at balanced routing (plan.theory.ep_all_to_all_bytes_per_micro_step, R = N·k) "
        "and at each step's measured load (bench.matrix.ep_all_to_all_at_load)" + missing
    )


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        error_line("bench", e)
        return 2
    if args.section:
        return print_section(args.section)
    t0 = time.perf_counter()
    args.out = os.path.abspath(args.out)  # the jobs run in the repository root
    os.makedirs(args.out, exist_ok=True)
    machine = runner.probe_machine(measure=args.peak_flops is None)
    gpu = machine["device"] == "cuda"
    nproc = args.nproc or (machine["count"] if gpu else 2)
    layouts = pick_layouts(args, nproc, gpu)
    if not layouts:
        error_line("bench", "no layout left to run")
        return 2
    peak = args.peak_flops or machine["peak_flops"]
    setup = make_setup(args, machine, nproc, layouts, peak)
    setup = replace(
        setup, dataset=ensure_dataset(args.dataset, args.out, setup.config.vocab_size), optimizer=args.optimizer
    )
    notes = run_notes(args, setup, layouts, nproc, gpu)
    with torch.device("meta"):
        params = GPT(setup.config).num_params()
    machine_desc = (
        f"{nproc}× {machine['name']}" if gpu else f"{machine['name']}, {os.cpu_count()} cores, 1 thread per rank"
    ) + f" ({platform.node()})"
    print(
        f"[bench] {machine_desc}; peak {peak:.4g} FLOP/s per device; {len(layouts)} layouts; "
        f"{setup.model} {params / 1e6:.1f}M params, {setup.rows} x {setup.seq_len} tokens/step, "
        f"{setup.warmup}+{setup.steps} steps",
        flush=True,
    )
    rows = runner.run_matrix(layouts, setup, args.out, args.repeats, log=lambda s: print(s, flush=True))
    meta = {
        "command": shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_desc,
        "torch": torch.__version__,
        "peak_source": "--peak_flops"
        if args.peak_flops
        else ("datasheet / measured (metrics.peak_flops)" if gpu else "measured 1024³ fp32 matmul, 1 thread"),
        "params": params,
        "config": asdict(setup.config),
        "steps": setup.steps,
        "warmup": setup.warmup,
        "repeats": args.repeats,
        "dataset": setup.dataset,
        "notes": notes,
        "wall_seconds": time.perf_counter() - t0,
    }
    if args.include_pp:
        meta["pipeline"] = run_pipeline(os.path.join(args.out, "pipeline"), min(4, nproc) if gpu else 2, setup.timeout)
        meta["wall_seconds"] = time.perf_counter() - t0
    report.write_outputs(rows, meta, setup, args.out)
    print(
        f"[bench] wrote {args.out}/bench.json, bench.md, results_section.md ({meta['wall_seconds']:.0f} s)", flush=True
    )
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def print_section(directory: str) -> int:
    """--section: the README's short table (results_section.md) of an earlier run, from its bench.json (and
    bench_meta.json where it is there), printed."""
    with open(os.path.join(directory, "bench.json")) as f:
        rows = json.load(f)
    meta_path = os.path.join(directory, "bench_meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else None
    print(report.render_section(rows, meta), end="")
    return 0


def pick_layouts(args: argparse.Namespace, nproc: int, gpu: bool) -> list[Layout]:
    """The matrix's layouts for these flags (bench.matrix.matrix); under --optimizer muon our implementation only:
    torch's Muon (the twins) has no ledger, nothing of Newton-Schulz or its exchange to report."""
    layouts = matrix(
        nproc,
        gpu,
        args.include_2d,
        args.layouts.split(",") if args.layouts else None,
        include_pp=args.include_pp,
        include_zero=args.include_zero,
        include_moe=args.include_moe,
    )
    if args.optimizer == "muon":
        layouts = [lay for lay in layouts if lay.implementation != "pytorch"]
    return layouts


def run_notes(args: argparse.Namespace, setup: Setup, layouts: list[Layout], nproc: int, gpu: bool) -> list[str]:
    """bench.md's notes on this run: what its theory counts for Muon, FSDP, ZeRO, PP and MoE layouts where they
    run, and what differs from the asked-for setup (n_head raised for TP, oversubscribed CPU cores)."""
    notes = []
    if args.optimizer == "muon":
        notes.append(
            "--optimizer muon: every layout runs Muon on the Block matrices (AdamW on the rest), custom "
            "implementation only; comm theory adds the Muon exchange's all_to_all as planned from the holds "
            "(optim/distributed_muon.Exchange.sent_bytes)"
        )
    if any(lay.dp_type == "fsdp" for lay in layouts):
        notes.append(
            "FSDP theory per micro-step: all-gather 2Ψ_blocks + Ψ_root (the root unit, wte = lm_head, "
            "wpe and ln_f, stays gathered from forward to backward, as in FSDP2), reduce-scatter Ψ; "
            "measured bytes also carry each unit's padding to a multiple of N (< N elements)"
        )
    base = make_config(setup.model, n_head=args.n_head)
    if setup.config.n_head != base.n_head:
        notes.append(f"n_head raised from the preset's {base.n_head} to {setup.config.n_head} so that TP divides it")
    if not gpu and any(lay.nproc > os.cpu_count() for lay in layouts):
        notes.append(f"{max(lay.nproc for lay in layouts)} ranks on {os.cpu_count()} CPU cores: oversubscribed")
    if any(lay.name in ZERO_LAYOUTS for lay in layouts):
        notes.append(
            "ZeRO theory per optimizer step (plan.theory.zero_comm_bytes_per_step): zero1 reduce-scatter "
            "Ψ + all-gather Ψ once; zero2 reduce-scatter Ψ per micro-step + all-gather Ψ once; hsdp: fsdp "
            "within the shard group plus all-reduce Ψ/S per micro-step across replicas. torch's zero2 twin "
            "(fully_shard(reshard_after_forward=False)) frees parameters after backward, so its state is "
            "ZeRO-3's between steps; its zero1 twin (ZeroRedundancyOptimizer) partitions whole parameters, "
            "so a rank's optimizer state depends on which tensors it owns"
        )
    if any(lay.pp > 1 for lay in layouts):
        notes.append(
            "PP layouts: 1F1B, M micro-batches per step (grad_accum column) with M >= 2P where the batch "
            "allows; theory for rank 0 = pipeline stage 0 (parallel.pipeline.runner.p2p_bytes_per_step, the "
            "tied-embedding all-reduce, DDP and TP on stage 0's parameters and Blocks only)"
        )
    moe = next((lay for lay in layouts if lay.experts), None)
    if args.include_moe:
        notes.append(moe_note(setup, moe.experts if moe else MOE_EXPERTS, nproc))
    return notes


if __name__ == "__main__":
    sys.exit(main())
