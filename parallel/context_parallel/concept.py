"""Context parallelism (the zigzag ring), registered: its flag, its checks and its planner terms (theory.py).
docs/context_parallel.md. The ring never imports this module."""

from __future__ import annotations

from parallel.context_parallel import theory
from runtime.registry import AT_LEAST_ONE, Checking, Concept, UsageError, register


def flags(a) -> None:
    a(
        "--context_parallel_size",
        type=int,
        default=1,
        metavar="C",
        help="split every sequence over C ranks (ring attention); gradients reduced over dp x C",
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


CONCEPT = register(
    Concept(
        name="context_parallel",
        title="context parallelism (docs/context_parallel.md)",
        flags=flags,
        mesh=lambda args: {"cp": args.context_parallel_size},
        ranges={"context_parallel_size": AT_LEAST_ONE},
        checks=(("flags", check_trace), ("batch", check_context)),
        terms=theory.TERMS,
    )
)
