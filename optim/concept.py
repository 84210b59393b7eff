"""Muon (--optimizer muon: Muon on each Block's weight matrices, AdamW on the rest, in every layout), registered:
its flags and their checks (optim/flags.py), what a checkpoint records and a resume refuses, its planner terms
(optim/theory.py), the sweep's --optimizer option and what a simulated rank needs of it (optim/simulate.py).
docs/muon.md. optim/build.py and the optimizers never import this module."""

from __future__ import annotations

from optim import flags, simulate, theory
from runtime.registry import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Checking,
    Concept,
    Sweep,
    SweepOption,
    UsageError,
    register,
)


def check(c: Checking) -> None:
    flags.check(c.args, c.dims, c.config.moe_num_experts > 0, c.dtype, refuse=UsageError)


def check_resume(manifest: dict, args, path: str) -> None:
    flags.check_resume(manifest, args.optimizer, path, refuse=UsageError)


def plan_flags(a) -> None:
    a(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: Muon's one moment per Block matrix, its exchange's bytes and Newton-Schulz FLOPs (docs/muon.md)",
    )


RULE = (
    "muon rows: the layout's tolerance plus optim/muon.rounding_rtol's first-order bound on what bf16 "
    "Newton-Schulz turns the layout's gradient rounding into (one bf16 spacing per update element), from "
    "the reference's lrs, grad norms and losses; grad norms after step 1 are not compared (no bound on the "
    "Hessian is derived)"
)


def sweep_rtol(config, lrs: list[float], ref: dict) -> float:
    """Muon's rounding bound (RULE) for the layout of model `config`, from the reference run's values `ref` and
    the lr of each step (then 0 for the val loss after the last)."""
    import torch

    from model.gpt import GPT
    from optim.muon import is_muon, rounding_rtol

    with torch.device("meta"):
        shapes = [
            tuple(p.shape[-2:])
            for n, p in GPT(config).named_parameters()
            if is_muon(n)
            for _ in range(p.shape[0] if p.dim() == 3 else 1)
        ]
    loss = ref["loss"] + ref["val_loss"][-1:]
    norms = ref["grad_norm"] + ref["grad_norm"][-1:]  # the val loss after the last step: its last norm stands in
    return rounding_rtol(shapes, "match_rms_adamw", lrs, norms, loss)


CONCEPT = register(
    Concept(
        name="muon",
        title="the optimizer (docs/muon.md)",
        flags=flags.add_flags,
        ranges={
            "muon_ns_steps": AT_LEAST_ONE,
            "muon_lr": POSITIVE,
            "muon_weight_decay": NON_NEGATIVE,
            "muon_momentum": NON_NEGATIVE,
        },
        checks=(("batch", check),),
        math_flags=flags.MUON_FLAGS,
        resume=check_resume,
        terms=theory.TERMS,
        plan_flags=plan_flags,
        sweep=Sweep(
            option=SweepOption(
                "--optimizer",
                ("adamw", "muon"),
                "adamw",
                help="every layout with this optimizer",
                rule=RULE,
                rtol=sweep_rtol,
            )
        ),
        simulate=simulate.simulate,
        findings=simulate.findings,
        uneven_sites=(simulate.SITE,),
    )
)
