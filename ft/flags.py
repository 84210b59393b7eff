"""The fault-tolerance flags and their checks: trainer/config.py calls `add_flags` (train_parser) and `check`
(validate), so a bad FT command is one line and exit 2 on every rank, before any work (ft/replicas.py runs them).

    --ft_lighthouse URL            torchft's lighthouse (http://HOST:PORT): the quorum service this run joins
    --ft_replica_group I           this job is replica group I ...
    --ft_replica_groups R          ... of R (the job's other groups are their own torchrun jobs)
    --ft_timeout S                 cross-group collectives, quorum and heal (default 60)
    --ft_connect_timeout S         the lighthouse must answer within it (default 5): here, and torchft's connections

A replica group continues its job, as `--resume` does: from a live peer that is ahead of it (a relaunched group
heals), else from its newest checkpoint, else from scratch. So the command that launched a group relaunches it.
"""

from __future__ import annotations

import argparse
import math
import os
import urllib.error
import urllib.request

import tomllib

FLAGS = ("ft_lighthouse", "ft_replica_group", "ft_replica_groups", "ft_timeout", "ft_connect_timeout")
TIMEOUT, CONNECT_TIMEOUT = 60.0, 5.0  # seconds, the defaults
INTS = {"ft_replica_group": 0, "ft_replica_groups": 1}  # the lowest value each takes
FLOATS = ("ft_timeout", "ft_connect_timeout")  # finite and > 0
PP_LEAST = {"zb_h1": 1, "zbv": 1, "dualpipev": 2}  # a zero-bubble schedule's micro-batches per pipeline stage


def add_flags(a) -> None:
    """`a`: the parser's add_argument."""
    a(
        "--ft_lighthouse",
        default=None,
        metavar="URL",
        help="fault-tolerant replica groups on torchft: the lighthouse's http://HOST:PORT (docs/fault-tolerance.md); "
        "a group continues its job as --resume does, healing from a live peer that is ahead of it",
    )
    a("--ft_replica_group", type=int, default=None, metavar="I", help="this job is replica group I (0 <= I < R)")
    a("--ft_replica_groups", type=int, default=None, metavar="R", help="the job's replica groups, each a torchrun job")
    a(
        "--ft_timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds a cross-group collective, a quorum or a heal may take (default {TIMEOUT:g})",
    )
    a(
        "--ft_connect_timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds the lighthouse has to answer, at the start and on torchft's connections "
        f"(default {CONNECT_TIMEOUT:g})",
    )


def enabled(args: argparse.Namespace) -> bool:
    return getattr(args, "ft_lighthouse", None) is not None


def timeouts(args: argparse.Namespace) -> tuple[float, float]:
    """(--ft_timeout, --ft_connect_timeout), defaults filled in."""
    return args.ft_timeout or TIMEOUT, args.ft_connect_timeout or CONNECT_TIMEOUT


