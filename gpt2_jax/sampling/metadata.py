"""Everything packed per row (vLLM's SamplingMetadata, beside the request's SamplingParams): the warpers'
RowSettings and the processors' ProcessorSettings, built from one SamplingParams per row (which checks them)
or from keyword settings, and the row keys.

Settings are traced values [B], never static: rows with different settings share one compiled program,
and a new value never recompiles. Ragged settings (logit_bias entries, bad words) are padded to buckets
(powers of two above a minimum), so a new value of similar size reuses the compiled program.

Shape legend: B rows, N logit-bias entries, W banned words, M tokens per word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket, traced
from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling.params import RULES, SamplingParams, check_values, sampling_rows

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Key


class RowSettings(NamedTuple):
    """Validated settings broadcast to one value per row; a pytree, so jit traces (not hashes) it."""

    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    # [B] float32: float32(1 - top_p), the sorted-ascending cumulative mass at or below which top-p
    # drops tokens. transformers subtracts in float64 and compares in float32; doing the same here on
    # the host keeps exact-boundary cases identical (1 - float32(0.9) is 3 ulps away from float32(0.1)).
    top_p_drop: jax.Array
    min_p: jax.Array  # [B] float32; 0 = off (applied after top-p, as transformers' MinPLogitsWarper)


class ProcessorSettings(NamedTuple):
    """Per-row processor settings, all traced (pack_processors builds them)."""

    bias_ids: jax.Array  # [B, N] int32 token ids of logit_bias (unused entries: id 0, bias 0)
    bias: jax.Array  # [B, N] float32
    repetition_penalty: jax.Array  # [B] float32 theta; 1 = off
    frequency_penalty: jax.Array  # [B] float32; 0 = off
    presence_penalty: jax.Array  # [B] float32; 0 = off
    no_repeat_ngram_size: jax.Array  # [B] int32 n; 0 = off
    bad_words: jax.Array  # [B, W, M] int32 token sequences, left-aligned
    bad_word_lengths: jax.Array  # [B, W] int32; 0 = unused slot
    min_new_tokens: jax.Array  # [B] int32; 0 = off


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_sampling_args(temperature: Any, top_k: Any, top_p: Any, batch_size: int) -> None:
    """Raise ConfigError for a bad setting (the rules are SamplingParams'); each is a scalar or one value per
    row [B]. Tracers are skipped: inside a user's jit, values are unknown until run time."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if not _is_tracer(value):
            check_values(name, value, batch_size)


def row_settings(temperature: Any, top_k: Any, top_p: Any, batch_size: int, min_p: Any = 0.0) -> RowSettings:
    """Validate (when concrete) and broadcast scalar or [B] settings to RowSettings of [B] arrays."""
    check_sampling_args(temperature, top_k, top_p, batch_size)
    min_p = min_p if _is_tracer(min_p) else check_values("min_p", min_p, batch_size)
    shape = (batch_size,)

    def rows(x: Any, dtype: Any) -> jax.Array:  # concrete values stay host arrays: no eager op compiles per value
        if _is_tracer(x):
            return jnp.broadcast_to(jnp.asarray(x, dtype), shape)
        return traced(np.broadcast_to(np.asarray(x).astype(dtype), shape))

    k = top_k if _is_tracer(top_k) else np.minimum(np.asarray(top_k), np.iinfo(np.int32).max)
    if _is_tracer(top_p):  # float32 subtraction: can sit a few ulps from transformers' threshold
        drop = 1 - jnp.asarray(top_p, jnp.float32)
    else:
        drop = (1.0 - np.asarray(top_p, np.float64)).astype(np.float32)
    return RowSettings(
        rows(temperature, np.float32), rows(k, np.int32), rows(drop, np.float32), rows(min_p, np.float32)
    )


def pack_settings(rows: Sequence[SamplingParams]) -> RowSettings:
    """One SamplingParams per row -> the warpers' RowSettings (host arrays)."""
    temperature, top_k, top_p = (np.array([getattr(r, f) for r in rows]) for f in ("temperature", "top_k", "top_p"))
    return row_settings(temperature, top_k, top_p, len(rows), np.array([r.min_p for r in rows]))


def row_keys(key: Any, batch_size: int) -> Key[Array, " B"]:
    """One key (row b gets fold_in(key, b)) or one per row [B] -> [B] typed PRNG keys."""
    key = jnp.asarray(key)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ConfigError(f"key must be a jax.random.key (or legacy PRNGKey), got {key.dtype} {key.shape}")
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(batch_size))
    if key.shape != (batch_size,):
        raise ConfigError(f"key must be one PRNG key or one per row (shape ({batch_size},)), got shape {key.shape}")
    return key


def pack_processors(rows: Sequence[SamplingParams], eos: Sequence[int | None]) -> ProcessorSettings:
    """One checked SamplingParams per row (and each row's EOS) -> ProcessorSettings of host arrays. Ragged
    settings are padded to buckets: logit_bias entries to 16, 32, ...; bad words to 4, 8, ... words of 4, 8,
    ... tokens. As transformers does, the one-token bad word [eos] is dropped (EOS stays possible)."""
    B = len(rows)
    n = pow2_bucket(max((len(r.logit_bias or ()) for r in rows), default=0), 16)
    ids, bias = np.zeros((B, n), np.int32), np.zeros((B, n), np.float32)
    for b, r in enumerate(rows):
        for i, (t, x) in enumerate((r.logit_bias or {}).items()):
            ids[b, i], bias[b, i] = t, x
    words = [[list(w) for w in r.bad_words_ids if list(w) != [e]] for r, e in zip(rows, eos)]
    W = pow2_bucket(max(map(len, words), default=0), 4)
    M = pow2_bucket(max((len(w) for row in words for w in row), default=0), 4)
    table, lengths = np.zeros((B, W, M), np.int32), np.zeros((B, W), np.int32)
    for b, row in enumerate(words):
        for i, w in enumerate(row):
            table[b, i, : len(w)], lengths[b, i] = w, len(w)
    scalars = {
        name: traced(np.array([getattr(r, name) for r in rows], RULES[name][0]))
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size",
                     "min_new_tokens")
    }  # fmt: skip
    return ProcessorSettings(
        bias_ids=traced(ids), bias=traced(bias), bad_words=traced(table), bad_word_lengths=traced(lengths), **scalars
    )


def processor_settings(batch_size: int, vocab: int, eos_id: int | None, **settings: Any) -> ProcessorSettings:
    """The processors' settings in keyword form (SamplingParams' names: logit_bias, repetition_penalty, ...;
    each one value for every row or one per row) -> ProcessorSettings, checked as SamplingParams checks them."""
    rows = sampling_rows(None, batch_size, settings)
    for r in rows:
        r.check(vocab, eos_id)
    return pack_processors(rows, [eos_id] * batch_size)
