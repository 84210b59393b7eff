"""Host reads from our code inside a step: the recorder tests/test_host_sync.py and scripts/gpu_check.sh share.

On CUDA `Tensor.item()`, `tolist()`, `cpu()` and `bool(tensor)` block the host until the device has caught up.
`recording` patches them so that every such call whose nearest frame is in this repository (tests excluded)
is appended to a list as (file, function, kind). With `audit`, also for the CUDA sync debugger
(`torch.cuda.set_sync_debug_mode("error")`, which the caller sets): the calls from an `ALLOWED` place run
with the debugger off, so only the syncs nobody allowed raise.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (file, function) -> why it may read the host once per step
ALLOWED = {
    ("train.py", "train_step"): "the step's loss and grad norm, logged (one sync, at the end)",
    ("faults.py", "agreed"): "the preemption vote, all-reduced with the loss's reductions, read after them",
    ("data/batches.py", "get"): "host tensors only: the rows' offsets come from a CPU generator",
}
SYNCS = ("item", "tolist", "cpu", "__bool__")


def ours(frame) -> tuple[str, str] | None:
    """(path relative to the repository, function) of the nearest frame in our code, tests excluded."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(ROOT + os.sep) and not path.startswith(os.path.join(ROOT, "tests")):
            return os.path.relpath(path, ROOT), frame.f_code.co_name
        frame = frame.f_back
    return None


@contextlib.contextmanager
def recording(seen: list[tuple[str, str, str]], audit: bool = False) -> Iterator[None]:
    """Append (file, function, kind) to `seen` for each host read made from our code inside the block."""
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def patched(name):
        def call(self, *args, **kw):
            where = ours(sys._getframe(1))
            if where is not None:
                seen.append((*where, name))
            if audit and where in ALLOWED:
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(0)
                try:
                    return real[name](self, *args, **kw)
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
            return real[name](self, *args, **kw)
        return call
    try:
        for name in SYNCS:
            setattr(torch.Tensor, name, patched(name))
        yield
    finally:
        for name in SYNCS:
            setattr(torch.Tensor, name, real[name])


def unallowed(seen: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The distinct recorded reads from places not in ALLOWED, sorted."""
    return sorted({s for s in seen if s[:2] not in ALLOWED})
