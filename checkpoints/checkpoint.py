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
(`Entry.runs()`), and runs are turned into positions at most `_INDEX_CHUNK` elements at a time. A save
writes its file one value (a name's parameter or moment) at a time, copied off the live views as torch.save
comes to it (checkpoints/streaming.py): host memory holds one value beside the state, not a copy of it all.

Loading works in any layout: each rank builds its own entries, and for every name assembles the full
tensor from all files' pieces (memory-mapped), checks that every element is covered exactly once, and
copies its own runs of it into its live views. So a checkpoint from one process, DDP, FSDP, TP or 2D resumes
in any other with the same model config.

Integrity (checkpoints/manifest.py, whose names this module re-exports): the manifest records each rank file's
size and CRC-32 (zlib.crc32: in C, about 1 GB/s per core, enough to catch truncation and flipped bytes; not a
defence against tampering). `verify` checks them, and `newest_intact` walks back from the newest checkpoint
past damaged ones (a garbled manifest, a missing, truncated or altered rank file), naming each, so a damaged
newest checkpoint never loads garbage and never needs a person to delete it before `--resume`, sample.py or
export.py can go on.

Atomicity: rank 0 clears leftovers of interrupted saves and creates `step_000012.tmp-saving`; every rank
writes and fsyncs its file; barrier; rank 0 checks all files are there, writes and fsyncs the manifest,
fsyncs the directory, renames it to `step_000012` and fsyncs `checkpoints/`. Only a directory with its
final name and a manifest counts as a checkpoint, so a save killed at any point leaves the previous one
as the newest. Older checkpoints beyond the newest `keep` are renamed away, then deleted.

train.py saves and resumes its Trainer through trainer/resume.py's `save_trainer` and `restore_trainer`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import IO, Callable

import torch
import torch.distributed as dist

from checkpoints.manifest import (
    FORMAT,
    MANIFEST,
    SUBDIR,
    VERSION,
    CheckpointError,
    config_mismatch,
    file_check,
    list_checkpoints,
    model_config,
    newest,
    newest_intact,
    rank_file,
    read_manifest,
    step_dir,
    verify,
)
from checkpoints.streaming import STAGING_BYTES, Lazy, Staging, save_streamed, stage

__all__ = [  # the manifest's names, re-exported: callers ask checkpoint.X
    "FORMAT",
    "MANIFEST",
    "SUBDIR",
    "VERSION",
    "CheckpointError",
    "config_mismatch",
    "file_check",
    "list_checkpoints",
    "model_config",
    "newest",
    "newest_intact",
    "rank_file",
    "read_manifest",
    "step_dir",
    "verify",
]

# The test seam (as parallel/comm.HOOKS is the runtime's): trainer/faults.py sets it to count the files this
# process writes, for GPT_CKPT_FAIL_AFTER_FILES. Checkpoints import nothing above them.
FILE_WRITTEN: Callable[[], None] | None = None


OPTIMIZER_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


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


def _shard(entries: list, device: torch.device | None) -> dict[str, torch.Tensor | Lazy]:
    """This rank's file: its writer entries grouped by name (runs + values per kind) and its RNG states. The
    values are `Lazy`: copied to CPU memory, one name and kind at a time, when the file is written (the live
    views cannot be saved as they are: torch.save would write their whole storage)."""
    by_name: dict[str, list] = {}
    for e in entries:
        if e.write and e.numel:
            by_name.setdefault(e.name, []).append(e)
    out: dict[str, torch.Tensor | Lazy] = {}
    for name, group in by_name.items():
        out[f"{name}::runs"] = torch.cat([e.runs() for e in group])
        for kind in group[0].tensors:
            out[f"{name}::{kind}"] = Lazy([e.tensors[kind].detach() for e in group])
    out["rng::cpu"] = torch.get_rng_state()
    if device is not None and device.type == "cuda":
        out["rng::cuda"] = torch.cuda.get_rng_state(device)
    return out


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
) -> dict:
    """This rank's part of the checkpoint of `step`: what `write` puts on disk. The values are still the live
    views (`Lazy`), copied when written: `write` it before training goes on, or hand it to an `AsyncSaver`,
    which stages the copies before it returns."""
    return {
        "out_dir": out_dir,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "keep": keep,
        "shard": _shard(entries, device),
        "shapes": {e.name: list(e.shape) for e in entries},
        "manifest": {**extra, "optimizer": optimizer_state(optimizer)} if rank == 0 else None,
    }


def write(snap: dict, group: dist.ProcessGroup | None = None) -> str:
    """Write a `snapshot` atomically (collective over `group`: every rank calls it with its own snapshot).

    Rank 0 clears leftovers and creates `<step>.tmp-saving`; every rank writes and fsyncs its file (streamed:
    one value in host memory at a time); the ranks exchange their tensor shapes and file checks
    (all_gather_object, which also orders the writes before the manifest); rank 0 writes the manifest, renames
    the directory and prunes old checkpoints. `group` lets a background thread save over a process group of its
    own (`AsyncSaver`)."""
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
    _write_durably(path, lambda f: save_streamed(snap["shard"], f))
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
    """Checkpoints that don't stop training (--async_checkpoint). `save` starts a background thread that writes
    the snapshot with `write`, over a gloo process group of its own (its collectives never interleave with
    training's), and meanwhile copies the snapshot's values into `staging` (host blocks, pinned on CUDA, kept
    from save to save; on CUDA the copies are only enqueued, and the writer waits for each before writing it).
    It returns once every value is staged. The staging holds at most `staging_bytes`: past that, `save` waits
    for the writer to free blocks, so a state larger than the budget blocks training for the write of the part
    beyond it. A second save first waits for the one in flight; `wait` joins it and re-raises its error.
    Atomicity is `write`'s: a crash mid-write leaves the previous checkpoint the newest."""

    def __init__(self, device: torch.device | None = None, staging_bytes: int = STAGING_BYTES):
        from parallel.groups import group_timeout

        self.group = (
            dist.new_group(backend="gloo", timeout=group_timeout())
            if dist.is_available() and dist.is_initialized()
            else None
        )
        self.device = device or torch.device("cpu")
        self.staging = Staging(self.device, staging_bytes)  # reused by every snapshot of this run
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.path: str | None = None

    def save(self, snap: dict) -> None:
        self.wait()
        self.path = step_dir(snap["out_dir"], snap["step"])
        lazies = [v for v in snap["shard"].values() if isinstance(v, Lazy)]
        for lazy in lazies:
            lazy.expect_staging()
        self.staging.reopen()

        def work():
            try:
                write(snap, self.group)
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread by wait()
                self.error = e
                self.staging.abort()  # the training thread stops staging

        self.thread = threading.Thread(target=work, name=f"checkpoint-{snap['step']}", daemon=True)
        self.thread.start()
        stage(lazies, self.staging, self.device)

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
