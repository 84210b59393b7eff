"""Host syncs from our code inside a step: the recorder tests/test_host_sync.py and scripts/gpu_measure.py share.

On CUDA the host blocks until the device has caught up whenever it needs a device value or hands the device
host memory it cannot copy asynchronously; `torch.cuda.set_sync_debug_mode("error")` raises on each. `recording`
records every such call whose nearest frame is in this repository (tests and this file excluded) as
(file, function, kind), in two layers:

- a dispatch-level recorder (`SyncRecorder`, a TorchDispatchMode: every aten op the step runs, the backward's
  included) of the ops that sync on CUDA when their tensor is on the run's `device`:
  `aten._local_scalar_dense` (what `item()`, `float()`, `int()` and `bool()` of a tensor read through), blocking copies
  between host and device (`aten._to_copy`, `aten.copy_` from a CPU tensor to
  another device unless it is pinned and non-blocking; to the CPU unless non-blocking), `aten.lift_fresh` (a
  tensor made from Python data: `torch.tensor(list, device=d)` copies a pageable host buffer to `d`), and ops
  whose output size depends on the data (`nonzero`, `masked_select`, `equal`, `unique`, `bincount`, a boolean
  mask index), which read a count back;
- Python-level patches of `Tensor.item`, `tolist`, `cpu` and `__bool__`, for the reads no aten op shows on the
  CPU (`cpu()` and `tolist()` of a CPU tensor dispatch nothing). An op inside a patched call is recorded once,
  by the patch.

What the CPU recorder sees, and what it cannot. On a CPU run the run's device is the CPU, so "on the run's
device" is every tensor: each scalar read and each tensor made from Python data or numpy is recorded, also those
that on a GPU run are host tensors and cost nothing (the data loader's: hence ALLOWED). It cannot see a
host-to-device move of an existing host tensor (`x.to(device)`: on the CPU that dispatches nothing), nor which
host buffer is pinned: those moves go through `parallel.mesh.to_device` (pinned, non-blocking on CUDA), and the
CUDA run of scripts/gpu_check.sh, where the same recorder also sees real host <-> device copies, audits them
under the sync debugger. Ops run by a thread with no frame of ours (NCCL's, gloo's) are not attributed.

With `audit` (the CUDA sync debugger on, set by the caller), the calls from an `ALLOWED` place run with the
debugger off, so only the syncs nobody allowed raise.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
# (file, function) -> why it may read the host once per step
ALLOWED = {
    ("train.py", "train_step"): "the step's loss and grad norm, logged (read at the end of the step, after the "
    "optimizer: nothing left to launch behind them)",
    ("trainer/faults.py", "agreed"): "the preemption vote, all-reduced with the loss's reductions, read after them",
    ("data/batches.py", "get"): "host tensors only: the rows' offsets come from a CPU generator and the tokens "
    "from a numpy memmap (on a GPU run they stay on the host until to_device)",
    (
        "parallel/expert_parallel/dispatch.py",
        "split_sizes",
    ): "an MoE layer's all_to_all split sizes: each rank must know how "
    "many rows it sends and receives before they move (one read per "
    "MoE layer and micro-batch; docs/moe.md)",
    (
        "model/moe.py",
        "split_sizes",
    ): "the MoE experts' group sizes for the per-expert loop, only where torch._grouped_mm "
    "does not run as a kernel (moe.grouped_mm_runs: CPU autocast, GPU fp32, GPUs before "
    "sm90, unaligned widths): one read per MoE layer and micro-batch",
    ("model/moe.py", "expert_loop"): "the same group sizes under torch.compile (moe.expert_loop, the loop as one op "
    "where the traced torch._grouped_mm takes no fp32): one read per MoE layer and micro-batch",
    ("model/moe.py", "expert_loop_backward"): "the forward's host copy of those sizes (a CPU tensor: no sync on a "
    "GPU, a read only this CPU recorder sees)",
    ("parallel/parallelize.py", "step_counters"): "the MoE layers' tokens per expert and balancing loss over the "
    "batch, logged (read after the step's loss: nothing left to wait "
    "for)",
}
SYNCS = ("item", "tolist", "cpu", "__bool__")

aten = torch.ops.aten
# ops whose output size is read back from the device before they return
DATA_DEPENDENT = {
    aten.nonzero,
    aten.masked_select,
    aten.equal,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
}
MASK_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_inside = threading.local()  # depth of patched calls on this thread: their ops are recorded by the patch


def ours(frame) -> tuple[str, str] | None:
    """(path relative to the repository, function) of the nearest frame in our code, tests and this file
    excluded."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if (
            path.startswith(ROOT + os.sep)
            and not path.startswith(os.path.join(ROOT, "tests") + os.sep)
            and path != HERE
        ):
            return os.path.relpath(path, ROOT), frame.f_code.co_name
        frame = frame.f_back
    return None


