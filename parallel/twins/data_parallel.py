"""PyTorch's data-parallel wrappers as our DDP's and sharding engine's twins: `DistributedDataParallel`
(+ `ZeroRedundancyOptimizer` for zero1) and FSDP2's `fully_shard` (HSDP on a 2D mesh), with the adapters that
make them answer parallel/protocol.py (ours: parallel/data_parallel/ddp.py, parallel/data_parallel/fsdp.py)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallel.comm import local
from parallel.mesh import Mesh
from parallel.pipeline.runner import PipelineStage
from parallel.protocol import Accumulating, Buffers, Params, Placement, Replicated
from runtime.blocks import blocks_by_index


class TorchFSDP2(Replicated):
    """FSDP2's parameters are DTensors sharded over the fsdp dims: norms and entries read their placements.
    FSDP2 leaves the root unsharded after a no_grad forward (an eval), while the optimizer holds the sharded
    parameters: reshard before listing checkpoint entries."""

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer):
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return super().checkpoint_parts(optimizer)

    def parameter_tensors(self):
        """(fixed, moving): nothing stays put; fully_shard swaps every parameter for its unsharded copy around
        each use (the entries of the modules' _parameters), so each is read afresh."""
        slots = [(m._parameters, n) for m in self.model.modules() for n, p in m._parameters.items() if p is not None]
        return [], lambda: [d[n] for d, n in slots]


class TorchZeRO1(Replicated):
    """torch DDP plus ZeroRedundancyOptimizer over the loss group: each replica keeps the AdamW state of its
    partition of the parameters; after the step it broadcasts its partition's new values to the others.
    Without a pipeline micro-steps before the last run in DDP's no_sync (`accumulate`); under one, each chunk's
    DDP is synced by torch's PipelineStage."""

    def __init__(
        self,
        model: nn.Module,
        at: Placement,
        groups: dict,
        group,
        sharded_as: dict | None = None,
        accumulate: bool = True,
    ):
        super().__init__(model, at, groups, sharded_as)
        self.group, self.accumulate = group, accumulate

    def grad_sync(self, last_micro_step: bool):
        return self.model.no_sync() if self.accumulate and not last_micro_step else contextlib.nullcontext()

    def make_optimizer(self, weight_decay: float, **adamw) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            self.param_groups(weight_decay), torch.optim.AdamW, process_group=self.group, **adamw
        )

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim  # the local AdamW: its step count, hyperparameters and this rank's moments

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer):
        """Each parameter's owner writes it with its moments (the replicas' values are equal)."""
        owner, a = optimizer._param_to_rank, self.at
        return [
            Params(
                list(self.model.named_parameters()),
                optimizer.optim,
                0,
                self.sharded_as,
                a.tp_rank,
                owns=lambda p: owner[p] == a.replica_rank,
            ),
            Buffers(self.model, a.replica_rank, a.tp_rank),
        ]


