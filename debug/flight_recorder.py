"""The flight recorder: every op that goes through parallel/comm.py, the last K of them per rank.

The runtime records through one seam, `parallel.comm.RECORDER` (a `comm.Recorder`, which records nothing), and
imports nothing of this module: `install` puts a `FlightRecorder` there (train.py, at the start of a run; a
simulated rank; the tests that read a ring). It answers the seam's calls: `post` an op, mark it completed
(`done`, or through `issued`), and the `step` and micro-batch context the loops set.

Completed means the op's work finished, not that the host is through with it. An op on host tensors (gloo on
the CPU) is done when its blocking call or its work's wait() returns. An op on device tensors (NCCL) is not:
enqueueing returns at once, and wait() only makes the current stream wait. Its record stays posted until the
work says so (`work.is_completed()`, an async op's), or, for a blocking op whose work torch does not return, a
marker on the current stream after it (runtime/device.stream_marker: the stream waits for the op there) has
passed. These are polled in post order at each `post` (up to the first one still running) and all of them
at `read` (the watchdog's dump), so a ring left by a killed rank may show an op posted that finished since,
never the reverse.

Each record: the op, its group (name and global ranks), a sequence number (per group for collectives, per
(group, op, peer) for p2p: the k-th send from a to b meets the k-th receive on b from a), shape, dtype, bytes,
the peer (a global rank, p2p only), the training step and micro-batch (set by train.py, the pipeline and the
micro-batch loop), the call site (the module and function that called comm, one frame up: no stack walk)
and its state (posted; completed once the op's work finished: see above).

Records are fixed-size slots of one bytes buffer, a ring of K (env GPT_FLIGHT_RECORDER_SIZE, default 2000;
0 switches it off). `open(path, ...)` puts that buffer in a memory-mapped file,
<out_dir>/flight_recorder/rank_N.bin: the kernel keeps what was written even when the rank is then
SIGKILLed, aborted by a backend (gloo aborts on a size mismatch) or SIGSTOPped, so `python -m debug hang`
reads those ranks' last ops too (`decode`; this module imports torch only to resolve groups). Strings
(groups, sites, dtypes) are interned into a table behind the ring, once each. Nothing is communicated; the
watchdog's JSON dump (`dump`, <out_dir>/hang/rank_N.json) is `read()` of the ring.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import weakref
from collections import OrderedDict
from typing import Any

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")
OP_INDEX = {name: i for i, name in enumerate(OPS)}  # a record stores its op as this index
POSTED, COMPLETED = 0, 1
STATES = ("posted", "completed")
MAGIC = b"GPTFR001"
HEADER = struct.Struct("<8sqqiiiii")  # magic, ops recorded, string bytes used, rank, world, K, record size, pid
# n (this rank's op index), seq, bytes, step, micro, peer, group id, site id, dtype id, op, state, ndim, pad, shape
RECORD = struct.Struct("<qqqiiiiiiBBBx4q")
STATE_AT = struct.calcsize("<qqqiiiiiiB")  # offset of the state byte within a record
COUNT = struct.Struct("<q")  # the header's op count (offset 8) and string bytes used (offset 16)
PAD = tuple((0,) * (4 - nd) for nd in range(5))
STRINGS = 64 * 1024  # bytes of interned strings behind the ring
DEFAULT_SIZE = 2000


def size_from_env() -> int:
    return int(os.environ.get("GPT_FLIGHT_RECORDER_SIZE", DEFAULT_SIZE))


class FlightRecorder:
    """A bounded ring of this rank's last `capacity` comm ops (see the module docstring). `post` and
    `done` are the per-op cost: a dict lookup or two and one struct.pack_into."""

    def __init__(self, capacity: int | None = None):
        self.step, self.micro = 0, -1  # context: set by train.py's loop and the micro-batch loops (comm.Recorder)
        self._file = None
        self._reset(size_from_env() if capacity is None else capacity, bytearray, rank=0, world=1)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _reset(self, capacity: int, make, rank: int, world: int) -> None:
        self.capacity, self.count, self._used = capacity, 0, 0
        self._buf = make(HEADER.size + capacity * RECORD.size + STRINGS) if capacity else bytearray(0)
        self._strings: dict[str, int] = {}
        # process group -> (string id, ranks), held weakly: a group the recorder kept alive would outlive
        # destroy_process_group() with its gloo threads, which can then abort the process at exit
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._world: tuple[int, tuple[int, ...]] | None = None  # group=None: the default group
        self._sites: dict[Any, int] = {}  # (code object, unit) -> string id
        self._dtypes: dict[Any, int] = {}  # torch.dtype -> string id
        self._seq: dict[tuple, int] = {}
        # device ops not yet known complete, in post order: n -> (device, probe); probe None until issued/done
        self._running: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self.rank, self.world = rank, world
        if capacity:
            HEADER.pack_into(self._buf, 0, MAGIC, 0, 0, rank, world, capacity, RECORD.size, os.getpid())
            self._intern(_backend())  # string 0: the backend

    def open(self, path: str | None, rank: int, world: int, capacity: int | None = None) -> None:
        """Start a fresh ring for a run: in the file `path` (memory-mapped; made with its folder), or in memory
        when path is None. Called on every rank at the start of train.py's run."""
        self.close()
        capacity = size_from_env() if capacity is None else capacity
        if not capacity or path is None:
            self._reset(capacity, bytearray, rank, world)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        n = HEADER.size + capacity * RECORD.size + STRINGS
        with open(path, "wb") as f:
            f.truncate(n)
        self._file = open(path, "r+b")
        self._reset(capacity, lambda size: mmap.mmap(self._file.fileno(), size), rank, world)
        self.path = path

    def close(self) -> None:
        if self._file is not None:
            self._buf.close()
            self._file.close()
            self._file = None
            self._reset(size_from_env(), bytearray, self.rank, self.world)  # in memory from here on

    # ------------------------------------------------------------------ the per-op path

    def _intern(self, s: str) -> int:
        i = self._strings.get(s)
        if i is None:
            data = s.encode()[:255]
            at = HEADER.size + self.capacity * RECORD.size + self._used
            if self._used + 1 + len(data) > STRINGS:
                return 0
            self._buf[at] = len(data)
            self._buf[at + 1 : at + 1 + len(data)] = data
            self._used += 1 + len(data)
            COUNT.pack_into(self._buf, 16, self._used)  # after the string is there
            i = self._strings[s] = len(self._strings)
        return i

    def _group(self, group) -> tuple[int, tuple[int, ...]]:
        g = self._world if group is None else self._groups.get(group)
        if g is None:
            import torch.distributed as dist  # here, not at the top: debug.hang reads rings without torch

            pg = dist.group.WORLD if group is None else group
            ranks = tuple(dist.get_process_group_ranks(pg))
            name = getattr(pg, "group_name", "?")
            g = (self._intern(f"{name}:{','.join(map(str, ranks))}"), ranks)
            if group is None:
                self._world = g
            else:
                self._groups[group] = g
        return g

    def post(self, op: str, tensor, group, peer: int = -1, unit: str | None = None) -> int:
        """Record op (a name of OPS) on `tensor` as posted; returns its slot handle for `done` (-1: off).
        `unit`: what the wrapper is moving (an FSDP unit's name, a DDP bucket), appended to the call site."""
        if not self.capacity:
            return -1
        if self._running:
            self._poll(first_only=True)
        gid, _ = self._group(group)
        op = OP_INDEX[op]
        key = (gid,) if peer < 0 else (gid, op, peer)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        f = sys._getframe(2)  # the caller of the comm wrapper, above torch.compiler.disable's frame
        while f.f_globals.get("__name__", "").startswith("torch."):
            f = f.f_back
        site = self._sites.get((f.f_code, unit))
        if site is None:
            where = f"{f.f_globals.get('__name__', '?')}.{f.f_code.co_name}"
            site = self._sites[f.f_code, unit] = self._intern(where if unit is None else f"{where} [{unit}]")
        shape = tuple(tensor.shape)
        nd = len(shape)
        dims = shape + PAD[nd] if nd <= 4 else (*shape[:3], -1)
        dtype = self._dtypes.get(tensor.dtype)
        if dtype is None:
            dtype = self._dtypes[tensor.dtype] = self._intern(str(tensor.dtype).removeprefix("torch."))
        n = self.count
        RECORD.pack_into(
            self._buf,
            HEADER.size + (n % self.capacity) * RECORD.size,
            n,
            seq,
            tensor.numel() * tensor.element_size(),
            self.step,
            self.micro,
            peer,
            gid,
            site,
            dtype,
            op,
            POSTED,
            nd,
            *dims,
        )
        self.count = n + 1
        COUNT.pack_into(self._buf, 8, n + 1)  # after the record: a reader never sees half of one
        if not getattr(tensor, "is_cpu", True):  # is_cpu: a fifth of .device's cost
            self._running[n] = (tensor.device, None)  # on a device: complete when its work says so, not on return
        return n

    def done(self, n: int) -> None:
        """The host returned from op `n` (post's handle: its blocking call, or its work's wait()). An op on host
        tensors is then complete: marked so, unless the ring has overwritten it since. An op on device tensors
        is complete when its work is: its probe (issued's is_completed, else a marker on the current stream,
        which waits for the op from here on) decides, polled now and later."""
        running = self._running.get(n)
        if running is None:
            self._mark(n)
            return
        device, probe = running
        if probe is None:
            from runtime.device import stream_marker  # here: reading a ring needs no torch

            self._running[n] = (device, stream_marker(device))
        self._poll(first_only=False)

    def issued(self, n: int, work, async_op: bool):
        """The handle for the caller of op `n` (`post`'s), once torch returned `work`. An async op's work comes
        back wrapped (`Recorded`: its wait() is `done`); on device tensors its own is_completed() is the probe.
        A blocking op's work comes back as it is, `done` now."""
        if not async_op:
            self.done(n)
            return work
        if n in self._running:
            self._running[n] = (self._running[n][0], work.is_completed)
        return Recorded(work, n, self) if n >= 0 else work

    def _mark(self, n: int) -> None:
        if n >= 0 and self.count - n <= self.capacity:
            self._buf[HEADER.size + (n % self.capacity) * RECORD.size + STATE_AT] = COMPLETED

    def _poll(self, first_only: bool) -> None:
        """Mark the device ops whose probe says complete, in post order; `first_only`: stop at the first one
        still running (the per-op cost stays O(1)). Ops the ring has overwritten are dropped unasked."""
        for n, (_, probe) in list(self._running.items()) if not first_only else []:
            if self.count - n > self.capacity or (probe is not None and probe()):
                self._mark(n)
                del self._running[n]
        while first_only and self._running:
            n, (_, probe) = next(iter(self._running.items()))
            if self.count - n <= self.capacity and (probe is None or not probe()):
                return
            self._mark(n)
            self._running.popitem(last=False)

    # ------------------------------------------------------------------ reading

    def read(self, reason: str = "") -> dict:
        """The ring as the JSON-able dict `python -m debug hang` reads (oldest op first), every device op's probe
        asked first. The watchdog calls this from its own thread: it marks, and leaves `_running` to the rank's."""
        for n, (_, probe) in self._running.copy().items():
            if probe is not None and probe():
                self._mark(n)
        return (
            decode(bytes(self._buf), reason)
            if self.capacity
            else {
                "format": FORMAT,
                "rank": self.rank,
                "world_size": self.world,
                "capacity": 0,
                "recorded": 0,
                "ops": [],
            }
        )

    def dump(self, path: str, reason: str) -> None:
        """Write `read(reason)` as JSON to `path` (the watchdog: <out_dir>/hang/rank_N.json)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(self.read(reason), f, indent=0)
        os.replace(path + ".tmp", path)


FORMAT = "gpt-flight-recorder/1"


def _backend() -> str:
    dist = sys.modules.get("torch.distributed")  # not imported here: reading a ring needs no torch
    return dist.get_backend() if dist is not None and dist.is_available() and dist.is_initialized() else "none"


def decode(buf: bytes, reason: str = "") -> dict:
    """A ring's bytes (a live .bin file, or memory) -> {format, rank, world_size, backend, capacity, recorded,
    reason, ops: [{n, seq, op, group, group_name, shape, dtype, bytes, peer, step, micro, site, state}]}.
    ValueError on anything that is not a ring."""
    if len(buf) < HEADER.size:
        raise ValueError("too short for a flight-recorder ring")
    magic, count, used, rank, world, capacity, rec_size, pid = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or rec_size != RECORD.size or len(buf) < HEADER.size + capacity * RECORD.size + used:
        raise ValueError("not a flight-recorder ring (bad magic, record size or length)")
    at, strings = HEADER.size + capacity * RECORD.size, []
    end = at + used
    while at < end:
        k = buf[at]
        strings.append(buf[at + 1 : at + 1 + k].decode(errors="replace"))
        at += 1 + k
    name = lambda i: strings[i] if 0 <= i < len(strings) else "?"
    ops = []
    for n in range(max(0, count - capacity), count):
        (m, seq, nbytes, step, micro, peer, gid, site, dtype, op, state, nd, *dims) = RECORD.unpack_from(
            buf, HEADER.size + (n % capacity) * RECORD.size
        )
        if m != n:
            continue  # a slot being rewritten when the rank stopped
        gname, _, ranks = name(gid).partition(":")
        ops.append(
            {
                "n": n,
                "seq": seq,
                "op": OPS[op] if op < len(OPS) else "?",
                "group_name": gname,
                "group": [int(r) for r in ranks.split(",") if r],
                "shape": list(dims[:nd]) if nd <= 4 else list(dims[:3]) + ["..."],
                "dtype": name(dtype),
                "bytes": nbytes,
                "peer": peer,
                "step": step,
                "micro": micro,
                "site": name(site),
                "state": STATES[state & 1],
            }
        )
    return {
        "format": FORMAT,
        "rank": rank,
        "world_size": world,
        "backend": name(0),
        "pid": pid,
        "capacity": capacity,
        "recorded": count,
        "reason": reason,
        "ops": ops,
    }


class Recorded:
    """An async op's work handle whose wait() (or a True is_completed()) also tells the recorder (`done`): on
    host tensors that marks its record completed, on device tensors its work's own is_completed() decides."""

    __slots__ = ("work", "n", "recorder")

    def __init__(self, work, n: int, recorder: FlightRecorder):
        self.work, self.n, self.recorder = work, n, recorder

    def wait(self, *args) -> bool:
        out = self.work.wait(*args)
        self.recorder.done(self.n)
        return out

    def is_completed(self) -> bool:
        done = self.work.is_completed()
        if done:
            self.recorder.done(self.n)
        return done

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def install(path: str | None, rank: int, world: int) -> FlightRecorder:
    """Record this process's comm ops from here on: a fresh ring (`open`: in the file `path`, or in memory when
    None) as parallel.comm.RECORDER, one per process (the one already there, if it is a FlightRecorder)."""
    from parallel import comm  # here, not at the top: reading a ring needs no torch

    rec = comm.RECORDER if isinstance(comm.RECORDER, FlightRecorder) else FlightRecorder()
    rec.open(path, rank, world)
    comm.RECORDER = rec
    return rec
