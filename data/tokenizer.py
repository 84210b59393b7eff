"""
The GPT-2 BPE tokenizer (tiktoken's "gpt2" encoding), with an offline-friendly fallback.

get_gpt2_encoding() first tries tiktoken's own loader, which downloads the BPE files from
openaipublic.blob.core.windows.net (only attempted when they are already in tiktoken's cache
or the host answers quickly, so we never hang on a dead network). Otherwise the encoding is
built from `gpt2.tiktoken` (identical to tiktoken's r50k_base.tiktoken), read from a local
cache dir or, failing that, from the openai-whisper sdist on PyPI, fetched with a plain
`pip download` (nothing is installed). Either way the result is the same GPT-2 encoding.

Cache dir: $GPT2_TOKENIZER_CACHE, default ~/.cache/gpt2-parallel/
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import tiktoken

from data.common import call_with_timeout, fetch_sdist_member, url_reachable

EOT_TOKEN = 50256
GPT2_N_VOCAB = 50257

CACHE_ENV_VAR = "GPT2_TOKENIZER_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/gpt2-parallel")
BPE_FILENAME = "gpt2.tiktoken"
# tiktoken's expected_hash for r50k_base.tiktoken, the GPT-2 BPE ranks
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# openai-whisper ships the very same file as an asset of its sdist
WHISPER_REQUIREMENT = "openai-whisper==20250625"
WHISPER_BPE_MEMBER = "whisper/assets/gpt2.tiktoken"

# the files tiktoken.get_encoding("gpt2") downloads, with tiktoken's expected hashes
_TIKTOKEN_GPT2_FILES = {
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",  # noqa: E501
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",  # noqa: E501
}
ONLINE_PROBE_TIMEOUT_S = 5.0
ONLINE_LOAD_TIMEOUT_S = 120.0


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _log(msg: str) -> None:
    print(f"tokenizer: {msg}", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# online path: tiktoken's own loader


def _tiktoken_cache_dir() -> Path | None:
    """Where tiktoken caches downloads (mirrors tiktoken.load.read_file_cached); None if disabled."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var]) if os.environ[var] else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _tiktoken_has_gpt2_cached() -> bool:
    """True if tiktoken can load "gpt2" from its cache without touching the network."""
    cache_dir = _tiktoken_cache_dir()
    if cache_dir is None:
        return False
    for url, expected in _TIKTOKEN_GPT2_FILES.items():
        path = cache_dir / hashlib.sha1(url.encode()).hexdigest()
        try:
            if _sha256(path.read_bytes()) != expected:
                return False
        except OSError:
            return False
    return True


def _try_tiktoken_gpt2() -> tiktoken.Encoding | None:
    """tiktoken.get_encoding("gpt2") if it can work quickly, else None."""
    if not _tiktoken_has_gpt2_cached():
        probe_url = next(iter(_TIKTOKEN_GPT2_FILES))
        if not url_reachable(probe_url, ONLINE_PROBE_TIMEOUT_S):
            return None
    try:
        return call_with_timeout(lambda: tiktoken.get_encoding("gpt2"), ONLINE_LOAD_TIMEOUT_S)
    except Exception as e:
        _log(f"tiktoken could not load 'gpt2' ({type(e).__name__}: {e}); using the offline fallback")
        return None


# -----------------------------------------------------------------------------
# offline path: gpt2.tiktoken from a local cache or the openai-whisper sdist


def gpt2_cache_dir() -> Path:
    """The directory holding our cached gpt2.tiktoken ($GPT2_TOKENIZER_CACHE overrides the default)."""
    return Path(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR).expanduser()


def fetch_gpt2_bpe_from_pypi() -> bytes:
    """Read gpt2.tiktoken out of the openai-whisper sdist, downloaded (not installed) with pip."""
    _log(f"fetching {BPE_FILENAME} from the {WHISPER_REQUIREMENT} sdist on PyPI (pip download, no install)")
    return fetch_sdist_member(WHISPER_REQUIREMENT, WHISPER_BPE_MEMBER)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is a plain shared file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_gpt2_bpe(cache_dir: Path | None = None, fetch: Callable[[], bytes] | None = None) -> bytes:
    """Return the verified contents of gpt2.tiktoken, fetching and caching it if needed.

    A cached file is re-verified against BPE_SHA256 on every load; a corrupt one is replaced.
    `fetch` (default: fetch_gpt2_bpe_from_pypi) produces fresh bytes when the cache can't be used.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else gpt2_cache_dir()
    path = cache_dir / BPE_FILENAME
    if path.is_file():
        data = path.read_bytes()
        if _sha256(data) == BPE_SHA256:
            return data
        _log(f"cached {path} is corrupt (sha256 mismatch); fetching it again")
    fetch = fetch or fetch_gpt2_bpe_from_pypi
    try:
        data = fetch()
    except Exception as e:
        raise RuntimeError(
            f"Could not obtain the GPT-2 tokenizer: tiktoken's download failed and so did the fallback "
            f"({e}). Give this machine access to PyPI (pip must work) or to openaipublic.blob.core.windows.net, "
            f"or copy a {BPE_FILENAME} with sha256 {BPE_SHA256} (tiktoken's r50k_base.tiktoken) to {path} "
            f"(set ${CACHE_ENV_VAR} to use another directory)."
        ) from e
    if _sha256(data) != BPE_SHA256:
        raise RuntimeError(
            f"The downloaded {BPE_FILENAME} has sha256 {_sha256(data)}, expected {BPE_SHA256}; refusing to use "
            f"it. Retry, or copy a verified {BPE_FILENAME} to {path}."
        )
    _write_atomic(path, data)
    return data


def parse_tiktoken_bpe(data: bytes) -> dict[bytes, int]:
    """Parse a .tiktoken file: one "<base64 token> <rank>" per line."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def encoding_from_bpe(data: bytes) -> tiktoken.Encoding:
    """Build the GPT-2 tiktoken.Encoding from the contents of gpt2.tiktoken."""
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=parse_tiktoken_bpe(data),
        special_tokens={ENDOFTEXT: EOT_TOKEN},
        explicit_n_vocab=GPT2_N_VOCAB,
    )


# -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def get_gpt2_encoding(allow_online: bool = True) -> tiktoken.Encoding:
    """The GPT-2 encoding ("Hello world" -> [15496, 995]; <|endoftext|> = EOT_TOKEN = 50256).

    Tries tiktoken's own download first (skipped when allow_online=False), then falls back to
    gpt2.tiktoken from the cache dir / PyPI. Raises RuntimeError saying what to do if both fail.
    """
    if allow_online:
        enc = _try_tiktoken_gpt2()
        if enc is not None:
            return enc
    return encoding_from_bpe(load_gpt2_bpe())
