"""Memory, measured: a rank's model state counted by distinct storage (`state_breakdown`, `storage_bytes_by_kind`),
the activations a forward saves for backward (`SavedBytes`, `SavedAndRecomputedBytes`, `SavedActivations`), the
CPU's allocated peak through the profiler (`AllocatedPeak`), and the live storages of fake tensors
(`LiveStorages`, a simulated rank's peak). The numbers the planner's memory terms are held against.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import weakref
from typing import Callable, Iterable
from unittest import mock

import torch
import torch.utils.checkpoint
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


def state_breakdown(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of this rank's {"params", "grads", "optimizer"} state, each storage counted once."""
    params = list(model.parameters())
    moments = [
        v
        for state in (optimizer.state.values() if optimizer is not None else ())
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]
    return storage_bytes_by_kind(
        {"params": params, "grads": [p.grad for p in params if p.grad is not None], "optimizer": moments}
    )


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state, each storage counted once."""
    return sum(state_breakdown(model, optimizer).values())


def storage_bytes_by_kind(kinds: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Per kind, bytes of the distinct storages behind its tensors; a storage shared by two kinds counts in
    the first (views of one buffer count once; meta, freed and empty storages count 0; a DTensor counts
    its local shard)."""
    seen: set[int] = set()
    out = {}
    for kind, tensors in kinds.items():
        total = 0
        for t in tensors:
            t = t.to_local() if isinstance(t, DTensor) else t  # a DTensor: its local shard
            if t.is_meta:
                continue
            storage = t.untyped_storage()
            key = storage_key(storage)
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        out[kind] = total
    return out


def distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (see storage_bytes_by_kind)."""
    return storage_bytes_by_kind({"all": tensors})["all"]


class LargestTensor(TorchDispatchMode):
    """While active, records the most elements of any tensor an op returns that `keep` accepts (default: any
    real, non-meta tensor), e.g. the largest index a checkpoint builds or the largest TP allocation."""

    def __init__(self, keep: Callable[[torch.Tensor], bool] = lambda t: not t.is_meta):
        super().__init__()
        self.keep, self.numel = keep, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.keep(t):
                self.numel = max(self.numel, t.numel())
        return out


# ----------------------------------------------------------------------------- saved activations


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind `t`; a DTensor's local shard's (a wrapper subclass has none of its own)."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity: its data pointer, 0 when it holds nothing (freed, empty). A fake tensor's storage (a
    simulated rank, sim/fake_rank.py) holds no data and lives on meta: the address of the storage itself stands
    in, 0 once it is resized to nothing."""
    if storage.device.type == "meta":
        return storage._cdata if storage.nbytes() else 0
    return storage.data_ptr()


