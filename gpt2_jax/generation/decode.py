"""The decode loop: prefill, then draw -> feed steps over a fixed-size KV cache, all jitted.

A step processes each row's raw logits (gpt2_jax.sampling.processors, then the row's constraint
automaton), samples with the row's warpers and key, records the token, and feeds it back.
Every setting rides in `Rules`, a pytree of traced per-row values: a new value never recompiles.

Shape legend: B rows, V vocab, S cache slots, N steps, R top-logprob entries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.model.axes import constrain, replicate
from gpt2_jax.model.gpt2 import forward_cached
from gpt2_jax.model.kv_cache import KVCache, init_cache
from gpt2_jax.model.params import Params, float_dtype
from gpt2_jax.sampling.constraints.tables import ConstraintTables, advance, allowed
from gpt2_jax.sampling.draw import exponential_clocks, log_probs, sample_rows, samples, token_logprobs
from gpt2_jax.sampling.metadata import RowSettings
from gpt2_jax.sampling.processors import ProcessorSettings, ProcessorState, apply_processors
from gpt2_jax.sampling.processors import init_state as init_processor_state
from gpt2_jax.sampling.processors import update_state as update_processor_state

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int, Key


class StopRule(NamedTuple):
    eos_id: jax.Array  # [B] int32: each row's EOS; -1 = never stop on EOS
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32: each row's other stop tokens; -1 = unused slot


class Rules(NamedTuple):
    """Everything a step applies to the logits, one traced value (or table) per row."""

    settings: RowSettings  # warpers: temperature, top-k, top-p, min-p
    processors: ProcessorSettings  # penalties, bias, bans, min new tokens
    stop: StopRule
    constraint: ConstraintTables  # every row's automaton (state 0 = free)


class DecodeState(NamedTuple):
    cache: KVCache  # K/V [L, B, H, S, K]; lengths [B]: tokens held, i.e. the position of the token drawn next
    logits: jax.Array  # [B, V] float32: next-token logits of each row (raw)
    keys: jax.Array  # [B] PRNG keys, one per row
    done: jax.Array  # [B] bool: the row has emitted EOS or a stop id
    fill: jax.Array  # [B] int32: what a finished row emits (the EOS id, else its stop token)
    generated: jax.Array  # [B] int32: tokens generated so far, the stopping token included
    history: ProcessorState  # tokens so far [B, S] and output counts [B, V], for the processors
    automaton: jax.Array  # [B] int32: each row's constraint state


class Step(NamedTuple):
    token: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, log p(token) under the raw logits
    top_ids: jax.Array  # [B, R] int32 (R = 0 unless top logprobs were asked for)
    top_logprobs: jax.Array  # [B, R] float32


@functools.partial(jax.jit, static_argnames=("config", "capacity", "hooks"))
def prefill(
    params: Params,
    tokens: jax.Array,
    lengths: jax.Array,
    keys: jax.Array,
    config: GPT2Config,
    capacity: int,
    start: jax.Array | None = None,
    hooks=None,
) -> DecodeState:
    """Right-padded prompts [B, P] of lengths [B] -> the state before the first draw: one cached forward
    writes every prompt's K/V into slots [0, P) of a fresh cache of `capacity` slots. start [B]: each
    row's initial constraint state (None: all free). hooks: a gpt2_jax.interp.Hooks editing the
    forward (steering), or None."""
    tokens, lengths, keys = constrain(tokens, "BT"), constrain(lengths, "B"), constrain(keys, "B")  # rows over "data"
    B = tokens.shape[0]
    cache = init_cache(config, B, capacity, float_dtype(params))
    logits, cache = forward_cached(params, tokens, cache, config, last=lengths - 1, hooks=hooks)
    no = jnp.zeros(B, bool)
    zero = jnp.zeros(B, jnp.int32)
    history = init_processor_state(tokens, lengths, capacity, config.vocab_size)
    start = zero if start is None else start
    return DecodeState(cache._replace(lengths=lengths), logits[:, 0], keys, no, zero, zero, history, start)


def most_likely(logits: jax.Array, r: int) -> tuple[jax.Array, jax.Array]:
    """Raw logits [B, V] -> the r most likely ids [B, r] and their log-probabilities, rounded alike for 1 row or many."""
    values, ids = jax.lax.top_k(log_probs(logits), r)
    return ids.astype(jnp.int32), values


def _allowed(rules: Rules, state: DecodeState) -> jax.Array:
    """[B, V] bool: the tokens each row's automaton allows (everything for a free row), only computed
    when some row is constrained."""
    c = rules.constraint
    return jax.lax.cond(jnp.any(state.automaton > 0),
                        lambda: allowed(c, state.automaton, rules.stop.eos_id),
                        lambda: jnp.ones(state.logits.shape, bool))  # fmt: skip


def position_keys(keys: Key[Array, " B"], positions: Int[Array, " B"]) -> Key[Array, " B"]:
    """Each row's key for the token drawn at its position: fold_in(row key, position)."""
    return jax.vmap(jax.random.fold_in)(keys, positions)


