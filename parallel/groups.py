"""Process groups beyond the mesh's own dims (the expert dims, the rings' link groups, the pipelines' embedding
groups, the checkpoint saver's): every rank of the world builds every one, in the same order, member or not
(`new_groups`), and every group this rank is in has the run's --timeout (`honour_timeout`, `group_timeout`).

A ring's link groups (the pipeline's stages, context parallelism's ring attention): which group carries the
messages between two neighbouring ranks (`p2p_link`), where the backend would otherwise put a rank's sends and
receives to both neighbours on one queue (`serial_p2p`). The mesh builds them (Mesh.build_links) over the same
ranks as the ring's dim.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from runtime.device import backend_for

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


# ----------------------------------------------------------------------------- a ring's link groups


def serial_p2p(device: torch.device) -> bool:
    """Whether a rank's unbatched p2p ops on one group run one after another, across all its peers: on NCCL
    (`backend_for`), whose groups are all eagerly initialised (init_distributed passes device_id), so
    ProcessGroupNCCL::pointToPoint puts every unbatched send and receive of a group on the group's one
    communicator and stream ("serialized with all other ops on this ProcessGroup, including other P2P ops",
    torch's warning). A ring's p2p (the pipeline's, context parallelism's) then goes over link groups
    (`p2p_link`; Mesh.build_links), so a send to one neighbour never queues behind a receive from the other
    (what that costs without them, by plan/timeline.py's "nccl_eager" model: docs/pipeline.md, Messages). Off
    on gloo: it matches each (sender, receiver) pair's k-th send with its k-th receive and never blocks a
    rank's other peers (and batch_isend_irecv, a single stream, can hang on gloo: parallel/comm.py `send`)."""
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
