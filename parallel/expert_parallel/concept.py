"""Expert parallelism (each MoE layer's experts split over the batch ranks, tokens sent by all_to_all),
registered: its flag, its checks and its planner terms (theory.py). The MoE model it parallelizes registers
beside it (moe_concept.py). docs/moe.md. The dispatch never imports this module."""

from __future__ import annotations

from parallel.expert_parallel import theory
from runtime.registry import AT_LEAST_ONE, Checking, Concept, UsageError, register


def flags(a) -> None:
    a(
        "--expert_parallel_size",
        type=int,
        default=1,
        metavar="N",
        help="split each MoE layer's experts over N of the dp x cp ranks; tokens reach them by all_to_all",
    )


def check_experts(c: Checking) -> None:
    """An MoE model whose experts split evenly, and our wrapper (torch 2.13 has none)."""
    E, N = c.config.moe_num_experts, c.dims.ep
    if E == 0:
        if N > 1:
            raise UsageError(f"--expert_parallel_size {N} needs an MoE model: pass --moe_num_experts")
        return
    if E % N:
        raise UsageError(
            f"--moe_num_experts {E} is not divisible by --expert_parallel_size {N}: every EP rank "
            f"holds the same number of experts"
        )
    if N > 1 and c.args.implementation == "pytorch":
        raise UsageError(
            "--implementation pytorch has no expert-parallel wrapper in torch 2.13: use "
            "--implementation custom with --expert_parallel_size"
        )


CONCEPT = register(
    Concept(
        name="expert_parallel",
        title="expert parallelism (docs/moe.md)",
        flags=flags,
        mesh=lambda args: {"ep": args.expert_parallel_size},
        ranges={"expert_parallel_size": AT_LEAST_ONE},
        checks=(("batch", check_experts),),
        terms=theory.TERMS,
    )
)
