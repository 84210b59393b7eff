"""Sharded, layout-independent, atomic training checkpoints.

Layout on disk, under `<out_dir>/checkpoints/`:

    step_000012/
        manifest.json      rank 0: step, model config, math-relevant args, layout, optimizer step and
                           param-group hyperparameters, the rank files, every tensor's full shape
        rank_00000.pt      one per rank: the elements this rank is the designated writer of
        rank_00001.pt      ...

A rank file is a plain {key: tensor} dict saved with torch.save and read back with
`torch.load(weights_only=True, mmap=True)` (no arbitrary unpickling). For each parameter name the
rank writes (its entries, checkpoints/entries.py, from `Parallelized.checkpoint_parts`):

    "<name>::runs"         int64 (k, 2): (start, length) runs of flat positions in the full tensor
    "<name>::param"        the values at those positions, in run order (1-D)
    "<name>::exp_avg"      AdamW's first moment at the same positions
    "<name>::exp_avg_sq"   and its second moment
    "<name>::momentum_buffer"  instead of the two moments, Muon's momentum (--optimizer muon, a Block matrix)
    "rng::cpu", "rng::cuda"  this rank's torch RNG states (written by every rank)

Runs keep the index small: a DDP/FSDP shard is one run, a row-sharded TP weight one run per row.
Elements held by several ranks (DDP replicas, TP-replicated LayerNorms) are written once. Neither saving
nor loading builds an index per element of the model: entries give their runs one at a time
(`Entry.runs()`), and runs are turned into positions at most `_INDEX_CHUNK` elements at a time.

Loading works in any layout: each rank builds its own entries, and for every name assembles the full
tensor from all files' pieces (memory-mapped), checks that every element is covered exactly once, and
copies its own runs of it into its live views. So a checkpoint from one process, DDP, FSDP, TP or 2D resumes
in any other with the same model config.

Integrity: the manifest records each rank file's size and CRC-32 (zlib.crc32: in C, about 1 GB/s per core,
enough to catch truncation and flipped bytes; not a defence against tampering). `verify` checks them, and
`newest_intact` walks back from the newest checkpoint past damaged ones (a garbled manifest, a missing,
truncated or altered rank file), naming each, so a damaged newest checkpoint never loads garbage and never
needs a person to delete it before `--resume`, sample.py or export.py can go on.

Atomicity: rank 0 clears leftovers of interrupted saves and creates `step_000012.tmp-saving`; every rank
writes and fsyncs its file; barrier; rank 0 checks all files are there, writes and fsyncs the manifest,
fsyncs the directory, renames it to `step_000012` and fsyncs `checkpoints/`. Only a directory with its
final name and a manifest counts as a checkpoint, so a save killed at any point leaves the previous one
as the newest. Older checkpoints beyond the newest `keep` are renamed away, then deleted.

train.py saves and resumes its Trainer through `save_trainer` and `restore_trainer` (the end of this file).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import zlib
from dataclasses import asdict, fields
from typing import IO, Callable

import torch
import torch.distributed as dist

# The test seam (as parallel/comm.HOOKS is the runtime's): trainer/faults.py sets it to count the files this
# process writes, for GPT_CKPT_FAIL_AFTER_FILES. Checkpoints import nothing above them.
FILE_WRITTEN: Callable[[], None] | None = None


FORMAT = "gpt2-parallel-checkpoint"
VERSION = 1
SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")
OPTIMIZER_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model it is loaded into."""


def step_dir(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, SUBDIR, f"step_{step:06d}")


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ----------------------------------------------------------------------------- finding checkpoints


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `out_dir` as (step, path), oldest first: a final name and a manifest."""
    root = os.path.join(out_dir, SUBDIR)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def newest(out_dir: str) -> str | None:
    """The newest complete checkpoint in `out_dir`, or None."""
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def file_check(path: str) -> dict[str, int]:
    """{"bytes", "crc32"} of one file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return {"bytes": size, "crc32": crc}


def verify(path: str) -> dict:
    """The manifest of checkpoint `path` after checking every rank file against its recorded size and CRC-32;
    CheckpointError naming the first damaged file. (Manifests without checks, from before they were recorded,
    get the existence check only.)"""
    manifest = read_manifest(path)
    checks = manifest.get("file_checks", {})
    for name in manifest.get("files", []):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        if name in checks:
            got, want = file_check(file), checks[name]
            if got["bytes"] != want["bytes"]:
                raise CheckpointError(
                    f"{file} is truncated or padded: {got['bytes']} bytes, the manifest says {want['bytes']}"
                )
            if got["crc32"] != want["crc32"]:
                raise CheckpointError(
                    f"{file} is damaged: CRC-32 {got['crc32']:08x}, the manifest says {want['crc32']:08x}"
                )
    return manifest


