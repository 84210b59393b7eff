"""A rank file written one tensor at a time: the bytes `torch.save(shard, f)` writes, with at most one of its
values in host memory at once.

torch.save pickles the dict first (each tensor's dtype, shape and storage key: no data is read), then writes
each storage as one zip record, in key order. `save_streamed` lets torch.save do both, and hands it, for each
value that is a `Lazy`, a placeholder tensor of the value's dtype and size: address space that is never
written, so it costs no resident memory. When torch.save comes to that placeholder's record, the record's bytes
are made (`Lazy.make`: a copy of the live views, one name and kind), written, and dropped (`Lazy.release`).
The file is byte-identical to torch.save's of the made values (tests/test_checkpoint.py holds that), so a
checkpoint loads as before, in any layout.

`Staging` is where an async save's copies wait for the writer thread: host blocks of at most `budget` bytes in
all, pinned on CUDA and kept from save to save.
"""

from __future__ import annotations

import inspect
import pickle
import threading
from typing import IO, Callable

import torch

# torch.save's private writer, as torch 2.x has it (2.13 and 2.11 alike); with another, save_streamed makes every value
# first and calls torch.save: the same file, without the memory bound
_STREAMS = list(inspect.signature(torch.serialization._save).parameters) == [
    "obj",
    "zip_file",
    "pickle_module",
    "pickle_protocol",
    "_disable_byteorder_record",
]
STAGING_BYTES = 512 << 20  # an async save's staging, at most (one record larger than that gets a block alone)


def _nothing() -> None:
    pass


class Lazy:
    """A value of a rank file, made when it is written: `parts` (live views, on any device) copied one after the
    other into a fresh CPU tensor; or, once `expect_staging` was called (an async save), the staged copy that
    the training thread hands over (`staged`), which `make` waits for and `release` gives back."""

    def __init__(self, parts: list[torch.Tensor]):
        self.parts = parts
        self.dtype = parts[0].dtype
        self.numel = sum(p.numel() for p in parts)
        self.nbytes = self.numel * parts[0].element_size()
        self.ready: threading.Event | None = None  # set once staged (async saves only)
        self.value: torch.Tensor | None = None
        self.landed: Callable[[], None] = _nothing  # waits for the staged copy's non-blocking transfers
        self.give_back: Callable[[], None] = _nothing

    def copy(self, out: torch.Tensor | None = None, non_blocking: bool = False) -> torch.Tensor:
        """The parts, one after the other, in `out` (a fresh CPU tensor when None)."""
        out = torch.empty(self.numel, dtype=self.dtype) if out is None else out
        offset = 0
        for p in self.parts:
            out[offset : offset + p.numel()].copy_(p.reshape(-1), non_blocking=non_blocking)
            offset += p.numel()
        return out

    def make(self) -> torch.Tensor:
        """The value: copied from the live views now, or the staged copy once it has landed."""
        if self.ready is None:
            return self.copy()
        self.ready.wait()
        if self.value is None:
            raise RuntimeError("the snapshot stopped before this value was staged")
        self.landed()
        return self.value

    def release(self) -> None:
        """The writer is done with the value: a staged block goes back to its Staging, and nothing here keeps it
        (the Staging may drop it to make room, and its memory must then be freed)."""
        give_back, self.give_back, self.landed, self.value = self.give_back, _nothing, _nothing, None
        give_back()

    def expect_staging(self) -> None:
        self.ready = threading.Event()

    def staged(self, value: torch.Tensor | None, landed: Callable[[], None], give_back: Callable[[], None]) -> None:
        """Hand the writer its copy (None: there will be none)."""
        self.value, self.landed, self.give_back = value, landed, give_back
        self.ready.set()


class _Records:
    """torch.save's zip writer, standing in for it: the record of a placeholder's storage is written from its
    Lazy's made value instead (same size, same place in the file)."""

    def __init__(self, writer, lazies: dict[int, Lazy]):
        self.writer, self.lazies = writer, lazies

    def write_record(self, name: str, data, nbytes: int) -> None:
        lazy = self.lazies.get(getattr(data, "_cdata", None))
        if lazy is None:
            self.writer.write_record(name, data, nbytes)
            return
        value = lazy.make()  # a fresh tensor, or the first bytes of a staging block: its storage's first bytes
        if value.numel() * value.element_size() != nbytes or value.storage_offset() or value.device.type != "cpu":
            raise RuntimeError(f"{name}: made {value.dtype} {tuple(value.shape)}, the file holds {nbytes} bytes")
        self.writer.write_record(name, value.untyped_storage(), nbytes)
        del value
        lazy.release()

    def __getattr__(self, name: str):
        return getattr(self.writer, name)


