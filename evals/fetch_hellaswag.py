"""Download HellaSwag (Zellers et al. 2019) from its authors' repository, as build-nanogpt does.

    python -m evals.fetch_hellaswag                     # the validation set -> data/hellaswag/hellaswag_val.jsonl
    python -m evals.fetch_hellaswag --split train --out FILE.jsonl

The file is checked before it is kept: every line an example evals/hellaswag.py can score (the test split has no
labels, so only train and val are offered), and the validation set's 10,042 examples. It is written aside and
renamed, so a failed download never leaves a partial file under the name. Bad input or a failed download: one line,
exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.common import http_get  # noqa: E402
from evals.hellaswag import HellaSwagError, load_examples  # noqa: E402

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
EXAMPLES = {"val": 10042}  # what the validation set must hold (build-nanogpt, llm.c)
TIMEOUT_S = 300.0


def fetch(split: str, out: str, get: Callable[[str, float], bytes] | None = None) -> int:
    """Download `split` to `out` (checked, then renamed into place); returns its number of examples. `get(url,
    timeout)` -> bytes: the download (tests pass their own)."""
    url = URL.format(split=split)
    try:
        body = (get or http_get)(url, TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 -- any failure here means "could not download"
        raise HellaSwagError(f"cannot download {url} ({type(e).__name__}: {e})") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        n = len(load_examples(tmp))  # every line an example with a label
        if split in EXAMPLES and n != EXAMPLES[split]:
            raise HellaSwagError(f"{url} gave {n} examples, not the {EXAMPLES[split]} of HellaSwag's {split} set")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return n


def main(argv: list[str] | None = None) -> int:
    from evals.hellaswag import DEFAULT_DATA

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--split", choices=["val", "train"], default="val")
    p.add_argument(
        "--out", default=None, help=f"where to write it (default: {DEFAULT_DATA} for val, beside it for train)"
    )
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(DEFAULT_DATA), f"hellaswag_{args.split}.jsonl")
    try:
        n = fetch(args.split, out)
    except HellaSwagError as e:
        sys.stderr.write(f"fetch_hellaswag: error: {' '.join(str(e).split())}\n")
        return 2
    print(f"{n} examples -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
