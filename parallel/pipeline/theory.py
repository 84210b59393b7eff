"""The pipeline's formulas: the activations and input gradients each rank sends per step, in closed form, and its
terms of the planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank). None of it runs in a
training step; tests/test_pipeline.py and test_plan_runs.py hold it equal to measured runs. (Its bubble,
plan/theory.bubble_fraction, is the planner's: the V schedules' comes from its simulator, plan/timeline.py.)

    pipeline            p2p_bytes_per_step, p2p_calls_per_step
"""

from __future__ import annotations

from parallel.data_parallel.flat_param import ZERO_STAGES, shard_numel
from parallel.pipeline.schedule import V_SCHEDULES, chunk_of, rank_of
from runtime.registry import Group, Terms


def p2p_bytes_per_step(
    pp: int, virtual: int, rank: int, micro: int, shape: tuple[int, ...], element_size: int = 4, v_shape: bool = False
) -> int:
    """Bytes rank `rank` sends per step (theory): every local chunk whose next chunk is on another rank sends
    each micro-batch's activation forward, every local chunk whose previous one is sends its input gradient
    backward (none between the V's chunks P-1 and P, both on rank P-1)."""
    n = 1
    for s in shape:
        n *= s
    return p2p_calls_per_step(pp, virtual, rank, micro, v_shape) * n * element_size


def p2p_calls_per_step(pp: int, virtual: int, rank: int, micro: int, v_shape: bool = False) -> int:
    """The messages (one `comm.send` each) rank `rank` sends per step, `p2p_bytes_per_step`'s: per micro-batch,
    one per local chunk whose next chunk is on another rank and one per local chunk whose previous one is."""
    if pp == 1:
        return 0
    C = pp * virtual
    chunks = [chunk_of(rank, v, pp, v_shape) for v in range(virtual)]
    messages = sum(c < C - 1 and rank_of(c + 1, pp, v_shape) != rank for c in chunks) + sum(
        c > 0 and rank_of(c - 1, pp, v_shape) != rank for c in chunks
    )
    return messages * micro


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "pp": the activations and input gradients (`p2p_bytes_per_step`, in the residual dtype, 1/tp of each
    under SP) and the tied embedding's gradient, all-reduced over [first, last] (no group when one rank holds both
    ends, the V layouts): this rank's tp shard in fp32, or under a sharding engine its 1/S of the tied unit."""
    d, a, c = s.dims, s.args, s.config
    if not d.pp_enabled:
        return
    _, first, last = s.stage_blocks(pp_rank)
    V, v_shape = a.pp_virtual_stages or 1, a.pp_schedule in V_SCHEDULES
    shape = (a.micro_batch_size, a.seq_len // d.cp // (d.tp if a.sequence_parallel else 1), c.n_embd)
    tied = c.vocab_size // d.tp * c.n_embd
    tied = shard_numel(tied, d.dp_shard * d.cp) if s.dp_type in ZERO_STAGES else tied
    out["pp"] = {
        "p2p": p2p_bytes_per_step(d.pp, V, pp_rank, s.grad_accum, shape, s.residual_bytes, v_shape=v_shape),
        "all_reduce": 4 * tied if (first or last) and not v_shape else 0,
    }


def calls(s, pp_rank: int, out: dict) -> None:
    d, a = s.dims, s.args
    if not d.pp_enabled:
        return
    _, first, last = s.stage_blocks(pp_rank)
    v_shape = a.pp_schedule in V_SCHEDULES
    out["pp"] = {
        "p2p": p2p_calls_per_step(d.pp, a.pp_virtual_stages or 1, pp_rank, s.grad_accum, v_shape),
        "all_reduce": int((first or last) and not v_shape),
    }


def groups(s) -> dict[str, Group]:
    """Each p2p message between two neighbouring stages; the tied embedding's all-reduce between two ranks."""
    return {"pp": Group(2, ("pp",))}


TERMS = Terms(comm=comm, calls=calls, groups=groups)
