"""
Prepare FineWeb-Edu, or local parquet / jsonl files, for GPT-2 training as build-nanogpt does: one stream of GPT-2
tokens, each document preceded by <|endoftext|>, cut into uint16 shards. The first --val_tokens tokens are
val_000000.bin; the rest are train_000001.bin, train_000002.bin, ... of --shard_size tokens each (the last one
shorter). train.py reads a split's shards end to end as one stream (data/batches.py).

Default: HuggingFaceFW/fineweb-edu, sample sample-10BT (~10B tokens: 1 val + ~99 train shards of 100M tokens,
~20 GB), through `datasets`. The other samples of fineweb-edu: sample-100BT, sample-350BT, and default (all of it,
~1.3T tokens); HuggingFaceFW/fineweb (--dataset) has samples of the same names.

--input PATH [PATH ...] runs the same code on local files (a directory stands for its .parquet / .jsonl files):
  .parquet  the "text" column (--text_field)       .jsonl  one JSON object a line, its "text" field

Tokenising runs in --num_proc worker processes, --batch_docs documents a task, in order, with a tqdm bar.
Resumable: a shard is written under a temporary name and renamed when complete, then `prepare_state.json` records
where the next shard starts in the document stream; a run killed at any point (SIGKILL included) and started again
with the same arguments continues from the last complete shard and writes the same bytes an uninterrupted run
would. Bad input (no files, only empty documents, a corpus too short for a train shard) exits with code 2 and one
"error: ..." line on stderr.

$ python data/fineweb/prepare.py                                   # sample-10BT into data/fineweb/
$ python data/fineweb/prepare.py --input my.parquet more/ --out_dir data/mine --shard_size 10000000
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.common import PrepareError, url_reachable  # noqa: E402

if TYPE_CHECKING:
    from datasets import Dataset

HUB_DATASET = "HuggingFaceFW/fineweb-edu"
SAMPLES = ("sample-10BT", "sample-100BT", "sample-350BT", "default")
HUB_PROBE_TIMEOUT_S = 10.0
SHARD_TOKENS = 100_000_000  # build-nanogpt's shard: 200 MB of uint16
BATCH_DOCS = 1024
STATE = "prepare_state.json"
INPUT_TYPES = (".parquet", ".jsonl")


class Encoding(Protocol):
    """What prepare needs of a tokenizer (tiktoken.Encoding has it; tests pass a stand-in)."""

    name: str
    eot_token: int

    def encode_ordinary(self, text: str) -> list[int]: ...


def shard_name(index: int) -> str:
    """Shard 0 is val, the rest train (build-nanogpt's numbering)."""
    return f"{'val' if index == 0 else 'train'}_{index:06d}.bin"


@dataclass
class State:
    """Where the next shard starts: document batch `batch`, after its first `skip` tokens."""

    fingerprint: dict
    shard: int = 0
    batch: int = 0
    skip: int = 0
    tokens: int = 0  # written to complete shards so far
    done: bool = False


# -----------------------------------------------------------------------------
# loading


def load_hub(name: str, sample: str, revision: str | None, num_proc: int, cache_dir: str | None) -> Dataset:
    """The "train" split of a Hub dataset's sample (config); PrepareError, quickly, when it can't be had."""
    from datasets import config, load_dataset

    hint = "to prepare local files instead, pass --input PATH [PATH ...] (.parquet or .jsonl)"
    if not config.HF_HUB_OFFLINE and not url_reachable(config.HF_ENDPOINT, HUB_PROBE_TIMEOUT_S):
        raise PrepareError(
            f"cannot download {name} ({sample}): the Hugging Face Hub ({config.HF_ENDPOINT}) is "
            f"unreachable; {hint}, or set HF_HUB_OFFLINE=1 to use a copy already in the HF cache"
        )
    try:
        return load_dataset(name, name=sample, split="train", revision=revision, num_proc=num_proc, cache_dir=cache_dir)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise PrepareError(f"cannot load {name} ({sample}): {type(e).__name__}: {reason}; {hint}") from e


def input_files(paths: list[Path]) -> list[Path]:
    """--input's files: files as given, directories as their .parquet / .jsonl files (sorted); none: PrepareError."""
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix.lower() in INPUT_TYPES and p.is_file())
        elif not path.is_file():
            raise PrepareError(f"input file not found: {path}")
        elif path.suffix.lower() not in INPUT_TYPES:
            raise PrepareError(
                f"unsupported input file type {path.suffix or '(none)'!r} for {path}; use {' or '.join(INPUT_TYPES)}"
            )
        else:
            files.append(path)
    if not files:
        raise PrepareError(f"no input files: {', '.join(map(str, paths))} hold no {' or '.join(INPUT_TYPES)} files")
    return files


def load_local(files: list[Path], text_field: str, num_proc: int, cache_dir: str | None) -> Dataset:
    """Local files through openwebtext's loader (the same checks; empty documents dropped, none left: error),
    quietly: local files load in seconds, and bad input stays one line."""
    import datasets

    from data.openwebtext.prepare import load_local_corpus

    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        return load_local_corpus(files, text_field, "document", num_proc, cache_dir)
    finally:
        datasets.enable_progress_bars()
        datasets.logging.set_verbosity(verbosity)


