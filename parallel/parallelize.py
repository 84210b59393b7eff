"""The one composition point: `parallelize` wraps a GPT for a layout, always in this order,

    0. pipeline stage over mesh["pp"]               (keeps this pp rank's chunks; the rest is dropped)
       then context parallelism over mesh["cp"]     (ring attention, or torch's context_parallel around each
                                                     micro-step for "pytorch"; parameters stay replicated over cp)
    1. tensor parallelism over mesh["tp"]           (shards matmul weights; materialises its own shards)
       then activation checkpointing and torch.compile of each Block (parallel/blocks.py)
    2. FSDP / ZeRO-1/2 / HSDP over mesh["dp"]       (shards what is left; materialises one unit at a time)
    3. materialise whatever is still on meta        (deferred init: only the local slices of DTensors)
    4. DDP over mesh["dp"]                          (replicates: needs real values, broadcasts rank 0's)
    5. the pipeline runner over mesh["pp"]          (runs the schedule through whatever 1-4 made: ours, or
                                                     torch.distributed.pipelining's for "pytorch")

Each step is an `apply_*` function looked up in `APPLY` by (implementation, what): "custom" are ours
from this package, "pytorch" are PyTorch's own (DTensor `parallelize_module`, FSDP2 `fully_shard`,
`DistributedDataParallel`), on the same ("dp", "tp") mesh. An `apply_*` returns the wrapped model and
any keywords the resulting `Parallelized` needs; a new dimension or ZeRO stage is one more entry.

`Parallelized` is what the trainer sees: the model, and for every gradient the process groups it is
sharded over, which a correct global gradient norm needs (parallel/grads.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from model import GPT, init_parameter, param_groups
from parallel.comm import local
from parallel.fsdp import ZERO_STAGES, FullyShardedDataParallel
from parallel.blocks import apply_activation_checkpointing, apply_compile
from parallel.context_parallel import apply_context_parallel, apply_torch_context_parallel, torch_context_parallel
from parallel.grads import clip_grad_norm_
from parallel.pipeline import PipelineRunner, PipelineStage, TorchChunk, TorchPipelineRunner, embedding_group


@dataclass(frozen=True)
class ParallelConfig:
    """The validated layout settings (config.validate builds it from the flags)."""
    dp_type: str | None = None          # "ddp" | "zero1" | "zero2" | "fsdp" (ZeRO-3) | None (no data parallelism)
    dp_replicate: int = 1               # HSDP: replicas of each shard group (zero1, zero2, fsdp)
    implementation: str = "pytorch"     # "pytorch" | "custom"
    loss_parallel: bool = False
    sequence_parallel: bool = False
    deferred_init: bool = False
    seed: int = 1337
    param_dtype: torch.dtype | None = None   # FSDP: dtype of the gathered compute copies (None: fp32)
    reduce_dtype: torch.dtype = torch.float32  # FSDP: dtype gradients are reduce-scattered in
    bucket_cap_mb: float = 25.0
    grad_compression: str | None = None  # custom DDP: "bf16" on the wire
    pp_schedule: str = "1f1b"           # pipeline: "gpipe" | "1f1b" | "interleaved_1f1b"
    pp_virtual: int = 1                 # pipeline: model chunks per pp rank (interleaved_1f1b: > 1)
    activation_checkpointing: str = "none"  # "none" | "full" | "selective" (every ac_every-th Block)
    ac_every: int = 2
    compile: bool = False               # torch.compile each Block's forward


@dataclass(kw_only=True)
class Parallelized:
    """The wrapped model plus what the trainer needs to treat every layout the same way."""
    model: nn.Module
    norm_groups: list[tuple]            # items for clip_grad_norm_: (param, groups) or (param, groups, lo, hi)
    replica_rank: int = 0               # index among identical replicas (dp rank under DDP): checkpoint writers
    tp_rank: int = 0                    # plain (non-DTensor) parameters are replicated over TP: tp rank 0 writes
    tp_size: int = 1
    sharded_as: dict[str, DTensor] = field(default_factory=dict)  # torch DDP over DTensor TP: the DTensors
    accumulate_locally: bool = False    # DDP: all-reduce on the last micro-step only (no_sync before it)
    dtensor_loss_parallel: bool = False  # DTensor loss parallel needs its context around forward + backward
    pipeline: PipelineRunner | None = None  # pp > 1: runs a step's micro-batches by `schedule`
    schedule: str = "1f1b"
    pp_group: dist.ProcessGroup | None = None  # the gradient norm's squares are summed over it last
    zero_optimizer: bool = False        # torch's ZeRO-1 twin: AdamW wrapped in ZeroRedundancyOptimizer
    torch_cp: DeviceMesh | None = None  # torch's context_parallel twin: the cp mesh its SDPA rings over

    def pipeline_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                      scale: Callable | None = None) -> torch.Tensor:
        """Forward and backward of the step's micro-batches through the pipeline, then the data-parallel
        gradient reduction (DDP: once, here; FSDP: per micro-batch, in its hooks) and the tied-embedding
        all-reduce over [first, last] stage. Returns this rank's share of the mean loss (0 off the last stage)."""
        reduce = self.model.reduce_on_exit() if self.accumulate_locally else contextlib.nullcontext()
        with reduce:
            loss = self.pipeline.step(micro_batches, self.schedule, scale)
        self.pipeline.reduce_tied_grads()
        return loss

    @property
    def fsdp(self) -> FullyShardedDataParallel | None:
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    def grad_sync(self, last_micro_step: bool):
        """Context for one micro-step's forward + backward: DDP communicates only on the last one. (FSDP
        reduce-scatters every micro-step: its no_sync would keep a full gradient per rank.)"""
        if self.accumulate_locally and not last_micro_step:
            return self.model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def micro_step(self, x: torch.Tensor, y: torch.Tensor):
        """Around one micro-batch's forward (and backward): what the PyTorch twins need open while they run.
        Yields the (x, y) to feed the model: torch's context_parallel takes the full rows and shards them
        itself; everything else gets this rank's tokens already (train._tokens)."""
        with contextlib.ExitStack() as stack:
            if self.dtensor_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel
                stack.enter_context(loss_parallel())
            if self.torch_cp is not None:
                x, y = stack.enter_context(torch_context_parallel(self.torch_cp, x, y))
            yield x, y

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay only on (pieces of) original parameters with at least 2 dims."""
        if self.fsdp is not None:
            return self.fsdp.param_groups(weight_decay)
        return param_groups(list(self.model.named_parameters()), weight_decay)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(self.norm_groups, max_norm, across=self.pp_group)

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose step count and hyperparameters a checkpoint records and restores: the local
        AdamW inside torch's ZeroRedundancyOptimizer, else the optimizer itself."""
        return optimizer.optim if self.zero_optimizer else optimizer

    def state_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """This rank's {"params", "grads", "optimizer"} bytes (distinct storages)."""
        import metrics
        if self.fsdp is not None:
            return self.fsdp.state_breakdown(optimizer)
        return metrics.state_breakdown(self.model, getattr(optimizer, "optim", optimizer))  # ZeRO-1 twin: its shard

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return sum(self.state_breakdown(optimizer).values())

    def after_optimizer_step(self) -> None:
        """ZeRO-1/2 keep full parameter copies: the optimizer updated the shards, so they are stale."""
        if self.fsdp is not None:
            self.fsdp.after_optimizer_step()

    def checkpoint_entries(self, optimizer: torch.optim.Optimizer) -> list:
        """This rank's parameters and AdamW moments as layout-independent entries (parallel/state.py)."""
        from torch.distributed.fsdp import FSDPModule

        from parallel.state import entries_for, entries_for_fsdp
        for module in self.model.modules():  # FSDP2 leaves the root unsharded after a no_grad forward
            if isinstance(module, FSDPModule):  # (an eval), but the optimizer holds the sharded parameters
                module.reshard()
        if self.fsdp is not None:
            entries = entries_for_fsdp(self.fsdp, optimizer, self.fsdp.tp_shard_dims, self.tp_rank, self.tp_size,
                                       self.replica_rank)
        elif self.zero_optimizer:  # torch's ZeRO-1: each parameter's owner writes it with its moments
            owner = optimizer._param_to_rank
            entries = entries_for(list(self.model.named_parameters()), optimizer.optim, 0, self.sharded_as,
                                  self.tp_rank, self.tp_size, owns=lambda p: owner[p] == self.replica_rank)
        else:
            entries = entries_for(list(self.model.named_parameters()), optimizer, self.replica_rank,
                                  self.sharded_as, self.tp_rank, self.tp_size)
        for e in entries:
            if e.name == "lm_head.weight":  # the last stage's copy of the tied matrix: loaded, never written
                e.name, e.write = "transformer.wte.weight", False
        return entries


