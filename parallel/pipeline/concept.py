"""Pipeline parallelism (GPipe, 1F1B, interleaved, the zero-bubble schedules), registered: its flags, their checks
(the schedule against the partition of the Blocks), its settings of the layout, its planner terms (theory.py) and
its rows of the layout sweep. docs/pipeline.md. The runner never imports this module."""

from __future__ import annotations

import functools

from model.gpt import GPTConfig
from parallel.pipeline import theory
from parallel.pipeline.partition import check_counts, layers_for
from runtime.registry import AT_LEAST_ONE, Checking, Concept, Sweep, UsageError, register


def flags(a) -> None:
    a("--pipeline_parallel_size", type=int, default=1, help="degree of pipeline parallelism (stages)")
    a(
        "--pp_schedule",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"],
        default="1f1b",
        help="pipeline schedule; the step's micro-batches are the pipeline's micro-batches (zb_h1, zbv, dualpipev: "
        "zero-bubble, the backward split into input and weight gradients; zbv and dualpipev cut 2 chunks per "
        "rank in a V)",
    )
    a(
        "--pp_virtual_stages",
        type=int,
        default=None,
        metavar="V",
        help="interleaved_1f1b: model chunks per pipeline rank (V > 1); zbv, dualpipev: 2",
    )
    a(
        "--pp_layers_per_stage",
        default=None,
        metavar="A,B,...",
        help="Blocks per pipeline chunk, P x V counts in chunk order (default: partitioned by the cost model, "
        "parallel/pipeline/partition.py)",
    )


def check_world(c: Checking) -> None:
    if c.world % c.args.pipeline_parallel_size:
        raise UsageError(
            f"--pipeline_parallel_size {c.args.pipeline_parallel_size} does not divide the world size ({c.world} ranks)"
        )


def check_schedule(c: Checking) -> None:
    """The schedule, its virtual stages and the micro-batch count M against the partition of n_layer Blocks.
    Leaves the partition, Blocks per chunk, in `c.found["pp_layers"]`: --pp_layers_per_stage's, else the cost
    model's at --seq_len (parallel/pipeline/partition.py); None without a pipeline."""
    args, dims, config, micro = c.args, c.dims, c.config, c.micro
    interleaved, v_shape = args.pp_schedule == "interleaved_1f1b", args.pp_schedule in ("zbv", "dualpipev")
    if args.pp_virtual_stages is not None and not (interleaved or v_shape):
        raise UsageError(
            f"--pp_virtual_stages is for --pp_schedule interleaved_1f1b; {args.pp_schedule} runs "
            f"one chunk per pipeline rank (zbv and dualpipev take --pp_virtual_stages 2)"
        )
    if not dims.pp_enabled:
        if args.pp_schedule != "1f1b" or args.pp_virtual_stages is not None:
            raise UsageError("--pp_schedule and --pp_virtual_stages need --pipeline_parallel_size > 1")
        if args.pp_layers_per_stage is not None:
            raise UsageError("--pp_layers_per_stage needs --pipeline_parallel_size > 1")
        c.found["pp_layers"] = None
        return
    virtual = args.pp_virtual_stages or 1
    if interleaved and virtual < 2:
        raise UsageError("--pp_schedule interleaved_1f1b needs --pp_virtual_stages V > 1 (model chunks per rank)")
    if v_shape and virtual != 2:
        raise UsageError(f"--pp_schedule {args.pp_schedule} needs --pp_virtual_stages 2 (two chunks per rank in a V)")
    if config.n_layer < dims.pp * virtual:
        raise UsageError(
            f"n_layer ({config.n_layer}) < pipeline_parallel_size x virtual stages = {dims.pp} x "
            f"{virtual}: every pipeline chunk needs at least one Block"
        )
    if args.pp_schedule in ("zb_h1", "zbv", "dualpipev"):
        check_zero_bubble(args, dims, micro)
    if interleaved and micro % dims.pp:
        raise UsageError(
            f"--pp_schedule interleaved_1f1b needs the step's micro-batches M = total_batch_size / "
            f"(micro_batch_size x seq_len x data_parallel_size) = {micro} to be a multiple of "
            f"--pipeline_parallel_size {dims.pp} (Megatron's rule)"
        )
    check_twin(args)
    counts = None
    if args.pp_layers_per_stage is not None:
        flag = f"--pp_layers_per_stage {args.pp_layers_per_stage}"
        try:
            counts = tuple(int(n) for n in args.pp_layers_per_stage.split(","))
        except ValueError:
            raise UsageError(f"{flag}: not a comma-separated list of integers (Blocks per chunk)") from None
        reason = check_counts(counts, config.n_layer, dims.pp * virtual)
        if reason:
            raise UsageError(f"{flag} {reason}")
    c.found["pp_layers"] = _partition(config, dims.pp, virtual, args.seq_len, counts, v_shape)


def check_twin(args) -> None:
    """What torch.distributed.pipelining (--implementation pytorch) cannot run."""
    if args.implementation == "pytorch" and (args.sequence_parallel or args.enable_loss_parallelism):
        raise UsageError(
            "--implementation pytorch with --pipeline_parallel_size > 1 runs DTensor TP without "
            "--sequence_parallel / --enable_loss_parallelism: their DTensor activations and logits "
            "are not plain tensors torch.distributed.pipelining can send or feed its loss_fn"
        )
    if args.implementation == "pytorch" and args.dtype == "float16":
        raise UsageError(
            "--implementation pytorch with --pipeline_parallel_size > 1 has no fp16 loss scaling "
            "(torch's schedules compute the loss inside step()); use --dtype bfloat16"
        )