# -----------------------------------------------------------------------------
# tokenising: worker processes read their documents from the (memory-mapped) dataset themselves

_WORK: dict = {}  # "dataset", "encoding", "batch_docs": set before the workers fork


def tokenize_batch(batch: int) -> np.ndarray:
    """Documents [batch * batch_docs, (batch + 1) * batch_docs) as one uint16 array: <|endoftext|> + each one's
    tokens."""
    ds, enc, n = _WORK["dataset"], _WORK["encoding"], _WORK["batch_docs"]
    texts = ds[batch * n : (batch + 1) * n]["text"]
    out = np.array(
        list(itertools.chain.from_iterable([enc.eot_token, *enc.encode_ordinary(t)] for t in texts)), dtype=np.int64
    )
    if out.size and (out.min() < 0 or out.max() >= 1 << 16):
        raise ValueError(f"token ids must fit uint16, got [{out.min()}, {out.max()}]")
    return out.astype(np.uint16)


def token_batches(
    dataset: Dataset, encoding: Encoding, first: int, batch_docs: int, num_proc: int
) -> Iterator[np.ndarray]:
    """tokenize_batch(b) for b = first, first + 1, ..., in order, over `num_proc` forked workers."""
    _WORK.update(dataset=dataset, encoding=encoding, batch_docs=batch_docs)
    batches = range(first, -(-len(dataset) // batch_docs))
    if num_proc == 1:
        yield from map(tokenize_batch, batches)
        return
    # fork: the workers inherit the dataset and tokenizer, and the parent's signal handlers, which _default_signals
    # drops: the pool's exit SIGTERMs its workers, and a worker whose inherited handler returned would be joined forever
    with mp.get_context("fork").Pool(num_proc, initializer=_default_signals) as pool:
        yield from pool.imap(tokenize_batch, batches)


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


# -----------------------------------------------------------------------------
# shards and the state


def write_atomic(path: Path, write: Callable) -> None:
    """write(f) into a temporary file beside `path`, synced, then renamed: `path` is whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    write_atomic(path, tokens.tofile)


def save_state(out_dir: Path, state: State) -> None:
    write_atomic(out_dir / STATE, lambda f: f.write(json.dumps(asdict(state), indent=1).encode()))


def start_state(out_dir: Path, fingerprint: dict, overwrite: bool) -> State:
    """The state to continue from: out_dir's, if it prepared the same thing; a fresh one if out_dir holds no
    shards (or --overwrite removed them). Leftover temporary files of a killed run are removed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for tmp in out_dir.glob(".*.tmp"):
        tmp.unlink()
    shards = sorted(out_dir.glob("val_*.bin")) + sorted(out_dir.glob("train_*.bin"))
    path = out_dir / STATE
    if overwrite:
        for p in [*shards, path]:
            p.unlink(missing_ok=True)
        return State(fingerprint)
    if path.exists():
        state = State(**json.loads(path.read_text()))
        if state.fingerprint != fingerprint:
            diff = sorted(
                k
                for k in fingerprint.keys() | state.fingerprint.keys()
                if fingerprint.get(k) != state.fingerprint.get(k)
            )
            raise PrepareError(
                f"{out_dir} holds shards of another preparation (it differs in {', '.join(diff)}); "
                f"pass --overwrite to replace them, or choose another --out_dir"
            )
        return state
    if shards:
        raise PrepareError(
            f"{out_dir} holds shards ({shards[0].name} ...) but no {STATE}: not this script's, or "
            f"from an older run; pass --overwrite to replace them, or choose another --out_dir"
        )
    return State(fingerprint)


def write_shards(
    out_dir: Path,
    batches: Iterator[np.ndarray],
    state: State,
    shard_size: int,
    val_tokens: int,
    on_batch: Callable[[int], None] = lambda n: None,
) -> State:
    """Cut the token stream of `batches` (starting at state.batch, whose first state.skip tokens are already
    written) into shards; after each complete shard, the state that resumes right after it."""
    capacity = lambda shard: val_tokens if shard == 0 else shard_size  # noqa: E731
    buf, fill, batch, (start, skip) = (
        np.empty(capacity(state.shard), dtype=np.uint16),
        0,
        state.batch,
        (state.batch, state.skip),
    )
    for batch, tokens in enumerate(batches, start=start):
        pos = first = skip if batch == start else 0
        while pos < len(tokens):
            take = min(len(buf) - fill, len(tokens) - pos)
            buf[fill : fill + take] = tokens[pos : pos + take]
            fill, pos = fill + take, pos + take
            if fill == len(buf):
                write_shard(out_dir / shard_name(state.shard), buf)
                state = State(state.fingerprint, state.shard + 1, batch, pos, state.tokens + fill)
                save_state(out_dir, state)
                buf, fill = np.empty(capacity(state.shard), dtype=np.uint16), 0
        on_batch(len(tokens) - first)
    if state.shard == 0 or (state.shard == 1 and fill == 0):
        raise PrepareError(
            f"the corpus holds {state.tokens + fill:,} tokens, not more than --val_tokens "
            f"{val_tokens:,}: nothing is left for a train shard; pass a smaller --val_tokens"
        )
    if fill:
        write_shard(out_dir / shard_name(state.shard), buf[:fill])
    state = State(state.fingerprint, state.shard + (fill > 0), batch + 1, 0, state.tokens + fill, done=True)
    save_state(out_dir, state)
    return state


# -----------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag: one "error: ..." line, exit code 2 (argparse's own prints its usage first)."""
        self.exit(2, f"error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="local .parquet / .jsonl files (or directories of them) instead of the Hub dataset",
    )
    p.add_argument("--text_field", default="text", help="the document's field / column (default: text)")
    p.add_argument("--dataset", default=HUB_DATASET, help=f"Hub dataset (default: {HUB_DATASET})")
    p.add_argument(
        "--sample", default=SAMPLES[0], help=f"its sample (config): {', '.join(SAMPLES)} (default: {SAMPLES[0]})"
    )
    p.add_argument("--revision", default=None, help="Hub dataset revision (branch, tag or commit)")
    p.add_argument("--cache_dir", default=None, help="datasets cache dir (default: the HF datasets cache)")
    p.add_argument(
        "--out_dir",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="where the shards go (default: this script's directory: train.py --dataset fineweb)",
    )
    p.add_argument(
        "--shard_size", type=int, default=SHARD_TOKENS, help=f"tokens a train shard (default: {SHARD_TOKENS:,})"
    )
    p.add_argument("--val_tokens", type=int, default=None, help="tokens of the val shard (default: --shard_size)")
    p.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="tokenising processes (default: half the CPUs, as build-nanogpt)",
    )
    p.add_argument(
        "--batch_docs",
        type=int,
        default=BATCH_DOCS,
        help=f"documents a worker tokenises at a time (default: {BATCH_DOCS})",
    )
    p.add_argument("--overwrite", action="store_true", help="delete shards of another preparation in --out_dir")
    args = p.parse_args(argv)
    args.val_tokens = args.val_tokens or args.shard_size
    for flag in ("shard_size", "val_tokens", "num_proc", "batch_docs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def fingerprint(args: argparse.Namespace, files: list[Path] | None, encoding: Encoding, n_docs: int) -> dict:
    """What makes two preparations the same stream of shards (a resume must match it)."""
    source = (
        {
            "input": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "text_field": args.text_field,
        }
        if files
        else {"dataset": args.dataset, "sample": args.sample, "revision": args.revision}
    )
    return {
        **source,
        "documents": n_docs,
        "tokenizer": encoding.name,
        "shard_size": args.shard_size,
        "val_tokens": args.val_tokens,
        "batch_docs": args.batch_docs,
    }


def main(argv: list[str] | None = None, encoding: Encoding | None = None) -> int:
    """Load, tokenise and shard (resuming where out_dir's state says). `encoding`: the tokenizer (default: GPT-2's,
    data/tokenizer.py). Returns the exit code."""
    args = parse_args(argv)
    bar = None
    try:
        files = input_files(args.input) if args.input else None  # bad input first: before fetching the tokenizer
        if encoding is None:
            from data.tokenizer import get_gpt2_encoding

            encoding = get_gpt2_encoding()  # before the workers fork: they inherit it
        dataset = (
            load_local(files, args.text_field, args.num_proc, args.cache_dir)
            if files
            else load_hub(args.dataset, args.sample, args.revision, args.num_proc, args.cache_dir)
        )
        state = start_state(args.out_dir, fingerprint(args, files, encoding, len(dataset)), args.overwrite)
        if state.done:
            print(f"{args.out_dir} already holds the {state.shard} shards ({state.tokens:,} tokens); nothing to do")
            return 0
        if state.shard:
            print(f"resuming after shard {state.shard - 1} ({state.tokens:,} tokens written)")
        bar = tqdm(
            total=len(dataset),
            initial=min(len(dataset), state.batch * args.batch_docs),
            unit="doc",
            desc=f"tokenising ({args.num_proc} processes)",
            dynamic_ncols=True,
        )
        tokens, t0 = [0], time.perf_counter()

        def on_batch(n: int) -> None:
            tokens[0] += n
            bar.update(min(args.batch_docs, bar.total - bar.n))
            bar.set_postfix_str(f"{tokens[0] / (time.perf_counter() - t0):,.0f} tok/s")

        batches = token_batches(dataset, encoding, state.batch, args.batch_docs, args.num_proc)
        state = write_shards(args.out_dir, batches, state, args.shard_size, args.val_tokens, on_batch)
    except (PrepareError, RuntimeError) as e:
        if bar is not None:
            bar.close()  # the error line starts a line of its own
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always a single line
        return 2
    bar.close()
    seconds = time.perf_counter() - t0
    print(
        f"{state.shard} shards ({state.tokens:,} tokens: val_000000.bin and {state.shard - 1} train) in "
        f"{args.out_dir}; tokenised {tokens[0]:,} tokens in {seconds:.1f}s ({tokens[0] / seconds:,.0f} tokens/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