def apply_fsdp(model, mesh: Mesh, cfg, device: torch.device) -> nn.Module:
    """FSDP2: each Block one unit, the root (embeddings, ln_f) another, as ours. zero2: the same with
    reshard_after_forward=False (parameters stay gathered from forward to backward). HSDP: on the 2D
    (dp_replicate, fsdp) mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    if mesh["dp_replicate"].enabled:
        dp_mesh = mesh.device_mesh("dp_replicate", "dp_shard")
    else:
        dp_mesh = mesh["loss"].device_mesh
    kw = {"mesh": dp_mesh, "mp_policy": mp, "reshard_after_forward": cfg.dp_type != "zero2"}
    for _, block in blocks_by_index(model):
        fully_shard(block, **kw)
    for root in getattr(model, "chunk_modules", {}).values() or [model]:  # a pipeline stage: each chunk
        fully_shard(root, **kw)
    return model


def apply_ddp(model: nn.Module, mesh: Mesh, cfg, device: torch.device) -> nn.Module:
    """torch DDP over the loss group (dp x cp). Under a pipeline each chunk module is its own DDP, which
    torch's PipelineStage syncs on the last backward; otherwise micro-steps before the last run in no_sync.
    zero1: DDP plus ZeroRedundancyOptimizer (TorchZeRO1, `protocol`). The TP parameters torch DDP sees as
    plain local shards stay known as DTensors, for checkpoints: `wrapped.tp_dtensors`."""
    from torch.nn.parallel import DistributedDataParallel

    stage = isinstance(model, PipelineStage)  # the chunk modules run, not the stage: they carry the hooks
    sharded_as = localize_tp_params(model, list(model.chunk_modules.values()) if stage else None)
    kw = {"process_group": mesh["loss"].group, "device_ids": [device.index] if device.type == "cuda" else None}
    if stage:
        model.chunk_modules = {c: DistributedDataParallel(m, **kw) for c, m in model.chunk_modules.items()}
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, **kw)
    wrapped.tp_dtensors = sharded_as
    return wrapped


def protocol(model: nn.Module, mesh: Mesh, cfg, at: Placement, groups: dict):
    """The protocol adapter (parallel/protocol.py) of what the steps above made, once its parameters are final:
    FSDP2's `TorchFSDP2`; torch DDP's `TorchZeRO1` (zero1), `Replicated` (under a pipeline: torch's PipelineStage
    syncs it) or `Accumulating` (no_sync before the last micro-step), checkpoint writers loss rank 0; none:
    `Replicated`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return TorchFSDP2(model, at, groups)
    stage = isinstance(model, PipelineStage)
    if not (
        isinstance(model, DistributedDataParallel)
        or stage
        and any(isinstance(m, DistributedDataParallel) for m in model.chunk_modules.values())
    ):
        return Replicated(model, at, groups)
    loss = mesh["loss"]
    at, sharded_as = dataclasses.replace(at, replica_rank=loss.rank), model.tp_dtensors
    if cfg.dp_type == "zero1":
        return TorchZeRO1(model, at, groups, loss.group, sharded_as, accumulate=not stage)
    return (Replicated if stage else Accumulating)(model, at, groups, sharded_as)


def localize_tp_params(model: nn.Module, run_by: list[nn.Module] | None = None) -> dict[str, DTensor]:
    """Let torch DDP (which knows nothing of DTensor) all-reduce the local shards of TP parameters.

    Each DTensor parameter is replaced by a plain Parameter holding its local shard (tied weights
    stay one Parameter); a forward pre-hook swaps in DTensor views of those Parameters and a forward
    hook swaps the same Parameter objects back, so DDP's gradient hooks stay attached to them.
    (torch's `_pre_dp_module_transform` does this too, but re-creates the Parameters after every
    forward, which detaches them from DDP's hooks, and it unties the embedding from lm_head.)
    Returns {name: DTensor} as they were (empty when there are none), for checkpoint entries.
    `run_by`: the modules whose forward runs the model (default: the model itself; a pipeline stage's chunk
    modules) carry the hooks.
    """
    dtensors = {n: p for n, p in model.named_parameters() if isinstance(p, DTensor)}
    locals_: dict[int, tuple[nn.Parameter, object]] = {}
    users: list[tuple[nn.Module, str, int]] = []
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in locals_:
                    locals_[id(p)] = (nn.Parameter(local(p).detach()), p._spec)
                users.append((module, attr, id(p)))
                module._parameters[attr] = locals_[id(p)][0]

    def to_dtensor(*_):
        views = {
            k: DTensor.from_local(t, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
            for k, (t, spec) in locals_.items()
        }
        for module, attr, k in users:
            del module._parameters[attr]
            setattr(module, attr, views[k])

    def to_local(*_):
        for module, attr, k in users:
            delattr(module, attr)
            module._parameters[attr] = locals_[k][0]

    if dtensors:
        for m in run_by or [model]:
            m.register_forward_pre_hook(to_dtensor)
            m.register_forward_hook(to_local)
    return dtensors
