"""Context parallelism's formulas: the ring's messages and Ulysses's all-to-alls per micro-step, in closed form,
and their terms of the planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank, by the layout's
--cp_algorithm). None of it runs in a training step; tests/test_context_parallel.py, test_context_parallel_train.py,
test_ulysses.py and test_plan_runs.py hold it equal to measured runs.

    ring                cp_p2p_bytes_per_micro_step, cp_p2p_calls_per_micro_step
    Ulysses             ulysses_all_to_all_bytes_per_micro_step, ulysses_all_to_all_calls_per_micro_step
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


def ulysses_all_to_all_bytes_per_micro_step(
    n_layer: int, B: int, T: int, n_embd: int, cp: int, tp: int = 1, element_size: int = 4, recomputed_blocks: int = 0
) -> int:
    """What parallel/comm.COUNTER records as "all_to_all" on one rank for one forward + backward of Ulysses
    (parallel/context_parallel/ulysses.py). COUNTER counts an all-to-all as its whole input, this rank's own
    split included. Per attention, one all-to-all per tensor, each tensor all of this rank's heads (n_embd / tp
    wide) for its T/C tokens, or its head group for all T tokens: A = B·(T/C)·(n_embd/tp) elements either way.
    Forward: q, k, v to heads (3·A) and the output back to tokens (A); backward, each the inverse of a forward
    one: the output's gradient to heads (A), dq, dk, dv back to tokens (3·A). So 8·A per layer, in the compute
    dtype (`element_size`: autocast's q, k, v and SDPA's output and gradients are bf16 under bf16; nothing is
    summed, so nothing travels in fp32 as the ring's dK, dV do). Activation checkpointing re-runs the forward
    of each recomputed Block: 4·A more. Of it (C-1)/C leaves the rank. Nothing with one cp rank."""
    if cp == 1:
        return 0
    A = B * (T // cp) * (n_embd // tp)
    return (8 * n_layer + 4 * recomputed_blocks) * A * element_size


def ulysses_all_to_all_calls_per_micro_step(n_layer: int, cp: int, recomputed_blocks: int = 0) -> int:
    """The all-to-alls behind `ulysses_all_to_all_bytes_per_micro_step`: 4 forward and 4 backward per attention,
    4 more per recomputed Block. Nothing with one cp rank."""
    return 0 if cp == 1 else 8 * n_layer + 4 * recomputed_blocks


def ulysses(s) -> bool:
    """Whether the layout runs Ulysses (--cp_algorithm) rather than the ring."""
    return s.args.cp_algorithm == "ulysses"


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "cp", per step (zero without CP): the ring's k, v, dK and dV blocks of the stage's Blocks, or
    Ulysses's all-to-alls of q, k, v and the output (and their gradients)."""
    d, a = s.dims, s.args
    blocks = s.stage_blocks(pp_rank)[0]
    sizes = (len(blocks), a.micro_batch_size, a.seq_len, s.config.n_embd, d.cp, d.tp, s.compute_bytes)
    if ulysses(s):
        out["cp"] = {"all_to_all": s.grad_accum * ulysses_all_to_all_bytes_per_micro_step(*sizes, s.recomputed(blocks))}
        return
    out["cp"] = {"p2p": s.grad_accum * cp_p2p_bytes_per_micro_step(*sizes, s.recomputed(blocks))}


def calls(s, pp_rank: int, out: dict) -> None:
    blocks = s.stage_blocks(pp_rank)[0]
    if ulysses(s):
        per_micro = ulysses_all_to_all_calls_per_micro_step(len(blocks), s.dims.cp, s.recomputed(blocks))
        out["cp"] = {"all_to_all": s.grad_accum * per_micro}
        return
    out["cp"] = {"p2p": s.grad_accum * cp_p2p_calls_per_micro_step(len(blocks), s.dims.cp, s.recomputed(blocks))}


def groups(s) -> dict[str, Group]:
    """Neither the ring nor Ulysses is overlapped with compute here: on the critical path (Ulysses cannot be:
    attention needs all of q, k, v, and c_proj the whole output)."""
    return {"cp": Group(s.dims.cp, ("cp",))}


TERMS = Terms(comm=comm, calls=calls, groups=groups)
