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


def serial_p2p(device: torch.device) -> bool:
    """Whether a rank's unbatched p2p ops on one group run one after another, across all its peers: on NCCL
    (`backend_for`), whose groups are all eagerly initialised here (init_distributed passes device_id), so
    ProcessGroupNCCL::pointToPoint puts every unbatched send and receive of a group on the group's one
    communicator and stream ("serialized with all other ops on this ProcessGroup, including other P2P ops",
    torch's warning). A ring's p2p (the pipeline's, context parallelism's) then goes over link groups
    (`p2p_link`; Mesh.build_links), so a send to one neighbour never queues behind a receive from the other
    (plan/simulate.py's "nccl_eager" model: without them up to +7.6% makespan for ZB-V and +9.3% for DualPipe-V
    when B is slower than F, +10.9% for 1F1B and +12.5% for ZB-H1 with a slow first stage; and CP's ring runs
    half duplex). Off on gloo: it matches each (sender, receiver) pair's k-th send with its k-th
    receive and never blocks a rank's other peers, so link groups would only cost groups there (and
    batch_isend_irecv, the other way round a single stream, can hang on gloo: parallel/comm.py `send`)."""
    return backend_for(device) == "nccl"


def p2p_link(lower: int, upper: int, n: int) -> int:
    """Which of a ring's link groups (`link_groups`) carries the messages between ranks `lower` and `upper` of
    a group of n, neighbours on the ring (upper = lower + 1 mod n, or lower - 1 for the way back up a V: the
    rank of the chunk before the boundary and the rank of the one after). Link i joins ranks i and i+1 (mod n);
    it goes on group i mod 2, and the ring's closing link n-1 on group 2 when n is odd, so no rank has two of
    its links on one group: each rank's FIFO on a group carries one peer's messages (see `serial_p2p`). Both
    ends compute it from the same (lower, upper), so both post the message on the same group. At n = 2 the two
    ranks have two links: 0 when lower is rank 0, the closing link 1 when lower is rank 1 (a V's way back)."""
    link = lower if upper == (lower + 1) % n else upper
    return 2 if n % 2 and link == n - 1 else link % 2


def link_groups(n: int) -> int:
    """How many link groups a ring of n ranks needs (`p2p_link`): none for one rank, 2 for an even ring, 3 for
    an odd one (its closing link would share a group with link 0)."""
    return 0 if n < 2 else 2 + n % 2


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


class WorldSizeError(ValueError):
    """The parallel sizes multiply to `needed` ranks, not the world's: the caller says how to get `needed` ranks
    (torchrun's --nproc_per_node, a simulated rank's --fake_world_size, plan.verify's --world_size)."""

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
    cp: int = 1            # context parallelism: each sequence split over cp ranks
    ep: int = 1            # expert parallelism: borrows its ranks from dp x cp (it must divide them)

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1 or self.pp < 1 or self.ep < 1:
            raise ValueError(f"parallel sizes must be >= 1, got pipeline_parallel_size={self.pp}, "
                             f"data_parallel_size={self.dp}, tensor_parallel_size={self.tp}, "
                             f"expert_parallel_size={self.ep}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert_parallel_size ({self.ep}) must divide data_parallel_size x "
                             f"context_parallel_size = {self.dp * self.cp}: expert parallelism borrows those ranks")
        n = self.pp * self.dp * self.cp * self.tp
        if n != self.world_size:
            cp = f"context_parallel_size ({self.cp}) x " if self.cp > 1 else ""
            raise WorldSizeError(f"pipeline_parallel_size ({self.pp}) x data_parallel_size ({self.dp}) x {cp}"
                                 f"tensor_parallel_size ({self.tp}) = {n} must equal the world size "
                                 f"({self.world_size})", n)

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

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def sizes(self) -> dict[str, int]:
        """Every dimension's size by name, the checkpoint manifest's record of the layout."""
        return {"pp": self.pp, "dp": self.dp, "dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp,
                "ep": self.ep}


# dims a run names only where they are on (train.py's description, a resume's note), beside pp, dp and tp
OPTIONAL_DIMS = ("cp", "ep")


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
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
             "tp": dims.tp}
    stride = 1
    for d in reversed(DIMS[DIMS.index(name) + 1:]):
        stride *= sizes[d]
    span = stride * sizes[name]  # ranks from one group's first to the next block's
    return [[base + k * stride for k in range(sizes[name])]
            for base in range(dims.world_size) if base % span < stride]


def new_groups(rank_lists: list[list[int]], timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """One process group per list of `rank_lists` (disjoint, each sorted), built by every rank of the world,
    member or not, with the same lists; returns this rank's (None where it is in none). Where the world group is
    bound to a device (NCCL, eager: init_distributed) that is one split_group: one world-wide ncclCommSplit for
    all the groups. Elsewhere (gloo, and the fake backend `init_group_calls` counts with) one dist.new_group
    per list, each a call every rank of the world makes (and on eager NCCL each a world-wide split too, the
    non-members' a no-colour one: c10d _new_process_group_helper)."""
    me = dist.get_rank()
    if c10d._get_default_group().bound_device_id is not None:
        return dist.split_group(split_ranks=rank_lists, timeout=timeout)
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            mine = g
    return mine


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
        lists = [[(pp * n + l) * T + tp for l in members(g)]
                 for pp in range(dims.pp) for tp in range(T) for g in range(count)]
        mine[name] = (new_groups(lists, group_timeout()), next(ranks for ranks in lists if rank in ranks))
    return tuple(MeshDim(name, len(mine[name][1]), mine[name][1].index(rank), mine[name][0], None)
                 for name in ("ep", "edp"))


FAKE = "fake"  # torch's fake backend: every collective is accepted and moves no data (a simulated rank)


def init_distributed(dims: ParallelDims, device: torch.device, timeout_s: float = 600.0,
                     fake_rank: int | None = None) -> Mesh:
    """Join the process group (when there is more than one rank) and return the run's Mesh (on one process: every
    dim of size 1, no groups), with link groups for the pp and cp rings where `serial_p2p`. Every group then has
    the run's timeout (`honour_timeout`).

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
            mesh = Mesh(dims, root)
            if serial_p2p(device):
                mesh.build_links()
            return mesh  # no timeouts: the fake backend waits for nothing
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device), timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    root = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                            mesh_dim_names=DIMS)
    mesh = Mesh(dims, root)
    if serial_p2p(device):
        mesh.build_links()
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