def _on(t, device: torch.device) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == device.type


def _copy_kind(src: torch.Tensor, target: torch.device, non_blocking: bool) -> str | None:
    """A copy that blocks the host: host -> device from pageable memory or without non_blocking (CUDA then
    stages it and waits), device -> host without non_blocking."""
    if src.device.type == "cpu" and target.type != "cpu":
        return None if non_blocking and src.is_pinned() else "host-to-device copy"
    if src.device.type != "cpu" and target.type == "cpu":
        return None if non_blocking else "device-to-host copy"
    return None


def sync_kind(func, args: tuple, kwargs: dict, device: torch.device) -> str | None:
    """What about this aten call blocks the host on a run on `device` (None: nothing)."""
    op = func.overloadpacket
    if op is aten._local_scalar_dense or op is aten.lift_fresh:
        return op.__name__ if _on(args[0], device) else None
    if op is aten._to_copy:
        src = args[0]
        return _copy_kind(src, torch.device(kwargs.get("device") or src.device), kwargs.get("non_blocking", False))
    if op is aten.copy_:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return _copy_kind(args[1], args[0].device, non_blocking) if isinstance(args[1], torch.Tensor) else None
    if op in DATA_DEPENDENT:
        return op.__name__ if _on(args[0], device) else None
    if op in MASK_INDEXED and _on(args[0], device):
        masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
        return f"{op.__name__} with a boolean mask" if masks else None
    return None


@contextlib.contextmanager
def _debugger_off() -> Iterator[None]:
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class SyncRecorder(TorchDispatchMode):
    """Appends (file, function, kind) to `seen` for each aten op that syncs on CUDA (`sync_kind`) when its
    tensor is on `device`, called from our code; with `audit`, runs the ones from ALLOWED places with the CUDA
    sync debugger off. Off while torch.compile traces (ignore_compile_internals); on for the compiled code's
    aten calls."""

    def __init__(self, seen: list[tuple[str, str, str]], device: torch.device, audit: bool):
        super().__init__()
        self.seen, self.device, self.audit = seen, device, audit

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = None if getattr(_inside, "depth", 0) else sync_kind(func, args, kwargs, self.device)
        if kind is None:
            return func(*args, **kwargs)
        where = ours(sys._getframe(1))
        if where is not None:
            self.seen.append((*where, kind))
        if self.audit and where in ALLOWED:
            with _debugger_off():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(
    seen: list[tuple[str, str, str]], audit: bool = False, device: torch.device | None = None
) -> Iterator[None]:
    """Append (file, function, kind) to `seen` for each host sync made from our code inside the block, on a
    run whose tensors live on `device` (default the CPU: then every tensor counts, see the module docstring)."""
    device = device if device is not None else torch.device("cpu")
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def patched(name):
        def call(self, *args, **kw):
            where = ours(sys._getframe(1))
            if where is not None:
                seen.append((*where, name))
            _inside.depth = getattr(_inside, "depth", 0) + 1
            try:
                if audit and where in ALLOWED:
                    with _debugger_off():
                        return real[name](self, *args, **kw)
                return real[name](self, *args, **kw)
            finally:
                _inside.depth -= 1

        return call

    try:
        for name in SYNCS:
            setattr(torch.Tensor, name, patched(name))
        with SyncRecorder(seen, device, audit):
            yield
    finally:
        for name in SYNCS:
            setattr(torch.Tensor, name, real[name])


def unallowed(seen: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The distinct recorded syncs from places not in ALLOWED, sorted."""
    return sorted({s for s in seen if s[:2] not in ALLOWED})
