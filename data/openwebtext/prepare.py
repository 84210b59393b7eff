"""
Prepare OpenWebText, or a local text corpus, for GPT-2 training: train.bin / val.bin of uint16
GPT-2 BPE token ids, each document followed by the <|endoftext|> token (like nanoGPT).

Default: the "openwebtext" dataset from the Hugging Face Hub (~8M documents, ~54 GB of HF cache;
gives train.bin ~17 GB, ~9B tokens, and val.bin ~8.5 MB, ~4M tokens).

--input PATH [PATH ...] uses local files instead, through the same split/tokenise/write code:
  .txt      --txt_sample_by document (default): each file is one document;
            paragraph: documents are separated by blank lines ("\\n\\n"); line: one per line
  .jsonl    one JSON object per line; the document is its "text" field (--text_field)
  .parquet  the "text" column (--text_field)
Empty / whitespace-only documents are dropped.

The documents are shuffled and split into train/val with datasets' train_test_split (seed 2357),
val getting ceil(val_fraction * n) documents (at least 1, and at least 1 left for train).
Bins are written to temporary files and only moved into place at the very end, so a failed run
never clobbers existing bins. Bad input exits with code 2 and one "error: ..." line on stderr.

$ python data/openwebtext/prepare.py                                  # OpenWebText from the Hub
$ python data/openwebtext/prepare.py --input my.jsonl --out_dir data/mine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from data.common import PrepareError, url_reachable, write_token_bins  # noqa: E402
from data.tokenizer import EOT_TOKEN, get_gpt2_encoding  # noqa: E402

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

HUB_DATASET = "openwebtext"
HUB_PROBE_TIMEOUT_S = 10.0
SEED = 2357
VAL_FRACTION = 0.0005
WRITE_CHUNKS = 1024  # like nanoGPT: write each bin in ~1024 pieces
INPUT_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}


def default_num_proc() -> int:
    return min(8, os.cpu_count() or 1)


# -----------------------------------------------------------------------------
# loading: the Hub


def load_hub_dataset(name: str, revision: str | None, num_proc: int, cache_dir: str | None) -> Dataset:
    """The "train" split of a Hub dataset; PrepareError (quickly) when it can't be had."""
    from datasets import config, load_dataset

    hint = "to prepare local files instead, pass --input PATH [PATH ...] (.txt, .jsonl or .parquet)"
    if not config.HF_HUB_OFFLINE and not url_reachable(config.HF_ENDPOINT, HUB_PROBE_TIMEOUT_S):
        raise PrepareError(
            f"cannot download the {name!r} dataset: the Hugging Face Hub ({config.HF_ENDPOINT}) is unreachable; "
            f"{hint}, or set HF_HUB_OFFLINE=1 to use a copy already in the HF cache"
        )
    try:
        dataset = load_dataset(name, revision=revision, num_proc=num_proc, cache_dir=cache_dir)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise PrepareError(f"cannot load the {name!r} dataset ({type(e).__name__}: {reason}); {hint}") from e
    if "train" not in dataset:
        raise PrepareError(f"the {name!r} dataset has no 'train' split (found {list(dataset)}); {hint}")
    return dataset["train"]


# -----------------------------------------------------------------------------
# loading: local files


def _has_text(path: Path) -> bool:
    """True if a text file holds anything but whitespace (reads only until it finds some)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while chunk := f.read(1 << 20):
            if not chunk.isspace():
                return True
    return False


def _check_jsonl(path: Path, text_field: str) -> bool:
    """Validate the first record of a .jsonl file; False if the file has no records."""
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        return False
    try:
        record = json.loads(first)
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}: first line is not valid JSON ({e})") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise PrepareError(f"{path}: no {text_field!r} field in the first record (found {fields}); set --text_field")
    if not isinstance(record[text_field], str):
        raise PrepareError(f"{path}: field {text_field!r} is {type(record[text_field]).__name__}, not a string")
    return True


def _check_parquet(path: Path, text_field: str) -> bool:
    """Validate a .parquet file's schema; False if it has no rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except Exception as e:
        raise PrepareError(f"{path}: not a readable parquet file ({e})") from None
    schema = meta.schema_arrow
    if text_field not in schema.names:
        raise PrepareError(f"{path}: no {text_field!r} column (found {schema.names}); set --text_field")
    col_type = schema.field(text_field).type
    if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
        raise PrepareError(f"{path}: column {text_field!r} has type {col_type}, not string")
    return meta.metadata.num_rows > 0