def draw(state: DecodeState, rules: Rules, n_valid: int, r: int = 0, clocks=None) -> tuple[DecodeState, Step]:
    """Process and sample each row's next token -> (state with done/fill/history updated, the Step). clocks:
    the draw's exponential clocks [B, V] made beforehand (draw_clocks), or None to make them here."""
    keys = position_keys(state.keys, state.cache.lengths)  # the drawn token's position
    stop = rules.stop
    stops = jnp.concatenate([stop.eos_id[:, None], stop.stop_ids], axis=1)  # [B, 1 + MAX_STOP_IDS]
    length = state.cache.lengths
    logits = apply_processors(state.logits, rules.processors, state.history, length, state.generated, stops,
                              _allowed(rules, state))  # fmt: skip
    token = sample_rows(keys, logits, rules.settings, n_valid, clocks)
    logprob = token_logprobs(state.logits, token)
    live = ~state.done
    history = update_processor_state(state.history, token, length, live)
    automaton = jnp.where(live, advance(rules.constraint, state.automaton, token), state.automaton)
    b = token.shape[0]
    top_ids, top_lp = most_likely(state.logits, r) if r else (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0)))
    ends = (token == stop.eos_id) | (token[:, None] == stop.stop_ids).any(-1)
    token = jnp.where(state.done, state.fill, token)
    logprob = jnp.where(state.done, 0.0, logprob)
    fill = jnp.where(state.done, state.fill, jnp.where(stop.eos_id >= 0, stop.eos_id, token))
    state = state._replace(done=state.done | ends, fill=fill, generated=state.generated + live.astype(jnp.int32),
                           history=history, automaton=automaton)  # fmt: skip
    return state, Step(token, logprob, top_ids, top_lp)


def draw_clocks(state: DecodeState, rules: Rules, positions: Int[Array, "N B"], v: int) -> Float[Array, "N B V"]:
    """The exponential clocks draw makes at each of N positions per row [N, B] (for speculative decoding, whose
    draft and check draw at the same positions with the same keys): made once, and only when some row samples
    (zeros otherwise, never read)."""
    keys = jax.vmap(lambda p: position_keys(state.keys, p))(positions)  # [N, B]: the keys draw would use
    shape = (*positions.shape, v)
    return jax.lax.cond(samples(rules.settings), lambda: jax.vmap(lambda k: exponential_clocks(k, v))(keys),
                        lambda: jnp.zeros(shape, jnp.float32))  # fmt: skip


def feed(params: Params, state: DecodeState, token: jax.Array, config: GPT2Config, hooks=None) -> DecodeState:
    """Run the drawn tokens [B] through the model: their K/V enter the cache, new logits come out."""
    logits, cache = forward_cached(params, token[:, None], state.cache, config, hooks=hooks)
    return state._replace(cache=cache, logits=logits[:, 0])


