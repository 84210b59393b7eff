"""The mesh: validates the parallel layout (`ParallelDims`) and builds the run's one mesh of named dims, each with
its process group (`init_distributed`). The device and the backend are chosen in runtime/device.py.

Mesh dims are ("pp", "dp_replicate", "dp_shard", "cp", "tp"), always all five (size 1 where unused), tp innermost
(fastest-varying) so TP groups are neighbouring ranks, which on a GPU node share NVLink; pp outermost, so a
pipeline's stages span nodes and only its point-to-point activations cross them. dp = dp_replicate x dp_shard
(dp_replicate > 1 only under HSDP). Flattened dims have names for what they do: `batch` (data loading),
`loss` (loss mean, DDP's gradient mean: dp x cp), `fsdp` (sharding: dp_shard x cp).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import _disable_current_modes

from parallel.groups import group_timeout, honour_timeout, link_groups, new_groups, serial_p2p
from runtime.device import join_world


class WorldSizeError(ValueError):
    """The parallel sizes multiply to `needed` ranks, not the world's: the caller says how to get `needed` ranks
    (torchrun's --nproc_per_node, a simulated rank's --fake_world_size, sim.verify's --world_size)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class ParallelDims:
    """A validated (pp, dp, cp, tp) layout. pp * dp * cp * tp must equal the world size."""

    dp: int
    tp: int
    world_size: int
    pp: int = 1
    dp_replicate: int = 1  # HSDP: dp = dp_replicate x dp_shard
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    ep: int = 1  # expert parallelism: borrows its ranks from dp x cp (it must divide them)

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(
                f"parallel sizes must be >= 1, got pipeline_parallel_size={self.pp}, "
                f"data_parallel_size={self.dp}, tensor_parallel_size={self.tp}, "
                f"expert_parallel_size={self.ep}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"expert_parallel_size ({self.ep}) must divide data_parallel_size x "
                f"context_parallel_size = {self.dp * self.cp}: expert parallelism borrows those ranks"
            )
        n = self.pp * self.dp * self.cp * self.tp
        if n != self.world_size:
            cp = f"context_parallel_size ({self.cp}) x " if self.cp > 1 else ""
            raise WorldSizeError(
                f"pipeline_parallel_size ({self.pp}) x data_parallel_size ({self.dp}) x {cp}"
                f"tensor_parallel_size ({self.tp}) = {n} must equal the world size "
                f"({self.world_size})",
                n,
            )

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
        return {
            "tp": rank % self.tp,
            "cp": rank // self.tp % self.cp,
            "dp": rank // (self.tp * self.cp) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
        }

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def mesh_sizes(self) -> dict[str, int]:
        """The size of each mesh dim (`DIMS`), by name."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    def sizes(self) -> dict[str, int]:
        """Every dimension's size by name, the checkpoint manifest's record of the layout."""
        return {
            "pp": self.pp,
            "dp": self.dp,
            "dp_replicate": self.dp_replicate,
            "cp": self.cp,
            "tp": self.tp,
            "ep": self.ep,
        }


# dims a run names only where they are on (train.py's description, a resume's note), beside pp, dp and tp
OPTIONAL_DIMS = ("cp", "ep")


DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dims, outermost first
# flattened dims, by what they are for: name -> the dims they span
FLATTENED = {
    "batch": ("dp_replicate", "dp_shard"),  # which rows of the global batch a rank reads (data loading)
    "loss": ("dp_replicate", "dp_shard", "cp"),  # same parameters, other tokens: the loss mean and DDP's gradient mean
    "fsdp": ("dp_shard", "cp"),  # what a sharding engine shards over (HSDP replicates over dp_replicate)
}


@dataclass(frozen=True)
class MeshDim:
    """One named dim of the mesh as this rank sees it: its size, this rank's coordinate on it, and the process
    group over it (None on one process, where every dim has size 1 and nothing is communicated). `device_mesh`:
    the same dim as a torch DeviceMesh, for the PyTorch twins (None on one process). `links`: the dim's link
    groups (`p2p_link`: the same ranks as `group`, in the same order, one per link colour), which its ring's
    p2p goes over where `serial_p2p` (Mesh.build_links); empty: every p2p message on `group`."""

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None
    device_mesh: DeviceMesh | None
    links: tuple[dist.ProcessGroup, ...] = ()

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
        sizes = dims.mesh_sizes()
        self._dims: dict[str, MeshDim] = {}
        for name in DIMS:
            dm = root[name] if root is not None else None
            self._dims[name] = MeshDim(
                name,
                sizes[name],
                dm.get_local_rank() if dm is not None else 0,
                dm.get_group() if dm is not None else None,
                dm,
            )
        for name, spans in FLATTENED.items():
            big = [d for d in spans if sizes[d] > 1]
            if len(big) <= 1:  # one dim (or none) of size > 1: the flattened dim is that dim
                self._dims[name] = dataclasses.replace(self._dims[big[0] if big else spans[-1]], name=name)
                continue
            dm = root[spans]._flatten("_".join(spans))
            self._dims[name] = MeshDim(name, dm.size(), dm.get_local_rank(), dm.get_group(), dm)
        self._dims["ep"], self._dims["edp"] = expert_dims(dims, self._dims["loss"])

    def __getitem__(self, name: str) -> MeshDim:
        return self._dims[name]

    def device_mesh(self, *names: str) -> DeviceMesh:
        """A torch DeviceMesh over `names` (one name: that dim, flattened ones included; several: the root's
        sub-mesh), for the twins that take a mesh."""
        return self._dims[names[0]].device_mesh if len(names) == 1 else self.root[names]

    def pipelines(self) -> list[list[int]]:
        """Every pipeline's global ranks in pp order (pp is outermost: the ranks j, j + W/P, j + 2W/P, ...)."""
        return dim_ranks(self.dims, "pp")

    def build_links(self) -> None:
        """Give the pp and cp dims (where larger than one rank) their link groups (`p2p_link`, `link_groups`):
        for each dim, each link colour, one group per instance of the dim with the dim's ranks (`new_groups`).
        Collective over the whole world: every rank calls it, in the same order."""
        for name in ("pp", "cp"):
            d = self._dims[name]
            if d.enabled:
                lists = dim_ranks(self.dims, name)
                links = tuple(new_groups(lists, group_timeout()) for _ in range(link_groups(d.size)))
                self._dims[name] = dataclasses.replace(d, links=links)


def dim_ranks(dims: ParallelDims, name: str) -> list[list[int]]:
    """Every group of mesh dim `name` (one of DIMS) over the world: the global ranks of each, in the dim's order
    (a group's rank i is its i-th), ordered by their first rank. Rank layout as Mesh's."""
    sizes = dims.mesh_sizes()
    stride = 1
    for d in reversed(DIMS[DIMS.index(name) + 1 :]):
        stride *= sizes[d]
    span = stride * sizes[name]  # ranks from one group's first to the next block's
    return [[base + k * stride for k in range(sizes[name])] for base in range(dims.world_size) if base % span < stride]


def expert_dims(dims: ParallelDims, loss: MeshDim) -> tuple[MeshDim, MeshDim]:
    """The expert-parallel dims, borrowed from `loss` (dp x cp, the ranks holding the same dense parameters):
    `ep`, E/ep experts per rank, EP rank r of group g being loss rank g·ep + r; and `edp`, the ranks holding the
    same experts (loss ranks ≡ r mod ep), which reduce their gradients. Every rank of the world builds every
    group, in the same order (ep groups, then edp groups, by (pp, tp) then index), member or not: `new_groups`,
    one split_group per kind on eager NCCL. Without EP: ep has size 1 and edp is `loss` itself."""
    ep = dims.ep
    if ep == 1 or loss.group is None:
        return MeshDim("ep", 1, 0, None, None), dataclasses.replace(loss, name="edp")
    n, T = dims.dp * dims.cp, dims.tp  # global rank = (pp·n + l)·T + tp, l the loss rank
    rank = dist.get_rank()
    mine: dict[str, tuple[dist.ProcessGroup, list[int]]] = {}
    for name, members in (("ep", lambda g: range(g * ep, (g + 1) * ep)), ("edp", lambda g: range(g, n, ep))):
        count = n // ep if name == "ep" else ep
        lists = [
            [(pp * n + l) * T + tp for l in members(g)]
            for pp in range(dims.pp)
            for tp in range(T)
            for g in range(count)
        ]
        mine[name] = (new_groups(lists, group_timeout()), next(ranks for ranks in lists if rank in ranks))
    return tuple(
        MeshDim(name, len(mine[name][1]), mine[name][1].index(rank), mine[name][0], None) for name in ("ep", "edp")
    )


FAKE = "fake"  # torch's fake backend: every collective is accepted and moves no data (a simulated rank)


def init_distributed(
    dims: ParallelDims, device: torch.device, timeout_s: float = 600.0, fake_rank: int | None = None
) -> Mesh:
    """Join the process group (when there is more than one rank) and return the run's Mesh (on one process: every
    dim of size 1, no groups), with link groups for the pp and cp rings where `serial_p2p`. Every group then has
    the run's timeout (`honour_timeout`).

    `fake_rank`: play that rank of a dims.world_size job on the fake backend instead (sim/fake_rank.py): no
    store, no peers, collectives that return at once; the mesh's groups are made by the same calls. Its rank
    tables are host data, built outside any dispatch mode (a simulated rank runs under FakeTensorMode, whose
    tensors have no values to read)."""
    if dims.world_size == 1:
        return Mesh(dims)
    timeout = timedelta(seconds=timeout_s)
    if fake_rank is None:
        join_world(device, timeout)
    elif not dist.is_initialized():
        dist.init_process_group(FAKE, rank=fake_rank, world_size=dims.world_size)
    with contextlib.nullcontext() if fake_rank is None else _disable_current_modes():
        root = init_device_mesh(device.type, tuple(dims.mesh_sizes()[d] for d in DIMS), mesh_dim_names=DIMS)
        mesh = Mesh(dims, root)
        if serial_p2p(device):
            mesh.build_links()
    if fake_rank is None:  # the fake backend waits for nothing: no timeouts
        honour_timeout(timeout)
    return mesh
