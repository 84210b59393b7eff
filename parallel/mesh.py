"""The one place that picks device, backend and timers, validates the parallel layout and builds the mesh.

Mesh dims are ("pp", "dp_replicate", "dp_shard", "cp", "tp"), always all five (size 1 where unused), tp innermost
(fastest-varying) so TP groups are neighbouring ranks, which on a GPU node share NVLink; pp outermost, so a
pipeline's stages span nodes and only its point-to-point activations cross them. dp = dp_replicate x dp_shard
(dp_replicate > 1 only under HSDP). Flattened dims have names for what they do: `batch` (data loading),
`loss` (loss mean, DDP's gradient mean: dp x cp), `fsdp` (sharding: dp_shard x cp).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def pick_device(requested: str = "auto") -> torch.device:
    """'auto' is the accelerator when there is one, else the CPU. Under torchrun each rank takes the GPU
    numbered by its LOCAL_RANK."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested} asked for but no CUDA device is available")
    return torch.device(requested, int(os.environ.get("LOCAL_RANK", 0)))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without blocking the host: on CUDA through pinned memory with a non-blocking copy (from
    pageable memory `non_blocking=True` is a synchronous copy); a tensor already there is returned as is."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def fused_optimizer(device: torch.device, params: list[torch.Tensor] | None = None) -> bool:
    """Whether torch's fused AdamW runs on `device` (torch 2.13: CUDA, CPU and others) for `params`: one kernel
    per step instead of a foreach chain. DTensor parameters fuse too (FSDP2's), but not mixed with plain ones in
    one group (DTensor TP leaves some plain): "aten._fused_adamw_.default got mixed torch.Tensor and DTensor"."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    kinds = {isinstance(p, DTensor) for p in params or []}
    return device.type in _get_fused_kernels_supported_devices() and len(kinds) <= 1


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


class HostTimer:
    """Marks by the host clock. On the CPU the host runs the work, so its clock times the work."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list) -> list[float]:
        """perf_counter seconds of each mark."""
        return list(marks)


class DeviceTimer:
    """Marks as CUDA events on the current stream: intervals of the device's work, not of its enqueueing (on CUDA
    `Work.wait()` and kernel launches return at once, so the host clock would time the launches)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> tuple[float, torch.cuda.Event]:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return time.perf_counter(), event

    def seconds(self, marks: list) -> list[float]:
        """Each mark's device time, as host seconds from the first mark's host time (synchronises the last
        event: call it after the step)."""
        if not marks:
            return []
        (host0, first), last = marks[0], marks[-1][1]
        last.synchronize()
        return [host0 + first.elapsed_time(e) / 1000 for _, e in marks]


def record_event(device: torch.device) -> Callable[[], None]:
    """A wait for the work enqueued so far on `device`'s current stream: a CUDA event's synchronize; on the CPU
    the work is done when enqueued, so nothing."""
    if device.type != "cuda":
        return lambda: None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


def make_timer(device: torch.device) -> HostTimer | DeviceTimer:
    """Device events where the device has them (CUDA), the host clock on the CPU."""
    return DeviceTimer(device) if device.type == "cuda" else HostTimer()


@dataclass(frozen=True)
class ParallelDims:
    """A validated (pp, dp, cp, tp) layout. pp * dp * cp * tp must equal the world size."""
    dp: int
    tp: int
    world_size: int
    pp: int = 1
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard
    cp: int = 1            # context parallelism: each sequence split over cp ranks

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel sizes must be >= 1, got pipeline_parallel_size={self.pp}, "
                             f"data_parallel_size={self.dp}, tensor_parallel_size={self.tp}")
        n = self.pp * self.dp * self.cp * self.tp
        if n != self.world_size:
            cp = f"context_parallel_size ({self.cp}) x " if self.cp > 1 else ""
            raise ValueError(f"pipeline_parallel_size ({self.pp}) x data_parallel_size ({self.dp}) x {cp}"
                             f"tensor_parallel_size ({self.tp}) = {n} must equal the world size "
                             f"({self.world_size}); launch with torchrun --nproc_per_node={n}")

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's place on the mesh: rank = ((pp * dp + dp) * cp + cp) * tp + tp."""
        return {"tp": rank % self.tp, "cp": rank // self.tp % self.cp, "dp": rank // (self.tp * self.cp) % self.dp,
                "pp": rank // (self.tp * self.cp * self.dp)}

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) for a plain `python`."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


_TIMEOUT: timedelta | None = None  # the run's --timeout, once init_distributed has run


def group_timeout() -> timedelta | None:
    """The run's --timeout, for a group created after the mesh (`dist.new_group(..., timeout=group_timeout())`):
    new_group's own default is the backend's (30 min on gloo, 10 on NCCL), not the world group's."""
    return _TIMEOUT