class SavedBytes:
    """Live and peak bytes of distinct non-parameter storages saved for backward while the context is open.

    Each saved tensor is wrapped in a holder whose __del__ runs when autograd drops it (after that node's
    backward, or when its graph is freed); a storage leaves the count when its last holder goes. `moving`:
    tensors excluded too, read again at every saved tensor (a regrown buffer's address may be reused)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), moving: Callable[[], list[torch.Tensor]] | None = None):
        self.still = {storage_key(storage_of(t)) for t in exclude}
        self.moving = moving
        self.skip = self.still | ({storage_key(storage_of(t)) for t in moving()} if moving else set())
        self.live: dict[int, list[int]] = {}  # storage_key -> [holders, nbytes]
        self.bytes = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t)

    def _pack(self, t: torch.Tensor) -> "_Held":
        if self.moving is not None:
            self.skip = self.still | {storage_key(storage_of(p)) for p in self.moving()}
        storage = storage_of(t)
        key = storage_key(storage)
        if key in self.skip:
            return _Held(t, None, key)
        if key in self.live:
            self.live[key][0] += 1
        else:
            self.live[key] = [1, storage.nbytes()]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        return _Held(t, self, key)

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[key]

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """One saved tensor, detached: a saved output must not keep its own grad_fn alive (a cycle)."""

    __slots__ = ("t", "counter", "key")

    def __init__(self, t: torch.Tensor, counter: SavedBytes | None, key: int):
        self.t, self.counter, self.key = t.detach(), counter, key

    def __del__(self):
        if self.counter is not None:
            self.counter._drop(self.key)


class SavedAndRecomputedBytes(SavedBytes):
    """SavedBytes, plus the tensors a checkpointed Block's recomputation keeps for backward.

    Those never reach our saved_tensors_hooks: torch.utils.checkpoint recomputes under its own
    `_recomputation_hook` (the innermost hooks win) and holds the results in its frame until backward unpacks
    them. So while open, this wraps that hook's pack function to count each storage it keeps (distinct,
    parameters excluded, not already counted as saved) from the moment it is recomputed until it is freed (a
    weakref finalizer on the storage). Counted before the pack runs: with early stop (checkpoint's default)
    the pack of the last tensor the forward saved keeps it, then raises to end the recomputation, so a count
    after it would miss that tensor (a row-parallel c_proj's input, GELU's output: mm saves it after the
    weight; nn.Linear's addmm saves the weight last, a parameter, which is not counted anyway)."""

    def __enter__(self) -> "SavedAndRecomputedBytes":
        counter, base = self, torch.utils.checkpoint._recomputation_hook
        self.recomputed: dict[int, int] = {}  # storage_key -> nbytes

        class Counting(base):
            def __init__(self, *args):
                super().__init__(*args)
                inner = self.pack_hook

                def pack(t: torch.Tensor):
                    counter._recomputed(storage_of(t))
                    return inner(t)  # the last one raises _StopRecomputationError, after keeping t

                self.pack_hook = pack

        self._patch = mock.patch.object(torch.utils.checkpoint, "_recomputation_hook", Counting)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._patch.stop()

    def _recomputed(self, storage) -> None:
        key = storage_key(storage)
        if key in self.skip or key in self.live or key in self.recomputed:
            return
        self.recomputed[key] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self._free_recomputed, key)

    def _free_recomputed(self, key: int) -> None:
        self.bytes -= self.recomputed.pop(key)


class SavedActivations:
    """While open, the peak bytes of distinct non-parameter storages saved for backward, a checkpointed Block's
    recomputed tensors included (SavedAndRecomputedBytes over saved-tensor hooks). `params`: (fixed, moving),
    what Parallelized.parameter_tensors returns: tensors whose storages hold parameters for the whole step
    (read once), and a callable for those a sharding engine regrows between uses (read again at every saved
    tensor: a freed buffer's address may be reused by an activation). With params None it measures nothing and
    costs nothing: `peak` stays None. A Python hook per saved tensor: train.py measures one step only."""

    def __init__(self, params: tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]] | None] | None):
        self.params, self.peak, self._inner = params, None, None

    def __enter__(self) -> "SavedActivations":
        if self.params is not None:
            fixed, moving = self.params
            self._inner = SavedAndRecomputedBytes(exclude=fixed, moving=moving).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._inner is not None:
            self._inner.__exit__(*exc)
            self.peak = self._inner.peak


# ----------------------------------------------------------------------------- the CPU's allocated peak


