"""A checkpoint on disk, found and checked: the names (`step_dir`, `rank_file`, the manifest), which checkpoints
a run holds (`list_checkpoints`, `newest`), whether one is intact (each rank file's size and CRC-32 against its
manifest: `verify`, `newest_intact`), and what its manifest says (`read_manifest`, `config_mismatch`,
`model_config`). Nothing here writes; checkpoints/checkpoint.py saves and loads, and re-exports these names.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import asdict, fields
from typing import Callable

FORMAT = "gpt2-parallel-checkpoint"
VERSION = 1
SUBDIR = "checkpoints"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


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
