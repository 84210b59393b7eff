"""Every collective our own wrappers issue goes through here, so the bytes they move can be counted.

The counter records payload bytes per kind, per call (and the number of calls per kind: `snapshot_calls`):
- all_reduce: the tensor's bytes;
- all_gather: the bytes of the gathered (full) output;
- reduce_scatter: the bytes of the (full) input;
- broadcast: the tensor's bytes;
- p2p: the bytes of each tensor sent point-to-point (`send`; `recv` adds nothing, so summed over ranks
  every message counts once);
- all_to_all: the bytes of this rank's input, every split (its own included: it is copied, not sent, but a
  layout-independent count is what the formulas are written in).
Each wrapper's theory is written in these sizes in the formula sheet, plan/theory.py: `ddp_comm_bytes_per_step`,
`fsdp_comm_bytes_per_micro_step` (2 all-gathers of each Block and 1 of the root, and 1 reduce-scatter of
everything, per micro-step), `tp_comm_bytes_per_micro_step`, ... Backend overheads (ring 2(N-1)/N factors, gloo
emulating reduce-scatter through all-reduce) are not counted: they are the transport's, not the algorithm's.

Every op is also recorded, posted and then completed, through `RECORDER`, counted or not: the scalar
reductions (grad norm, mean loss, found-inf, the preemption vote) pass `counted=False`. `RECORDER` records
nothing until a flight recorder is installed from above (debug/flight_recorder.py: train.py's runs; `python -m
debug hang` reads it after a hang). `HOOKS` is the one seam for test hooks.

Averages are computed as SUM followed by a division by the group size, which every backend supports
(gloo has no ReduceOp.AVG in older torch versions, and some backends none for integer tensors).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all")


class CommCounter:
    """Payload bytes and calls (one per counted op: a collective, or a p2p message) per collective kind since the
    last `reset()`. The calls are what a per-call latency charges (plan/search.py step_time); each wrapper's
    calls formula sits beside its bytes formula."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)

    def snapshot_calls(self) -> dict[str, int]:
        """{kind: calls}, the kinds as `snapshot` lists them (broadcast, p2p only if any)."""
        return _listed(self.calls)

    def snapshot(self) -> dict[str, int]:
        """{kind: bytes} for all_reduce, all_gather and reduce_scatter (and broadcast, p2p, all_to_all if any)."""
        return _listed(self.bytes)


def _listed(counts: dict[str, int]) -> dict[str, int]:
    """all_reduce, all_gather and reduce_scatter always; broadcast, p2p and all_to_all only where nonzero."""
    out = {k: int(counts.get(k, 0)) for k in KINDS[:3]}
    out.update({k: int(counts[k]) for k in KINDS[3:] if counts.get(k)})
    return out


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the old names.
# Looked up on torch.distributed at each call (so a test can record what torch receives).
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

COUNTER = CommCounter()  # one per process: every wrapper's traffic adds up in the same place


# The one seam through which tests and trainer/faults.py reach the runtime, asked at two named places; None in a normal
# run (then no hook is even asked), else set from above (faults.FaultHooks: nothing in parallel/ imports it).
#   HOOKS.op(name, tensor)          before every all_reduce and recv: None, "skip" (the op is not issued) or
#                                   "shape" (it is issued on all but the last element), as a buggy rank would
#   HOOKS.local_gradients(buffers)  our DDP, after a backward inside no_sync, with its bucket buffers
HOOKS = None


class Recorder:
    """The seam every op is recorded through: `RECORDER`. This one records nothing; debug/flight_recorder.py's
    FlightRecorder, installed from above (nothing in parallel/ imports it), answers the same calls:
        post(op, tensor, group, peer, unit) -> n   before the op is issued (`unit`: what a wrapper moves)
        issued(n, work, async_op) -> work          once torch returned; an async op's work may come back
                                                   wrapped, so that its wait() marks the op completed
        done(n)                                    the op completed
    `step` and `micro` are the context train.py's loop and the micro-batch loops set."""

    step, micro = 0, -1

    def post(self, op: str, tensor: torch.Tensor, group, peer: int = -1, unit: str | None = None) -> int:
        return -1

    def issued(self, n: int, work, async_op: bool):
        return work

    def done(self, n: int) -> None:
        pass


RECORDER: Recorder = Recorder()


