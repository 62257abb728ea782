"""The logits processors' settings packed into traced per-row arrays (from SamplingParams, which checks
them), and process_logits: the processors alone, outside the decode loop.

Ragged settings are padded to buckets (powers of two above a minimum), so a new value of similar size
reuses the compiled program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket
from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling.params import RULES, SamplingParams, sampling_rows
from gpt2_jax.sampling.processors import ProcessorSettings, ProcessorState, apply_processors


def _token(t: Any, vocab: int, what: str) -> int:
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
        raise ConfigError(f"{what}: token id {t!r} must be an int in [0, {vocab})")
    return int(t)


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
        name: np.array([getattr(r, name) for r in rows], RULES[name][0])
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size",
                     "min_new_tokens")
    }  # fmt: skip
    return ProcessorSettings(bias_ids=ids, bias=bias, bad_words=table, bad_word_lengths=lengths, **scalars)


def processor_settings(batch_size: int, vocab: int, eos_id: int | None, **settings: Any) -> ProcessorSettings:
    """The processors' settings in keyword form (SamplingParams' names: logit_bias, repetition_penalty, ...;
    each one value for every row or one per row) -> ProcessorSettings, checked as SamplingParams checks them."""
    rows = sampling_rows(None, batch_size, settings)
    for r in rows:
        r.check(vocab, eos_id)
    return pack_processors(rows, [eos_id] * batch_size)


def history_state(prompts: Any, outputs: Any, vocab: int) -> tuple[ProcessorState, np.ndarray, np.ndarray]:
    """Token lists per row: prompts and the outputs generated after them -> (ProcessorState, text lengths
    [B], output lengths [B]), as the decode loop holds them before its next draw."""
    outputs = [[] for _ in prompts] if outputs is None else outputs
    if len(outputs) != len(prompts):
        raise ConfigError(f"outputs must have one token list per prompt ({len(prompts)}), got {len(outputs)}")
    texts = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    history = np.zeros((len(texts), pow2_bucket(max(map(len, texts)), 16)), np.int32)
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
    return _process_jit(logits, p, state, length, generated, np.broadcast_to(stops, (b, len(stops))))