class AllocatedPeak:
    """While open on the CPU, the peak bytes of live tensor storages: what torch.cuda.max_memory_allocated is on
    GPU, so plan.predict's peak_memory_bytes has a CPU number to be held against. `bytes` after exit; None when
    not `enabled`, on GPU (there peak_memory_bytes is that number already) or under another profiler (--profile).

    The CPU has no allocator statistics in torch (torch.cpu has no memory API; torch.accelerator's are for
    accelerators), but its allocator reports each allocation and free, with its address and size, to the
    profiler: torch.autograd.profiler.profile(profile_memory=True), the events torch.profiler._memory_profiler
    reads. The live set starts as the distinct CPU storages alive at the start (gc's tensors: the state and
    whatever else is held) and follows the events in time order; the peak is its largest total. Two frees are
    not reported: of a block allocated before the window (the allocator no longer knows its size; it warns once
    on stderr), and any free on a thread the profiler does not cover (gloo's, dropping a collective's tensors).
    Such a block leaves the live set when its address is allocated again, so the number is an upper bound
    (by the bytes of those frees between the true free and the reuse). The profiler records every op: a run
    opens it on one step only. With `timeline`, `live_at_peak`: the window's allocations alive at the peak, by
    the op that made them, to explain a difference.

    Under fake tensors (a simulated rank, sim/fake_rank.py) nothing is allocated: there `LiveStorages` follows
    the fake storages themselves, from those alive at the start, and `bytes` is its peak."""

    def __init__(self, enabled: bool, timeline: bool = False):
        from torch.autograd import _profiler_enabled

        self.on = enabled and not _profiler_enabled()
        self.timeline, self.bytes, self.live_at_peak = timeline, None, None
        self._tracker = None

    def __enter__(self) -> "AllocatedPeak":
        from torch._guards import active_fake_mode

        if self.on and active_fake_mode() is not None:
            self._tracker = LiveStorages(self.timeline).__enter__()
        elif self.on:
            import gc

            storages = {}
            for t in gc.get_objects():
                if issubclass(type(t), torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                    try:
                        s = storage_of(t)
                        ptr = s.data_ptr()
                    except RuntimeError:  # no real storage: --compile's fake tensors, which gc still holds
                        continue
                    if ptr:
                        storages[ptr] = ("(before the window)", s.nbytes())
            self._start = storages
            self._quiet = _stderr_without(PROFILER_CHATTER)
            self._quiet.__enter__()
            self._prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self.bytes, self.live_at_peak = self._tracker.peak, self._tracker.live_at_peak
            self._tracker = None
            return
        if not self.on:
            return
        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(None, None, None)
        from torch._C._profiler import _EventType

        allocs, stack = [], list(self._prof.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                allocs.append(e)
        allocs.sort(key=lambda e: e.start_time_ns)
        live = dict(self._start)
        total = peak = sum(n for _, n in live.values())
        at_peak = dict(live) if self.timeline else None
        for e in allocs:
            f = e.extra_fields
            total -= live.pop(f.ptr, (None, 0))[1]  # a free, or an allocation at an address whose free was unseen
            if f.alloc_size > 0:
                live[f.ptr] = (_op_of(e) if self.timeline else "", f.alloc_size)
                total += f.alloc_size
                if total > peak:
                    peak = total
                    at_peak = dict(live) if self.timeline else None
        self.bytes = peak
        if self.timeline:
            out: dict[str, int] = {}
            for op, n in at_peak.values():
                out[op] = out.get(op, 0) + n
            self.live_at_peak = dict(sorted(out.items(), key=lambda kv: -kv[1]))


class LiveStorages(TorchDispatchMode):
    """While open, the live and peak bytes of the distinct tensor storages of this process: those alive at the
    start (gc's CPU tensors; a DTensor's local shard is a tensor of its own), then every storage an op returns,
    each until it dies (a weakref finalizer) and at its size after every `UntypedStorage.resize_` (the sharding
    engine frees and regrows its flat buffers so). It needs no allocator, so it measures fake tensors (what
    AllocatedPeak does under FakeTensorMode; torch's MemTracker, which does the same, refuses a module called
    more than once a step, as a pipeline's chunks are). Storages made outside any op (torch.from_numpy) are
    seen once an op returns them. Under FakeTensorMode only that mode's tensors are counted at the start. With
    `timeline`, `live_at_peak`: the bytes alive at the peak by the op that made them, as AllocatedPeak's.
    """

    def __init__(self, timeline: bool = False):
        super().__init__()
        self.live: dict[int, int] = {}  # storage_key -> bytes
        self.bytes = self.peak = 0
        self.timeline, self.made_by, self.live_at_peak = timeline, {}, None  # made_by: storage_key -> op
        self._op = "(before the window)"

    def _set(self, key: int, n: int) -> None:
        self.bytes += n - self.live.get(key, 0)
        self.live[key] = n

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = storage_key(storage)
        if not key:
            return
        n = storage.nbytes()
        old = self.live.get(key)
        if old is None:
            weakref.finalize(storage, self._free, key)
        self.live[key] = n
        self.bytes += n - (old or 0)
        if self.timeline and old is None:
            self.made_by[key] = self._op
        if self.bytes > self.peak:
            self.peak = self.bytes
            if self.timeline:
                out: dict[str, int] = {}
                for k, b in self.live.items():
                    out[self.made_by.get(k, "")] = out.get(self.made_by.get(k, ""), 0) + b
                self.live_at_peak = dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key, 0)

    def __enter__(self) -> "LiveStorages":
        import gc

        from torch._guards import active_fake_mode

        mode = active_fake_mode()  # under one: only its tensors (a process may hold other simulated ranks' garbage)
        for t in gc.get_objects():
            if (
                issubclass(type(t), torch.Tensor)
                and not isinstance(t, DTensor)
                and t.device.type == "cpu"
                and (mode is None or getattr(t, "fake_mode", None) is mode)
            ):
                self._see(t.untyped_storage())
        resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            key = storage_key(storage)  # before: a storage shrunk to nothing has key 0 after
            out = resize(storage, size)
            if key and not storage.nbytes():
                tracker._set(key, 0)  # freed, still known (its finalizer is registered)
            else:
                tracker._see(storage)
            return out

        self._patch = mock.patch.object(torch.UntypedStorage, "resize_", resize_)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._patch.stop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func.overloadpacket) if self.timeline else ""
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._see(t.untyped_storage())
        return out


# what the profiler prints on every use (kineto's start/stop lines; the CPU allocator's one warning about a block
# from before the window, which the docstring above accounts for): C++ logging, out of Python's reach
PROFILER_CHATTER = (b"SyncActivityProfilerHandler.cpp", b"Memory block of unknown size")


@contextlib.contextmanager
def _stderr_without(needles: tuple[bytes, ...]):
    """fd 2 into a temporary file while open, then replayed without the lines holding any of `needles`: every
    other line (a warning, a traceback from another thread) still reaches stderr, after the window."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not any(n in line for n in needles)]
            if kept:
                os.write(2, b"".join(kept))


def _op_of(e) -> str:
    """The op an allocation event belongs to, above the empty/zeros factories it went through."""
    parent = e.parent
    while parent is not None and parent.name.startswith(("aten::empty", "aten::zeros", "aten::new_", "aten::resize")):
        parent = parent.parent
    return parent.name if parent is not None else "?"
