"""The one place that picks the device and the backend, and what differs by device: a host-to-device copy that
does not block, whether the fused optimizer runs there, a wait for the work enqueued so far, and a clock for
the device's work. Everything else asks here (cuda -> nccl, cpu -> gloo) and never names a device itself: the
runtime (parallel/, which imports this leaf as it imports model/gpt.py) and the one-process programs (sample.py, evals).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


def pick_device(requested: str = "auto") -> torch.device:
    """'auto' is the accelerator when there is one, else the CPU. Under torchrun each rank takes the GPU
    numbered by its LOCAL_RANK.

    More ranks on this machine than GPUs (torchrun's LOCAL_WORLD_SIZE, else LOCAL_RANK + 1, against
    `torch.cuda.device_count()`) is refused with a ValueError (train.py's one line and exit 2), not run on the
    CPU: every local rank sees the same two numbers, so all of them refuse before any group forms, where a
    fallback would make a GPU box run 100x slower without saying so, and a node that fell back while another
    did not would mix gloo and NCCL in one job. The message names both ways out: `--device cpu`, or
    `--nproc_per_node` at most the device count."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested} asked for but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)), local_rank + 1)
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ValueError(
            f"{local_ranks} ranks on this machine but {gpus} CUDA device(s): two ranks can't share a GPU; "
            f"pass --device cpu, or launch with torchrun --nproc_per_node={gpus} (at most the device count)"
        )
    return torch.device(requested, local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_world(device: torch.device, timeout: timedelta) -> None:
    """Join the world's process group on `device`'s backend (once). A CUDA rank first makes its GPU current and
    binds the group to it (`device_id`): NCCL then initialises every group eagerly (parallel/groups.py's
    `serial_p2p` counts on it), and the mesh's groups are split from the world's communicator (`new_groups`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(device), timeout=timeout, device_id=device if device.type == "cuda" else None
        )


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


def record_event(device: torch.device) -> Callable[[], None]:
    """A wait for the work enqueued so far on `device`'s current stream: a CUDA event's synchronize; on the CPU
    the work is done when enqueued, so nothing."""
    if device.type != "cuda":
        return lambda: None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


def stream_marker(device: torch.device) -> Callable[[], bool]:
    """Whether `device` has finished the work enqueued so far on its current stream: a CUDA event's query()
    (it does not block); on the CPU the work is done when enqueued, so True. The flight recorder's completion of
    a blocking NCCL op, whose wait() only made the current stream wait for it."""
    if device.type != "cuda":
        return lambda: True
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.query


# ----------------------------------------------------------------------------- clocks (the pipeline's timeline,
# the Block split's measured costs)


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


def make_timer(device: torch.device) -> HostTimer | DeviceTimer:
    """Device events where the device has them (CUDA), the host clock on the CPU."""
    return DeviceTimer(device) if device.type == "cuda" else HostTimer()
