"""Startup at scale: how many process groups a layout builds at init, and how many calls every rank of the world
makes to build them (`init_group_calls`).

Every group here is built by every rank of the world, member or not, in the same order: dist.new_group is a call
of the whole world, and on NCCL with an eagerly initialised world group (runtime/device.py join_world
passes device_id) each new_group is a world-wide ncclCommSplit: the members split off with one colour, every
other rank with none (c10d `_new_process_group_helper`: `split_from.perform_nocolor_split`). dist.split_group
builds many disjoint groups in one such split (one call of the world for all of them); DeviceMesh uses it on
eager NCCL, one per mesh dim (torch/distributed/device_mesh.py `_init_one_process_group`), and otherwise calls
new_group once per group of the dim, a dim of size 1 included (W one-rank groups). dist.new_subgroups_by_enumeration
is no cheaper: it calls new_group once per list. parallel/groups.py `new_groups` builds our own families of
groups (the pipelines' [first, last] embedding groups, the link groups, the expert groups) by one split_group on
eager NCCL, one new_group per group elsewhere.

`init_group_calls` counts by running the real code on torch's fake backend in this process, one rank (every rank
makes the same calls), with dist.new_group and dist.split_group recorded; for NCCL it makes the checks that pick
the eager paths answer yes (the world group bound to a device and an accelerator present, DeviceMesh's and
`new_groups`'; `serial_p2p`, the link groups') and builds a split's groups with uncounted new_group calls (the
device unbound meanwhile), since the fake backend cannot split.

At 1,024 ranks (world-wide calls at init on NCCL; before `new_groups`, the embedding and expert groups were one
new_group each and there were no link groups):

| layout | before | now | of which mesh / links / embedding | groups now (links) |
|---|---|---|---|---|
| pp 8 x dp 128 | 133 | 8 | 5 / 2 / 1 | 3,592 (256) |
| pp 4 x dp 32 x tp 8 | 261 | 8 | 5 / 2 / 1 | 3,232 (512) |
| pp 8 x dp 16 x tp 8 | 133 | 8 | 5 / 2 / 1 | 2,752 (256) |
| pp 4 x dp 8 x cp 4 x tp 8 | 263 | 12 | 7 / 4 / 1 | 3,136 (1,024) |
| pp 4 x dp 32 x tp 8, ep 8 | 645 | 10 | 7 / 2 / 1 | 3,616 (512) |

On gloo the same layouts make 3,336, 2,720, 2,496, 2,112 and 3,104 new_group calls: DeviceMesh builds every dim
group by group there, each of its size-1 dims (dp_replicate, and cp or tp where unused) W of them.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh_module

from parallel.mesh import ParallelDims


@dataclass
class GroupCalls:
    """What building a layout's groups takes, on every rank: `new_group` calls, `split_group` calls (each one call
    of the whole world; on eager NCCL each a world-wide ncclCommSplit: `world_calls`), and `groups`, the groups
    they create over the world (a split_group creates one per list). `by_phase`: (new_group, split_group,
    groups) per phase: "mesh" (DeviceMesh's dims and flattened dims, and the expert dims), "links" (the pp and cp
    rings' link groups, NCCL only), "embedding" (the pipelines' tied-embedding groups); `ranks`: each phase's
    groups' global ranks, in the order they were built."""

    new_group: int = 0
    split_group: int = 0
    groups: int = 0
    by_phase: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    ranks: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def world_calls(self) -> int:
        return self.new_group + self.split_group


def init_group_calls(dims: ParallelDims, backend: str = "nccl", v_shape: bool = False) -> GroupCalls:
    """The groups a run of layout `dims` (a parallel.mesh.ParallelDims) builds before its first step, and the
    world-wide calls that build them, on `backend` ("nccl": the eager path a CUDA run takes; "gloo": the CPU
    path): parallel.mesh.init_distributed's (the mesh, the expert dims, and on NCCL the link groups) and, with
    pp > 1, the pipelines' embedding groups (parallel.pipeline.runner.embedding_group; none under a V schedule,
    `v_shape`). Needs this process without a process group: it joins a fake one of dims.world_size ranks and
    leaves it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel import mesh as mesh_module
    from parallel.pipeline.runner import embedding_group

    if dist.is_initialized():
        raise RuntimeError(
            "init_group_calls runs the group building on a fake process group of its own: call it "
            "where no process group is initialised"
        )
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend is 'nccl' or 'gloo', got {backend!r}")
    eager = backend == "nccl"
    out, phase = GroupCalls(), ["mesh"]
    real_new_group = dist.new_group

    def count(new: int, split: int, lists: list[list[int]]) -> None:
        out.new_group, out.split_group = out.new_group + new, out.split_group + split
        out.groups += len(lists)
        n, s, g = out.by_phase.get(phase[0], (0, 0, 0))
        out.by_phase[phase[0]] = (n + new, s + split, g + len(lists))
        out.ranks.setdefault(phase[0], []).extend(sorted(r) for r in lists)

    @contextlib.contextmanager
    def unbound():  # the fake backend refuses to build groups on a device without an accelerator
        world = dist.distributed_c10d._get_default_group()
        bound, world.bound_device_id = world.bound_device_id, None
        try:
            yield
        finally:
            world.bound_device_id = bound

    def new_group(ranks=None, *args, **kw):
        count(1, 0, [list(range(dims.world_size)) if ranks is None else ranks])
        with unbound():
            return real_new_group(ranks, *args, **kw)

    def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **kw):
        count(0, 1, split_ranks)
        mine = None
        with unbound():
            for ranks in split_ranks:  # the fake backend cannot split: the same groups, by uncounted new_group calls
                g = real_new_group(sorted(ranks), timeout=timeout, pg_options=pg_options, group_desc=group_desc)
                if dist.get_rank() in ranks:
                    mine = g
        return mine

    dist.init_process_group("fake", rank=0, world_size=dims.world_size, store=FakeStore())
    try:
        with contextlib.ExitStack() as stack, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Set timeout is now only supported")  # honour_timeout on the fake groups
            for target in (dist, device_mesh_module):
                stack.enter_context(mock.patch.object(target, "new_group", new_group))
                stack.enter_context(mock.patch.object(target, "split_group", split_group))
            if eager:  # what takes NCCL's eager paths: a bound world group, an accelerator; its link groups
                dist.distributed_c10d._get_default_group().bound_device_id = torch.device("cpu", 0)
                stack.enter_context(mock.patch.object(torch.accelerator, "is_available", lambda: True))
                stack.enter_context(mock.patch.object(mesh_module, "serial_p2p", lambda device: True))
            real_links = mesh_module.Mesh.build_links

            def build_links(self):
                phase[0] = "links"
                real_links(self)

            stack.enter_context(mock.patch.object(mesh_module.Mesh, "build_links", build_links))
            mesh = mesh_module.init_distributed(dims, torch.device("cpu"))
            if dims.pp > 1:
                phase[0] = "embedding"
                embedding_group(mesh.pipelines(), v_shape)
    finally:
        dist.destroy_process_group()
    return out
