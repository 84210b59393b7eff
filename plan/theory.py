"""The formula sheet's index: what every layout stores, sends and holds, per rank, in closed form. Each concept's
formulas sit beside its code, with their derivations (each concept's theory.py, which its concept.py registers as
the planner's terms, and the runtime never imports); this module gathers their names for the planner, train.py
and the tests, and keeps the one formula that needs the planner's own simulator: `bubble_fraction`.

Each formula is written in the sizes parallel/comm.py counts (payload bytes per kind and calls: all_reduce the
tensor, all_gather the gathered output, reduce_scatter the full input, p2p each message once, by its sender). None
of it runs in a training step: the planner (plan/predict.py) builds its predictions from them, train.py logs them
beside what the wrappers measured, and the tests hold each one equal to a measured run (tests/test_ddp.py,
test_zero.py, test_tp.py, test_context_parallel.py, test_pipeline.py, test_plan_runs.py). Backend overheads (a
ring's 2(N-1)/N, gloo emulating reduce-scatter with an all-reduce) are properties of the transport, not of the
algorithm, and are left out.

    data parallel       parallel/data_parallel/theory.py: ddp_comm_bytes_per_step, ddp_comm_calls_per_step
    ZeRO 1-3 / FSDP     parallel/data_parallel/theory.py: zero_comm_bytes_per_step, zero_comm_calls_per_step,
                        fsdp_comm_bytes_per_micro_step, fsdp_unit_state_bytes (the ZeRO ladder of state), and under
                        a pipeline zero_comm_bytes_per_pipeline_step, pipelined_root_gathers; the backward's held
                        gradients reduce_held_bytes, reduce_accumulated_held_bytes
    tensor parallel     parallel/tensor_parallel/theory.py: tp_comm_bytes_per_micro_step, tp_comm_calls_per_micro_step
    context parallel    parallel/context_parallel/theory.py: cp_p2p_bytes_per_micro_step, cp_p2p_calls_per_micro_step
                        (the ring), ulysses_all_to_all_bytes_per_micro_step, ulysses_all_to_all_calls_per_micro_step
    expert parallel     parallel/expert_parallel/theory.py: ep_all_to_all_bytes_per_micro_step,
                        ep_all_to_all_calls_per_micro_step
    pipeline            parallel/pipeline/theory.py: p2p_bytes_per_step, p2p_calls_per_step; here bubble_fraction
                        (the simulator behind the V schedules' and the p2p models' proofs: plan/timeline.py)
    the optimizer       optim/theory.py (its exchange, owners, state and FLOPs)
"""

from __future__ import annotations

from parallel.context_parallel.theory import (
    cp_p2p_bytes_per_micro_step,
    cp_p2p_calls_per_micro_step,
    ulysses_all_to_all_bytes_per_micro_step,
    ulysses_all_to_all_calls_per_micro_step,
)
from parallel.data_parallel.theory import (
    ddp_comm_bytes_per_step,
    ddp_comm_calls_per_step,
    engine_comm_bytes_per_micro_step,
    fsdp_comm_bytes_per_micro_step,
    fsdp_unit_state_bytes,
    pipelined_root_gathers,
    reduce_accumulated_held_bytes,
    reduce_held_bytes,
    zero_comm_bytes_per_pipeline_step,
    zero_comm_bytes_per_step,
    zero_comm_calls_per_step,
)
from parallel.expert_parallel.theory import ep_all_to_all_bytes_per_micro_step, ep_all_to_all_calls_per_micro_step
from parallel.pipeline.schedule import ALL_SCHEDULES, V_SCHEDULES
from parallel.pipeline.theory import p2p_bytes_per_step, p2p_calls_per_step
from parallel.tensor_parallel.theory import tp_comm_bytes_per_micro_step, tp_comm_calls_per_micro_step

__all__ = [
    "bubble_fraction",
    "cp_p2p_bytes_per_micro_step",
    "cp_p2p_calls_per_micro_step",
    "ddp_comm_bytes_per_step",
    "ddp_comm_calls_per_step",
    "engine_comm_bytes_per_micro_step",
    "ep_all_to_all_bytes_per_micro_step",
    "ep_all_to_all_calls_per_micro_step",
    "fsdp_comm_bytes_per_micro_step",
    "fsdp_unit_state_bytes",
    "p2p_bytes_per_step",
    "p2p_calls_per_step",
    "pipelined_root_gathers",
    "reduce_accumulated_held_bytes",
    "reduce_held_bytes",
    "tp_comm_bytes_per_micro_step",
    "tp_comm_calls_per_micro_step",
    "ulysses_all_to_all_bytes_per_micro_step",
    "ulysses_all_to_all_calls_per_micro_step",
    "zero_comm_bytes_per_pipeline_step",
    "zero_comm_bytes_per_step",
    "zero_comm_calls_per_step",
]


def bubble_fraction(schedule_name: str, pp: int, micro: int, virtual: int = 1) -> float:
    """Idle share of the makespan, bubble / (ideal + bubble), when every chunk's F and B take fixed times.

    GPipe and 1F1B: the fill and drain cost (P-1)(t_f+t_b) against M(t_f+t_b) of work per rank, so
    (P-1)/(M+P-1). Interleaving with V chunks per rank divides the fill and drain by V (each chunk is 1/V
    of a stage): (P-1)/(V·M+P-1). Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", section 2.2, state the same bubbles as bubble / ideal time:
    (p-1)/m and (p-1)/(v·m); x/(1+x) of those gives ours.

    ZB-H1 (Qi et al. 2023, section 3.1): the backward split into B and W, t_F = t_B = t_W; its bubble is
    (P-1)(t_F + t_B - t_W) = P-1 units against M·3 units of work per rank, so (P-1)/(3M+P-1): 1F1B's
    3(P-1) units of fill and drain cut to a third.

    ZB-V and DualPipe-V: the simulator's ideal timeline of the list (each chunk's F = B = W = 1). For M >= 2P
    both take 6M + P - 1 units (tests/test_pipeline_schedule.py): every rank idles P-1 chunk-F units, the
    least any list can (the last rank's first F waits for micro-batch 0 to cross P-1 chunks), so
    (P-1)/(6M+P-1): in units of a whole stage (2 chunks) half of ZB-H1's. DualPipe-V's gain over ZB-V, F and B
    of two micro-batches overlapped on two streams, is outside this model (its overlapped pairs run in turn).
    """
    if schedule_name not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule_name!r}; known: {sorted(ALL_SCHEDULES)}")
    if schedule_name == "zb_h1":  # (P-1)(t_F + t_B - t_W) of idle against M(t_F + t_B + t_W) of work, all = 1
        return (pp - 1) / (3 * micro + pp - 1)
    if schedule_name in V_SCHEDULES:  # from the list itself: its ideal timeline (unit times, isends)
        from plan.timeline import simulate_schedule

        return simulate_schedule(
            ALL_SCHEDULES[schedule_name](pp, micro, 2), pp, 2, micro, p2p="async", v_shape=True
        ).bubble_fraction
    v = virtual if schedule_name == "interleaved_1f1b" else 1
    return (pp - 1) / (v * micro + pp - 1)
