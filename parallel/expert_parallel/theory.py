"""Expert parallelism's formulas: the MoE layers' all_to_alls per rank, in closed form, and its terms of the
planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank). None of it runs in a training step;
tests/test_expert_parallel.py and test_plan_runs.py hold it equal to measured runs.

    expert parallel     ep_all_to_all_bytes_per_micro_step, ep_all_to_all_calls_per_micro_step
"""

from __future__ import annotations

from runtime.registry import Group, Terms


def is_expert(name: str) -> bool:
    """Whether parameter `name` is one of an MoE layer's stacked experts (moe.Experts): what expert parallelism
    splits (E/ep experts per rank) and copies over the expert-data-parallel group."""
    return ".mlp.experts." in name


def ep_all_to_all_bytes_per_micro_step(
    tokens: int,
    k: int,
    n_embd: int,
    experts: int,
    moe_layers: int,
    ep: int = 2,
    dtype_bytes: int = 4,
    received: int | None = None,
    recomputed_layers: int = 0,
) -> int:
    """What parallel/comm.COUNTER records as "all_to_all" on one EP rank for one forward + backward of `tokens`
    tokens (its micro-batch's, B·T, or B·T/cp) through `moe_layers` MoE layers, k experts a token (each
    all_to_all counts this rank's input, parallel/comm.py):
    - the counts, E int64 (8E bytes), once per layer forward;
    - forward: its N·k assignment rows out (N·k·C·s), then the outputs of the rows its experts received back
      (R·C·s);
    - backward: the gradients of those two the other way round (R·C·s, then N·k·C·s);
    s = `dtype_bytes`, the compute dtype's (bf16 under bf16 autocast): the experts' outputs are in it, and the rows
    go in it too, cast before they are sent (moe.expert_rows: ln_2's output is fp32 under autocast, but the
    experts' first matmul casts it anyway, so the cast moves to the sender and the all_to_all carries half the
    bytes for the same values).
    R = `received`, the rows that reached this rank's experts. Summed over an EP group, Σ R = Σ N·k, so the
    group sends ep·(8E + 4·N·k·C·s) per layer; R = N·k exactly when the routing is balanced (the default).
    Activation checkpointing re-runs the forward of `recomputed_layers` layers (counts and both moves again).
    Nothing without EP."""
    if ep == 1:
        return 0
    R = tokens * k if received is None else received
    forward = 8 * experts + (tokens * k + R) * n_embd * dtype_bytes
    backward = (R + tokens * k) * n_embd * dtype_bytes
    return moe_layers * (forward + backward) + recomputed_layers * forward


def ep_all_to_all_calls_per_micro_step(moe_layers: int, ep: int = 2, recomputed_layers: int = 0) -> int:
    """The all_to_alls behind `ep_all_to_all_bytes_per_micro_step`: per MoE layer the counts and two moves
    forward, two moves backward; three more per recomputed layer. Nothing without EP."""
    return 0 if ep == 1 else 5 * moe_layers + 3 * recomputed_layers


def ep_all_to_all_bytes(s, pp_rank: int = 0) -> int:
    """`theory.ep_all_to_all_bytes_per_micro_step` of one micro-step on this stage: its MoE layers, each on the
    rank's B·T/cp tokens (under TP every rank runs the layer whole, on the whole sequence), under balanced routing
    (the rows this rank's experts receive, R, = the N·k it sends: the formula's default; a skewed router moves
    R·C·2 element bytes per layer away from it, the one thing here that depends on the data), its recomputed
    layers again under AC. Rows and outputs both go in the compute dtype (moe.expert_rows casts the rows before
    they are sent)."""
    d, a, c = s.dims, s.args, s.config
    moe = s.moe_blocks(pp_rank)
    N = a.micro_batch_size * a.seq_len // d.cp
    return ep_all_to_all_bytes_per_micro_step(
        N,
        c.moe_top_k,
        c.n_embd,
        c.moe_num_experts,
        len(moe),
        d.ep,
        s.compute_bytes,
        recomputed_layers=s.recomputed(moe),
    )


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "ep": the MoE layers' all_to_alls over the ep ranks, per step (`ep_all_to_all_bytes` per micro-step)."""
    if s.dims.ep > 1:
        out["ep"] = {"all_to_all": s.grad_accum * ep_all_to_all_bytes(s, pp_rank)}


def calls(s, pp_rank: int, out: dict) -> None:
    d = s.dims
    if d.ep > 1:
        moe = s.moe_blocks(pp_rank)
        out["ep"] = {"all_to_all": s.grad_accum * ep_all_to_all_calls_per_micro_step(len(moe), d.ep, s.recomputed(moe))}


def groups(s) -> dict[str, Group]:
    """The ep ranks are made of the batch ranks (dp x cp): inside a node where those are. Between the router and
    the experts: on the critical path."""
    return {"ep": Group(s.dims.ep, ("dp_replicate", "dp_shard", "cp"))}


TERMS = Terms(comm=comm, calls=calls, groups=groups)
