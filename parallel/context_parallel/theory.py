"""Context parallelism's formulas: the ring's messages per micro-step, in closed form, and its terms of the
planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank). None of it runs in a training step;
tests/test_context_parallel.py and test_plan_runs.py hold it equal to measured runs.

    context parallel    cp_p2p_bytes_per_micro_step, cp_p2p_calls_per_micro_step
"""

from __future__ import annotations

from runtime.registry import Group, Terms


def cp_p2p_bytes_per_micro_step(
    n_layer: int, B: int, T: int, n_embd: int, cp: int, tp: int = 1, element_size: int = 4, recomputed_blocks: int = 0
) -> int:
    """What parallel/comm.COUNTER records as "p2p" on one rank for one forward + backward: per attention, with
    A = B·(T/C)·(n_embd/tp) elements (one k or v block: all of this rank's heads), forward sends 2(C-1)·A
    (k and v, C-1 moves; fully masked blocks still travel, only their compute is skipped) and backward
    2(C-1)·A (k, v) + 2(C-1)·A (dK, dV, C-1 moves) + 2·A (dK, dV home). k and v travel in `element_size` (the
    compute dtype's), dK and dV in fp32 (the ring sums them in fp32: context_parallel._RingAttention._backward).
    Activation checkpointing re-runs the forward of each recomputed Block. Nothing with one cp rank."""
    if cp == 1:
        return 0
    A = B * (T // cp) * (n_embd // tp)
    per_layer_fwd = 2 * (cp - 1) * A * element_size
    per_layer_bwd = 2 * (cp - 1) * A * element_size + (2 * (cp - 1) + 2) * A * 4
    return n_layer * (per_layer_fwd + per_layer_bwd) + recomputed_blocks * per_layer_fwd


def cp_p2p_calls_per_micro_step(n_layer: int, cp: int, recomputed_blocks: int = 0) -> int:
    """The messages behind `cp_p2p_bytes_per_micro_step`: `_exchange` sends each tensor (a k, v, dK or dV block
    of A elements) on its own, so one call per A: 2(C-1) forward and 4(C-1) + 2 backward per attention, and
    2(C-1) more per recomputed Block. Nothing with one cp rank."""
    if cp == 1:
        return 0
    return n_layer * (6 * (cp - 1) + 2) + recomputed_blocks * 2 * (cp - 1)


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "cp": the ring's k, v, dK and dV blocks of the stage's Blocks, per step (zero without CP)."""
    d, a = s.dims, s.args
    blocks = s.stage_blocks(pp_rank)[0]
    per_micro = cp_p2p_bytes_per_micro_step(
        len(blocks), a.micro_batch_size, a.seq_len, s.config.n_embd, d.cp, d.tp, s.compute_bytes, s.recomputed(blocks)
    )
    out["cp"] = {"p2p": s.grad_accum * per_micro}


def calls(s, pp_rank: int, out: dict) -> None:
    blocks = s.stage_blocks(pp_rank)[0]
    out["cp"] = {"p2p": s.grad_accum * cp_p2p_calls_per_micro_step(len(blocks), s.dims.cp, s.recomputed(blocks))}


def groups(s) -> dict[str, Group]:
    """The ring is not overlapped with its own block's kernel here: on the critical path."""
    return {"cp": Group(s.dims.cp, ("cp",))}


TERMS = Terms(comm=comm, calls=calls, groups=groups)