def save_streamed(shard: dict[str, torch.Tensor | Lazy], f: IO[bytes]) -> None:
    """torch.save(shard with each Lazy made, f), making one Lazy at a time (module docstring)."""
    if not _STREAMS:
        torch.save({k: _made(v) if isinstance(v, Lazy) else v for k, v in shard.items()}, f)
        return
    lazies: dict[int, Lazy] = {}
    obj: dict[str, torch.Tensor] = {}
    for key, value in shard.items():
        if isinstance(value, Lazy):
            value = torch.empty(value.numel, dtype=value.dtype)  # never written: its record comes from the Lazy
            lazies[value.untyped_storage()._cdata] = shard[key]
        obj[key] = value
    with torch.serialization._open_zipfile_writer(f) as writer:
        torch.serialization._save(obj, _Records(writer, lazies), pickle, torch.serialization.DEFAULT_PROTOCOL, False)


def _made(lazy: Lazy) -> torch.Tensor:
    value = lazy.make().clone() if lazy.ready is not None else lazy.make()  # a staged block is given back below
    lazy.release()
    return value


class Staging:
    """Host blocks (uint8) an async save's snapshot is copied into, `budget` bytes at most, in use or free. `take`
    hands out a free block that fits (at most twice the size asked) or a new one, and waits for the writer to
    `give` one back while the budget is spent; a record larger than the budget gets a block of its own once no
    other is in use. Free blocks are kept for the next save (pinned memory is slow to allocate) and dropped when
    a new block needs their room. `abort` (the writer failed) makes `take` answer None from then on."""

    def __init__(self, device: torch.device, budget: int = STAGING_BYTES):
        self.pin, self.budget = device.type == "cuda", budget
        self.free: list[torch.Tensor] = []
        self.held = 0  # bytes of every block, free or in use
        self.peak = 0  # the most held at once (scripts/checkpoint_memory.py reports it)
        self.aborted = False
        self.cond = threading.Condition()

    def take(self, nbytes: int) -> torch.Tensor | None:
        with self.cond:
            while not self.aborted:
                fits = [(b.numel(), i) for i, b in enumerate(self.free) if nbytes <= b.numel() <= 2 * nbytes]
                if fits:
                    return self.free.pop(min(fits)[1])
                while self.free and self.held + nbytes > self.budget:
                    self.held -= self.free.pop(0).numel()
                in_use = self.held - sum(b.numel() for b in self.free)
                if self.held + nbytes <= self.budget or in_use == 0:
                    self.held += nbytes
                    self.peak = max(self.peak, self.held)
                    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
                self.cond.wait()
            return None

    def give(self, block: torch.Tensor) -> None:
        with self.cond:
            self.free.append(block)
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def reopen(self) -> None:
        with self.cond:
            self.aborted = False


def stage(lazies: list[Lazy], staging: Staging, device: torch.device) -> None:
    """Copy each Lazy's parts into a staging block (non-blocking on CUDA) and hand it to the writer thread, in the
    order the writer makes them (every Lazy must have been told to `expect_staging` before the writer started):
    once this returns, the writer needs no live view. Blocks while the budget is spent (the writer gives blocks
    back as it writes). If the writer aborted, or a copy fails, the Lazies not staged are handed None."""
    from runtime.device import record_event

    done = 0
    try:
        for lazy in lazies:
            block = staging.take(lazy.nbytes)
            if block is None:
                return
            value = lazy.copy(block[: lazy.nbytes].view(lazy.dtype), non_blocking=True)
            lazy.staged(value, record_event(device), lambda block=block: staging.give(block))
            block = value = None  # the Lazy holds them now, until its release
            done += 1
    finally:
        for lazy in lazies[done:]:
            lazy.staged(None, _nothing, _nothing)
