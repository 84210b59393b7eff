"""Tensor parallelism's formulas: what each rank stores and sends per micro-step, in closed form, and its terms of
the planner's prediction (`TERMS`, over plan/counts.Setup's view of one rank). None of it runs in a training step;
tests/test_tp.py and test_plan_runs.py hold it equal to measured runs.

    tensor parallel     tp_local_shape, tp_comm_bytes_per_micro_step, tp_comm_calls_per_micro_step
"""

from __future__ import annotations

from model.gpt import GPTConfig
from parallel.tensor_parallel.apply import SHARD_DIMS, plan_style
from runtime.registry import Group, Terms


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one tp rank stores of parameter `name` (full `shape`): 1/tp along its style's SHARD_DIMS dim."""
    module, _, attr = name.rpartition(".")
    dim = SHARD_DIMS.get(plan_style(module) or "", {}).get(attr)
    if dim is None or tp == 1:
        return tuple(shape)
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def tp_comm_bytes_per_micro_step(
    config: GPTConfig,
    B: int,
    T: int,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool,
    dtype_bytes: int = 4,
    residual_bytes: int | None = None,
    recomputed_blocks: int = 0,
    blocks: int | None = None,
    first: bool = True,
    last: bool = True,
    moe_blocks: int = 0,
) -> dict[str, int]:
    """Bytes parallel/comm.COUNTER records on one rank for one forward + backward, by kind.

    dtype_bytes: element size of matmul outputs (the compute dtype). residual_bytes: that of the residual stream,
    embeddings, LayerNorm outputs and weights' compute copies (fp32 under autocast, a sharding engine's param_dtype).
    With A(b) = B*T*C*b, one activation:
    - the region's 2L+1 entries (ln_1, ln_2 of each block, ln_f): f's backward all-reduce of A(residual),
      or under SP an all-gather forward and a reduce-scatter backward of A(residual) each;
    - its 2L exits (attn.c_proj, mlp.c_proj): g's forward all-reduce of A(dtype), or under SP a
      reduce-scatter forward and an all-gather backward each; the embedding's exit likewise, of A(residual);
    - under SP also the position embeddings' backward all-gather (T*C) and the all-reduce of the gradients of
      the replicated parameters that saw only T/p positions (LayerNorms, row-parallel biases), of residual_bytes;
    - the loss: with loss parallelism 3 fp32 numbers per token (max; target logit and sum-exp), else the
      all-gather of lm_head's whole (V, C) weight, in the compute dtype (VocabShard);
    - activation checkpointing of `recomputed_blocks` Blocks: backward re-runs each one's forward up to the
      last tensor it saves (mlp.c_proj's input; non-reentrant checkpointing stops there), so its forward
      collectives run again except mlp.c_proj's exit: under SP 2 all-gathers of A(residual) (ln_1, ln_2
      entries) and 1 reduce-scatter of A(dtype) (attn.c_proj), else 1 all-reduce of A(dtype).
    - a pipeline stage (`blocks` of the Blocks; `first`: it holds the embeddings, `last`: ln_f and the loss):
      each module it runs costs what it costs in the whole model, and the others nothing (default: the whole
      model, L Blocks, first and last).
    - `moe_blocks` of those Blocks MoE layers (tensor_parallel._moe: replicated, run whole): their ln_2 is no
      entry and the layer no exit, so without SP neither all-reduce; under SP the layer all-gathers its input
      forward (A(residual)) and its output's gradient backward (A(dtype)), the entry's and exit's all-gathers, but
      reduce-scatters neither, and has no row-parallel c_proj bias to all-reduce (ln_2's weight and bias, which
      still see T/p positions, are).
    """
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if tp == 1:
        return out
    residual_bytes = dtype_bytes if residual_bytes is None else residual_bytes
    C, N, E = config.n_embd, B * T, moe_blocks
    L = config.n_layer if blocks is None else blocks
    norms = 2 * L + last  # ln_1, ln_2 of each Block, and ln_f
    entries = (norms - E) * N * C * residual_bytes
    exits = (2 * L - E) * N * C * dtype_bytes + first * N * C * residual_bytes
    if sequence_parallel:
        moe = E * N * C * (residual_bytes + dtype_bytes)  # the MoE layers' own all-gathers, forward and backward
        out["all_gather"] += entries + exits + moe + first * T * C * residual_bytes
        out["reduce_scatter"] += entries + exits
        n_bias = 1 if config.bias else 0
        out["all_reduce"] += (norms * (1 + n_bias) * C + (2 * L - E) * n_bias * C) * residual_bytes
    else:
        out["all_reduce"] += entries + exits
    if sequence_parallel:
        out["all_gather"] += recomputed_blocks * 2 * N * C * residual_bytes
        out["reduce_scatter"] += recomputed_blocks * N * C * dtype_bytes
    else:
        out["all_reduce"] += recomputed_blocks * N * C * dtype_bytes
    if not last:
        return out
    if loss_parallel:
        out["all_reduce"] += 3 * N * 4
    else:
        out["all_gather"] += config.vocab_size * C * dtype_bytes
    return out