def _check_input(path: Path, suffix: str, text_field: str) -> bool:
    """Validate one input file by type; False if it holds no documents."""
    try:
        if suffix == ".txt":
            return _has_text(path)
        if suffix == ".jsonl":
            return _check_jsonl(path, text_field)
        return _check_parquet(path, text_field)
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read {path}: {e}") from None


def check_inputs(paths: list[Path], text_field: str) -> list[Path]:
    """Validate the --input files up front (cheaply); return the non-empty ones."""
    keep = []
    for path in paths:
        if not path.is_file():
            raise PrepareError(f"input file not found: {path}")
        suffix = path.suffix.lower()
        if suffix not in INPUT_BUILDERS:
            supported = ", ".join(INPUT_BUILDERS)
            raise PrepareError(f"unsupported input file type {path.suffix or '(none)'!r} for {path}; use {supported}")
        if _check_input(path, suffix, text_field):
            keep.append(path)
        else:
            print(f"skipping empty input file {path}")
    if not keep:
        raise PrepareError(f"empty corpus: the input files ({', '.join(map(str, paths))}) contain no text")
    return keep


def _keep_document(texts: list[str | None]) -> list[bool]:
    return [bool(t) and not t.isspace() for t in texts]


def load_local_corpus(
    paths: list[Path], text_field: str, txt_sample_by: str, num_proc: int, cache_dir: str | None
) -> Dataset:
    """Load local .txt/.jsonl/.parquet files with datasets as one "text" column, dropping empty docs."""
    from datasets import Value, concatenate_datasets, load_dataset

    paths = check_inputs(paths, text_field)
    by_builder: dict[str, list[str]] = {}
    for path in paths:
        by_builder.setdefault(INPUT_BUILDERS[path.suffix.lower()], []).append(str(path))
    parts = []
    for builder, files in by_builder.items():
        kwargs = {"sample_by": txt_sample_by} if builder == "text" else {}
        try:
            ds = load_dataset(
                builder, data_files=files, split="train", num_proc=num_proc, cache_dir=cache_dir, **kwargs
            )
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0]
            raise PrepareError(f"could not read {', '.join(files)} ({type(e).__name__}: {reason})") from e
        field = "text" if builder == "text" else text_field
        if field not in ds.column_names:
            raise PrepareError(f"no {field!r} field in {', '.join(files)} (found {ds.column_names}); set --text_field")
        ds = ds.select_columns([field])
        if field != "text":
            ds = ds.rename_column(field, "text")
        if ds.features["text"] not in (Value("string"), Value("large_string")):
            raise PrepareError(f"field {field!r} in {', '.join(files)} is {ds.features['text']}, not a string")
        parts.append(ds)
    if len({ds.features["text"].dtype for ds in parts}) > 1:  # concatenation needs one type; widen
        parts = [ds.cast_column("text", Value("large_string")) for ds in parts]
    corpus = concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    n_missing = corpus.with_format("arrow")[:]["text"].null_count
    if n_missing:
        raise PrepareError(f"{n_missing:,} of {len(corpus):,} records have no {text_field!r} field")
    n_before = len(corpus)
    corpus = corpus.filter(
        _keep_document, input_columns="text", batched=True, num_proc=num_proc, desc="dropping empty documents"
    )
    if len(corpus) < n_before:
        print(f"dropped {n_before - len(corpus):,} empty documents")
    if len(corpus) == 0:
        raise PrepareError(f"empty corpus: no non-empty documents in {', '.join(map(str, paths))}")
    return corpus


# -----------------------------------------------------------------------------
# the shared split -> tokenise -> write pipeline


def split_train_val(dataset: Dataset, val_fraction: float, seed: int) -> DatasetDict:
    """Shuffle and split documents like nanoGPT, giving val ceil(val_fraction * n) docs (>= 1, < n)."""
    from datasets import DatasetDict

    n = len(dataset)
    if n < 2:
        raise PrepareError(
            f"need at least 2 documents to make a train/val split, got {n}; pass more files, "
            f"or split .txt files with --txt_sample_by paragraph or line"
        )
    n_val = min(max(1, math.ceil(val_fraction * n)), n - 1)
    split = dataset.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    return DatasetDict({"train": split["train"], "val": split["test"]})


