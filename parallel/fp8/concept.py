"""FP8 training, registered: its flag (`--fp8 none|tensorwise|rowwise`), its one-line refusals, its setting of the
layout (`ParallelConfig.fp8`) and the sweep's `--fp8` option. docs/fp8.md. The FP8 linear never imports this module.

What each layout syncs, and so what this phase runs: one process, DDP, ZeRO-1/2 and pipelines hold every scaled
operand whole (a micro-batch's activations and gradients on the rank that computes them, a Block's whole weight:
ZeRO-1/2 keep full parameters, a pipeline stage whole Blocks), so their amaxes are one process's; FSDP (ZeRO-3)
casts the all-gathered weight, whole again. CP cuts the tokens: their amax is all-reduced over the cp group
(parallel/fp8/layouts.py). TP cuts the weights: refused until its amax all-reduce is wired (and torchao's twin
under CP, whose amaxes are the rank's own).
"""

from __future__ import annotations

from runtime.registry import Checking, Concept, Sweep, SweepOption, UsageError, register

CHOICES = ("none", "tensorwise", "rowwise")


def flags(a) -> None:
    a(
        "--fp8",
        choices=CHOICES,
        default="none",
        help="the Blocks' linears in FP8 (dynamic scaling; the head and embeddings stay in --dtype): tensorwise "
        "(one scale a tensor) or rowwise (one a row); --implementation pytorch runs torchao's Float8Linear",
    )


def check_layout(c: Checking) -> None:
    """The layouts FP8 runs in (this module's docstring), and a compute dtype its GEMMs can output."""
    args, dims = c.args, c.dims
    if args.fp8 == "none":
        return
    if dims.tp > 1:
        twin = " (torchao's twin would need its Float8 TP styles)" if args.implementation == "pytorch" else ""
        raise UsageError(
            f"--fp8 with --tensor_parallel_size {dims.tp}: TP cuts the weights a scale spans, and their amax "
            f"all-reduce is not built yet (docs/fp8.md){twin}; use DDP, ZeRO, FSDP, a pipeline or CP"
        )
    if dims.cp > 1 and args.implementation == "pytorch":
        raise UsageError(
            f"--fp8 --implementation pytorch with --context_parallel_size {dims.cp}: torchao's Float8Linear "
            "scales each rank's share of the tokens by its own amax; use --implementation custom (ours all-reduces it)"
        )


def check_model(c: Checking) -> None:
    """--dtype float16, a linear dimension or a token count per call that torch._scaled_mm can't take
    (parallel/fp8/checks.py)."""
    if c.args.fp8 == "none":
        return
    import torch

    from model.gpt import GPT
    from parallel.fp8.checks import check_fp8, linear_dims

    with torch.device("meta"):
        dims = linear_dims(GPT(c.config))
    refusal = check_fp8(c.args.fp8, dims, c.dtype, c.args.micro_batch_size * c.args.seq_len // c.dims.cp)
    if refusal is not None:
        raise UsageError(refusal)


RULE = (
    "fp8 rows: every layout and its one-process reference in FP8, at the layout's micro-batch size (a tensorwise "
    "activation scale is the micro-batch's amax); the tolerance is the layout's own (a layout "
    "that holds every operand whole casts the same values as one process, up to the fp32 reorderings the "
    "layout's tolerance already bounds)"
)

CONCEPT = register(
    Concept(
        name="fp8",
        title="FP8 training (docs/fp8.md)",
        flags=flags,
        checks=(("layout", check_layout), ("model", check_model)),
        parallel=lambda c: {"fp8": None if c.args.fp8 == "none" else c.args.fp8},
        sweep=Sweep(
            option=SweepOption(
                "--fp8", CHOICES, "none", help="every layout and its reference in FP8", rule=RULE, per_micro=True
            )
        ),
    )
)
