"""What every data-parallel wrapper answers, ours and (through a thin adapter, parallel/twins/) PyTorch's, so
that `Parallelized` (parallel/parallelize.py) only delegates and never asks which wrapper it holds.

    param_groups(weight_decay)      AdamW groups over what this rank steps (whole parameters, or FSDP shards)
    make_optimizer(wd, **adamw)     AdamW over those groups (torch's ZeRO-1 twin: ZeroRedundancyOptimizer)
    grad_norm_items()               (param, groups[, lo, hi]) items for parallel/grads.clip_grad_norm_
    grad_sync(last_micro_step)      context around one micro-step's forward + backward (DDP: no_sync before the last)
    step_sync()                     context around a pipeline's whole step (ours: accumulate, reduce once on exit)
    after_optimizer_step()          ZeRO-1/2: the full parameter copies are stale now
    state_breakdown(optimizer)      this rank's {"params", "grads", "optimizer"} bytes
    checkpoint_parts(optimizer)     what this rank holds of the training state, and who writes it (`Params`,
                                    `Buffers`, `FlatShards`: checkpoints/entries.py makes them entries)
    checkpoint_optimizer(optimizer) the AdamW whose step count and hyperparameters a checkpoint records
    parameter_tensors()             (fixed, moving): the tensors that hold parameter values, for memory's accounting
    fsdp                            our sharding engine, whose shards the optimizer steps (None for every other)

`Replicated` is the default: parameters as they are (no data parallelism, or a wrapper that keeps whole
replicas); `Accumulating` adds DDP's local accumulation; `Sharded` is our FSDP / ZeRO engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.grads import norm_items


class Cut(NamedTuple):
    """What a step that changes a micro-batch's tokens or context returns: the model, and (either or both) how
    each micro-batch's rows are cut to this rank's tokens on the host (`tokens`: our CP's zigzag share) and a
    context opened around each micro-step's forward and backward that yields its (x, y) (`context`: the twins'
    DTensor loss parallel, torch's context_parallel)."""

    model: nn.Module
    tokens: Callable | None = None
    context: Callable | None = None


class Params(NamedTuple):
    """A checkpoint part: parameters that are whole tensors or DTensors (one process, DDP, FSDP2, DTensor TP), or
    our layers' marked slices (parallel/marks.py). `replica_rank`: this rank's index among identical replicas (the
    dp rank under DDP, else 0); `plain_replica_rank`: among the ranks holding plain (non-DTensor) parameters whole
    (the tp rank under TP, which replicates them); `sharded_as`: names of plain local tensors that are really
    DTensor shards (TP under torch DDP) -> a DTensor with their placements; `owns(p)`: torch's ZeRO-1, whose
    `optimizer` (its local AdamW) holds the moments of the parameters this rank owns."""

    named: list[tuple[str, nn.Parameter]]
    optimizer: torch.optim.Optimizer
    replica_rank: int = 0
    sharded_as: dict | None = None
    plain_replica_rank: int = 0
    owns: Callable | None = None


class Buffers(NamedTuple):
    """A checkpoint part: the persistent buffers that are training state (the MoE expert bias), whole on every rank
    of the stage that holds them, written by replica 0 and tp rank 0."""

    module: nn.Module
    replica_rank: int = 0
    plain_replica_rank: int = 0


class FlatShards(NamedTuple):
    """A checkpoint part: our sharding engine's shards, each original parameter's slice [offset, offset + n) of
    this rank's flat shard (another dimension's slice where `fsdp.shard_marks` says). Writers: replica 0, and tp
    rank 0 for the parameters replicated over TP."""

    fsdp: nn.Module
    optimizer: torch.optim.Optimizer
    tp_rank: int
    replica_rank: int = 0


Part = Params | Buffers | FlatShards


class DataParallel(Protocol):
    model: nn.Module
    fsdp: nn.Module | None

    def param_groups(self, weight_decay: float) -> list[dict]: ...
    def make_optimizer(self, weight_decay: float, **adamw) -> torch.optim.Optimizer: ...
    def grad_norm_items(self) -> list[tuple]: ...
    def grad_sync(self, last_micro_step: bool) -> ContextManager: ...
    def step_sync(self) -> ContextManager: ...
    def after_optimizer_step(self) -> None: ...
    def state_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]: ...
    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> list[Part]: ...
    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...
    def parameter_tensors(self) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]] | None]: ...


@dataclass(frozen=True)
class Placement:
    """Where this rank's parameters sit in the other dims, which norms and checkpoints need.
    tp_*: plain (non-DTensor) parameters are replicated over TP, our TP shards are the tp_rank-th slice;
    replica_rank: index among identical replicas (checkpoint writers are replica 0);
    lm_head_copy: this pipeline stage holds the last stage's copy of the tied embedding (scaled, not measured)."""

    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_size: int = 1
    replica_rank: int = 0
    lm_head_copy: bool = False