def shares(units: int, live: int) -> list[range]:
    """The step's micro-steps cut among `live` replica groups, by their position among the quorum's members: group i
    takes [i U / W, (i + 1) U / W). Every micro-step goes to exactly one group, and the sizes differ by at most 1."""
    return [range(i * units // live, (i + 1) * units // live) for i in range(live)]


def check(args: argparse.Namespace, dims, grad_accum: int, refuse: type[Exception] = ValueError) -> None:
    """Bad input, one line (`refuse`: config's UsageError): the ranges, the flags that need each other, what a group
    cannot run yet, a lighthouse that does not answer within --ft_connect_timeout. A valid FT run then continues its
    job: `args.resume` is set (the module docstring)."""
    for flag, low in INTS.items():
        value = getattr(args, flag)
        if value is not None and value < low:
            raise refuse(f"--{flag} must be >= {low}, got {value}")
    for flag in FLOATS:
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise refuse(f"--{flag} must be a finite number > 0, got {value}")
    given = [f"--{f}" for f in FLAGS[1:] if getattr(args, f) is not None]
    if not enabled(args):
        if given:
            raise refuse(f"{given[0]} is a replica group's flag: it needs --ft_lighthouse http://HOST:PORT")
        return
    group, groups = args.ft_replica_group, args.ft_replica_groups
    if group is None or groups is None:
        raise refuse("--ft_lighthouse needs --ft_replica_group I and --ft_replica_groups R: which group this job is")
    if group >= groups:
        raise refuse(
            f"--ft_replica_group {group} is outside the {groups} groups of --ft_replica_groups (0..{groups - 1})"
        )
    _check_run(args, dims, grad_accum, refuse)
    _check_out_dir(args, refuse)
    probe(args.ft_lighthouse, timeouts(args)[1], refuse)
    args.resume = True  # a group continues its job: the same command starts it and relaunches it


def _check_run(args: argparse.Namespace, dims, grad_accum: int, refuse: type[Exception]) -> None:
    """What a replica group does not run (yet), and enough micro-steps for every group however many are live."""
    R = args.ft_replica_groups
    if grad_accum < R:
        raise refuse(
            f"--ft_replica_groups {R} needs at least {R} micro-steps per step to share, one per group: "
            f"total_batch_size / (micro_batch_size x seq_len x data_parallel_size) = {grad_accum}"
        )
    refused = [
        what
        for what, on in (
            ("--overwrite (a group continues its job; start a new one in a fresh --out_dir)", args.overwrite),
            ("--moe_num_experts (the expert statistics would be one group's)", args.moe_num_experts > 0),
            ("--dtype float16 (the GradScaler's state is not healed)", args.dtype == "float16"),
            ("--fake_world_size (a simulated rank joins no quorum)", args.fake_world_size is not None),
        )
        if on
    ]
    if refused:
        raise refuse(f"--ft_lighthouse does not take {refused[0]}")
    if dims.pp_enabled:
        sizes = {len(s) for live in range(1, R + 1) for s in shares(grad_accum, live)}
        least = PP_LEAST.get(args.pp_schedule, 0) * dims.pp
        bad = [n for n in sorted(sizes) if n < least or (args.pp_schedule == "interleaved_1f1b" and n % dims.pp)]
        if bad:
            raise refuse(
                f"--pp_schedule {args.pp_schedule} under --ft_replica_groups {R}: a group's share of the step's "
                f"{grad_accum} micro-steps can be {bad[0]}, which the schedule does not run (shares: {sorted(sizes)})"
            )


def _check_out_dir(args: argparse.Namespace, refuse: type[Exception]) -> None:
    """Each group has its own --out_dir: one that holds another group's run is refused (its config.toml says)."""
    path = os.path.join(args.out_dir, "config.toml")
    try:
        with open(path, "rb") as f:
            held = tomllib.load(f).get("ft_replica_group")
    except (OSError, tomllib.TOMLDecodeError):
        return
    if held is not None and held != args.ft_replica_group:
        raise refuse(
            f"--out_dir {args.out_dir} holds replica group {held}'s run, not group {args.ft_replica_group}'s: "
            "each group writes its own --out_dir"
        )


def probe(url: str, timeout: float, refuse: type[Exception] = ValueError) -> None:
    """The lighthouse answers its status page (GET URL/status) within `timeout` seconds, or `refuse`. A plain
    HTTP request: a gRPC heartbeat would register a replica that then never joins, and delay every quorum."""
    if not url.startswith(("http://", "https://")) or ":" not in url.split("//", 1)[1]:
        raise refuse(f"--ft_lighthouse {url}: not an address http://HOST:PORT")
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=timeout) as reply:
            reply.read(1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise refuse(
            f"--ft_lighthouse {url}: no answer within --ft_connect_timeout {timeout:g}s ({reason}); start it first: "
            "torchft_lighthouse --min_replicas 1 --bind [::]:PORT (scripts/ft_launch.py starts one)"
        ) from None
