"""Batches as a pure function of (seed, step, split): every layout trains on exactly the same tokens.

The global batch of optimizer step s is `rows = total_batch_size // seq_len` windows of seq_len+1
tokens whose start offsets are drawn from a CPU generator seeded by (seed, split, s) alone. That batch
is then cut into micro-batches: micro-step m of data-parallel rank r takes rows
[(m * dp + r) * mb, (m * dp + r + 1) * mb). One process with 8 micro-steps, DDP x2 with 4, or
DDP x4 with 2 all see the same rows, so they compute the same mean loss up to float rounding.
Tensor-parallel ranks of one dp rank get identical rows.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

SHARDS = ("train", "val")
BUILTIN = ("shakespeare", "shakespeare_char", "openwebtext")  # data/<name>/prepare.py writes data/<name>/


class DataError(ValueError):
    """A dataset that is missing, empty or corrupt (the trainer turns it into one line and exit 2)."""


def resolve_dataset_dir(dataset: str, root: str | None = None) -> str:
    """'shakespeare' / 'shakespeare_char' / 'openwebtext' name data/<name>/; anything else is a directory with the
    bins."""
    root = root or os.path.dirname(os.path.abspath(__file__))
    if dataset in BUILTIN:
        return os.path.join(root, dataset)
    return dataset


def prepare_hint(dataset: str) -> str:
    if dataset in BUILTIN:
        return f"python data/{dataset}/prepare.py"
    return "python data/openwebtext/prepare.py --input YOUR_FILES --out_dir " + dataset


def ensure_builtin(dataset: str, data_dir: str, leader: bool) -> bool:
    """Prepare a built-in Shakespeare dataset in `data_dir` when it is missing (`leader`: this process prepares, the
    others wait for it); False when that failed. Other datasets are prepared beforehand: True."""
    if dataset not in ("shakespeare", "shakespeare_char"):
        return True
    import importlib
    return importlib.import_module(f"data.{dataset}.prepare").ensure_prepared(data_dir, leader=leader)


def open_tokens(path: str, vocab_size: int, min_tokens: int, hint: str) -> np.memmap:
    """Memory-map a uint16 token file, checking that it is complete, long enough and in-vocabulary.

    The vocabulary check reads the first and last million tokens (a full scan of OpenWebText's 9B
    tokens would cost minutes at every start)."""
    if not os.path.exists(path):
        raise DataError(f"missing {path}; prepare it with: {hint}")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path} is empty; re-create it with: {hint}")
    if size % 2:
        raise DataError(f"{path} has {size} bytes, not a whole number of uint16 tokens (corrupt?); "
                        f"re-create it with: {hint}")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) < min_tokens:
        raise DataError(f"{path} holds {len(data)} tokens, fewer than the {min_tokens} one sequence needs")
    probe = np.concatenate([data[:1 << 20], data[-(1 << 20):]])
    if int(probe.max()) >= vocab_size:
        raise DataError(f"{path} holds token id {int(probe.max())} >= vocab size {vocab_size} (corrupt?); "
                        f"re-create it with: {hint}")
    return data


def batch_seed(seed: int, split: str, step: int) -> int:
    digest = hashlib.sha256(f"{seed}:{split}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def micro_batch_chunk(micro: int, dp_rank: int, dp: int) -> int:
    """Which chunk of the global batch micro-step `micro` of data-parallel rank `dp_rank` trains on."""
    return micro * dp + dp_rank


class BatchSource:
    """Serves (x, y) micro-batches of shape (mb, seq_len) from the train/val token files."""

    def __init__(self, data_dir: str, seq_len: int, vocab_size: int, seed: int, hint: str = ""):
        self.seq_len, self.seed = seq_len, seed
        self.paths = {s: os.path.join(data_dir, f"{s}.bin") for s in SHARDS}
        hint = hint or prepare_hint(data_dir)
        self.num_tokens = {s: len(open_tokens(p, vocab_size, seq_len + 1, hint)) for s, p in self.paths.items()}

    def offsets(self, split: str, step: int, rows: int) -> torch.Tensor:
        """Start offsets of the `rows` windows that make up global batch `step` of `split`."""
        gen = torch.Generator().manual_seed(batch_seed(self.seed, split, step))
        return torch.randint(self.num_tokens[split] - self.seq_len, (rows,), generator=gen)

    def get(self, split: str, step: int, rows: int, chunk: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [chunk*mb, (chunk+1)*mb) of global batch `step`: inputs x, next-token targets y (int64).

        The trainer's micro-step m on dp rank r reads chunk `micro_batch_chunk(m, r, dp)`."""
        start = chunk * micro_batch
        offs = self.offsets(split, step, rows)[start:start + micro_batch].tolist()
        data = np.memmap(self.paths[split], dtype=np.uint16, mode="r")  # re-opened: memmaps leak otherwise
        windows = torch.from_numpy(np.stack([data[o:o + self.seq_len + 1] for o in offs]).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
