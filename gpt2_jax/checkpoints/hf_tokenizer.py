"""GPT-2's tokenizer as HuggingFace files (vocab.json, merges.txt, tokenizer.json and their configs), built
offline from the shipped tiktoken ranks, so an export opens with AutoTokenizer and pipeline as it is.

tiktoken stores only each token's bytes and rank; a BPE tokenizer also needs the merges. A token of rank r
is the merge of the two parts that byte-pair encoding its own bytes with the ranks below r leaves, so the
merge list is recovered token by token, in rank order (the method tiktoken's own docs describe).
HuggingFace spells each byte as a printable character (GPT-2's bytes_to_unicode): "Ġ" is a space.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

EOT_TEXT = "<|endoftext|>"


@functools.cache
def byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: every byte to a printable character (printable bytes keep their own)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def spelled(token: bytes) -> str:
    table = byte_chars()
    return "".join(table[b] for b in token)


def _parts(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """Byte-pair encode `token` using only merges of rank < below."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = min((ranks.get(parts[i] + parts[i + 1], below), i) for i in range(len(parts) - 1))
        if best[0] >= below:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list, in rank order, that reproduces tiktoken's ranks."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _parts(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
        out.append((parts[0], parts[1]))
    return out


def write_tokenizer(dst: Path, encoding, n_positions: int) -> None:
    """vocab.json, merges.txt, tokenizer.json, tokenizer_config.json and special_tokens_map.json for the
    gpt2 encoding (a tiktoken Encoding) into dst."""
    ranks = encoding._mergeable_ranks
    vocab = {spelled(t): r for t, r in ranks.items()}
    vocab[EOT_TEXT] = encoding.eot_token
    pairs = [f"{spelled(a)} {spelled(b)}" for a, b in merges(ranks)]
    (dst / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(pairs) + "\n", encoding="utf-8")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    fast = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": encoding.eot_token, "content": EOT_TEXT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, trim_offsets=False), "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": pairs},
    }  # fmt: skip
    (dst / "tokenizer.json").write_text(json.dumps(fast, ensure_ascii=False))
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT}
    (dst / "special_tokens_map.json").write_text(json.dumps(special))
    config = dict(special, tokenizer_class="GPT2Tokenizer", model_max_length=n_positions, add_prefix_space=False,
                  clean_up_tokenization_spaces=False)  # fmt: skip
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_generation_config(dst: Path, eos_id: int | None) -> None:
    """generation_config.json: the EOS (and BOS, GPT-2's <|endoftext|>) generate stops on."""
    cfg = {} if eos_id is None else {"bos_token_id": eos_id, "eos_token_id": eos_id}
    (dst / "generation_config.json").write_text(json.dumps(cfg, indent=2))