def newest_intact(out_dir: str, report: Callable[[str], None] | None = print) -> str | None:
    """The newest checkpoint in `out_dir` that passes `verify`, or None; each damaged newer one is reported
    in one line (`report`; None: silently) and skipped."""
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            verify(path)
            return path
        except CheckpointError as e:
            if report is not None:
                report(f"skipping damaged checkpoint: {e}")
    return None


def read_manifest(path: str) -> dict:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read {MANIFEST} ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: {MANIFEST} is not a JSON object")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: not a version-{VERSION} {FORMAT} (format {manifest.get('format')!r}, "
            f"version {manifest.get('version')!r})"
        )
    return manifest


def config_mismatch(manifest: dict, model_config) -> str | None:
    """A one-line description of how the checkpoint's model config differs from `model_config`, or None."""
    saved, ours = manifest["config"]["model"], asdict(model_config)
    default = {f.name: f.default for f in fields(type(model_config))}  # fields newer than the checkpoint
    diff = [
        f"{k} {saved.get(k, default[k])!r} (checkpoint) vs {ours[k]!r}"
        for k in ours
        if saved.get(k, default[k]) != ours[k]
    ]
    return ", ".join(diff) or None


def model_config(manifest: dict):
    from model.gpt import GPTConfig

    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in manifest["config"]["model"].items() if k in known})


# ----------------------------------------------------------------------------- saving


def _runs(index: torch.Tensor) -> torch.Tensor:
    """int64 (k, 2) (start, length) runs of consecutive positions, in the order of `index`."""
    if index.numel() == 0:
        return torch.zeros((0, 2), dtype=torch.int64)
    breaks = torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), breaks, torch.tensor([index.numel()])])
    return torch.stack([index[bounds[:-1]], bounds[1:] - bounds[:-1]], dim=1)


def _positions(runs: torch.Tensor) -> torch.Tensor:
    """The inverse of `_runs`: the flat positions the runs cover, in order."""
    lengths = runs[:, 1]
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(runs[:, 0] - offsets, lengths) + torch.arange(int(lengths.sum()))


_INDEX_CHUNK = 1 << 20  # positions made at once from short runs: 8 MiB of int64, whatever the model


def _pieces(runs: torch.Tensor):
    """Yield (lo, hi, where): values [lo, hi) in run order belong at `where` of the flat full tensor. `where`
    is a slice for a run of at least `_INDEX_CHUNK` elements, else the int64 positions of a batch of
    shorter runs (under 2 * _INDEX_CHUNK of them), so positions never cost memory in the tensor's size."""
    done, batch, size = 0, [], 0
    for start, length in runs.tolist():
        if length >= _INDEX_CHUNK:
            if batch:
                yield done, done + size, _positions(torch.tensor(batch))
                done, batch, size = done + size, [], 0
            yield done, done + length, slice(start, start + length)
            done += length
            continue
        batch.append((start, length))
        size += length
        if size >= _INDEX_CHUNK:
            yield done, done + size, _positions(torch.tensor(batch))
            done, batch, size = done + size, [], 0
    if batch:
        yield done, done + size, _positions(torch.tensor(batch))


def _shard_dict(
    entries: list, device: torch.device | None, buffers: "SnapshotBuffers | None" = None
) -> dict[str, torch.Tensor]:
    """This rank's file: its writer entries grouped by name (runs + values per kind) and its RNG states.
    Values are copied once, to CPU memory: fresh tensors, or `buffers`' reused (pinned on CUDA) ones with
    non-blocking copies (then `buffers.ready()` must be waited before the values are read). The live views
    cannot be saved as they are: torch.save would write their whole storage."""
    by_name: dict[str, list] = {}
    for e in entries:
        if e.write and e.numel:
            by_name.setdefault(e.name, []).append(e)
    out: dict[str, torch.Tensor] = {}
    for name, group in by_name.items():
        out[f"{name}::runs"] = torch.cat([e.runs() for e in group])
        for kind in group[0].tensors:
            parts = [e.tensors[kind].detach() for e in group]
            out[f"{name}::{kind}"] = (
                torch.cat(parts).cpu() if buffers is None else buffers.copy(f"{name}::{kind}", parts)
            )
    out["rng::cpu"] = torch.get_rng_state()
    if device is not None and device.type == "cuda":
        out["rng::cuda"] = torch.cuda.get_rng_state(device)
    return out


