"""The optimizer's flags and their checks, which optim/concept.py registers (`add_flags`, `check`, `check_resume`;
optim/build.py makes the optimizer from them).

Defaults follow Moonlight's recipe ("Muon is Scalable for LLM Training", Liu et al. 2025; torch's
adjust_lr_fn="match_rms_adamw"): the update's RMS is scaled to AdamW's (0.2 sqrt(max(A, B))), so Muon takes
AdamW's tuned lr and weight decay as they are (`--muon_lr` and `--muon_weight_decay` default to `--lr` and
`--weight_decay`), momentum 0.95 with Nesterov, 5 Newton-Schulz steps. A user who switches `--optimizer muon`
on a run tuned for AdamW then gets a sensible run without retuning; torch's own defaults (lr 1e-3,
adjust "original") need an lr tuned for Muon, and modded-nanogpt's (lr 0.05, no weight decay) a speedrun's
schedule. Pass `--muon_adjust_lr_fn original --muon_lr 0.02` for Keller Jordan's.
"""

from __future__ import annotations

import argparse

import torch

MUON_FLAGS = ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_weight_decay", "muon_adjust_lr_fn")


def add_flags(a) -> None:
    """`a`: the parser's add_argument."""
    a(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="adamw everywhere, or muon on each Block's weight matrices and adamw on the rest (docs/muon.md)",
    )
    a("--muon_lr", type=float, default=None, help="Muon's peak lr (default: --lr; same warmup and decay)")
    a("--muon_momentum", type=float, default=None, help="Muon's momentum (default 0.95)")
    a("--muon_nesterov", choices=["on", "off"], default=None, help="Nesterov momentum (default on)")
    a("--muon_ns_steps", type=int, default=None, help="Newton-Schulz steps (default 5)")
    a("--muon_weight_decay", type=float, default=None, help="Muon's decoupled weight decay (default: --weight_decay)")
    a(
        "--muon_adjust_lr_fn",
        choices=["original", "match_rms_adamw"],
        default=None,
        help="torch.optim.Muon's lr adjustment (default match_rms_adamw: Moonlight's, AdamW's lr carries over)",
    )


def muon_settings(args: argparse.Namespace) -> dict:
    """torch.optim.Muon's keyword arguments from the flags, defaults filled in (the module docstring's)."""
    pick = lambda flag, default: default if getattr(args, flag) is None else getattr(args, flag)  # noqa: E731
    return dict(
        lr=pick("muon_lr", args.lr),
        weight_decay=pick("muon_weight_decay", args.weight_decay),
        momentum=pick("muon_momentum", 0.95),
        nesterov=pick("muon_nesterov", "on") == "on",
        ns_steps=pick("muon_ns_steps", 5),
        adjust_lr_fn=pick("muon_adjust_lr_fn", "match_rms_adamw"),
    )


def check(args: argparse.Namespace, dims, moe: bool, dtype: torch.dtype, refuse: type[Exception] = ValueError) -> None:
    """Bad input: raises `refuse` with one line (optim/concept.py passes the registry's UsageError: exit 2 on every
    rank, before any work)."""
    given = [f"--{f}" for f in MUON_FLAGS if getattr(args, f) is not None]
    if args.optimizer != "muon":
        if given:
            raise refuse(f"{given[0]} sets Muon, which this run does not use: add --optimizer muon or drop it")
        return
    s = muon_settings(args)  # ranges >= 0, > 0 and >= 1: config.check_ranges, first
    if s["momentum"] >= 1 or s["ns_steps"] >= 100:
        raise refuse(
            f"--muon_momentum must be < 1 and --muon_ns_steps < 100 (torch.optim.Muon's bound), got "
            f"{s['momentum']} and {s['ns_steps']}"
        )
    if dtype == torch.float16:
        raise refuse(
            "--optimizer muon with --dtype float16 is not built yet (the GradScaler's unscale does not "
            "reach the flat shards' Muon views): use bfloat16"
        )
    if args.implementation == "pytorch":
        refused = [
            what
            for what, on in (
                (
                    f"--data_parallel_type {args.data_parallel_type}",
                    dims.dp * dims.cp > 1 and args.data_parallel_type not in (None, "ddp"),
                ),
                ("--tensor_parallel_size", dims.tp > 1),
                ("--moe_num_experts", moe),
            )
            if on
        ]
        if refused:
            raise refuse(
                f"--implementation pytorch --optimizer muon: torch.optim.Muon needs each matrix whole and "
                f"2-D on every rank, which {refused[0]} does not give; use --implementation custom"
            )


def check_resume(manifest: dict, optimizer: str, path: str, refuse: type[Exception] = ValueError) -> None:
    """--resume from a checkpoint another --optimizer wrote: raises `refuse` with one line (config.resume_checkpoint
    asks optim/concept.py, which passes the registry's UsageError: every rank reads the manifest, so every rank
    exits 2, before any work). Their state does
    not carry over: Muon keeps one momentum per Block matrix where AdamW keeps two moments and a step count. A
    checkpoint from before --optimizer existed records none: AdamW wrote it."""
    saved = manifest["config"]["train"].get("optimizer") or "adamw"
    if saved != optimizer:
        raise refuse(
            f"--resume: checkpoint {path} was written with --optimizer {saved}, and this run has --optimizer "
            f"{optimizer}: the optimizer state does not carry over (muon keeps one momentum per Block "
            f"matrix, adamw two moments); resume with --optimizer {saved}, or choose another --out_dir"
        )
