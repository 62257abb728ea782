"""Host-side preparation of a generation batch: ragged prompts -> right-padded, bucketed arrays, keys, stop ids."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.layers import KEY_BLOCK

MIN_BUCKET = 16


class Batch(NamedTuple):
    tokens: np.ndarray  # [B, P] int32: row b's prompt in [0, lengths[b]), then padding that is never attended
    lengths: np.ndarray  # [B] int32: prompt lengths
    keys: Any  # [B] PRNG keys
    capacity: int  # S = P + steps rounded up to whole blocks of KEY_BLOCK slots, the cache size
    steps: int  # N, decode steps compiled (max_new_tokens rounded up)
    rows: int  # the caller's prompts; rows beyond (padding for a mesh) are copies of the last one


def bucket(n: int, cap: int) -> int:
    """n rounded up to a power of two (at least MIN_BUCKET), at most cap."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), cap)


def as_prompts(prompts: Any) -> list[list[int]]:
    """A list of token-id lists (ragged), a [B, T] array, or one flat list of ids -> list of lists."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]  # a single prompt
    if not prompts:
        raise InputError("no prompts given")
    out = []
    for b, p in enumerate(prompts):
        p = list(p) if not isinstance(p, (int, np.integer)) else None
        if not p:
            raise InputError(f"prompt {b} is empty; every prompt needs at least one token")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise InputError(f"prompt {b} must be a list of int token ids")
        out.append([int(t) for t in p])
    return out


def make_batch(prompts: Any, config: GPT2Config, max_new_tokens: int) -> Batch:
    """Check prompts and lengths, then right-pad into a bucketed [B, P] array: every prompt starts at
    slot 0, its tokens at the positions a full forward gives them (see gpt2_jax.cache)."""
    rows = as_prompts(prompts)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for b, p in enumerate(rows):
        bad = [t for t in p if not 0 <= t < config.valid_vocab]
        if bad:
            raise InputError(f"prompt {b}: token id {bad[0]} is outside the vocab [0, {config.valid_vocab})")
        if len(p) + max_new_tokens > config.n_positions:
            raise InputError(
                f"prompt {b}: {len(p)} prompt tokens + max_new_tokens={max_new_tokens} exceed the context "
                f"n_positions={config.n_positions}"
            )
    lengths = np.array([len(p) for p in rows], np.int32)
    P = bucket(int(lengths.max()), config.n_positions)
    tokens = np.zeros((len(rows), P), np.int32)  # the padding value is never read: attention masks it
    for b, p in enumerate(rows):
        tokens[b, : len(p)] = p
    steps = bucket(int(max_new_tokens), config.n_positions)
    return Batch(tokens, lengths, None, cache_capacity(P, steps, config), steps, len(rows))


def cache_capacity(prompt_len: int, max_new_tokens: int, config: GPT2Config) -> int:
    """The cache slots S for a prompt and a step count: both bucketed, then rounded up to whole blocks of
    attention's key slots, so the cache is scored without padding (see gpt2_jax.attend)."""
    total = bucket(prompt_len, config.n_positions) + bucket(max_new_tokens, config.n_positions)
    return -(-total // KEY_BLOCK) * KEY_BLOCK


def check_stop_args(eos_id: Any, stop_ids: Any, config: GPT2Config, max_stop: int) -> tuple[np.ndarray, np.ndarray]:
    """eos_id (None = never) and extra stop ids -> (eos [] int32, stops [max_stop] int32), -1 = unused."""
    ids = list(stop_ids) + ([] if eos_id is None else [eos_id])
    for t in ids:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < config.vocab_size:
            raise ConfigError(f"stop/EOS id {t!r} must be an int in [0, {config.vocab_size})")
    if len(stop_ids) > max_stop:
        raise ConfigError(f"at most {max_stop} stop_ids are supported, got {len(stop_ids)}")
    stops = np.full(max_stop, -1, np.int32)
    stops[: len(stop_ids)] = list(stop_ids)
    return np.int32(-1 if eos_id is None else eos_id), stops