def tokenize_batch(batch: dict[str, list[str]]) -> dict[str, list]:
    """encode_ordinary each document and append <|endoftext|>."""
    # the encoding is cached per process (forked workers inherit the parent's); it is looked up
    # here rather than passed in so datasets doesn't pickle and hash the whole BPE table per map
    enc = get_gpt2_encoding()
    ids = [enc.encode_ordinary(text) + [EOT_TOKEN] for text in batch["text"]]
    return {"ids": ids, "len": [len(x) for x in ids]}


def tokenize_splits(splits: DatasetDict, num_proc: int) -> DatasetDict:
    """Map tokenize_batch over every split with num_proc workers, storing ids as uint16."""
    from datasets import Features, List, Value

    features = Features({"ids": List(Value("uint16")), "len": Value("int64")})
    return splits.map(
        tokenize_batch,
        batched=True,
        remove_columns=splits["train"].column_names,
        features=features,
        num_proc=num_proc,
        desc="tokenizing the splits",
    )


def iter_token_chunks(dataset: Dataset, n_chunks: int = WRITE_CHUNKS) -> Iterator[np.ndarray]:
    """Yield the concatenated "ids" of consecutive row ranges as uint16 arrays."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    rows = max(1, math.ceil(len(dataset) / n_chunks))
    for start in range(0, len(dataset), rows):
        yield pc.list_flatten(table[start : start + rows]["ids"]).to_numpy()


def write_splits(tokenized: DatasetDict, out_dir: Path) -> dict[str, int]:
    """Write train.bin / val.bin (all or nothing); return token counts."""
    import pyarrow.compute as pc

    totals = {name: int(pc.sum(ds.with_format("arrow")[:]["len"]).as_py() or 0) for name, ds in tokenized.items()}
    write_token_bins(out_dir, {name: (totals[name], iter_token_chunks(ds)) for name, ds in tokenized.items()})
    return totals


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="local .txt / .jsonl / .parquet files to use instead of the Hub dataset",
    )
    p.add_argument("--text_field", default="text", help="document field/column in .jsonl/.parquet (default: text)")
    p.add_argument(
        "--txt_sample_by",
        choices=["document", "paragraph", "line"],
        default="document",
        help="what a document is in a .txt file (default: the whole file)",
    )
    p.add_argument(
        "--out_dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where to write train.bin / val.bin (default: this script's directory)",
    )
    p.add_argument(
        "--num_proc",
        type=int,
        default=default_num_proc(),
        help="worker processes for loading and tokenising (default: min(8, cpu count))",
    )
    p.add_argument(
        "--val_fraction",
        type=float,
        default=VAL_FRACTION,
        help=f"fraction of documents for val.bin (default: {VAL_FRACTION})",
    )
    p.add_argument("--seed", type=int, default=SEED, help=f"shuffle seed for the split (default: {SEED})")
    p.add_argument("--dataset", default=HUB_DATASET, help=f"Hub dataset name (default: {HUB_DATASET})")
    p.add_argument("--revision", default=None, help="Hub dataset revision (branch, tag or commit)")
    p.add_argument("--cache_dir", default=None, help="datasets cache dir (default: the HF datasets cache)")
    args = p.parse_args(argv)
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val_fraction must be in (0, 1), got {args.val_fraction}")
    if args.num_proc < 1:
        p.error(f"--num_proc must be >= 1, got {args.num_proc}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Load, split, tokenise and write the bins. Returns the process exit code."""
    args = parse_args(argv)
    try:
        get_gpt2_encoding()  # fail early (and fetch once, before the workers fork) if it can't be had
        if args.input:
            corpus = load_local_corpus(args.input, args.text_field, args.txt_sample_by, args.num_proc, args.cache_dir)
        else:
            corpus = load_hub_dataset(args.dataset, args.revision, args.num_proc, args.cache_dir)
        splits = split_train_val(corpus, args.val_fraction, args.seed)
    except (PrepareError, RuntimeError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always a single line
        return 2
    print(f"{len(splits['train']):,} train / {len(splits['val']):,} val documents")

    tokenized = tokenize_splits(splits, args.num_proc)
    totals = write_splits(tokenized, args.out_dir)
    for name, total in totals.items():
        print(f"{name}.bin has {total:,} tokens -> {args.out_dir / f'{name}.bin'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
