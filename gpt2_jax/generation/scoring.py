"""Scoring text the model already has: the log-probability of each given token, bit for bit what generate reports.

A token's logprob is log_softmax(logits)[token] under the raw logits (no processor, temperature or filter),
computed by the same `token_logprobs` a decode step runs, on logits that equal a decode step's bit for bit
(the model's prefill/decode invariance: a full forward over a sequence gives each position the logits a
cached step gives it). So `prompt_logprobs` of a prompt is what `generate` would have reported had it sampled
those tokens (lm-evaluation-harness's loglikelihood requests, echo with logprobs). The same logprobs of
sampled completions, still those bits under jax.grad, are gpt2_jax.rl.sequence_logprobs (which builds on
check_rows and padded_rows here).

Shape legend: B rows, T positions (bucketed), N completion tokens, R top entries, V vocab.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.generation.batching import as_prompts, bucket
from gpt2_jax.generation.decode import most_likely
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.gpt2 import apply
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.checks import MAX_TOP_LOGPROBS
from gpt2_jax.sampling.draw import token_logprobs

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int


class PromptScores(NamedTuple):
    logprobs: list  # per prompt: [None, log p(t_1 | t_0), ...] (the first token has no context)
    top_ids: list | None  # per prompt: [None, [R ids], ...] the R most likely ids after each earlier position
    top_logprobs: list | None  # ... and their log-probabilities


def score_tokens(
    params: Params, tokens: Int[Array, "B T"], config: GPT2Config, r: int = 0
) -> tuple[Float[Array, "B T-1"], Int[Array, "B T-1 R"] | None, Float[Array, "B T-1 R"] | None]:
    """tokens [B, T] -> (logprobs [B, T-1]: log p(tokens[:, t+1] | tokens[:, :t+1]), top ids [B, T-1, r], top
    logprobs [B, T-1, r]), unjitted (for a caller's jit or grad). Right padding is harmless: a position only
    sees the ones before it."""
    logits = apply(params, tokens, config)  # [B, T, V], float32
    B, T, V = logits.shape
    rows = logits[:, :-1].reshape(B * (T - 1), V)  # every position a row, as a decode step's [B, V]
    picked = token_logprobs(rows, tokens[:, 1:].reshape(-1)).reshape(B, T - 1)
    if not r:
        return picked, None, None
    ids, values = most_likely(rows, r)
    return picked, ids.reshape(B, T - 1, r), values.reshape(B, T - 1, r)


_score = functools.partial(jax.jit, static_argnames=("config", "r"))(score_tokens)


def padded_rows(rows: list[list[int]], config: GPT2Config, length: int = 0) -> Int[np.ndarray, "B T"]:
    """Right-pad to a bucketed length (a new length rarely compiles), at least `length`, repeating each row's
    last token."""
    T = bucket(max(max(map(len, rows)), length), config.n_positions)
    out = np.empty((len(rows), T), np.int32)
    for b, row in enumerate(rows):
        out[b, : len(row)], out[b, len(row) :] = row, row[-1]
    return out


def check_rows(rows: list[list[int]], config: GPT2Config) -> None:
    """InputError for a sequence longer than the context or holding an id outside the vocab."""
    for b, row in enumerate(rows):
        if len(row) > config.n_positions:
            raise InputError(f"sequence {b}: {len(row)} tokens exceed the context n_positions={config.n_positions}")
        bad = [t for t in row if not 0 <= t < config.valid_vocab]
        if bad:
            raise InputError(f"sequence {b}: token id {bad[0]} is outside the vocab [0, {config.valid_vocab})")


def prompt_logprobs(params: Params, config: GPT2Config, prompts: Any, top_logprobs: int = 0) -> PromptScores:
    """Prompts (token-id lists, ragged) -> each token's logprob given the tokens before it (None for the first),
    and with top_logprobs = R <= 20 the R most likely ids at each position, as generate reports them."""
    rows = as_prompts(prompts)
    check_rows(rows, config)
    r = MAX_TOP_LOGPROBS if top_logprobs else 0  # one compiled width, cut on the host, as generate does
    with on_mesh(mesh_of(params)):
        picked, ids, values = jax.device_get(_score(params, jnp.asarray(padded_rows(rows, config)), config, r))
    lps = [[None] + picked[b, : len(p) - 1].tolist() for b, p in enumerate(rows)]
    if not r:
        return PromptScores(lps, None, None)
    top_ids = [[None] + ids[b, : len(p) - 1, :top_logprobs].tolist() for b, p in enumerate(rows)]
    top_lps = [[None] + values[b, : len(p) - 1, :top_logprobs].tolist() for b, p in enumerate(rows)]
    return PromptScores(lps, top_ids, top_lps)
