"""The tokens a row may not draw next, as [B, V] masks: banned n-grams, bad words, EOS and the stop ids before
min_new_tokens (gpt2_jax.sampling.processors' steps 4-6, in transformers' semantics), and `ban`, which sets
them to -inf.

Shape legend: B batch, V vocab, S history slots, W banned words, M tokens per word, P stop ids per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp

from gpt2_jax.sampling.checks import MAX_NGRAM  # the static window of the history that banned n-grams read

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int


def ban(logits: Float[Array, "B V"], banned: Bool[Array, "B V"]) -> Float[Array, "B V"]:
    """-inf where banned [B, V]."""
    return jnp.where(banned, -jnp.inf, logits)


def token_mask(ids: Int[Array, "B J"], hit: Bool[Array, "B J"], v: int) -> Bool[Array, "B V"]:
    """Token ids [B, J] where hit [B, J] -> [B, V] bool marking them (ids where ~hit are dropped)."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], v), bool).at[rows, jnp.where(hit, ids, v)].set(True, mode="drop")


def repeated_ngrams(
    history: Int[Array, "B S"], length: Int[Array, " B"], n: Int[Array, " B"], v: int
) -> Bool[Array, "B V"]:
    """transformers' NoRepeatNGramLogitsProcessor -> banned [B, V]: with the text history[:length] (history [B, S]),
    a token t is banned when (last n-1 tokens, t) already occurs as an n-gram of the text. n [B], 0 = off."""
    b, s = history.shape
    i = jnp.arange(MAX_NGRAM - 1)
    padded = jnp.concatenate([history, jnp.zeros((b, MAX_NGRAM), history.dtype)], axis=1)
    tail = jnp.take_along_axis(padded, jnp.clip(length[:, None] - n[:, None] + 1 + i, 0, s - 1), axis=1)  # [B, n-1]
    j = jnp.arange(s)
    window = padded[:, j[:, None] + i[None, :]]  # [B, S, n-1]: the n-1 tokens starting at each j
    same = (window == tail[:, None, :]) | (i >= n[:, None] - 1)[:, None, :]
    # the n-gram starting at j must end inside the text: j + n - 1 < length
    hit = same.all(-1) & (j[None, :] + n[:, None] <= length[:, None]) & (n[:, None] > 0)
    last = jnp.take_along_axis(padded, jnp.clip(j[None, :] + n[:, None] - 1, 0, s - 1), axis=1)
    return token_mask(last, hit, v)


def bad_word_tokens(history: Int[Array, "B S"], length: Int[Array, " B"], words: Int[Array, "B W M"],
                    word_len: Int[Array, "B W"], v: int) -> Bool[Array, "B V"]:  # fmt: skip
    """transformers' NoBadWordsLogitsProcessor -> banned [B, V]: a word's last token when the word's other
    tokens (words [B, W, M], lengths [B, W]) end the text history[:length]; a one-token word always."""
    b, w, m = words.shape
    i = jnp.arange(m)
    prefix = word_len[..., None] - 1  # [B, W, 1]
    at = length[:, None, None] - prefix + i  # where token i of the prefix must sit
    seen = jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1).reshape(b, -1), axis=1).reshape(b, w, m)
    same = (seen == words) | (i >= prefix)
    hit = same.all(-1) & (word_len > 0) & (length[:, None] >= prefix[..., 0])
    last = jnp.take_along_axis(words, jnp.clip(word_len - 1, 0, m - 1)[..., None], axis=-1)[..., 0]
    return token_mask(last, hit, v)


def early_stop_tokens(generated: Int[Array, " B"], min_new: Int[Array, " B"], stop_ids: Int[Array, "B P"],
                      v: int) -> Bool[Array, "B V"]:  # fmt: skip
    """transformers' MinNewTokensLengthLogitsProcessor -> banned [B, V]: each row's stop ids [B, P] (its EOS
    among them, -1 = unused) while it has generated fewer than min_new [B] tokens."""
    early = (generated < min_new)[:, None] & (stop_ids >= 0)
    return token_mask(stop_ids, early, v)