class Replicated:
    """Parameters as they are: no data parallelism, or whole replicas (torch DDP under a pipeline, whose
    PipelineStage syncs). `groups`: for each parameter name, the groups its gradient is sharded over (TP)."""

    fsdp = None

    def __init__(self, model: nn.Module, at: Placement, groups: dict[str, tuple], sharded_as: dict | None = None):
        self.model, self.at, self.sharded_as = model, at, sharded_as or {}
        copy = {"lm_head.weight": None} if at.lm_head_copy else {}  # scaled, not measured (counted as wte)
        self._norm_items = norm_items(
            ((n.removeprefix("module."), p) for n, p in model.named_parameters()), {**groups, **copy}
        )

    def param_groups(self, weight_decay: float) -> list[dict]:
        from model.gpt import param_groups

        return param_groups(list(self.model.named_parameters()), weight_decay)

    def make_optimizer(self, weight_decay: float, **adamw) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(weight_decay), **adamw)

    def grad_norm_items(self) -> list[tuple]:
        return self._norm_items

    def grad_sync(self, last_micro_step: bool) -> ContextManager:
        return contextlib.nullcontext()

    def step_sync(self) -> ContextManager:
        return contextlib.nullcontext()

    def after_optimizer_step(self) -> None:
        pass

    def state_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        from runtime import memory

        return memory.state_breakdown(self.model, self.checkpoint_optimizer(optimizer))

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def parameter_tensors(self) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]] | None]:
        """(fixed, moving): the parameters, whose storages stay put through a step; nothing moves."""
        return list(self.model.parameters()), None

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> list[Part]:
        a = self.at
        return [
            Params(list(self.model.named_parameters()), optimizer, a.replica_rank, self.sharded_as, a.tp_rank),
            Buffers(self.model, a.replica_rank, a.tp_rank),
        ]


class Accumulating(Replicated):
    """Whole replicas whose gradients are reduced once per step: micro-steps before the last run in `no_sync`;
    a pipeline's step runs inside our wrapper's `reduce_on_exit` (torch's DDP has none: it is only used
    without a pipeline)."""

    def grad_sync(self, last_micro_step: bool) -> ContextManager:
        return contextlib.nullcontext() if last_micro_step else self.model.no_sync()

    def step_sync(self) -> ContextManager:
        return self.model.reduce_on_exit()


class Sharded:
    """Our FSDP / ZeRO-1/2 / HSDP engine (parallel/data_parallel/fsdp.py): it answers groups, norms, state and the
    ZeRO-1/2 refresh itself; this adds what needs the other dims (TP slices, the replica index, the lm_head copy).
    ZeRO-1 accumulates its micro-steps locally (reduced on the last one, or on a pipeline step's exit)."""

    def __init__(self, fsdp, at: Placement):
        self.model, self.fsdp, self.at = fsdp, fsdp, at
        tp = {n: tuple(m.group for m in marks) for n, marks in fsdp.shard_marks.items()}
        self._norm_items = fsdp.grad_norm_items({**tp, **({"lm_head.weight": None} if at.lm_head_copy else {})})
        self._local = fsdp.policy.reduces_at_end  # ZeRO-1

    def param_groups(self, weight_decay: float) -> list[dict]:
        return self.model.param_groups(weight_decay)

    def make_optimizer(self, weight_decay: float, **adamw) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(weight_decay), **adamw)

    def grad_norm_items(self) -> list[tuple]:
        return self._norm_items

    def grad_sync(self, last_micro_step: bool) -> ContextManager:
        return self.model.no_sync() if self._local and not last_micro_step else contextlib.nullcontext()

    def step_sync(self) -> ContextManager:
        """ZeRO-1: accumulate, reduce once on exit; ZeRO-2/3: reduce per micro-batch (at B, or after the last W
        that completes it under a zero-bubble schedule), and wait for the last ones on exit (no end-of-backward
        callback waits for what W reduced)."""
        return self._reduce_on_exit() if self._local else self._finish_on_exit()

    @contextlib.contextmanager
    def _reduce_on_exit(self):
        with self.model.no_sync():
            yield
        self.model.reduce_accumulated()

    @contextlib.contextmanager
    def _finish_on_exit(self):
        yield
        self.model.reduction.finish()

    def after_optimizer_step(self) -> None:
        self.model.after_optimizer_step()

    def state_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds, {"params", "grads", "optimizer"}: shards and (ZeRO-1/2) the full copies;
        shard gradients and full ones (ZeRO-1's buffers, or kept under no_sync); `optimizer`'s state of every
        tensor in a shard (its pieces, or views of them: --optimizer muon steps views).
        Distinct storages, padding included; a ZeRO-3 unit gathered right now counts too."""
        from runtime.memory import storage_bytes_by_kind, storage_key

        params, grads, moments = [], [], []
        for unit in self.model.units:
            params += [unit.shard, unit.flat]
            grads += [p.grad for p, _, _ in unit.pieces if p.grad is not None]
            grads += [t for t in (unit.flat.grad, unit.acc_grad) if t is not None]
        if optimizer is not None:  # the state of every tensor in a shard: its pieces, or views of them (Muon's)
            shards = {storage_key(unit.shard.untyped_storage()) for unit in self.model.units}
            for p, state in optimizer.state.items():
                if storage_key(p.untyped_storage()) in shards:
                    moments += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return storage_bytes_by_kind({"params": params, "grads": grads, "optimizer": moments})

    def parameter_tensors(self) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]] | None]:
        """(fixed, moving): the shards stay put; the flat buffers (the original parameters are views of them)
        regrow storage between uses, read afresh."""
        units = self.model.units
        return list(self.model.parameters()), lambda: [u.flat for u in units]

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> list[Part]:
        """The shards (HSDP: replica 0 writes; experts: every rank its own shard), and the buffers (whole on every
        rank: written by the first rank of the shard group's replica 0)."""
        a = self.at
        first = a.replica_rank == 0 and self.model.rank == 0
        return [
            FlatShards(self.model, optimizer, a.tp_rank, a.replica_rank),
            Buffers(self.model, 0 if first else 1, a.tp_rank),
        ]
