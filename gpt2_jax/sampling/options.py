"""Host-side checks of the logits-processor settings, and their packing into traced per-row arrays.

Scalars apply to every row; a [B] array (or, for logit_bias / bad_words_ids, a list of B entries)
gives one value per row. Ragged settings are padded to buckets (powers of two above a minimum),
so a new value of similar size reuses the compiled program.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling.processors import MAX_NGRAM, ProcessorSettings, ProcessorState, apply_processors

MAX_LOGIT_BIAS = 300  # entries per row, as OpenAI's API allows
MAX_BAD_WORDS = 256  # sequences per row
MAX_TOP_LOGPROBS = 20

_SCALARS = {  # name: (dtype, default, allowed, check)
    "repetition_penalty": (np.float32, 1.0, "a finite number > 0 (1 means off)", lambda v: np.isfinite(v) & (v > 0)),
    "frequency_penalty": (np.float32, 0.0, "a number in [-2, 2] (0 means off)", lambda v: (v >= -2) & (v <= 2)),
    "presence_penalty": (np.float32, 0.0, "a number in [-2, 2] (0 means off)", lambda v: (v >= -2) & (v <= 2)),
    "min_p": (np.float32, 0.0, "a number in [0, 1] (0 means off)", lambda v: (v >= 0) & (v <= 1)),
    "no_repeat_ngram_size": (
        np.int32,
        0,
        f"an integer in [0, {MAX_NGRAM}] (0 means off)",
        lambda v: (v >= 0) & (v <= MAX_NGRAM),
    ),
    "min_new_tokens": (np.int32, 0, "an integer >= 0 (0 means off)", lambda v: v >= 0),
}


def bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def check_row_values(name: str, value: Any, batch_size: int, allowed: str, ok: Any, floats: bool) -> np.ndarray:
    """Check one scalar-or-[B] setting -> it as an array: its shape, its dtype (integers, or floats too when
    `floats`), and the rule ok(values) (NaN fails every rule); ConfigError names the setting and row."""
    v = np.asarray(value)
    if v.ndim > 1 or (v.ndim == 1 and v.shape[0] != batch_size):
        raise ConfigError(f"{name} must be a scalar or one value per row (shape ({batch_size},)), got shape {v.shape}")
    integral = np.issubdtype(v.dtype, np.integer)
    if v.dtype == bool or not (integral or (floats and np.issubdtype(v.dtype, np.floating))):
        raise ConfigError(f"{name} must be {allowed}, got {value!r} of dtype {v.dtype}")
    bad = np.flatnonzero(~np.atleast_1d(ok(v.astype(np.float64))))
    if bad.size:
        where = f"{name}[{bad[0]}]" if v.ndim else name
        raise ConfigError(f"{where} must be {allowed}, got {np.atleast_1d(v)[bad[0]].item()!r}")
    return v


def row_scalar(name: str, value: Any, batch_size: int) -> np.ndarray:
    """Check one scalar-or-[B] processor setting -> [B] array of its dtype."""
    dtype, _, allowed, ok = _SCALARS[name]
    v = check_row_values(name, value, batch_size, allowed, ok, floats=dtype == np.float32)
    return np.broadcast_to(v.astype(dtype), (batch_size,))


def _per_row(value: Any, batch_size: int, shared: bool, name: str) -> list:
    if shared:
        return [value] * batch_size
    if len(value) != batch_size:
        raise ConfigError(f"{name} given per row must have one entry per prompt ({batch_size}), got {len(value)}")
    return list(value)


def _token(t: Any, vocab: int, what: str) -> int:
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
        raise ConfigError(f"{what}: token id {t!r} must be an int in [0, {vocab})")
    return int(t)


def logit_bias_rows(logit_bias: Any, batch_size: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """None, one {token_id: bias} dict, or one dict (or None) per row -> (ids [B, N], bias [B, N])."""
    if logit_bias is None:
        rows = [None] * batch_size
    else:
        rows = _per_row(logit_bias, batch_size, isinstance(logit_bias, dict), "logit_bias")
    n = bucket(max((len(r) for r in rows if r), default=0), 16)
    ids, bias = np.zeros((batch_size, n), np.int32), np.zeros((batch_size, n), np.float32)
    for b, row in enumerate(rows):
        if not row:
            continue
        if not isinstance(row, dict):
            raise ConfigError(f"logit_bias must map token ids to biases, got {type(row).__name__}")
        if len(row) > MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias has {len(row)} entries; at most {MAX_LOGIT_BIAS} are supported")
        for i, (t, x) in enumerate(row.items()):
            t = int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t  # JSON keys are strings
            ids[b, i] = _token(t, vocab, "logit_bias")
            if not isinstance(x, (int, float, np.number)) or isinstance(x, bool) or not -100 <= float(x) <= 100:
                raise ConfigError(f"logit_bias[{t}] = {x!r}: a bias must be a number in [-100, 100]")
            bias[b, i] = x
    return ids, bias


def _is_word(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in x)


def bad_words_rows(
    bad_words_ids: Any, batch_size: int, vocab: int, eos_id: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """None, one list of token sequences, or one such list (or None) per row -> (words [B, W, M], lengths
    [B, W]). As transformers does, the one-token word [eos_id] is dropped (EOS stays possible)."""
    if not bad_words_ids:
        rows = [None] * batch_size
    else:
        shared = all(_is_word(w) for w in bad_words_ids)
        rows = _per_row(bad_words_ids, batch_size, shared, "bad_words_ids")
    clean = []
    for row in rows:
        words = []
        for w in row or []:
            if not _is_word(w) or len(w) == 0:
                raise ConfigError(f"bad_words_ids: each banned word must be a non-empty list of token ids, got {w!r}")
            word = [_token(t, vocab, "bad_words_ids") for t in w]
            if word != [eos_id]:
                words.append(word)
        if len(words) > MAX_BAD_WORDS:
            raise ConfigError(f"bad_words_ids has {len(words)} sequences; at most {MAX_BAD_WORDS} are supported")
        clean.append(words)
    w = bucket(max(map(len, clean)), 4)
    m = bucket(max((len(x) for row in clean for x in row), default=0), 4)
    words, lengths = np.zeros((batch_size, w, m), np.int32), np.zeros((batch_size, w), np.int32)
    for b, row in enumerate(clean):
        for i, word in enumerate(row):
            words[b, i, : len(word)] = word
            lengths[b, i] = len(word)
    return words, lengths


def processor_settings(
    batch_size: int,
    vocab: int,
    eos_id: int | None,
    *,
    logit_bias: Any = None,
    repetition_penalty: Any = 1.0,
    frequency_penalty: Any = 0.0,
    presence_penalty: Any = 0.0,
    no_repeat_ngram_size: Any = 0,
    bad_words_ids: Any = None,
    min_new_tokens: Any = 0,
) -> ProcessorSettings:
    """Validate every processor setting -> ProcessorSettings of host arrays (ConfigError names the bad one)."""
    ids, bias = logit_bias_rows(logit_bias, batch_size, vocab)
    words, lengths = bad_words_rows(bad_words_ids, batch_size, vocab, eos_id)
    scalars = {
        "repetition_penalty": repetition_penalty, "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty, "no_repeat_ngram_size": no_repeat_ngram_size,
        "min_new_tokens": min_new_tokens,
    }  # fmt: skip
    rows = {k: row_scalar(k, v, batch_size) for k, v in scalars.items()}
    return ProcessorSettings(bias_ids=ids, bias=bias, bad_words=words, bad_word_lengths=lengths, **rows)


def check_top_logprobs(n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ConfigError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
    return int(n)


def history_state(prompts: Any, outputs: Any, vocab: int) -> tuple[ProcessorState, np.ndarray, np.ndarray]:
    """Token lists per row: prompts and the outputs generated after them -> (ProcessorState, text lengths
    [B], output lengths [B]), as the decode loop holds them before its next draw."""
    outputs = [[] for _ in prompts] if outputs is None else outputs
    if len(outputs) != len(prompts):
        raise ConfigError(f"outputs must have one token list per prompt ({len(prompts)}), got {len(outputs)}")
    texts = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    history = np.zeros((len(texts), bucket(max(map(len, texts)), 16)), np.int32)
    in_prompt, counts = np.zeros((len(texts), vocab), bool), np.zeros((len(texts), vocab), np.int32)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        history[b, : len(texts[b])] = [_token(t, vocab, "prompts/outputs") for t in texts[b]]
        in_prompt[b, list(p)] = True
        np.add.at(counts[b], list(o), 1)
    return (ProcessorState(history, in_prompt, counts), np.array(list(map(len, texts)), np.int32),
            np.array(list(map(len, outputs)), np.int32))  # fmt: skip


_process_jit = jax.jit(apply_processors)


def process_logits(
    logits: Any, *, prompts: Any, outputs: Any = None, eos_id: int | None = None, stop_ids: Any = (), **processors: Any
) -> jax.Array:
    """The processors alone, outside the decode loop: raw logits [B, V] for the next token after each row's
    prompt + outputs (token-id lists) -> processed logits [B, V] (-inf where banned). The same function
    (apply_processors) the loop runs; the settings are generate's."""
    logits = jnp.asarray(logits)
    b, v = logits.shape
    p = processor_settings(b, v, eos_id, **processors)
    state, length, generated = history_state(prompts, outputs, v)
    stops = np.array([-1 if eos_id is None else eos_id, *stop_ids], np.int32)
    return _process_jit(logits, p, state, length, generated, stops)