@functools.lru_cache(maxsize=1024)
def _partition(
    config: GPTConfig, pp: int, virtual: int, seq_len: int, counts: tuple[int, ...] | None, v_shape: bool
) -> tuple[int, ...]:
    """layers_for's Blocks per chunk, once per argument set (the planner checks thousands of layouts that share
    a few partitions, and the cost model builds a Block on meta each time)."""
    return tuple(len(r) for r in layers_for(config, pp, virtual, seq_len, counts, v_shape=v_shape))


def check_zero_bubble(args, dims, micro: int) -> None:
    """The zero-bubble schedules: enough micro-batches (zb_h1, zbv: M >= P; dualpipev: M >= 2P), and the layouts
    their split backward is built and tested for (parallel/pipeline/zero_bubble.py: no data parallelism, DDP,
    ZeRO-1/2/3 and HSDP, our TP with or without SP and beside them; eager Blocks; the PyTorch twin, torch's
    ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble / ScheduleDualPipeV, without data parallelism)."""
    name, least = args.pp_schedule, 2 * dims.pp if args.pp_schedule == "dualpipev" else dims.pp
    if micro < least:
        raise UsageError(
            f"--pp_schedule {name} needs the step's micro-batches M = total_batch_size / (micro_batch_size "
            f"x seq_len x data_parallel_size) = {micro} >= "
            + (f"2 x --pipeline_parallel_size = {least}" if least > dims.pp else f"--pipeline_parallel_size {dims.pp}")
        )
    if args.implementation == "pytorch" and (dims.dp_enabled or dims.tp_enabled):
        raise UsageError(
            f"--implementation pytorch --pp_schedule {name} runs without data or tensor parallelism "
            "here: torch's split backward under its DDP / FSDP2 / DTensor TP is not tested; use "
            "--implementation custom"
        )
    if dims.cp_enabled or args.compile:
        raise UsageError(
            f"--pp_schedule {name} does not run under --context_parallel_size or --compile: its split "
            "backward is not tested with ring attention, and torch refuses its own input/weight split "
            "under compile"
        )


def parallel(c: Checking) -> dict:
    return dict(
        pp_schedule=c.args.pp_schedule, pp_virtual=c.args.pp_virtual_stages or 1, pp_layers=c.found.get("pp_layers")
    )


# ----------------------------------------------------------------------------- its rows of the sweep (bench/sweep.py)

SPLIT = (("zb_h1", 1), ("zbv", 2), ("dualpipev", 2))  # the split-backward schedules and their chunks per rank


def sweep_rows() -> list[dict]:
    """pp = 3 beside dp = 2 on 6 ranks, the smallest layouts with a middle stage and another dimension (the first
    user report: ValueError at build), in ddp and in fsdp with --deferred_init. Cheap enough for CI. Then the
    split-backward schedules (zb_h1; zbv and dualpipev on a V, V = 2) at P = 2, 3, 4 alone, and at P = 2 with DDP,
    ZeRO-2, FSDP and TP + SP (4 ranks); ZB-V and DualPipe-V x FSDP in bf16 (the GPU's defaults). Kept out of the
    sweep's product of layouts: the other dims they do not run with are refused in one line (check_zero_bubble,
    tests/test_zero_bubble.py)."""
    out = [dict(pp=3, dp=2, dp_type="ddp"), dict(pp=3, dp=2, dp_type="fsdp", deferred=True)]
    out += [dict(pp=p, schedule=s, virtual=v) for p in (2, 3, 4) for s, v in SPLIT]
    for s, v in SPLIT:
        out += [dict(pp=2, dp=2, dp_type=t, schedule=s, virtual=v) for t in ("ddp", "zero2", "fsdp")]
        out.append(dict(pp=2, tp=2, schedule=s, virtual=v))
    return out + [
        dict(pp=2, dp=2, dp_type="fsdp", schedule=s, virtual=2, dtype="bfloat16") for s in ("zbv", "dualpipev")
    ]


def sweep_large_rows() -> list[dict]:
    """The split schedules beside a sharding engine and TP (pp=2 x dp=2 x tp=2), under HSDP (pp=2 x dp=4, R=2), and
    at P = 4 with DDP, ZeRO-2, FSDP (dp=2) and TP + SP (tp=2): 8 ranks, run with the 6- and 8-rank sample. DualPipe-V
    needs M >= 2P = 8 per dp rank, so its P = 4 x dp = 2 rows train 16 rows per step (against one process of 16)."""
    return (
        [dict(pp=2, dp=2, tp=2, dp_type=t, schedule=s, virtual=v) for s, v in SPLIT for t in ("zero2", "fsdp")]
        + [
            dict(pp=2, dp=4, dp_type=t, replicate=2, schedule=s, virtual=v)
            for s, v in SPLIT[:2]
            for t in ("zero2", "fsdp")
        ]
        + [
            dict(pp=4, dp=2, dp_type=t, schedule=s, virtual=v, rows=16 if s == "dualpipev" else 0)
            for s, v in SPLIT
            for t in ("ddp", "zero2", "fsdp")
        ]
        + [dict(pp=4, tp=2, schedule=s, virtual=v) for s, v in SPLIT]
    )


CONCEPT = register(
    Concept(
        name="pipeline",
        title="pipeline parallelism (docs/pipeline.md)",
        flags=flags,
        mesh=lambda args: {"pp": args.pipeline_parallel_size},
        ranges={"pipeline_parallel_size": AT_LEAST_ONE, "pp_virtual_stages": AT_LEAST_ONE},
        checks=(("world", check_world), ("batch", check_schedule)),
        parallel=parallel,
        terms=theory.TERMS,
        sweep=Sweep(rows=sweep_rows, large=sweep_large_rows),
    )
)