# ----------------------------------------------------------------------------- the steps

def apply_pp_custom(model: GPT, pp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """Our pipeline stage (parallel/pipeline.py): this pp rank's chunks of the GPT, nothing of the others'."""
    return PipelineStage(model, pp_mesh.get_local_rank(), pp_mesh.size(), cfg.pp_virtual), {}


def apply_pp_pytorch(model: GPT, pp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """The same cut, plus one module per local chunk (`TorchChunk`) for torch.distributed.pipelining's
    PipelineStage: torch's DDP and FSDP2 then wrap those chunk modules, as torchtitan wraps its model chunks."""
    stage = PipelineStage(model, pp_mesh.get_local_rank(), pp_mesh.size(), cfg.pp_virtual)
    stage.chunk_modules = {c: TorchChunk(stage, c) for c in stage.chunks}
    return stage, {}


def apply_cp_custom(model: GPT, cp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """Our ring attention over mesh["cp"] in every attention module (parallel/context_parallel.py)."""
    apply_context_parallel(model, cp_mesh.get_group())
    return model, {}


def apply_cp_pytorch(model: GPT, cp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """torch's context_parallel (CUDA only): zigzag positions now, the SDPA ring per micro-step (micro_step)."""
    apply_torch_context_parallel(model, cp_mesh.get_local_rank(), cp_mesh.size())
    return model, {"torch_cp": cp_mesh}


def apply_tp_custom(model: GPT, tp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """Our Megatron TP (parallel/tensor_parallel.py); on meta it materialises only this rank's shards."""
    from parallel.tensor_parallel import apply_tensor_parallel
    apply_tensor_parallel(model, tp_mesh.get_group(), cfg.loss_parallel, cfg.sequence_parallel,
                          seed=cfg.seed if cfg.deferred_init else None, device=device)
    return model, {}


def apply_tp_pytorch(model: GPT, tp_mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device):
    """DTensor TP with the same sharding as ours (`pytorch_tp_plan`, torchtitan-style)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from parallel.tensor_parallel import pytorch_tp_plan
    parallelize_module(model, tp_mesh, pytorch_tp_plan(model, cfg.loss_parallel, cfg.sequence_parallel))
    if not isinstance(model, PipelineStage):  # a stage's lm_head is a copy of wte, not tied to it
        model.lm_head.weight = model.transformer.wte.weight  # both Shard(0) over vocab: re-tie after the swap
    return model, {"dtensor_loss_parallel": cfg.loss_parallel}


def apply_fsdp_custom(model: GPT, mesh, cfg: ParallelConfig, device: torch.device):
    """Our sharding engine at the ZeRO stage of cfg.dp_type: over mesh["dp"], or with HSDP over
    mesh["dp_shard"], replicated over mesh["dp_replicate"]. ZeRO-1 accumulates its micro-steps locally."""
    meta = any(p.is_meta for p in model.parameters())
    hsdp = cfg.dp_replicate > 1
    fsdp = FullyShardedDataParallel(model, process_group=mesh["dp_shard" if hsdp else "dp"].get_group(),
                                    param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype, device=device,
                                    deferred_init_seed=cfg.seed if meta else None,
                                    zero_stage=ZERO_STAGES[cfg.dp_type],
                                    replicate_group=mesh["dp_replicate"].get_group() if hsdp else None)
    return fsdp, {"accumulate_locally": fsdp.zero_stage == 1,
                  "replica_rank": mesh["dp_replicate"].get_local_rank() if hsdp else 0}


def apply_fsdp_pytorch(model: GPT, mesh, cfg: ParallelConfig, device: torch.device):
    """FSDP2: each Block one unit, the root (embeddings, ln_f) another, as ours. zero2: the same with
    reshard_after_forward=False (parameters stay gathered from forward to backward). HSDP: on the 2D
    (dp_replicate, dp_shard) mesh."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=cfg.reduce_dtype)
    dp_mesh = mesh.root["dp_replicate", "dp_shard"] if cfg.dp_replicate > 1 else mesh["dp"]
    kw = {"mesh": dp_mesh, "mp_policy": mp, "reshard_after_forward": cfg.dp_type != "zero2"}
    h = model.transformer.h
    for block in (h.values() if isinstance(h, nn.ModuleDict) else h):
        fully_shard(block, **kw)
    for root in getattr(model, "chunk_modules", {}).values() or [model]:  # a pipeline stage: each chunk
        fully_shard(root, **kw)
    return model, {}


def apply_ddp_custom(model: nn.Module, mesh, cfg: ParallelConfig, device: torch.device):
    from parallel.ddp import DistributedDataParallel
    dp_mesh = mesh["dp"]
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), bucket_cap_mb=cfg.bucket_cap_mb,
                                   grad_compression=cfg.grad_compression), \
        {"accumulate_locally": True, "replica_rank": dp_mesh.get_local_rank()}


def apply_ddp_pytorch(model: nn.Module, mesh, cfg: ParallelConfig, device: torch.device):
    from torch.nn.parallel import DistributedDataParallel
    dp_mesh = mesh["dp"]
    stage = isinstance(model, PipelineStage)  # the chunk modules run, not the stage: they carry the hooks
    sharded_as = localize_tp_params(model, list(model.chunk_modules.values()) if stage else None)
    kw = {"process_group": dp_mesh.get_group(), "device_ids": [device.index] if device.type == "cuda" else None}
    if stage:  # each chunk its own DDP; torch's PipelineStage syncs on the last backward
        model.chunk_modules = {c: DistributedDataParallel(m, **kw) for c, m in model.chunk_modules.items()}
        return model, {"replica_rank": dp_mesh.get_local_rank(), "sharded_as": sharded_as}
    return DistributedDataParallel(model, **kw), {"accumulate_locally": True, "replica_rank": dp_mesh.get_local_rank(),
                                                  "sharded_as": sharded_as}


APPLY: dict[tuple[str, str], Callable] = {
    ("custom", "pp"): apply_pp_custom, ("pytorch", "pp"): apply_pp_pytorch,
    ("custom", "cp"): apply_cp_custom, ("pytorch", "cp"): apply_cp_pytorch,
    ("custom", "tp"): apply_tp_custom, ("pytorch", "tp"): apply_tp_pytorch,
    ("custom", "fsdp"): apply_fsdp_custom, ("pytorch", "fsdp"): apply_fsdp_pytorch,
    ("custom", "ddp"): apply_ddp_custom, ("pytorch", "ddp"): apply_ddp_pytorch,
}


def parallelize(model: GPT, mesh: DeviceMesh | None, dims, cfg: ParallelConfig,
                device: torch.device) -> Parallelized:
    """PP cut -> CP -> TP -> AC/compile -> FSDP or ZeRO -> materialise -> DDP -> pipeline runner (see the
    module docstring). `model` may be on meta when cfg.deferred_init; `mesh` is None for one process."""
    impl, extras = cfg.implementation, {}
    dp_type = cfg.dp_type if dims.dp_enabled or dims.cp_enabled else None
    tp_group = mesh["tp"].get_group() if mesh is not None else None

    def step(what: str, mesh_dim: str | None) -> None:
        nonlocal model  # data parallel steps get the whole mesh: HSDP needs its replicate and shard dims
        model, more = APPLY[impl, what](model, mesh[mesh_dim] if mesh_dim else mesh, cfg, device)
        extras.update(more)

    if dims.pp_enabled:
        step("pp", "pp")
    stage = model
    if dims.cp_enabled:  # a ring over mesh["cp"]; the dp wrappers below then reduce over dp x cp
        step("cp", "cp")
    if dims.tp_enabled:
        step("tp", "tp")
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.compile:
        apply_compile(model)
    # which engine a dp_type runs on: ours shard on one engine; torch's ZeRO-1 is DDP + ZeroRedundancyOptimizer
    engine = {"ddp": "ddp", "zero1": "fsdp", "zero2": "fsdp", "fsdp": "fsdp"}.get(dp_type)
    if impl == "pytorch" and dp_type == "zero1":
        engine, extras["zero_optimizer"] = "ddp", True
    if engine == "fsdp":
        step("fsdp", None)
    materialize(model, cfg.seed, device)
    groups = grad_groups(model, tp_group)  # by name, before DDP renames the parameters "module.*"
    if engine == "ddp":
        step("ddp", None)
    # a pipeline's last stage holds a copy of wte as lm_head.weight: its gradient is scaled, not measured
    copy = dims.pp_enabled and stage.last
    if isinstance(model, FullyShardedDataParallel):
        norm_groups = model.grad_norm_items({**{n: (tp_group,) for n in model.tp_shard_dims},
                                             **({"lm_head.weight": None} if copy else {})})
    else:
        norm_groups = [(p, None if copy and n.endswith("lm_head.weight") else groups[n.removeprefix("module.")])
                       for n, p in model.named_parameters()]
    if dims.pp_enabled:
        pp_group = mesh["pp"].get_group()
        pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, dims.pp).tolist()  # every (dp, tp): its pp ranks
        runner_class = TorchPipelineRunner if impl == "pytorch" else PipelineRunner
        runner = runner_class(stage, pp_group, embedding_group(pipelines),  # every rank builds every group
                              act_dtype=activation_dtype(cfg, engine),
                              seq_shard=dims.tp if cfg.sequence_parallel else 1, device=device,
                              **({"forward": model.run_chunk, "tied": model.tied_pieces()}
                                 if isinstance(model, FullyShardedDataParallel) else {}))
        extras.update(pipeline=runner, schedule=cfg.pp_schedule, pp_group=pp_group)
    tp = {} if mesh is None else {"tp_rank": mesh["tp"].get_local_rank(), "tp_size": dims.tp}
    return Parallelized(model=model, norm_groups=norm_groups, **tp, **extras)


# ----------------------------------------------------------------------------- helpers

def activation_dtype(cfg: ParallelConfig, engine: str | None) -> torch.dtype:
    """The dtype of the residual stream between pipeline chunks, on every rank alike: the embedding's output
    dtype, which every Block keeps (x + f(x) promotes autocast's bf16 f(x) to x's dtype). That is the compute
    copies' param_dtype under a sharding engine (ours or FSDP2, which also casts chunk inputs to it), and the
    parameters' fp32 otherwise (autocast alone leaves embeddings and the residual in fp32)."""
    return cfg.param_dtype if engine == "fsdp" and cfg.param_dtype is not None else torch.float32


def grad_groups(model: nn.Module, tp_group) -> dict[str, tuple]:
    """For each parameter name, the process groups its gradient is sharded over: a DTensor's non-replicated
    mesh dims (Shard, or _StridedShard under FSDP2 over TP); tp_group for our TP shards (parallel/
    tensor_parallel.py marks them); none for replicated parameters."""
    from parallel.tensor_parallel import tp_grad_groups
    out = tp_grad_groups(model, tp_group)
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements)
                              if not pl.is_replicate())
    return out


def materialize(model: nn.Module, seed: int, device: torch.device) -> None:
    """Give the parameters still on meta real storage and the init rule's values, rank-locally.

    A DTensor parameter gets only its local slice of the full init value (`src_data_rank=None`: no
    communication). Tied weights keep a single storage. A model with nothing on meta is left alone."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = init_parameter(name, p.shape, model.config, seed).to(device)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)
    t = model.transformer
    if "wte" in t and hasattr(model, "lm_head") and getattr(model, "pp", 1) == 1:  # re-tie (not a PP copy)
        model.lm_head.weight = t.wte.weight


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
        views = {k: DTensor.from_local(t, spec.mesh, spec.placements, run_check=False,
                                       shape=spec.shape, stride=spec.stride)
                 for k, (t, spec) in locals_.items()}
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
