"""Fault-tolerant replica groups (--ft_lighthouse, docs/fault-tolerance.md), registered: their flags and, once the
step's micro-steps are known, their checks (ft/flags.py: the ranges, what a group does not run, a lighthouse that
answers). ft/replicas.py and ft/heal.py never import this module."""

from __future__ import annotations

from ft import flags
from runtime.registry import Checking, Concept, UsageError, register


def check(c: Checking) -> None:
    flags.check(c.args, c.dims, c.micro, refuse=UsageError)  # sets args.resume: a group continues its job


register(
    Concept(
        name="ft",
        title="fault-tolerant replica groups (torchft)",
        flags=flags.add_flags,
        checks=(("batch", check),),
    )
)
