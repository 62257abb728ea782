"""Verification: k proposed tokens checked in one target forward, keeping exactly the tokens plain
decoding draws.

One round, for each row at position p (its cache holds p tokens, its logits are for position p):
  1. draw t0 at p from the row's logits, exactly as decode.draw does in plain decoding;
  2. propose d1..dk to follow t0 (gpt2_jax.generation.speculative.propose; a draft model draws d_j
     with the very draw of step 4, on its own logits, so it agrees with x_j wherever it can);
  3. feed [t0, d1..dk] at slots p..p+k in one cached forward: logits L0..Lk for positions p+1..p+k+1,
     each bit-identical to what one-token decode steps would give (the cache's invariance);
  4. for j = 1..k, draw x_j at p+j from L_{j-1} with the row's own key fold_in(key, p+j), settings,
     processors and automaton, updated by the tokens kept so far. Keep x_j while it equals d_j: then
     the next logits L_j were computed from the right token. At the first x_j != d_j, drop x_j and
     stop: the state is then exactly plain decoding's after t0, x_1..x_{j-1} (logits L_{j-1}, cache
     p + j tokens), and the next round draws x_j again as its t0, bit for bit.

So every kept token is the token plain decoding draws at that position from the same logits and the
same state, for greedy, sampling and every processor, and whatever the proposer guessed: a wrong
guess costs speed only. A round keeps 1 + m tokens (m accepted proposals). Rows keep different
counts: each row's cache length, position and output offset are its own, slots past a row's length
hold rejected guesses that its mask hides until they are overwritten, and a row's result never
depends on its neighbours (the same per-row invariance plain decoding has).

Shape legend: B rows, V vocab, S slots, k proposals, N steps, R top-logprob entries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.decode import DecodeState, Rules, Step, draw, draw_clocks, empty_steps, fill_after
from gpt2_jax.generation.speculative.propose import draft_prefill, draft_propose, prompt_lookup
from gpt2_jax.model.axes import replicate
from gpt2_jax.model.gpt2 import forward_cached
from gpt2_jax.model.kv_cache import KVCache, init_cache
from gpt2_jax.model.params import Params, float_dtype

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Int


class Stats(NamedTuple):
    proposed: jax.Array  # [B] int32: tokens proposed to the row
    accepted: jax.Array  # [B] int32: proposals kept
    rounds: jax.Array  # [B] int32: target forwards the row took part in


def _commit(take: jax.Array, new: DecodeState, old: DecodeState) -> DecodeState:
    """Row by row [B]: the draw's updates (done, fill, count, history, automaton) where take, else old."""

    def pick(a, b):
        return jnp.where(take.reshape(-1, *([1] * (a.ndim - 1))), a, b)

    return old._replace(done=pick(new.done, old.done), fill=pick(new.fill, old.fill),
                        generated=pick(new.generated, old.generated), history=jax.tree.map(pick, new.history, old.history),
                        automaton=pick(new.automaton, old.automaton))  # fmt: skip