@functools.partial(jax.jit, static_argnames=("config", "r", "hooks"), donate_argnames=("state",))
def decode_step(
    params: Params, state: DecodeState, rules: Rules, config: GPT2Config, r: int = 0, hooks=None
) -> tuple[DecodeState, Step]:
    """One streaming step: draw tokens [B] (with their logprobs), then feed them back. The state is
    donated: its cache is updated in place, so pass the returned state on and drop the old one. On a
    mesh, the step and the done flags come back whole on every device (and process)."""
    state, step = draw(state, rules, config.valid_vocab, r)
    state = feed(params, state, step.token, config, hooks)
    return state._replace(done=replicate(state.done)), replicate(step)


def empty_steps(B: int, steps: int, r: int) -> Step:
    """Steps [B, steps] (top entries [B, steps, r]) of zeros, preallocated for a loop to write in place."""
    zeros = jnp.zeros((B, steps, r))
    return Step(jnp.zeros((B, steps), jnp.int32), jnp.zeros((B, steps)), zeros.astype(jnp.int32), zeros)


def fill_after(out: Step, fill: Int[Array, " B"], made: Int[Array, "*B"]) -> Step:
    """Steps [B, steps] with every step from made (a scalar, or [B] per row) on holding the row's fill [B]
    and logprob 0: the steps a loop never drew."""
    after = jnp.arange(out.token.shape[1])[None, :] >= jnp.reshape(made, (-1, 1))
    return out._replace(token=jnp.where(after, fill[:, None], out.token), logprob=jnp.where(after, 0.0, out.logprob))


@functools.partial(jax.jit, static_argnames=("config", "steps", "r", "hooks"), donate_argnames=("state",))
def decode_chunk(
    params: Params,
    state: DecodeState,
    rules: Rules,
    limit: jax.Array,
    config: GPT2Config,
    steps: int,
    r: int = 0,
    hooks=None,
) -> tuple[DecodeState, Step, jax.Array]:
    """Continue a prefilled state by up to `limit` <= steps draws, stopping early once every row is done ->
    (state, Steps with a [B, steps] (or [B, steps, R]) leaf each, draws made). Steps never drawn hold the
    rows' fill and 0. The host reads the steps and each row's done, generated and fill, so on a mesh those
    come back whole on every device (and process).

    lax.while_loop has a run-time trip count, so the bucket's padding steps never run. (A lax.cond
    inside a lax.scan would skip them too, but XLA then copies the whole KV cache every step.) Outputs are
    preallocated and written in place."""
    B = state.logits.shape[0]

    def running(carry):
        t, state, _ = carry
        return (t < limit) & ~state.done.all()

    def step(carry):
        t, state, out = carry
        state, s = draw(state, rules, config.valid_vocab, r)
        out = jax.tree.map(lambda o, x: jax.lax.dynamic_update_index_in_dim(o, x, t, axis=1), out, s)
        return t + 1, feed(params, state, s.token, config, hooks), out

    out = empty_steps(B, steps, r)
    t, state, out = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), state, out))
    out = fill_after(out, state.fill, t)  # steps never drawn because every row had stopped
    whole = replicate((state.done, state.generated, state.fill))
    return state._replace(done=whole[0], generated=whole[1], fill=whole[2]), replicate(out), t


@jax.jit
def halt(state: DecodeState, rows: Bool[Array, " B"], eos_id: Int[Array, " B"]) -> DecodeState:
    """Stop rows [B] bool (a stop string completed, a row's own max_new_tokens reached): they emit their fill
    (their EOS eos_id [B], else their last token) from now on."""
    last = state.history.history[jnp.arange(rows.shape[0]), state.cache.lengths - 1]
    new = rows & ~state.done
    fill = jnp.where(new, jnp.where(eos_id >= 0, eos_id, last), state.fill)
    return state._replace(done=state.done | rows, fill=fill)