class SnapshotBuffers:
    """CPU buffers an async checkpoint's snapshot copies into, kept and reused from save to save (one per
    tensor of the file), pinned on CUDA so that the device -> host copies are non-blocking: the training
    thread only enqueues them, and the writer thread waits for them (`ready`) before torch.save reads them.
    Reuse is safe because they are handed out by AsyncSaver.free_buffers, which waits for the write in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self._done = None

    def copy(self, key: str, parts: list[torch.Tensor]) -> torch.Tensor:
        n = sum(p.numel() for p in parts)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() != n or buf.dtype != parts[0].dtype:
            buf = self.buffers[key] = torch.empty(n, dtype=parts[0].dtype, pin_memory=self.device.type == "cuda")
        offset = 0
        for p in parts:
            buf[offset : offset + p.numel()].copy_(p.reshape(-1), non_blocking=True)
            offset += p.numel()
        return buf

    def enqueued(self) -> None:
        """Every copy of this snapshot is enqueued: mark the point the writer waits for."""
        from runtime.device import record_event

        self._done = record_event(self.device)

    def ready(self) -> None:
        """Wait until the copies have landed (the writer thread, before torch.save)."""
        if self._done is not None:
            self._done()


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """AdamW's step count (the same for every parameter) and each group's hyperparameters."""
    steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(
            f"optimizer parameters are at different step counts {sorted(steps)}; this checkpoint format stores one"
        )
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in OPTIMIZER_HYPERPARAMETERS}
        for g in optimizer.param_groups
    ]
    return {"step": steps.pop() if steps else 0.0, "param_groups": groups}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, write: Callable[[IO], None], mode: str = "wb") -> None:
    """Write a file and fsync it before returning, so a crash after this never leaves it half on disk."""
    with open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if FILE_WRITTEN is not None:
        FILE_WRITTEN()


def _all_shapes(
    shapes: dict[str, list[int]],
    check: dict,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, list[int]], dict[str, dict]]:
    """({name: full shape} of every parameter any rank holds (pipeline stages hold different ones), {rank
    file: its size and CRC-32}), over all ranks; collective when distributed (all_gather_object of each
    rank's small dicts over `group`)."""
    mine = (shapes, check)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=group)
    return (
        {name: shape for d, _ in every for name, shape in d.items()},
        {name: c for _, d in every for name, c in d.items()},
    )


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def save(
    out_dir: str,
    step: int,
    entries: list,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    *,
    rank: int,
    world_size: int,
    keep: int,
    device: torch.device | None = None,
) -> str:
    """Collective: every rank calls it with its own entries. Returns the final directory.

    `extra` (from rank 0) goes into the manifest: "config" {"model", "train"}, "layout", and anything
    else the trainer restores itself (e.g. "scaler")."""
    return write(
        snapshot(out_dir, step, entries, optimizer, extra, rank=rank, world_size=world_size, keep=keep, device=device)
    )


def snapshot(
    out_dir: str,
    step: int,
    entries: list,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    *,
    rank: int,
    world_size: int,
    keep: int,
    device: torch.device | None = None,
    buffers: SnapshotBuffers | None = None,
) -> dict:
    """This rank's part of the checkpoint of `step`, copied off the live state (to CPU memory): what `write`
    puts on disk. Taking it is the only part of a save that must stop training; into `buffers` (an async
    save's) it only enqueues the copies, and `write` waits for them."""
    shard = _shard_dict(entries, device, buffers)
    if buffers is not None:
        buffers.enqueued()
    return {
        "out_dir": out_dir,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "keep": keep,
        "shard": shard,
        "shapes": {e.name: list(e.shape) for e in entries},
        "buffers": buffers,
        "manifest": {**extra, "optimizer": optimizer_state(optimizer)} if rank == 0 else None,
    }