def honour_timeout(timeout: timedelta) -> None:
    """Give every process group this rank is in `timeout`. DeviceMesh builds its dims' groups (split_group on
    NCCL, new_group on gloo) and flattened dims with the backend's default timeout, not the world's, so a
    stalled dp, tp, pp or cp peer would be noticed after 10-30 minutes instead of --timeout."""
    global _TIMEOUT
    _TIMEOUT = timeout
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dims, outermost first
# flattened dims, by what they are for: name -> the dims they span
FLATTENED = {
    "batch": ("dp_replicate", "dp_shard"),      # which rows of the global batch a rank reads (data loading)
    "loss": ("dp_replicate", "dp_shard", "cp"),  # same parameters, other tokens: the loss mean and DDP's gradient mean
    "fsdp": ("dp_shard", "cp"),                  # what a sharding engine shards over (HSDP replicates over dp_replicate)
}


@dataclass(frozen=True)
class MeshDim:
    """One named dim of the mesh as this rank sees it: its size, this rank's coordinate on it, and the process
    group over it (None on one process, where every dim has size 1 and nothing is communicated). `device_mesh`:
    the same dim as a torch DeviceMesh, for the PyTorch twins (None on one process)."""
    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None
    device_mesh: DeviceMesh | None

    @property
    def enabled(self) -> bool:
        return self.size > 1


class Mesh:
    """The run's one mesh, always there (on one process too): dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    size-1 dims included, tp innermost, and the flattened dims of `FLATTENED` by honest names (`batch`, `loss`,
    `fsdp`). `mesh[name]` is a MeshDim. A flattened dim that spans one dim of size > 1 (say loss without cp)
    is that dim: no extra group. Rank r = (((pp * R + rep) * S + shard) * C + cp) * T + tp, as
    ParallelDims.coordinates."""

    def __init__(self, dims: ParallelDims, root: DeviceMesh | None = None):
        self.dims, self.root = dims, root
        sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                 "tp": dims.tp}
        self._dims: dict[str, MeshDim] = {}
        for name in DIMS:
            dm = root[name] if root is not None else None
            self._dims[name] = MeshDim(name, sizes[name], dm.get_local_rank() if dm is not None else 0,
                                       dm.get_group() if dm is not None else None, dm)
        for name, spans in FLATTENED.items():
            big = [d for d in spans if sizes[d] > 1]
            if len(big) <= 1:  # one dim (or none) of size > 1: the flattened dim is that dim
                self._dims[name] = dataclasses.replace(self._dims[big[0] if big else spans[-1]], name=name)
                continue
            dm = root[spans]._flatten("_".join(spans))
            self._dims[name] = MeshDim(name, dm.size(), dm.get_local_rank(), dm.get_group(), dm)

    def __getitem__(self, name: str) -> MeshDim:
        return self._dims[name]

    def device_mesh(self, *names: str) -> DeviceMesh:
        """A torch DeviceMesh over `names` (one name: that dim, flattened ones included; several: the root's
        sub-mesh), for the twins that take a mesh."""
        return self._dims[names[0]].device_mesh if len(names) == 1 else self.root[names]

    def pipelines(self) -> list[list[int]]:
        """Every pipeline's global ranks in pp order (pp is outermost: the ranks j, j + W/P, j + 2W/P, ...)."""
        rest = self.dims.world_size // self.dims.pp
        return [[s * rest + j for s in range(self.dims.pp)] for j in range(rest)]


FAKE = "fake"  # torch's fake backend: every collective is accepted and moves no data (a simulated rank)


def init_distributed(dims: ParallelDims, device: torch.device, timeout_s: float = 600.0,
                     fake_rank: int | None = None) -> Mesh:
    """Join the process group (when there is more than one rank) and return the run's Mesh (on one process: every
    dim of size 1, no groups). Every group then has the run's timeout (`honour_timeout`).

    `fake_rank`: play that rank of a dims.world_size job on the fake backend instead (plan/fake_rank.py): no
    store, no peers, collectives that return at once; the mesh's groups are made by the same calls. Its rank
    tables are host data, built outside any dispatch mode (a simulated rank runs under FakeTensorMode, whose
    tensors have no values to read)."""
    if dims.world_size == 1:
        return Mesh(dims)
    if fake_rank is not None:
        from torch.utils._python_dispatch import _disable_current_modes
        if not dist.is_initialized():
            dist.init_process_group(FAKE, rank=fake_rank, world_size=dims.world_size)
        with _disable_current_modes():
            root = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                                    mesh_dim_names=DIMS)
            return Mesh(dims, root)  # no timeouts: the fake backend waits for nothing
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    root = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                            mesh_dim_names=DIMS)
    mesh = Mesh(dims, root)
    honour_timeout(timeout)
    return mesh


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables (plus `extra`), for launching a separate job:
    a run started from inside a torchrun rank must not join that rank's job."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env


def exit_process(code: int) -> NoReturn:
    """End this rank's process now, with `code`, skipping the interpreter's finalization. Call it last, once
    everything is flushed and closed and the group destroyed. Gloo's threads outlive destroy_process_group()
    while anything still references their group (FSDP2's DeviceMesh, kept by DTensor's caches, holds it in
    _pg_registry); one that drops the last reference to a Python-owned tensor after finalization has begun is
    killed mid-destructor: "terminate called without an active exception", SIGABRT, though the work is done."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
