"""python -m plan: the layouts that fit a model on a cluster, ranked by predicted step time.

    python -m plan --model gpt2-xl --gpus 8 --gpu a100-40gb --seq_len 1024 --total_batch_size 524288
    python -m plan ... --explain "dp=8(fsdp) ac=none mb=4"       # one layout's breakdown
    python -m plan ... --json                                     # every fitting layout, for scripts
    python -m plan ... --verify 3                                 # the top 3 checked by simulating their ranks

Bad input (an unknown GPU preset, batch sizes that no layout can divide, nothing fits) is one line on stderr
and exit code 2; "nothing fits" names the smallest GPU memory that would hold the best layout.
"""

from __future__ import annotations

import argparse
import json
import sys

from model.gpt import PRESETS as MODELS
from plan.cluster import PRESETS, Cluster, efficiency_for, parse_memory
from plan.search import candidates, model_flags, model_refusal
from trainer.concepts import concepts
from trainer.config import Parser, UsageError, error_line

MiB, GiB = 2**20, 2**30


def parser() -> Parser:
    p = Parser(prog="python -m plan", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="gpt2", help=f"preset: {', '.join(MODELS)}")
    a("--n_layer", type=int)
    a("--n_head", type=int)
    a("--n_embd", type=int)
    a("--vocab_size", type=int)
    a("--block_size", type=int, help="the preset's context (gpt2: 1024); a longer --seq_len needs it")
    a("--seq_len", type=int, default=1024)
    a("--total_batch_size", type=int, default=524288, help="tokens per optimizer step")
    a("--micro_batch_size", type=int, default=None, help="default: try 1, 2, 4, ... 32")
    a("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    a("--gpus", type=int, default=8)
    a("--gpus_per_node", type=int, default=8)
    a("--gpu", default="h100-sxm", help=f"preset: {', '.join(PRESETS)}")
    a("--gpu_memory", default=None, help="override the preset's memory, e.g. 80GB")
    a("--peak_flops", type=float, default=None, help="override the preset's dense bf16 FLOP/s")
    a("--intra_bw", type=float, default=None, help="bytes/s per GPU per direction inside a node")
    a("--inter_bw", type=float, default=None, help="bytes/s per GPU per direction between nodes")
    a(
        "--efficiency",
        type=float,
        default=None,
        help="the fraction of peak FLOP/s compute runs at (default: the GPU check's measurement for --gpu in "
        "results/gpu/efficiency.json, else 0.5, assumed)",
    )
    a("--headroom", type=float, default=0.9, help="the fraction of GPU memory a layout may plan to use")
    a("--pp", type=int, default=None, help="only this pipeline size")
    a("--tp", type=int, default=None, help="only this tensor-parallel size")
    a("--cp", type=int, default=None, help="only this context-parallel size")
    a("--ep", type=int, default=None, help="only this expert-parallel size")
    a("--no_cp", action="store_true", help="same as --cp 1")
    a("--dp_type", choices=["ddp", "zero1", "zero2", "fsdp"], default=None)
    a("--ac", choices=["none", "full", "selective"], default=None)
    for c in concepts():  # a concept's own (runtime/registry.Concept.plan_flags), passed on to train.py's flags
        if c.plan_flags is not None:
            c.plan_flags(p.add_argument_group(c.title).add_argument)
    a("--top", type=int, default=10, help="rows of the table")
    a("--explain", default=None, metavar="LAYOUT", help="one layout's breakdown, by its name in the table")
    a("--json", action="store_true")
    a(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="simulate the top K layouts' ranks before printing (python -m sim.verify: one rank per class) and mark "
        "each verified or not; exit 1 if any is not",
    )
    return p


VERIFY_FLAGS = ("--eval_iters", "1", "--out_dir", "runs/plan-verify")  # a simulated rank's: one validation batch


def verify_top(fits: list, k: int) -> dict[str, object]:
    """sim.verify of each of the first k layouts (its flags as the table's command runs them), by name."""
    from sim.verify import verify

    out = {}
    for c in fits[:k]:
        print(f"verifying {c.name} ({c.setup.dims.world_size} ranks) ...", file=sys.stderr, flush=True)
        out[c.name] = verify(
            [*c.flags, *VERIFY_FLAGS],
            c.setup.dims.world_size,
            progress=lambda r, run: print(f"  rank {r}: {run.seconds:.1f} s", file=sys.stderr, flush=True),
        )
    return out


def cluster_of(a: argparse.Namespace) -> Cluster:
    if a.gpu not in PRESETS:
        raise UsageError(
            f"--gpu {a.gpu!r} is not a known preset; choose one of {', '.join(PRESETS)} or pass "
            f"--gpu_memory, --peak_flops, --intra_bw and --inter_bw with any of them"
        )
    if a.gpus < 1 or a.gpus_per_node < 1 or (a.gpus > a.gpus_per_node and a.gpus % a.gpus_per_node):
        raise UsageError(f"--gpus {a.gpus} must be >= 1 and fill whole nodes of --gpus_per_node {a.gpus_per_node}")
    p = dict(PRESETS[a.gpu])
    try:
        memory = parse_memory(a.gpu_memory) if a.gpu_memory else p["memory"]
    except ValueError:
        raise UsageError(f"--gpu_memory {a.gpu_memory!r}: expected a size such as 80GB") from None
    return Cluster(
        a.gpus,
        min(a.gpus_per_node, a.gpus),
        memory,
        a.peak_flops or p["peak_flops"],
        a.intra_bw or p["intra_bw"],
        a.inter_bw or p["inter_bw"],
        a.gpu,
    )


def check_batch(a: argparse.Namespace) -> list[int]:
    """The micro-batch sizes to try; refuses batch sizes that no layout can split."""
    if a.seq_len < 1 or a.total_batch_size < 1 or a.total_batch_size % a.seq_len:
        raise UsageError(
            f"--total_batch_size {a.total_batch_size} must be a positive multiple of --seq_len "
            f"{a.seq_len} (whole sequences per step)"
        )
    rows = a.total_batch_size // a.seq_len
    sizes = [a.micro_batch_size] if a.micro_batch_size else [b for b in (1, 2, 4, 8, 16, 32) if b <= rows]
    if a.micro_batch_size and rows % a.micro_batch_size:
        raise UsageError(
            f"--total_batch_size {a.total_batch_size} = {rows} sequences of {a.seq_len} is not "
            f"divisible by --micro_batch_size {a.micro_batch_size}"
        )
    return sizes


def mark(verdict) -> str:
    """A row's verification cell: '-' (not verified), 'verified' or 'not verified (n findings)'."""
    if verdict is None:
        return "-"
    return "verified" if not verdict.findings else f"not verified ({len(verdict.findings)} finding(s))"


def row(c, memory: int, verified: str | None = None) -> str:
    p = c.predicted
    ms = f"{c.seconds * 1e3:.0f}"
    return (
        f"| {c.name} |{f' {verified} |' if verified is not None else ''} {ms} | "
        f"{p['peak_memory_bytes'] / GiB:.1f} | "
        f"{p['state_bytes'] / GiB:.2f} | {p['saved_activation_bytes'] / GiB:.2f} | "
        f"{sum(p.get('comm_bytes', {}).values()) / GiB:.2f} | `{c.torchrun()}` |"
    )


def explain(c) -> str:
    p, t = c.predicted, c.times
    lines = [
        f"{c.name}: {c.torchrun()}",
        f"  per rank (the pipeline stage with the highest peak): peak {p['peak_memory_bytes'] / MiB:.0f} MiB = "
        f"parameters + optimizer state + the largest phase (plan.peak.peak_parts: end of forward, full AC's "
        f"recompute, a sharding engine's backward, optimizer step); state {p['state_bytes'] / MiB:.0f} MiB "
        f"({', '.join(f'{k} {v / MiB:.0f}' for k, v in p['state_bytes_by_kind'].items())}), "
        f"saved activations {p['saved_activation_bytes'] / MiB:.0f} MiB",
        "  sent per step (rank 0): "
        + (
            ", ".join(f"{k} {v / MiB:.1f} MiB" for k, v in p["comm_bytes"].items())
            if "comm_bytes" in p
            else "nothing (one rank)"
        ),
        f"  step time {c.seconds * 1e3:.1f} ms: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items() if k != "total"),
    ]
    return "\n".join(lines)


def print_table(a: argparse.Namespace, cluster: Cluster, fits: list, accepted: int, verdicts: dict, pace: str) -> None:
    """The text output: what was planned (and at which efficiency), the top layouts, and any verdicts."""
    print(
        f"{a.model} on {a.gpus} x {cluster.name} ({cluster.memory / GiB:.0f} GiB), seq_len {a.seq_len}, "
        f"{a.total_batch_size} tokens/step, {a.dtype}: {len(fits)} of {accepted} accepted layouts fit; {pace}"
    )
    check = " verified |" if verdicts else ""
    print(
        f"| layout |{check} step ms | peak GiB | state GiB | saved act. GiB | sent GiB/step | command |\n"
        f"|---|{'---|' if verdicts else ''}---|---|---|---|---|---|"
    )
    for c in fits[: max(a.top, a.verify)]:
        print(row(c, cluster.memory, mark(verdicts.get(c.name)) if verdicts else None))
    if verdicts:
        from sim.verify import HEADER, table_row

        print(f"\nverified by simulation (python -m sim.verify):\n{HEADER}")
        for name, v in verdicts.items():
            print(table_row(name, v.table))
        for name, v in verdicts.items():
            print("".join(f"{name}: finding: {f}\n" for f in v.findings), end="")


def main(argv: list[str] | None = None) -> int:
    try:
        a = parser().parse_args(argv)
        cluster = cluster_of(a)
        sizes = check_batch(a)
        if a.verify < 0:
            raise UsageError(f"--verify K must be >= 0 (the top K layouts to simulate), got {a.verify}")
        constraints = {
            "pp": a.pp,
            "tp": a.tp,
            "cp": 1 if a.no_cp else a.cp,
            "ep": a.ep,
            "dp_type": a.dp_type,
            "ac": a.ac,
        }
        efficiency, source = (
            (a.efficiency, "--efficiency") if a.efficiency is not None else efficiency_for(cluster.name)
        )
        pace = f"compute at {efficiency:g} of peak FLOP/s ({source})"
        every = candidates(model_flags(a), cluster, sizes, constraints, efficiency)
        if not every:  # the model's own flags refused (an unknown preset, say) are named, not the batch's
            raise UsageError(
                model_refusal(model_flags(a), sizes[0])
                or f"no layout of {a.gpus} GPUs is accepted by train.py for these batch sizes and "
                f"constraints (try another --micro_batch_size, --total_batch_size or --gpus)"
            )
        budget = cluster.memory * a.headroom
        # ties (rarer since the time model charges Cluster.overhead per compute action, but overlapped traffic is
        # hidden and 4-digit rounding merges near-equal times) go to bigger micro-batches, then to fewer bytes sent
        # state_floor first: a layout whose state alone exceeds the budget is never predicted in full
        fits = sorted(
            (c for c in every if c.state_floor <= budget and c.predicted["peak_memory_bytes"] <= budget),
            key=lambda c: (
                round(c.seconds, 4),
                -c.setup.args.micro_batch_size,
                sum(c.predicted.get("comm_bytes", {}).values()),
            ),
        )
        if a.explain:
            match = [c for c in every if c.name == a.explain]
            if not match:
                raise UsageError(f"--explain {a.explain!r} is not an accepted layout; the table names them")
            print(f"{explain(match[0])}\n  {pace}")
            return 0
        if not fits:
            least = min(every, key=lambda c: c.predicted["peak_memory_bytes"])
            need = least.predicted["peak_memory_bytes"] / a.headroom
            raise UsageError(
                f"nothing fits in {cluster.memory / GiB:.0f} GiB per GPU; the smallest layout "
                f"({least.name}) needs {need / GiB:.1f} GiB per GPU (with --headroom {a.headroom})"
            )
    except UsageError as e:
        error_line("python -m plan", e)
        return 2
    verdicts = verify_top(fits, a.verify) if a.verify > 0 else {}
    failed = any(v.findings for v in verdicts.values())
    if a.json:
        json.dump(
            [
                {
                    "layout": c.name,
                    "step_seconds": c.seconds,
                    "times": c.times,
                    "predicted": c.predicted,
                    "command": c.torchrun(),
                    **(
                        {"verified": not verdicts[c.name].findings, "findings": verdicts[c.name].findings}
                        if c.name in verdicts
                        else {}
                    ),
                }
                for c in fits
            ],
            sys.stdout,
            indent=1,
        )
        print()
        return 1 if failed else 0
    print_table(a, cluster, fits, len(every), verdicts, pace)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