def write(snap: dict, group: dist.ProcessGroup | None = None) -> str:
    """Write a `snapshot` atomically (collective over `group`: every rank calls it with its own snapshot).

    Rank 0 clears leftovers and creates `<step>.tmp-saving`; every rank writes and fsyncs its file; the
    ranks exchange their tensor shapes and file checks (all_gather_object, which also orders the writes
    before the manifest); rank 0 writes the manifest, renames the directory and prunes old checkpoints.
    `group` lets a background thread save over a process group of its own (`AsyncSaver`)."""
    out_dir, step, rank, world_size = snap["out_dir"], snap["step"], snap["rank"], snap["world_size"]
    root = os.path.join(out_dir, SUBDIR)
    final = step_dir(out_dir, step)
    tmp = final + ".tmp-saving"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # leftovers of saves or deletions that were interrupted
            if ".tmp-" in name or name.endswith(".deleting"):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    _barrier(group)
    path = os.path.join(tmp, rank_file(rank))
    if snap.get("buffers") is not None:
        snap["buffers"].ready()  # the snapshot's non-blocking copies have landed
    _write_durably(path, lambda f: torch.save(snap["shard"], f))
    shapes, checks = _all_shapes(snap["shapes"], {rank_file(rank): file_check(path)}, group)  # also a barrier
    if rank == 0:
        files = [rank_file(r) for r in range(world_size)]
        missing = [f for f in files if not os.path.exists(os.path.join(tmp, f))]
        if missing:
            raise CheckpointError(
                f"{tmp}: rank files {missing} are missing after every rank wrote its own; "
                f"--out_dir must be on a filesystem that every node shares"
            )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            **snap["manifest"],
            "files": files,
            "tensors": {name: {"shape": shape} for name, shape in shapes.items()},
            "file_checks": checks,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_durably(os.path.join(tmp, MANIFEST), lambda f: json.dump(manifest, f, indent=1), "w")
        _fsync_dir(tmp)
        if os.path.exists(final):  # e.g. re-saving a step after resuming from an older checkpoint
            os.rename(final, final + ".deleting")
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(final + ".deleting", ignore_errors=True)
        prune(out_dir, snap["keep"])
    _barrier(group)
    return final


