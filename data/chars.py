"""A character-level vocabulary: token id i is the i-th character of the dataset's sorted character set.

A dataset directory is character-level when it holds `meta.json` beside its bins (data/shakespeare_char/ writes
one): {"kind": "chars", "chars": "<every character, sorted>"}. train.py sizes the model's vocabulary from it
(`padded_vocab`: rounded up to a multiple of 64, as GPT-2's 50257 is to 50304, so every tensor-parallel size
we use divides it); sample.py and export.py decode with it. A directory without meta.json holds GPT-2 BPE ids.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from data.batches import DataError

META = "meta.json"
VOCAB_MULTIPLE = 64  # as model.GPTConfig pads GPT-2's vocabulary


class CharsError(DataError):
    """A meta.json that is not a character vocabulary, or one a model's vocabulary cannot hold (one line)."""


@dataclass(frozen=True)
class CharVocab:
    chars: str  # sorted, each character once: id i <-> chars[i]

    @classmethod
    def of_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    @property
    def padded_vocab(self) -> int:
        """The model's vocab_size: len(chars) rounded up to a multiple of VOCAB_MULTIPLE (the extra rows are
        never a target and never sampled)."""
        return -(-len(self.chars) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; KeyError names the first character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def save(self, data_dir: str) -> str:
        """Write meta.json in `data_dir` (whole or not at all: a temporary file moved into place)."""
        path = os.path.join(data_dir, META)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"kind": "chars", "vocab_size": len(self.chars), "chars": self.chars}, f)
        os.replace(tmp, path)
        return path


def load_chars(data_dir: str, vocab_size: int | None = None) -> CharVocab | None:
    """The character vocabulary in `data_dir`/meta.json, or None when there is no meta.json (BPE ids). With
    `vocab_size` (a model's), refused when the model cannot hold every character."""
    path = os.path.join(data_dir, META)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        chars = meta["chars"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CharsError(f"{path} is not a character vocabulary ({type(e).__name__}: {e})") from None
    if meta.get("kind") != "chars" or not isinstance(chars, str) or not chars or "".join(sorted(set(chars))) != chars:
        raise CharsError(
            f"{path} is not a character vocabulary: 'chars' must be a non-empty string of sorted, distinct characters"
        )
    if vocab_size is not None and vocab_size < len(chars):
        raise CharsError(
            f"vocab_size {vocab_size} is smaller than the {len(chars)} characters of {path} (a "
            f"character-level model's vocab is {CharVocab(chars).padded_vocab}: leave --vocab_size out)"
        )
    return CharVocab(chars)


def holds_chars(dataset: str) -> bool:
    """Whether `dataset` (a --dataset value) is character-level: shakespeare_char, prepared or not, or a directory
    with meta.json."""
    from data.batches import resolve_dataset_dir

    return dataset == "shakespeare_char" or os.path.isfile(os.path.join(resolve_dataset_dir(dataset), META))


def run_chars(manifest: dict) -> CharVocab | None:
    """The characters a checkpoint's model reads and writes (None: GPT-2 BPE ids), from the dataset its run
    trained on (the manifest's config.train.dataset, as nanoGPT's sample.py finds meta.pkl). Refused in one
    line when that dataset is shakespeare_char and unprepared, or the model cannot hold its characters."""
    from data.batches import prepare_hint, resolve_dataset_dir

    dataset, vocab_size = manifest["config"]["train"].get("dataset"), manifest["config"]["model"]["vocab_size"]
    if dataset is None:
        return None
    data_dir = resolve_dataset_dir(dataset)
    chars = load_chars(data_dir, vocab_size)
    if chars is None and dataset == "shakespeare_char":
        raise CharsError(
            f"the run trained on {dataset}, whose characters ({os.path.join(data_dir, META)}) are "
            f"missing: prepare them with {prepare_hint(dataset)}"
        )
    return chars
