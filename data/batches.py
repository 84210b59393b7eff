"""Batches as a pure function of (seed, step, split): every layout trains on exactly the same tokens.

The global batch of optimizer step s is `rows = total_batch_size // seq_len` windows of seq_len+1
tokens whose start offsets are drawn from a CPU generator seeded by (seed, split, s) alone. That batch
is then cut into micro-batches: micro-step m of data-parallel rank r takes rows
[(m * dp + r) * mb, (m * dp + r + 1) * mb). One process with 8 micro-steps, DDP x2 with 4, or
DDP x4 with 2 all see the same rows, so they compute the same mean loss up to float rounding.
Tensor-parallel ranks of one dp rank get identical rows.

A split is one token stream: `train.bin` alone, or shards `train_000001.bin`, `train_000002.bin`, ... (as
data/fineweb/prepare.py writes them) read end to end in their numeric order. Offsets index the stream, and a
window that starts near a shard's end continues into the next shard, so the same tokens cut into any number of
shards give the same batches as one file.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re

import numpy as np
import torch

SHARDS = ("train", "val")
BUILT_IN = ("shakespeare", "shakespeare_char", "openwebtext", "fineweb")  # data/<name>/, data/<name>/prepare.py


class DataError(ValueError):
    """A dataset that is missing, empty or corrupt (the trainer turns it into one line and exit 2)."""


def resolve_dataset_dir(dataset: str, root: str | None = None) -> str:
    """'shakespeare' / 'shakespeare_char' / 'openwebtext' / 'fineweb' name data/<name>/; anything else is a directory
    with the bins."""
    root = root or os.path.dirname(os.path.abspath(__file__))
    if dataset in BUILT_IN:
        return os.path.join(root, dataset)
    return dataset


def prepare_hint(dataset: str) -> str:
    if dataset in BUILT_IN:
        return f"python data/{dataset}/prepare.py"
    return "python data/openwebtext/prepare.py --input YOUR_FILES --out_dir " + dataset


def prepared_dir(dataset: str, leader: bool) -> str:
    """The dataset's directory. A built-in Shakespeare one whose files are missing is prepared (`leader`: this
    process prepares, the others wait for it). DataError when that failed, or when there is no such directory."""
    data_dir = resolve_dataset_dir(dataset)
    if dataset in ("shakespeare", "shakespeare_char"):
        import importlib

        if not importlib.import_module(f"data.{dataset}.prepare").ensure_prepared(data_dir, leader=leader):
            raise DataError(f"dataset {dataset} could not be prepared in {data_dir}; run: {prepare_hint(dataset)}")
    if not os.path.isdir(data_dir):
        raise DataError(f"dataset {dataset!r}: no directory {data_dir}; prepare it with: {prepare_hint(dataset)}")
    return data_dir


def split_files(data_dir: str, split: str) -> list[str]:
    """The files of `split`, in stream order: `<split>.bin`, or its shards `<split>_<n>.bin` by n. Both at once
    is ambiguous: DataError."""
    single = os.path.join(data_dir, f"{split}.bin")
    pattern = re.compile(rf"{split}_(\d+)\.bin")
    numbered = sorted(
        (int(m.group(1)), name)
        for name in (os.listdir(data_dir) if os.path.isdir(data_dir) else [])
        if (m := pattern.fullmatch(name))
    )
    if numbered and os.path.exists(single):
        raise DataError(f"{data_dir} holds both {split}.bin and {len(numbered)} {split}_N.bin shards: keep one of them")
    return [os.path.join(data_dir, name) for _, name in numbered] or [single]


def open_tokens(path: str, vocab_size: int, min_tokens: int, hint: str, probe: int = 1 << 20) -> np.memmap:
    """Memory-map a uint16 token file, checking that it is complete, long enough and in-vocabulary.

    The vocabulary check reads the first and last `probe` tokens (a full scan of OpenWebText's 9B
    tokens would cost minutes at every start)."""
    if not os.path.exists(path):
        raise DataError(f"missing {path}; prepare it with: {hint}")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path} is empty; re-create it with: {hint}")
    if size % 2:
        raise DataError(
            f"{path} has {size} bytes, not a whole number of uint16 tokens (corrupt?); re-create it with: {hint}"
        )
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) < min_tokens:
        raise DataError(f"{path} holds {len(data)} tokens, fewer than the {min_tokens} one sequence needs")
    ends = np.concatenate([data[:probe], data[-probe:]])
    if int(ends.max()) >= vocab_size:
        raise DataError(
            f"{path} holds token id {int(ends.max())} >= vocab size {vocab_size} (corrupt?); re-create it with: {hint}"
        )
    return data


def batch_seed(seed: int, split: str, step: int) -> int:
    digest = hashlib.sha256(f"{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def micro_batch_chunk(micro: int, dp_rank: int, dp: int) -> int:
    """Which chunk of the global batch micro-step `micro` of data-parallel rank `dp_rank` trains on."""
    return micro * dp + dp_rank


class BatchSource:
    """Serves (x, y) micro-batches of shape (mb, seq_len) from the train/val token streams (one file or shards)."""

    def __init__(self, data_dir: str, seq_len: int, vocab_size: int, seed: int, hint: str = ""):
        self.seq_len, self.seed = seq_len, seed
        hint = hint or prepare_hint(data_dir)
        self.files = {s: split_files(data_dir, s) for s in SHARDS}
        self.starts: dict[str, list[int]] = {}  # each file's first stream offset, and the stream's length last
        for split, files in self.files.items():
            probe = max(1 << 14, (1 << 20) // len(files))  # ~2M tokens read in all, however many shards
            sizes = [len(open_tokens(p, vocab_size, 1 if len(files) > 1 else seq_len + 1, hint, probe)) for p in files]
            self.starts[split] = np.cumsum([0, *sizes]).tolist()
            if self.starts[split][-1] < seq_len + 1:
                raise DataError(
                    f"the {split} split holds {self.starts[split][-1]} tokens in {len(files)} shards "
                    f"({os.path.basename(files[0])} ...), fewer than the {seq_len + 1} one sequence needs"
                )
        self.num_tokens = {s: starts[-1] for s, starts in self.starts.items()}

    def offsets(self, split: str, step: int, rows: int) -> torch.Tensor:
        """Start offsets (in the split's stream) of the `rows` windows that make up global batch `step`."""
        gen = torch.Generator().manual_seed(batch_seed(self.seed, split, step))
        return torch.randint(self.num_tokens[split] - self.seq_len, (rows,), generator=gen)

    def window(self, split: str, offset: int, maps: dict[int, np.memmap]) -> np.ndarray:
        """Tokens [offset, offset + seq_len] of the split's stream, read across shard boundaries (`maps`: the
        files this read opened, by index)."""
        starts, out, filled = self.starts[split], np.empty(self.seq_len + 1, dtype=np.uint16), 0
        i = bisect.bisect_right(starts, offset) - 1
        while filled < len(out):
            if i not in maps:
                maps[i] = np.memmap(self.files[split][i], dtype=np.uint16, mode="r")
            local = offset + filled - starts[i]
            take = min(len(out) - filled, starts[i + 1] - starts[i] - local)
            out[filled : filled + take] = maps[i][local : local + take]
            filled, i = filled + take, i + 1
        return out

    def get(self, split: str, step: int, rows: int, chunk: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [chunk*mb, (chunk+1)*mb) of global batch `step`: inputs x, next-token targets y (int64).

        The trainer's micro-step m on dp rank r reads chunk `micro_batch_chunk(m, r, dp)`."""
        start = chunk * micro_batch
        offs = self.offsets(split, step, rows)[start : start + micro_batch].tolist()
        maps: dict[int, np.memmap] = {}  # re-opened at every call: memmaps leak otherwise
        windows = torch.from_numpy(np.stack([self.window(split, o, maps) for o in offs]).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