class AsyncSaver:
    """Checkpoints that don't stop training (--async_checkpoint): `save` takes the snapshot (non-blocking
    copies of this rank's state into `buffers`, reused pinned CPU memory) and returns; a background thread writes it
    with `write`, over a gloo process group of
    its own so its collectives never interleave with training's. A second save first waits for the one in
    flight (so at most one snapshot is held besides the live state); `wait` joins it and re-raises its
    error. Atomicity is `write`'s: a crash mid-write leaves the previous checkpoint the newest."""

    def __init__(self, device: torch.device | None = None):
        from parallel.groups import group_timeout

        self.group = (
            dist.new_group(backend="gloo", timeout=group_timeout())
            if dist.is_available() and dist.is_initialized()
            else None
        )
        self.buffers = SnapshotBuffers(device or torch.device("cpu"))  # reused by every snapshot of this run
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.path: str | None = None

    def free_buffers(self) -> SnapshotBuffers:
        """The buffers for the next snapshot, once the write in flight (which reads them) has finished."""
        self.wait()
        return self.buffers

    def save(self, snap: dict) -> None:
        self.wait()
        self.path = step_dir(snap["out_dir"], snap["step"])

        def work():
            try:
                write(snap, self.group)
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=work, name=f"checkpoint-{snap['step']}", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def prune(out_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (renamed first, so a half-deleted one never
    looks complete)."""
    for _, path in list_checkpoints(out_dir)[:-keep]:
        os.rename(path, path + ".deleting")
        shutil.rmtree(path + ".deleting", ignore_errors=True)


# ----------------------------------------------------------------------------- loading


class _Shards:
    """All rank files of a checkpoint, memory-mapped, and full tensors assembled from their pieces."""

    def __init__(self, path: str, manifest: dict | None = None):
        self.path = path
        self.manifest = manifest or read_manifest(path)
        self.files = []
        for name in self.manifest["files"]:
            try:
                self.files.append(
                    torch.load(os.path.join(path, name), map_location="cpu", weights_only=True, mmap=True)
                )
            except Exception as e:  # noqa: BLE001 -- missing or corrupt file: say which
                raise CheckpointError(f"{path}: cannot read {name} ({type(e).__name__}: {e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.manifest["tensors"]:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return tuple(self.manifest["tensors"][name]["shape"])

    def full(self, name: str, kinds) -> dict[str, torch.Tensor]:
        """{kind: flat full tensor} of `name`, assembled from every file's pieces; each element must be
        written exactly once."""
        numel = 1
        for d in self.shape(name):
            numel *= d
        seen = torch.zeros(numel, dtype=torch.bool)
        out: dict[str, torch.Tensor] = {}
        for shard in self.files:
            runs = shard.get(f"{name}::runs")
            if runs is None:
                continue
            pieces = {kind: shard.get(f"{name}::{kind}") for kind in kinds}
            for kind, piece in pieces.items():
                if piece is None:
                    raise CheckpointError(f"{self.path}: {name} has no {kind!r} values")
                if kind not in out:
                    out[kind] = torch.empty(numel, dtype=piece.dtype)
            for lo, hi, where in _pieces(runs):
                if seen[where].any():
                    raise CheckpointError(f"{self.path}: elements of {name} are written by more than one rank file")
                seen[where] = True
                for kind, piece in pieces.items():
                    out[kind][where] = piece[lo:hi]
        if not bool(seen.all()):
            raise CheckpointError(f"{self.path}: {name} is incomplete ({int(seen.sum())} of {numel} elements)")
        return out


def _check_same_step(step: int, device: torch.device | None) -> None:
    """Every rank must have picked the same checkpoint (e.g. nodes that do not share --out_dir would not)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    t = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if int(t[0]) != step or int(t[1]) != -step:
        raise CheckpointError(
            f"ranks resume from different checkpoints (steps {-int(t[1])}..{int(t[0])}); "
            f"--out_dir must be on a filesystem that every node shares"
        )


def load(
    path: str,
    entries: list,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    world_size: int,
    device: torch.device | None = None,
) -> dict:
    """Fill this rank's entries (parameters and AdamW moments), the optimizer's step count and group
    hyperparameters, and (same world size only) this rank's RNG states from checkpoint `path`.
    Collective when distributed (ranks check they load the same step). Returns the manifest."""
    shards = _Shards(path)
    manifest = shards.manifest
    _check_same_step(int(manifest["step"]), device)
    by_name: dict[str, list] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e)
    with torch.no_grad():
        for name, group in by_name.items():
            if shards.shape(name) != tuple(group[0].shape):
                raise CheckpointError(
                    f"{path}: {name} has shape {shards.shape(name)}, the model {tuple(group[0].shape)}"
                )
            full = shards.full(name, list(group[0].tensors))
            for e in group:
                for lo, hi, where in _pieces(e.runs()):
                    for kind, view in e.tensors.items():
                        view[lo:hi].copy_(full[kind][where])
    load_optimizer_state(optimizer, manifest["optimizer"])
    if manifest["layout"]["world_size"] == world_size:
        own = shards.files[rank]
        torch.set_rng_state(own["rng::cpu"].clone())
        if "rng::cuda" in own and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(own["rng::cuda"].clone(), device)
    return manifest


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The step count into the parameters that keep one (AdamW's: ensure_optimizer_state made it; Muon keeps
    none), then the groups' hyperparameters."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            state = optimizer.state[p]
            if "step" not in state:
                continue
            state["step"] = torch.tensor(
                float(saved["step"]), dtype=torch.float32, device=p.device if on_device else "cpu"
            )
    if len(saved["param_groups"]) == len(optimizer.param_groups):
        for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in hyper.items()})


def consolidate(path: str, kinds=("param",)) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {kind: full tensor}} of a checkpoint, whatever layout saved it (one process, CPU)."""
    shards = _Shards(path)
    return {
        name: {k: v.view(shards.shape(name)) for k, v in shards.full(name, kinds).items()}
        for name in shards.manifest["tensors"]
    }


def load_model(path: str, device: torch.device | str = "cpu"):
    """A single-process GPT with the parameters of checkpoint `path` (saved in any layout)."""
    from model.gpt import GPT

    manifest = read_manifest(path)
    with torch.device("meta"):
        model = GPT(model_config(manifest))
    model.to_empty(device=device)
    model.lm_head.weight = model.transformer.wte.weight  # to_empty unties
    shards = _Shards(path, manifest)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if shards.shape(name) != tuple(p.shape):
                raise CheckpointError(f"{path}: {name} has shape {shards.shape(name)}, the model {tuple(p.shape)}")
            p.copy_(shards.full(name, ["param"])["param"].view(p.shape))
        for name, b in model.named_buffers():  # to_empty left them unset; the state ones (the MoE expert bias)
            b.zero_()  # are in the checkpoint, the counters start at zero
            if name in shards.manifest["tensors"]:
                b.copy_(shards.full(name, ["param"])["param"].view(b.shape))
    return model