def tp_comm_calls_per_micro_step(
    config: GPTConfig,
    B: int,
    T: int,
    tp: int,
    loss_parallel: bool,
    sequence_parallel: bool,
    recomputed_blocks: int = 0,
    blocks: int | None = None,
    first: bool = True,
    last: bool = True,
    moe_blocks: int = 0,
) -> dict[str, int]:
    """The calls behind `tp_comm_bytes_per_micro_step` (its arguments, less the element sizes): one per f or g
    and per SP all-gather or reduce-scatter (each moves one activation), so the 2L + last entries and 2L + first
    exits are a call each way; under SP the position embeddings' backward all-gather (first) and one all-reduce
    per replicated parameter that saw T/p positions (each LayerNorm's weight and bias, each row-parallel bias);
    a recomputed Block 2 all-gathers and 1 reduce-scatter (SP), else 1 all-reduce; the loss, whatever its number
    of row chunks, 2 all-reduces (max; target logit and sum-exp, each for all rows at once) with loss parallelism,
    else 1 all-gather of lm_head's weight. An MoE Block (`moe_blocks` of them) has one entry and one exit fewer,
    and under SP gathers its input and its output's gradient itself (2 all-gathers) and has no c_proj bias to
    all-reduce."""
    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if tp == 1:
        return out
    L, E = (config.n_layer if blocks is None else blocks), moe_blocks
    entries, exits = 2 * L + last - E, 2 * L + first - E
    if sequence_parallel:
        n_bias = 1 if config.bias else 0
        out["all_gather"] += entries + exits + 2 * E + first + 2 * recomputed_blocks
        out["reduce_scatter"] += entries + exits + recomputed_blocks
        out["all_reduce"] += (entries + E) * (1 + n_bias) + (2 * L - E) * n_bias
    else:
        out["all_reduce"] += entries + exits + recomputed_blocks
    if last:
        out["all_reduce" if loss_parallel else "all_gather"] += 2 if loss_parallel else 1
    return out


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "tp": `tp_comm_bytes_per_micro_step` of the stage's Blocks and ends, per step (zero without TP)."""
    d, a = s.dims, s.args
    blocks, first, last = s.stage_blocks(pp_rank)
    per_micro = tp_comm_bytes_per_micro_step(
        s.config,
        a.micro_batch_size,
        a.seq_len // d.cp,
        d.tp,
        a.enable_loss_parallelism,
        a.sequence_parallel,
        s.compute_bytes,
        s.residual_bytes,
        s.recomputed(blocks),
        len(blocks),
        first,
        last,
        len(s.moe_blocks(pp_rank)),
    )
    out["tp"] = {k: v * s.grad_accum for k, v in per_micro.items()}


def calls(s, pp_rank: int, out: dict) -> None:
    d, a = s.dims, s.args
    blocks, first, last = s.stage_blocks(pp_rank)
    per_micro = tp_comm_calls_per_micro_step(
        s.config,
        a.micro_batch_size,
        a.seq_len // d.cp,
        d.tp,
        a.enable_loss_parallelism,
        a.sequence_parallel,
        s.recomputed(blocks),
        len(blocks),
        first,
        last,
        len(s.moe_blocks(pp_rank)),
    )
    out["tp"] = {k: v * s.grad_accum for k, v in per_micro.items()}


def groups(s) -> dict[str, Group]:
    """TP's collectives sit between matmuls: on the critical path."""
    return {"tp": Group(s.dims.tp, ("tp",))}


TERMS = Terms(comm=comm, calls=calls, groups=groups)
