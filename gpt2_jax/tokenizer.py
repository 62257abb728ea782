"""The GPT-2 tokenizer: tiktoken's "gpt2" encoding, available offline.

Sources, in order: an explicit ranks file (argument or $GPT2_JAX_TIKTOKEN_FILE); tiktoken's own
cache; the ranks file shipped in gpt2_jax/assets (MIT, from the openai-whisper sdist); and last
tiktoken's download. Every local file is checked against the sha256 tiktoken expects.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import tiktoken

from gpt2_jax.errors import GPT2JaxError

RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
BUNDLED_RANKS = Path(__file__).parent / "assets" / "gpt2.tiktoken"
EOT = 50256  # <|endoftext|>
FETCH_HINT = (
    "get the ranks file with: pip download --no-deps openai-whisper -d /tmp/whisper && "
    "tar -xzf /tmp/whisper/openai_whisper-*.tar.gz -C /tmp/whisper && "
    "export GPT2_JAX_TIKTOKEN_FILE=$(ls /tmp/whisper/openai_whisper-*/whisper/assets/gpt2.tiktoken)"
)
_GPT2_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


def _tiktoken_cached() -> bool:
    """Does tiktoken's own cache already hold the gpt2 files (so get_encoding needs no network)?"""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    cache = cache or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return all(os.path.exists(os.path.join(cache, hashlib.sha1(u.encode()).hexdigest())) for u in _GPT2_URLS)


def encoding_from_file(path: str | Path) -> tiktoken.Encoding:
    """Build the gpt2 Encoding from a local .tiktoken ranks file, verified by sha256."""
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    path = Path(path)
    if not path.is_file():
        raise GPT2JaxError(f"GPT-2 ranks file {path} does not exist; {FETCH_HINT}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != RANKS_SHA256:
        raise GPT2JaxError(f"{path}: sha256 {digest} is not the GPT-2 ranks hash {RANKS_SHA256}")
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(path), expected_hash=RANKS_SHA256),
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=50257,
    )


@functools.cache
def tokenizer(ranks_file: str | None = None) -> tiktoken.Encoding:
    """The tiktoken "gpt2" Encoding (50257 tokens, <|endoftext|> = 50256), offline if need be."""
    ranks_file = ranks_file or os.environ.get("GPT2_JAX_TIKTOKEN_FILE")
    if ranks_file:
        return encoding_from_file(ranks_file)
    if _tiktoken_cached():
        return tiktoken.get_encoding("gpt2")
    if BUNDLED_RANKS.is_file():
        return encoding_from_file(BUNDLED_RANKS)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise GPT2JaxError(f"cannot load the GPT-2 tokenizer ({type(e).__name__}); {FETCH_HINT}") from None
