"""DTensor tensor parallelism as our TP's twin: `parallelize_module` with the same sharding as TP_PLAN
(ours: parallel/tensor_parallel/apply.py)."""

from __future__ import annotations

import contextlib

import torch

from model.gpt import GPT
from parallel.mesh import Mesh
from parallel.pipeline.runner import PipelineStage
from parallel.protocol import Cut
from runtime.blocks import blocks_by_index


def pytorch_tp_plan(model: GPT, loss_parallel: bool, sequence_parallel: bool) -> dict:
    """Module name -> DTensor ParallelStyle for `parallelize_module`, the same sharding as TP_PLAN (as in
    torchtitan). Re-tie lm_head.weight to transformer.wte.weight after parallelize_module.

    Under SP the residual stream stays a DTensor sharded on T (Shard(1)): LayerNorms are SequenceParallel,
    attn and mlp all-gather their input (PrepareModuleInput), the row-parallel layers reduce-scatter, and
    the position embeddings are re-laid out as Shard(0) over T to line up with it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=act, use_local_output=not sp)}
    if sp:
        plan["transformer.wpe"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False
        )
    for i, _ in blocks_by_index(model):  # a GPT's Blocks, or a pipeline stage's (keyed by global index)
        p = f"transformer.h.{i}"
        plan.update(
            {
                f"{p}.attn.c_q": ColwiseParallel(),
                f"{p}.attn.c_k": ColwiseParallel(),
                f"{p}.attn.c_v": ColwiseParallel(),
                f"{p}.attn.c_proj": RowwiseParallel(output_layouts=act, use_local_output=not sp),
                f"{p}.mlp.c_fc": ColwiseParallel(),
                f"{p}.mlp.c_proj": RowwiseParallel(output_layouts=act, use_local_output=not sp),
            }
        )
        if sp:
            plan.update(
                {
                    f"{p}.ln_1": SequenceParallel(),
                    f"{p}.ln_2": SequenceParallel(),
                    f"{p}.attn": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
                    f"{p}.mlp": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
                }
            )
    if sp:
        plan["transformer.ln_f"] = SequenceParallel()
    plan["lm_head"] = ColwiseParallel(
        input_layouts=act,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    present = {name for name, _ in model.named_modules()}  # a pipeline stage holds only some of them
    return {name: style for name, style in plan.items() if name in present}


def apply_tp(model, mesh: Mesh, cfg, device: torch.device) -> Cut:
    """DTensor TP with the same sharding as ours (`pytorch_tp_plan`, torchtitan-style). DTensor loss parallel
    needs its context around each micro-step's forward and backward."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"].device_mesh, pytorch_tp_plan(model, cfg.loss_parallel, cfg.sequence_parallel))
    if not isinstance(model, PipelineStage):  # a stage's lm_head is a copy of wte, not tied to it
        model.lm_head.weight = model.transformer.wte.weight  # both Shard(0) over vocab: re-tie after the swap
    return Cut(model, context=loss_parallel_around if cfg.loss_parallel else None)


@contextlib.contextmanager
def loss_parallel_around(x: torch.Tensor, y: torch.Tensor):
    """DTensor's loss_parallel context around one micro-step, yielding its (x, y) as they are."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield x, y
