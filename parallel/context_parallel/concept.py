"""Context parallelism, registered: its flags (the degree, and the algorithm: the zigzag ring or Ulysses), its
checks, its planner terms and variants (theory.py) and its sweep rows. docs/context_parallel.md. Neither algorithm
imports this module."""

from __future__ import annotations

from parallel.context_parallel import theory
from parallel.context_parallel.ulysses import check_ulysses
from runtime.registry import AT_LEAST_ONE, Checking, Concept, Sweep, UsageError, register

ALGORITHMS = ("ring", "ulysses")


def flags(a) -> None:
    a(
        "--context_parallel_size",
        type=int,
        default=1,
        metavar="C",
        help="split every sequence over C ranks (ring attention); gradients reduced over dp x C",
    )
    a(
        "--cp_algorithm",
        choices=ALGORITHMS,
        default="ring",
        help="how attention sees the whole sequence under CP: ring (k/v blocks passed round, C-1 hops) or "
        "ulysses (all-to-alls from tokens to heads and back; needs n_head / tp divisible by C)",
    )


def check_trace(c: Checking) -> None:
    """--trace_step (debug/trace.py) places each rank's sequence shards by our ring's zigzag, not torch's."""
    args = c.args
    if args.trace_step is not None and args.implementation == "pytorch" and args.context_parallel_size > 1:
        raise UsageError(
            "--trace_step cannot place the sequence shards of torch's context_parallel; trace CP "
            "with --implementation custom"
        )


def check_context(c: Checking) -> None:
    """Context parallelism: what it needs of the sequence and what it does not compose with (yet)."""
    args, dims, config, device = c.args, c.dims, c.config, c.device
    C = dims.cp
    if C == 1:
        return
    if args.seq_len % (2 * C):
        raise UsageError(
            f"--context_parallel_size {C} needs --seq_len ({args.seq_len}) divisible by 2 x {C}: "
            f"each sequence is cut into 2C chunks (zigzag)"
        )
    if args.implementation == "pytorch" and device.type != "cuda":
        raise UsageError(
            "--implementation pytorch --context_parallel_size needs CUDA: PyTorch's context_parallel "
            "rings only the flash, memory-efficient and cuDNN SDPA kernels, and attention on "
            f"{device.type} is none of them (--implementation custom runs our ring anywhere)"
        )
    if args.implementation == "pytorch" and (
        dims.tp_enabled or dims.pp_enabled or args.compile or args.data_parallel_replicate_size > 1
    ):
        raise UsageError(
            "--implementation pytorch --context_parallel_size composes with data parallelism only "
            "(DDP, FSDP2); for CP with TP, PP, HSDP or --compile use --implementation custom"
        )
    if args.sequence_parallel and (args.seq_len // C) % dims.tp:
        raise UsageError(
            f"--sequence_parallel with --context_parallel_size {C} needs each rank's share of a "
            f"sequence (--seq_len / C = {args.seq_len // C}) divisible by --tensor_parallel_size "
            f"({dims.tp})"
        )
    if config.dropout > 0:
        raise UsageError(f"--context_parallel_size needs dropout 0 (got {config.dropout}): ring attention has none")
    if args.cp_algorithm == "ulysses":
        check_ulysses_heads(args, config.n_head, dims.tp, C)


def check_ulysses_heads(args, n_head: int, tp: int, cp: int) -> None:
    """Ulysses: our implementation only (torch's context_parallel is a ring), and each tp rank's heads split
    over cp (parallel/context_parallel/ulysses.check_ulysses)."""
    if args.implementation == "pytorch":
        raise UsageError("--cp_algorithm ulysses is ours only: use --implementation custom")
    refusal = check_ulysses(n_head, tp, cp)
    if refusal is not None:
        raise UsageError(f"--cp_algorithm ulysses: {refusal}")


def search(sizes: dict) -> list[tuple[str, list[str]]]:
    """The planner's variants of a layout: the ring always, Ulysses beside it when there is a cp dim (a
    layout whose heads it cannot split is refused by `check_ulysses_heads` and dropped)."""
    return [("", [])] + ([("ulysses", ["--cp_algorithm", "ulysses"])] if sizes["cp"] > 1 else [])


ULYSSES = ("--cp_algorithm", "ulysses")


def sweep_rows() -> list[dict]:
    """Ulysses in the sweep (bench.sweep.Layout fields): alone, under TP (4 heads / 2 / 2), FSDP, a pipeline and
    bf16 DDP, each held against one process as the ring's layouts are (the grid's cp rows run the ring)."""
    return [
        dict(cp=2, extra=ULYSSES),
        dict(cp=2, tp=2, extra=ULYSSES),
        dict(cp=2, dp=2, dp_type="fsdp", extra=ULYSSES),
        dict(cp=2, pp=2, extra=ULYSSES),
        dict(cp=2, dp=2, dp_type="ddp", dtype="bfloat16", extra=ULYSSES),
    ]


CONCEPT = register(
    Concept(
        name="context_parallel",
        title="context parallelism (docs/context_parallel.md)",
        flags=flags,
        mesh=lambda args: {"cp": args.context_parallel_size},
        ranges={"context_parallel_size": AT_LEAST_ONE},
        checks=(("flags", check_trace), ("batch", check_context)),
        parallel=lambda c: {"cp_algorithm": c.args.cp_algorithm},
        terms=theory.TERMS,
        search=search,
        sweep=Sweep(rows=sweep_rows),
    )
)
