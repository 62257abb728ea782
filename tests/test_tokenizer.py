import hashlib

import pytest

import gpt2_jax
from gpt2_jax.tokenizer import BUNDLED_RANKS, RANKS_SHA256, encoding_from_file


def test_known_ids():
    enc = gpt2_jax.tokenizer()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("!") == [0]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.n_vocab == 50257


def test_unicode_round_trip():
    enc = gpt2_jax.tokenizer()
    for text in ["Hello world", "naïve café — 東京 🚀", "  leading spaces\n\ttabs", "ROMEO:\nBut soft!"]:
        assert enc.decode(enc.encode(text)) == text


def test_bundled_file_is_the_gpt2_ranks():
    data = BUNDLED_RANKS.read_bytes()
    assert hashlib.sha256(data).hexdigest() == RANKS_SHA256


def test_bundled_encoding_equals_tiktokens_own(monkeypatch, tmp_path):
    # An empty tiktoken cache forces the bundled file, which must give the same ids as the
    # encoding tiktoken builds from the same ranks.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    enc = encoding_from_file(BUNDLED_RANKS)
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode(" the quick brown fox") == [262, 2068, 7586, 21831]


def test_explicit_file_with_wrong_hash_is_rejected(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(b"not the ranks")
    with pytest.raises(gpt2_jax.GPT2JaxError, match="sha256"):
        encoding_from_file(bad)


def test_missing_file_says_how_to_get_it(tmp_path):
    with pytest.raises(gpt2_jax.GPT2JaxError, match="pip download --no-deps openai-whisper"):
        encoding_from_file(tmp_path / "missing.tiktoken")
