"""Tensor parallelism (Megatron's column/row split, sequence and loss parallelism), registered: its flags, their
checks, its settings of the layout and its planner terms (theory.py). docs/layouts.md. The wrappers never
import this module."""

from __future__ import annotations

from parallel.tensor_parallel import theory
from parallel.tensor_parallel.apply import check_tp_divisibility
from runtime.registry import AT_LEAST_ONE, Checking, Concept, UsageError, register


def flags(a) -> None:
    a("--tensor_parallel_size", type=int, default=1, help="degree of tensor parallelism")
    a("--enable_loss_parallelism", action="store_true", help="vocab-parallel cross-entropy under TP")
    a("--sequence_parallel", action="store_true", help="TP: LayerNorms/residuals on sequence-sharded activations")


def check_switches(c: Checking) -> None:
    """Loss and sequence parallelism need TP; SP splits the sequence over it."""
    args, dims = c.args, c.dims
    for flag in ("enable_loss_parallelism", "sequence_parallel"):
        if getattr(args, flag) and not dims.tp_enabled:
            raise UsageError(f"--{flag} needs --tensor_parallel_size > 1")
    if args.sequence_parallel and args.seq_len % dims.tp:
        raise UsageError(
            f"--sequence_parallel needs --seq_len ({args.seq_len}) divisible by --tensor_parallel_size ({dims.tp})"
        )


def check_model(c: Checking) -> None:
    """Whole heads, widths and vocabulary slices on every rank (apply.check_tp_divisibility)."""
    reason = check_tp_divisibility(c.config, c.dims.tp)
    if reason:
        raise UsageError(f"--tensor_parallel_size {c.dims.tp}: {reason}")


def parallel(c: Checking) -> dict:
    return dict(loss_parallel=c.args.enable_loss_parallelism, sequence_parallel=c.args.sequence_parallel)


CONCEPT = register(
    Concept(
        name="tensor_parallel",
        title="tensor parallelism (docs/layouts.md)",
        flags=flags,
        mesh=lambda args: {"tp": args.tensor_parallel_size},
        ranges={"tensor_parallel_size": AT_LEAST_ONE},
        checks=(("layout", check_switches), ("model", check_model)),
        parallel=parallel,
        terms=theory.TERMS,
    )
)