def speculate_round(params: Params, draft_params: Params | None, state: DecodeState, dcache: KVCache | None,
                    rules: Rules, until: Int[Array, ""], config: GPT2Config, draft_config: GPT2Config | None,
                    k: int, r: int = 0, hooks=None) -> tuple[DecodeState, KVCache | None, Step, Int[Array, " B"]]:  # fmt: skip
    """One round (module docstring) -> (state, draft cache, Steps [B, k+1] (t0, x_1..x_k), kept [B]).
    A row takes part while it is not done and has fewer than `until` tokens; the others are unchanged.
    draft_config None: prompt lookup. hooks edit the target's forward (gpt2_jax.interp.Hooks), not the draft's."""
    base = state.cache.lengths
    active = ~state.done & (state.generated < until)
    s0, step0 = draw(state, rules, config.valid_vocab, r)
    s = _commit(active, s0, state)
    rows = jnp.arange(base.shape[0])
    clocks = None  # the draws' exponential clocks at p+1..p+k: a draft model's draw j and the check's share them
    if draft_config is None:
        guess = prompt_lookup(s.history.history, base + 1, k)
    else:
        assert draft_params is not None and dcache is not None, "a draft model comes with its params and cache"
        clocks = draw_clocks(
            state, rules, base[None] + jnp.arange(1, k + 1, dtype=jnp.int32)[:, None], config.vocab_size
        )
        prev = s.history.history[rows, base - 1]
        guess, dcache = draft_propose(draft_params, dcache, s, rules, prev, step0.token, k, draft_config, clocks)
    logits, cache = forward_cached(params, jnp.concatenate([step0.token[:, None], guess], 1), state.cache, config,
                                   hooks=hooks)  # fmt: skip

    def check(carry, xs):
        s, ok, kept = carry
        logits_j, guess_j, j, clock = xs
        # draw reads only the lengths: the view holds no K/V (None), so the scan carries no cache
        view = s._replace(logits=logits_j, cache=KVCache(None, None, base + j))  # pyright: ignore[reportArgumentType]
        sj, step = draw(view, rules, config.valid_vocab, r, clock)
        take = ok & (step.token == guess_j) & (state.generated + j < until)
        return (_commit(take, sj, s), take & ~sj.done, kept + take), step

    small = s._replace(cache=None)  # the scan carries no cache
    ok = active & ~s.done
    xs = (jnp.swapaxes(logits[:, :k], 0, 1), guess.T, jnp.arange(1, k + 1, dtype=jnp.int32), clocks)
    (s, _, kept), steps = jax.lax.scan(check, (small, ok, active.astype(jnp.int32)), xs)
    last = jnp.take_along_axis(logits, jnp.maximum(kept - 1, 0)[:, None, None], axis=1)[:, 0]
    s = s._replace(logits=jnp.where(active[:, None], last, state.logits),
                   cache=cache._replace(lengths=base + kept))  # fmt: skip
    out = jax.tree.map(lambda a, b: jnp.concatenate([a[:, None], jnp.swapaxes(b, 0, 1)], 1), step0, steps)
    return s, dcache, out, kept


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "steps", "k", "r", "hooks"),
                   donate_argnames=("state", "dcache"))  # fmt: skip
def speculate_chunk(
    params: Params,
    draft_params: Params | None,
    state: DecodeState,
    dcache: KVCache | None,
    rules: Rules,
    until: jax.Array,
    rounds: jax.Array,
    config: GPT2Config,
    draft_config: GPT2Config | None,
    steps: int,
    k: int,
    r: int = 0,
    hooks=None,
):
    """Rounds until every row is done or holds `until` tokens (at most `rounds` rounds) -> (state, draft
    cache, (Steps [B, steps] from the row's count at entry (the fill and 0 after its last token), tokens
    made [B], Stats)); state and draft cache are donated (updated in place)."""
    B = state.logits.shape[0]
    start = state.generated
    rows = jnp.arange(B)[:, None]
    zeros = jnp.zeros(B, jnp.int32)

    def running(c):
        i, state = c[0], c[1]
        return (i < rounds) & jnp.any(~state.done & (state.generated < until))

    def body(c):
        i, state, dcache, out, stats = c
        where = state.generated - start
        state, dcache, new, kept = speculate_round(params, draft_params, state, dcache, rules, until, config,
                                                   draft_config, k, r, hooks)  # fmt: skip
        j = jnp.arange(k + 1)[None, :]
        idx = jnp.where(j < kept[:, None], where[:, None] + j, steps)  # past the end: dropped
        out = jax.tree.map(lambda o, x: o.at[rows, idx].set(x, mode="drop"), out, new)
        on = (kept > 0).astype(jnp.int32)  # the rows that took part: each keeps at least its t0
        stats = Stats(stats.proposed + on * k, stats.accepted + jnp.maximum(kept - 1, 0), stats.rounds + on)
        return i + 1, state, dcache, out, stats

    carry = (jnp.zeros((), jnp.int32), state, dcache, empty_steps(B, steps, r), Stats(zeros, zeros, zeros))
    _, state, dcache, out, stats = jax.lax.while_loop(running, body, carry)
    made = state.generated - start
    return (
        state._replace(done=replicate(state.done)),
        dcache,
        replicate((fill_after(out, state.fill, made), made, stats)),
    )


@functools.partial(jax.jit, static_argnames=("draft_config", "capacity"))
def start_draft(
    draft_params: Params, tokens: jax.Array, lengths: jax.Array, draft_config: GPT2Config, capacity: int
) -> KVCache:
    """The draft's cache of `capacity` slots holding the prompts [B, P] (lengths [B])."""
    cache = init_cache(draft_config, tokens.shape[0], capacity, float_dtype(draft_params))
    return draft_prefill(draft_params, tokens, lengths, cache, draft_config)