class Skipped:
    """The work handle of an op a hook skipped: already complete."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _fault(op: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """tensor, narrowed by a "shape" fault; None for a "skip" fault."""
    action = HOOKS.op(op, tensor)
    if action == "skip":
        return None
    if action == "shape":
        return tensor.view(-1)[:-1]
    return tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def world(group: dist.ProcessGroup | None) -> int:
    """Size of `group`; 1 when torch.distributed is not initialised (single process)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank within `group`; 0 when the group has one rank (or there is no process group)."""
    return dist.get_rank(group) if world(group) > 1 else 0


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    async_op: bool = False,
    counted: bool = True,
    unit: str | None = None,
):
    """In-place all-reduce of `tensor` over `group`. op: "sum", "avg" (sum then divide), or "max".

    With async_op the division for "avg" is left to the caller, after wait(). counted=False: recorded but not
    counted (the scalar reductions that are not wrapper traffic). `unit`: what is reduced, for the flight
    recorder (as for every op below).
    """
    if world(group) == 1:
        return None
    if counted:
        COUNTER.add("all_reduce", _nbytes(tensor))
    wire = tensor if HOOKS is None else _fault("all_reduce", tensor)
    if wire is None:
        return Skipped() if async_op else None
    n = RECORDER.post("all_reduce", wire, group, unit=unit)
    red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    work = RECORDER.issued(n, dist.all_reduce(wire, op=red, group=group, async_op=async_op), async_op)
    if op == "avg" and not async_op:
        tensor.div_(world(group))
    return work


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def all_gather_into_tensor(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: str | None = None,
):
    """Gather every rank's equal-sized `shard` into `output` (rank order, along dim 0)."""
    if world(group) == 1:
        output.copy_(shard.view_as(output))
        return None
    COUNTER.add("all_gather", _nbytes(output))
    n = RECORDER.post("all_gather", shard, group, unit=unit)
    return RECORDER.issued(n, getattr(dist, ALL_GATHER)(output, shard, group=group, async_op=async_op), async_op)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def reduce_scatter_tensor(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: str | None = None,
):
    """Sum `full` over ranks and leave this rank's 1/N slice (along dim 0) in `output`."""
    if world(group) == 1:
        output.copy_(full.view_as(output))
        return None
    COUNTER.add("reduce_scatter", _nbytes(full))
    n = RECORDER.post("reduce_scatter", full, group, unit=unit)
    work = getattr(dist, REDUCE_SCATTER)(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return RECORDER.issued(n, work, async_op)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    unit: str | None = None,
):
    """Rank r sends rows [sum(input_split_sizes[:j]), ...) of `input` (dim 0) to rank j and receives rank j's
    rows for it into `output` in rank order (`output_split_sizes[j]` rows from rank j); None: equal splits. The
    split sizes are host ints: both sides must know them before the op (their all_to_all first, if they vary)."""
    if world(group) == 1:
        output.copy_(input)
        return None
    COUNTER.add("all_to_all", _nbytes(input))
    n = RECORDER.post("all_to_all", input, group, unit=unit)
    work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    return RECORDER.issued(n, work, async_op)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (no communication), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t`: a DTensor is all-gathered over its mesh (collective), a plain tensor is itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `tensor` with global rank `src`'s copy."""
    if world(group) == 1:
        return
    COUNTER.add("broadcast", _nbytes(tensor))
    n = RECORDER.post("broadcast", tensor, group, -1)
    dist.broadcast(tensor, src=src, group=group)
    RECORDER.done(n)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Post a non-blocking send of `tensor` to `dst` (a rank of `group`); returns the work handle to wait.

    Plain isend, not batch_isend_irecv (which can hang on gloo). gloo matches the k-th send from a to b
    with the k-th receive on b from a, so both sides must post a pair's messages in the same order."""
    COUNTER.add("p2p", _nbytes(tensor))
    peer = _global(dst, group)
    n = RECORDER.post("send", tensor, group, peer)
    return RECORDER.issued(n, dist.isend(tensor, dst=peer, group=group), True)


@torch.compiler.disable  # eager under torch.compile: the counter is a Python side effect
def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> dist.Work:
    """Post a non-blocking receive into `tensor` from `src` (a rank of `group`); returns the work handle.
    Not counted: the sender counts the message."""
    if HOOKS is not None and _fault("recv", tensor) is None:
        return Skipped()
    peer = _global(src, group)
    n = RECORDER.post("recv", tensor, group, peer)
    return RECORDER.issued(n, dist.irecv(tensor, src=peer, group=group), True)


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
