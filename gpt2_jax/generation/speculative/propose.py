"""Proposers: where the k guessed tokens come from. A proposal only decides speed, never output
(gpt2_jax.generation.speculative.verify draws every token plain decoding would draw, whatever is proposed).

  prompt lookup   the continuation of the most recent earlier occurrence of the row's last n tokens
                  (n = 3, then 2, then 1) in its prompt + output: free, and right whenever the text
                  copies itself (code edits, quotes, summaries, repetition).
  draft model     a smaller model with the same vocabulary, run from its own KV cache (which follows
                  the target's accepted tokens: positions line up slot for slot), each proposal drawn
                  with the coupled draw below.

The coupled draw: the draft draws d_j exactly as verification will draw x_j at that position, the
same key fold_in(row_key, p + j), settings, processors over the history extended by d_1..d_{j-1}, and
constraint automaton advanced by them (decode.draw on the draft's logits). The draw is an exponential
race over token ids (gpt2_jax.sampling.draw): the argmax of w / E with one clock E ~ Exp(1) per id from
that key, so the two races share their clocks and pick the same token at least (1 - TV) / (1 + TV) of
the time for total variation TV, however the mass is spread. Greedy rows get the argmax of the
processed draft logits.
An argmax proposal would instead be kept only when the target happens to sample its own argmax.

Shape legend: B rows, S cache slots, k proposed tokens, V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.decode import DecodeState, Rules, draw
from gpt2_jax.model.gpt2 import forward_cached
from gpt2_jax.model.kv_cache import KVCache
from gpt2_jax.model.params import Params

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int

LOOKUP_NGRAM = 3  # prompt lookup matches the last 3 tokens, else the last 2, else the last 1


def last_match(history: Int[Array, "B S"], length: Int[Array, " B"], n: int) -> Int[Array, " B"]:
    """history [B, S] holding `length` [B] tokens -> [B] int32: the end slot e of the latest earlier
    occurrence of the row's last n tokens (history[e-n+1 .. e] == history[length-n .. length-1],
    e < length - 1), or -1 if there is none."""
    B, S = history.shape
    e = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S] candidate end slots
    rows = jnp.arange(B)[:, None]
    match = (e >= n - 1) & (e <= length[:, None] - 2) & (length[:, None] >= n + 1)
    for i in range(n):  # token i back from the end: history[e - i] == history[length - 1 - i]
        back = jnp.take_along_axis(history, jnp.maximum(e - i, 0).repeat(B, 0), axis=1)
        want = history[rows[:, 0], jnp.maximum(length - 1 - i, 0)][:, None]
        match = match & (back == want)
    return jnp.max(jnp.where(match, e, -1), axis=1)


def prompt_lookup(history: Int[Array, "B S"], length: Int[Array, " B"], k: int) -> Int[Array, "B k"]:
    """history [B, S] holding `length` [B] tokens -> k proposed next tokens [B, k]: what followed the
    latest earlier occurrence of the last LOOKUP_NGRAM (else fewer) tokens. The continuation repeats with
    the match's period once it reaches the row's end (a loop keeps looping); with no match at all, the
    last token repeated."""
    end = jnp.full(length.shape, -1, jnp.int32)
    for n in range(LOOKUP_NGRAM, 0, -1):  # the longest n that matches wins
        end = jnp.where(end >= 0, end, last_match(history, length, n))
    found = end >= 0
    period = jnp.where(found, length - 1 - end, 1)  # slots end+1 .. length-1 are known: `period` of them
    first = jnp.where(found, end + 1, length - 1)
    slots = first[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :] % period[:, None]  # [B, k]
    return jnp.take_along_axis(history, slots, axis=1)


def draft_prefill(
    draft_params: Params, tokens: Int[Array, "B P"], lengths: Int[Array, " B"], cache: KVCache, draft_config: GPT2Config
) -> KVCache:
    """The draft reads the prompts [B, P] into its own cache (lengths [B] set to the prompts')."""
    _, cache = forward_cached(draft_params, tokens, cache, draft_config, last=lengths - 1)
    return cache._replace(lengths=lengths)


def coupled_draw(
    state: DecodeState,
    rules: Rules,
    logits: Float[Array, "B V"],
    position: Int[Array, " B"],
    n_valid: int,
    clocks: Float[Array, "B V"] | None = None,
) -> tuple[DecodeState, Int[Array, " B"]]:
    """The draw the target makes at `position` [B] (its key, settings, processors, automaton, from
    `state`'s keys, history, automaton and counts), made on the draft's logits [B, V] -> (state with
    the token recorded, token [B]). The state carries no cache; its logits are left as they were.
    clocks: that draw's exponential clocks (decode.draw_clocks), shared with the check's draw."""
    view = state._replace(logits=logits, cache=KVCache(None, None, position))  # pyright: ignore[reportArgumentType]
    drawn, step = draw(view, rules, n_valid, clocks=clocks)
    return drawn._replace(logits=state.logits, cache=None), step.token


def draft_propose(
    draft_params: Params,
    cache: KVCache,
    state: DecodeState,
    rules: Rules,
    prev: Int[Array, " B"],
    token: Int[Array, " B"],
    k: int,
    draft_config: GPT2Config,
    clocks: Float[Array, "k B V"] | None = None,
) -> tuple[Int[Array, "B k"], KVCache]:
    """The draft's k coupled draws [B, k] after the row's accepted tokens, ending (prev at slot p - 1,
    token at p), p = state.cache.lengths [B]: `state` is the decode state once `token` is drawn at p
    (its history, counts and automaton hold it), so d_j is drawn at p + j. prev is fed again each
    round: its slot may hold a proposal the target did not take or nothing yet (when the previous
    round's k proposals were all accepted), and feeding the same token at the same slot again writes
    the same K/V. Slots past p + k hold stale guesses that the cache's lengths mask. clocks: the k draws'
    exponential clocks (decode.draw_clocks at p + 1 .. p + k), or None to make them in each draw."""
    p, nv = state.cache.lengths, draft_config.valid_vocab
    logits, cache = forward_cached(draft_params, jnp.stack([prev, token], 1), cache._replace(lengths=p - 1),
                                   draft_config, last=jnp.ones_like(p))  # fmt: skip
    first_clocks, rest_clocks = (None, None) if clocks is None else (clocks[0], clocks[1:])
    s, first = coupled_draw(state._replace(cache=None), rules, logits[:, 0], p + 1, nv, first_clocks)  # no cache

    def step(carry, xs):
        cache, s, tok = carry
        j, clock = xs
        logits, cache = forward_cached(draft_params, tok[:, None], cache, draft_config)
        s, nxt = coupled_draw(s, rules, logits[:, 0], p + j, nv, clock)
        return (cache, s, nxt), nxt

    js = jnp.arange(2, k + 1, dtype=jnp.int32)
    (cache, _, _), rest = jax.lax.scan(step, (cache, s, first), (js, rest_clocks))
    return jnp.concatenate([first[:, None], rest.T], axis=1), cache
