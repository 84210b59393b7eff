"""The one place that picks device and backend, validates the parallel layout and builds the mesh.

Mesh dims are ("pp", "dp", "tp"), tp innermost (fastest-varying) so TP groups are neighbouring ranks, which
on a GPU node share NVLink; pp outermost, so a pipeline's stages span nodes and only its point-to-point
activations cross them. Rank r = (pp_rank * dp + dp_rank) * tp + tp_rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
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


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class ParallelDims:
    """A validated (pp, dp, tp) layout. pp * dp * tp must equal the world size."""
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


def init_distributed(dims: ParallelDims, device: torch.device, timeout_s: float = 600.0) -> DeviceMesh | None:
    """Join the process group (when there is more than one rank) and return the ("pp", "dp", "tp") mesh;
    with HSDP a `HybridMesh` whose "dp" also splits into "dp_replicate" x "dp_shard"."""
    if dims.world_size == 1:
        return None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    if dims.cp > 1:
        return ContextMesh(init_device_mesh(device.type, (dims.pp, dims.dp, dims.cp, dims.tp),
                                            mesh_dim_names=("pp", "dp", "cp", "tp")))
    if dims.dp_replicate == 1:
        return init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    return HybridMesh(init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp),
                                       mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp")))


class HybridMesh:
    """The HSDP mesh: ("pp", "dp_replicate", "dp_shard", "tp"), dp_replicate outer, plus "dp", the two
    flattened (dp rank = replicate rank x dp_shard + shard rank), kept here: torch deprecates slicing a
    flattened dim from the root mesh. `mesh` is the rank grid seen as (pp, dp, tp), like the plain mesh's."""

    def __init__(self, root: DeviceMesh):
        self.root = root
        self.dp = root["dp_replicate", "dp_shard"]._flatten("dp")
        self.mesh = root.mesh.reshape(root.mesh.shape[0], -1, root.mesh.shape[-1])

    def __getitem__(self, name):
        return self.dp if name == "dp" else self.root[name]


class ContextMesh:
    """The context-parallel mesh: ("pp", "dp", "cp", "tp"). Parameters are replicated over cp, so every
    gradient reduction and loss mean runs over dp x cp: "dp" here is the two flattened (kept here: torch
    deprecates slicing a flattened dim from the root); "cp" is the ring. `mesh` is the rank grid seen as
    (pp, dp x cp, tp). A rank's pure dp coordinate (which rows it reads) is ParallelDims.coordinates'."""

    def __init__(self, root: DeviceMesh):
        self.root = root
        self.dp = root["dp", "cp"]._flatten("dp_cp")
        self.mesh = root.mesh.reshape(root.mesh.shape[0], -1, root.mesh.shape[-1])

    def __getitem__(self, name):
        return self.dp if name == "dp" else self.root[name]


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables (plus `extra`), for launching a separate job:
    a run started from inside a torchrun rank must not join that rank's job."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env
