"""Apply the parallelisms to a GPT in a fixed order: tensor parallel first, then FSDP or DDP over dp.

Each `apply_*` is a small function that takes the mesh it works on. `--implementation pytorch` uses
PyTorch's own wrappers (DTensor `parallelize_module`, FSDP2 `fully_shard`, `DistributedDataParallel`);
`--implementation custom` uses ours from this package. Both run on the same ("dp", "tp") mesh.

`parallelize` returns the wrapped model and, for every parameter, the process groups over which its
gradient is sharded. That is what a correct global gradient norm needs: squares of a replicated
gradient are counted once, squares of a sharded one are summed over the groups it is sharded over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from model import GPT, init_parameter, param_groups

CUSTOM_AVAILABLE: dict[str, bool] = {"ddp": True, "fsdp": True, "tp": True}


@dataclass
class ParallelConfig:
    dp_type: str | None = None          # "ddp" | "fsdp" | None
    implementation: str = "pytorch"     # "pytorch" | "custom"
    loss_parallel: bool = False
    sequence_parallel: bool = False
    deferred_init: bool = False
    seed: int = 1337
    param_dtype: torch.dtype | None = None   # FSDP: dtype of the gathered compute copies (None: fp32)
    reduce_dtype: torch.dtype = torch.float32  # FSDP: dtype gradients are reduce-scattered in
    bucket_cap_mb: float = 25.0
    grad_compression: str | None = None  # custom DDP: "bf16" on the wire


@dataclass
class Parallelized:
    """The wrapped model plus what the trainer needs to treat every layout the same way."""
    model: nn.Module
    norm_groups: list[tuple] = field(default_factory=list)  # (param, groups) or (param, groups, lo, hi)
    replica_rank: int = 0  # index among identical replicas (the dp rank under DDP), for checkpoint writers
    sharded_as: dict[str, DTensor] = field(default_factory=dict)  # TP shards held as plain tensors
    tp_rank: int = 0  # plain (non-DTensor) parameters are replicated over TP: tp rank 0 writes them
    tp_size: int = 1

    tp_dims: dict[str, int] = field(default_factory=dict)  # our TP: name -> shard dim, recorded before FSDP

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    @property
    def fsdp(self):
        from parallel.fsdp import FullyShardedDataParallel
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay only on (pieces of) original parameters with at least 2 dims."""
        if self.fsdp is not None:
            return self.fsdp.param_groups(weight_decay)
        return param_groups(self.named_parameters(), weight_decay)

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(self.norm_groups, max_norm)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        import metrics
        return self.fsdp.state_bytes(optimizer) if self.fsdp is not None else metrics.state_bytes(self.model, optimizer)

    def checkpoint_entries(self, optimizer: torch.optim.Optimizer) -> list:
        """This rank's parameters and AdamW moments as layout-independent entries (parallel/state.py)."""
        from torch.distributed.fsdp import FSDPModule

        from parallel.state import entries_for, entries_for_fsdp
        for module in self.model.modules():  # FSDP2 leaves the root unsharded after a no_grad forward
            if isinstance(module, FSDPModule):  # (an eval), but the optimizer holds the sharded parameters
                module.reshard()
        if self.fsdp is not None:
            return entries_for_fsdp(self.fsdp, optimizer, self.tp_dims, self.tp_rank, self.tp_size)
        return entries_for(self.named_parameters(), optimizer, self.replica_rank, self.sharded_as,
                           self.tp_rank, self.tp_size)


def not_implemented(dims, cfg: ParallelConfig) -> str | None:
    """A one-line reason if this layout has no implementation yet, else None (checked before any work)."""
    if cfg.implementation != "custom":
        return None
    wanted = ([cfg.dp_type] if dims.dp > 1 else []) + (["tp"] if dims.tp > 1 else [])
    missing = [w for w in wanted if not CUSTOM_AVAILABLE.get(w)]
    if missing:
        return f"--implementation custom is not implemented yet for {', '.join(missing)}; use --implementation pytorch"
    return None


# ----------------------------------------------------------------------------- PyTorch's own wrappers

