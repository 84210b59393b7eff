"""Data parallelism (DDP, ZeRO-1/2, FSDP = ZeRO-3, HSDP), registered: its flags, their checks, its settings of the
layout and its planner terms (theory.py). docs/layouts.md. The wrappers never import this module."""

from __future__ import annotations

import torch

from parallel.data_parallel import theory
from runtime.registry import AT_LEAST_ONE, POSITIVE, Checking, Concept, UsageError, register

DTYPES = ("float32", "bfloat16", "float16")


def flags(a) -> None:
    a("--data_parallel_size", type=int, default=1, help="degree of data parallelism")
    a(
        "--data_parallel_type",
        choices=["ddp", "zero1", "zero2", "fsdp"],
        default=None,
        help="required when dp > 1: replicate (ddp) or shard optimizer state (zero1), + gradients (zero2), "
        "+ parameters (fsdp = ZeRO-3)",
    )
    a(
        "--data_parallel_replicate_size",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: the dp ranks are R replicas x dp/R shards (zero1, zero2, fsdp)",
    )
    a("--bucket_cap_mb", type=float, default=25.0, help="custom DDP: gradient bucket size")
    a("--grad_compression", choices=["none", "bf16"], default="none", help="custom DDP: bf16 on the wire")
    a(
        "--param_dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="FSDP: dtype of the gathered compute copies (the master shard stays fp32); auto: the --dtype "
        "autocast computes in",
    )
    a("--reduce_dtype", choices=DTYPES, default="float32", help="FSDP: dtype gradients are reduce-scattered in")


def check_wrapper(c: Checking) -> None:
    """A type for dp > 1, and HSDP's replicas over a sharded type."""
    args, dims = c.args, c.dims
    if dims.dp_enabled and args.data_parallel_type is None:
        raise UsageError(f"--data_parallel_type ddp|zero1|zero2|fsdp is required with --data_parallel_size {dims.dp}")
    R = args.data_parallel_replicate_size
    if R > 1 and (dims.dp % R or args.data_parallel_type in (None, "ddp")):
        raise UsageError(
            f"--data_parallel_replicate_size {R} needs a sharded --data_parallel_type (zero1, zero2, "
            f"fsdp) and must divide --data_parallel_size {dims.dp}"
        )
    if R > 1 and args.data_parallel_type == "zero1" and args.implementation == "pytorch":
        raise UsageError(
            "--implementation pytorch has no hybrid ZeRO-1: ZeroRedundancyOptimizer shards over one "
            "group and would ignore --data_parallel_replicate_size; use the custom engine or zero2/fsdp"
        )


def check_dtypes(c: Checking) -> None:
    """fp16 compute copies or reductions only beside fp16's GradScaler."""
    fp16 = [f"--{f} float16" for f in ("param_dtype", "reduce_dtype") if getattr(c.args, f) == "float16"]
    if fp16 and c.dtype != torch.float16:
        raise UsageError(
            f"{' and '.join(fp16)} need --dtype float16, whose GradScaler keeps fp16 gradients "
            f"from overflowing; use bfloat16 instead"
        )


def parallel(c: Checking) -> dict:
    """ParallelConfig's data-parallel fields. Context parallelism replicates the parameters over cp: a data-parallel
    wrapper reduces over dp x cp (DDP when no type is given)."""
    args, dims = c.args, c.dims
    param_dtype = args.param_dtype
    if param_dtype == "auto":  # gather what autocast computes in: half the bytes, no fp32 copies kept alive
        param_dtype = str(c.dtype).removeprefix("torch.")
    dp_type = (args.data_parallel_type or "ddp") if dims.cp_enabled else args.data_parallel_type
    return dict(
        dp_type=dp_type if dims.dp_enabled or dims.cp_enabled else None,
        param_dtype=None if param_dtype == "float32" else getattr(torch, param_dtype),
        reduce_dtype=getattr(torch, args.reduce_dtype),
        bucket_cap_mb=args.bucket_cap_mb,
        grad_compression=None if args.grad_compression == "none" else args.grad_compression,
    )


CONCEPT = register(
    Concept(
        name="data_parallel",
        title="data parallelism: DDP, ZeRO-1/2, FSDP, HSDP (docs/layouts.md)",
        flags=flags,
        mesh=lambda args: {"dp": args.data_parallel_size, "dp_replicate": args.data_parallel_replicate_size},
        ranges={
            "data_parallel_size": AT_LEAST_ONE,
            "data_parallel_replicate_size": AT_LEAST_ONE,
            "bucket_cap_mb": POSITIVE,
        },
        checks=(("layout", check_wrapper), ("layout", check_dtypes)),
        parallel=parallel,
        terms=theory.TERMS,
    )
)