def apply_tp_pytorch(model: GPT, tp_mesh: DeviceMesh, loss_parallel: bool, sequence_parallel: bool) -> None:
    """DTensor TP with the same sharding as ours (`pytorch_tp_plan`, torchtitan-style)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from parallel.tensor_parallel import pytorch_tp_plan
    parallelize_module(model, tp_mesh, pytorch_tp_plan(model, loss_parallel, sequence_parallel))
    model.lm_head.weight = model.transformer.wte.weight  # both Shard(0) over vocab: re-tie after the swap


def apply_fsdp_pytorch(model: GPT, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None,
                       reduce_dtype: torch.dtype = torch.float32) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.transformer.h:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def apply_ddp_pytorch(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel
    if any(isinstance(p, DTensor) for p in model.parameters()):
        model._tp_dtensors = dict(model.named_parameters())  # the DTensors, before they become locals
        localize_tp_params(model)
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(),
                                   device_ids=[device.index] if device.type == "cuda" else None)


def localize_tp_params(model: nn.Module) -> None:
    """Let torch DDP (which knows nothing of DTensor) all-reduce the local shards of TP parameters.

    Each DTensor parameter is replaced by a plain Parameter holding its local shard (tied weights
    stay one Parameter); a forward pre-hook swaps in DTensor views of those Parameters and a forward
    hook swaps the same Parameter objects back, so DDP's gradient hooks stay attached to them.
    (torch's `_pre_dp_module_transform` does this too, but re-creates the Parameters after every
    forward, which detaches them from DDP's hooks, and it unties the embedding from lm_head.)
    """
    locals_: dict[int, tuple[nn.Parameter, object]] = {}
    users: list[tuple[nn.Module, str, int]] = []
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in locals_:
                    locals_[id(p)] = (nn.Parameter(p._local_tensor.detach()), p._spec)
                users.append((module, attr, id(p)))
                module._parameters[attr] = locals_[id(p)][0]

    def to_dtensor(*_):
        views = {k: DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                       shape=spec.shape, stride=spec.stride)
                 for k, (local, spec) in locals_.items()}
        for module, attr, k in users:
            del module._parameters[attr]
            setattr(module, attr, views[k])

    def to_local(*_):
        for module, attr, k in users:
            delattr(module, attr)
            module._parameters[attr] = locals_[k][0]

    model.register_forward_pre_hook(to_dtensor)
    model.register_forward_hook(to_local)


# ----------------------------------------------------------------------------- the one entry point

def sharding_groups(model: nn.Module) -> dict[str, tuple]:
    """For each parameter name, the groups of the mesh dims its (DTensor) placement shards it over."""
    out = {}
    for name, p in model.named_parameters():
        groups: tuple = ()
        if isinstance(p, DTensor):
            groups = tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements)
                           if not pl.is_replicate())  # Shard or _StridedShard (FSDP over TP)
        out[name] = groups
    return out


def attach_groups(model: nn.Module, groups: dict[str, tuple]) -> list[tuple[nn.Parameter, tuple]]:
    """Pair the wrapped model's parameters with the groups recorded (by name) before wrapping."""
    return [(p, groups[n.removeprefix("module.")]) for n, p in model.named_parameters()]


def materialize(model: nn.Module, seed: int, device: torch.device) -> None:
    """Give a (possibly sharded) meta model real storage and the init rule's values, rank-locally.

    A DTensor parameter gets only its local slice of the full init value (`src_data_rank=None`: no
    communication). Tied weights keep a single storage."""
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = init_parameter(name, p.shape, model.config, seed).to(device)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


def parallelize(model: GPT, mesh: DeviceMesh | None, dims, cfg: ParallelConfig,
                device: torch.device) -> Parallelized:
    """TP -> (materialise if deferred) -> FSDP or DDP. `model` may be on meta when cfg.deferred_init."""
    if mesh is None:  # one process
        if cfg.deferred_init:
            model.init_weights(cfg.seed, device)
        return Parallelized(model, attach_groups(model, sharding_groups(model)))
    if cfg.implementation == "custom":
        return parallelize_custom(model, mesh, dims, cfg, device)
    if dims.tp_enabled:
        apply_tp_pytorch(model, mesh["tp"], cfg.loss_parallel, cfg.sequence_parallel)
    if dims.dp_enabled and cfg.dp_type == "fsdp":
        apply_fsdp_pytorch(model, mesh["dp"], cfg.param_dtype, cfg.reduce_dtype)
    if cfg.deferred_init:
        materialize(model, cfg.seed, device)
        if model.lm_head.weight is not model.transformer.wte.weight:
            model.lm_head.weight = model.transformer.wte.weight
    groups = sharding_groups(model)
    tp_rank = mesh["tp"].get_local_rank()
    if dims.dp_enabled and cfg.dp_type == "ddp":
        model = apply_ddp_pytorch(model, mesh["dp"], device)
        return Parallelized(model, attach_groups(model, groups), mesh["dp"].get_local_rank(),
                            getattr(model.module, "_tp_dtensors", {}), tp_rank)
    return Parallelized(model, attach_groups(model, groups), tp_rank=tp_rank)


def parallelize_custom(model: GPT, mesh: DeviceMesh, dims, cfg: ParallelConfig,
                       device: torch.device) -> Parallelized:
    """Our own wrappers, same order: TP (materialising only local shards if deferred) -> FSDP or DDP."""
    from parallel.ddp import DistributedDataParallel
    from parallel.fsdp import FullyShardedDataParallel
    from parallel.tensor_parallel import apply_tensor_parallel
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    fsdp = dims.dp_enabled and cfg.dp_type == "fsdp"
    if dims.tp_enabled:
        apply_tensor_parallel(model, tp_group, cfg.loss_parallel, cfg.sequence_parallel,
                              seed=cfg.seed if cfg.deferred_init else None, device=device)
    elif cfg.deferred_init and not fsdp:
        model.init_weights(cfg.seed, device)
    # a TP-sharded gradient's squares are summed over tp; replicated ones (also under SP, whose partial
    # LayerNorm gradients the TP layers already all-reduce) count once
    tp_dims = {n: p._tp_shard_dim for n, p in model.named_parameters() if hasattr(p, "_tp_shard_dim")}
    groups = {n: (tp_group,) if n in tp_dims else () for n, _ in model.named_parameters()}
    if fsdp:
        meta = any(p.is_meta for p in model.parameters())
        model = FullyShardedDataParallel(model, process_group=dp_group, param_dtype=cfg.param_dtype,
                                         reduce_dtype=cfg.reduce_dtype, device=device,
                                         deferred_init_seed=cfg.seed if meta else None)
        return Parallelized(model, fsdp_norm_groups(model, groups, dp_group), dp_rank, tp_rank=tp_rank,
                            tp_size=dims.tp, tp_dims=tp_dims)
    if dims.dp_enabled and cfg.dp_type == "ddp":
        model = DistributedDataParallel(model, process_group=dp_group,
                                        bucket_cap_mb=cfg.bucket_cap_mb, grad_compression=cfg.grad_compression)
        return Parallelized(model, attach_groups(model, groups), dp_rank, tp_rank=tp_rank, tp_size=dims.tp)
    return Parallelized(model, attach_groups(model, groups), tp_rank=tp_rank, tp_size=dims.tp)


def fsdp_norm_groups(fsdp, groups: dict[str, tuple], dp_group) -> list[tuple]:
    """(flat shard piece, groups, lo, hi) per original parameter's slice of this rank's shard.

    Every slice is sharded over dp; a TP-sharded parameter's slice is also sharded over tp. Without TP all
    slices of one piece share their groups, so each piece is one item. The list starts with one empty
    item per pattern (same on every rank), so clip_grad_norm_ issues the same reductions everywhere."""
    items = [(torch.empty(0), (dp_group,) + g) for g in dict.fromkeys(groups.values())]
    for unit in fsdp.units:
        for spec in unit.specs:
            a, b, start = fsdp._held(unit, spec)
            for p, pa, pb in unit.pieces:
                if b > a and pa <= start and start + (b - a) <= pb:
                    items.append((p, (dp_group,) + groups[spec.names[0]], start - pa, start - pa + (b - a)))
    if all(item[1] == (dp_group,) for item in items):
        return [(p, (dp_group,)) for p in fsdp.flat_params]
    return items


# ----------------------------------------------------------------------------- gradient norm

@torch.no_grad()
def clip_grad_norm_(norm_groups: list[tuple], max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of all gradients; scales them by min(1, max_norm / (norm + 1e-6)) if max_norm.

    Squares are summed locally per sharding pattern, then all-reduced over the groups that pattern is
    sharded over, so each gradient element is counted exactly once whatever the layout. Items are
    (param, groups) or (param, groups, lo, hi) for a slice of a flat shard's gradient."""
    by_groups: dict[tuple, list[torch.Tensor]] = {}   # what to measure
    to_scale: dict[int, torch.Tensor] = {}             # the gradients' own storage, to clip in place
    for p, groups, *segment in norm_groups:
        g = p.grad
        if g is None:
            continue
        if segment:  # (lo, hi): one original parameter's slice of a flat FSDP shard
            to_scale[id(g)] = g
            by_groups.setdefault(groups, []).append(g[segment[0]:segment[1]])
            continue
        if isinstance(g, DTensor):
            to_scale[id(g)] = g.to_local()
            if any(pl.is_partial() for pl in g.placements):  # e.g. LayerNorm grads under DTensor SP
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            g = g.to_local()
        else:
            to_scale[id(g)] = g
        by_groups.setdefault(groups, []).append(g)
    # Every rank must issue the same all-reduces in the same order, even for patterns of which it holds
    # no element (an FSDP rank may hold no slice of some parameter): walk the patterns in list order.
    total = None
    device = next(iter(to_scale.values())).device if to_scale else torch.device("cpu")
    for groups in dict.fromkeys(item[1] for item in norm_groups):
        grads = by_groups.get(groups, [])
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum() if grads else \
            torch.zeros((), device=device)
        for g in groups:
            dist.all_reduce(sq, group=g)  # a scalar: not counted as wrapper traffic
        total = sq if total is None else total + sq
    norm = total.sqrt() if total is not None else torch.zeros(())
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(list(to_scale.values()), coef.to(norm.device))
    return norm
