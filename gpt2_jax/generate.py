"""Autoregressive generation: prefill the prompts in one pass, then a loop of decode steps, in one jit.

Shapes are bucketed (prompt length P and step count N round up to powers of two), and every
sampling setting, key and stop id is a traced value, so a new temperature never recompiles.
A row's randomness is fold_in(row_key, absolute position): its tokens depend only on its prompt,
key and settings, never on its batch neighbours, the batch size, the padding or the cache size.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax import sampling
from gpt2_jax.cache import KVCache, init_cache
from gpt2_jax.config import GPT2Config
from gpt2_jax.model import forward_cached
from gpt2_jax.params import Params
from gpt2_jax.prompts import Batch, check_stop_args, make_batch
from gpt2_jax.sharding import constrain, data_size, mesh_of, on_mesh, replicate

MAX_STOP_IDS = 8  # stop ids are padded to a fixed count so their number never changes a shape


class StopRule(NamedTuple):
    eos_id: jax.Array  # [] int32; -1 = never stop on EOS
    stop_ids: jax.Array  # [MAX_STOP_IDS] int32; -1 = unused slot


class DecodeState(NamedTuple):
    cache: KVCache  # K/V [L, B, H, S, K]; lengths [B]: tokens held, i.e. the position of the token drawn next
    logits: jax.Array  # [B, V] float32: next-token logits of each row
    keys: jax.Array  # [B] PRNG keys, one per row
    done: jax.Array  # [B] bool: the row has emitted EOS or a stop id
    fill: jax.Array  # [B] int32: what a finished row emits (the EOS id, else its stop token)
    generated: jax.Array  # [B] int32: tokens generated so far, the stopping token included


class GenerateResult(NamedTuple):
    tokens: np.ndarray  # [B, max_new_tokens] int32; after a row stops: the EOS id
    lengths: np.ndarray  # [B] int32: generated tokens per row, the stopping token included
    logprobs: np.ndarray | None  # [B, max_new_tokens] float32 log p(token) under the raw logits


@functools.partial(jax.jit, static_argnames=("config", "capacity"))
def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, config: GPT2Config,
            capacity: int) -> DecodeState:
    """Right-padded prompts [B, P] of lengths [B] -> the state before the first draw: one cached forward
    writes every prompt's K/V into slots [0, P) of a fresh cache of `capacity` slots."""
    tokens, lengths, keys = constrain(tokens, "BT"), constrain(lengths, "B"), constrain(keys, "B")  # rows over "data"
    B = tokens.shape[0]
    cache = init_cache(config, B, capacity, params["wte"].dtype)
    logits, cache = forward_cached(params, tokens, cache, config, last=lengths - 1)
    no = jnp.zeros(B, bool)
    zero = jnp.zeros(B, jnp.int32)
    return DecodeState(cache._replace(lengths=lengths), logits[:, 0], keys, no, zero, zero)


def _draw(state: DecodeState, settings: sampling.RowSettings, stop: StopRule, n_valid: int):
    """Sample each row's next token -> (state with done/fill/lengths updated, tokens [B], logprobs [B])."""
    keys = jax.vmap(jax.random.fold_in)(state.keys, state.cache.lengths)  # the drawn token's position
    token = sampling.sample_rows(keys, state.logits, settings, n_valid)
    logprob = sampling.token_logprobs(state.logits, token)
    stops = (token == stop.eos_id) | (token[:, None] == stop.stop_ids[None, :]).any(-1)
    token = jnp.where(state.done, state.fill, token)
    logprob = jnp.where(state.done, 0.0, logprob)
    fill = jnp.where(state.done, state.fill, jnp.where(stop.eos_id >= 0, stop.eos_id, token))
    generated = state.generated + (~state.done).astype(jnp.int32)
    return state._replace(done=state.done | stops, fill=fill, generated=generated), token, logprob


def _feed(params: Params, state: DecodeState, token: jax.Array, config: GPT2Config) -> DecodeState:
    """Run the drawn tokens [B] through the model: their K/V enter the cache, new logits come out."""
    logits, cache = forward_cached(params, token[:, None], state.cache, config)
    return state._replace(cache=cache, logits=logits[:, 0])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("state",))
def decode_step(params: Params, state: DecodeState, settings: sampling.RowSettings, stop: StopRule,
                config: GPT2Config) -> tuple[DecodeState, jax.Array, jax.Array]:
    """One streaming step: draw tokens [B] (and their logprobs [B]), then feed them back. The state is
    donated: its cache is updated in place, so pass the returned state on and drop the old one. On a mesh, the tokens, logprobs and done flags come back whole on every device (and process)."""
    state, token, logprob = _draw(state, settings, stop, config.valid_vocab)
    state = _feed(params, state, token, config)
    return state._replace(done=replicate(state.done)), *replicate((token, logprob))


@functools.partial(jax.jit, static_argnames=("config", "capacity", "steps"))
def _generate(params: Params, tokens: jax.Array, lengths: jax.Array, keys: jax.Array,
              settings: sampling.RowSettings, stop: StopRule, max_new: jax.Array, config: GPT2Config,
              capacity: int, steps: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """prefill + up to max_new draws -> (tokens [B, steps], logprobs [B, steps], lengths [B]).

    The loop is lax.while_loop, scan's sibling with a run-time trip count: it stops after max_new
    draws or once every row has stopped, never running the bucket's padding steps. (A lax.cond
    inside a lax.scan would skip them too, but XLA then copies the whole KV cache every step:
    8 ms of a 49 ms step at batch 8, measured.) Outputs are preallocated and written in place."""
    state = prefill(params, tokens, lengths, keys, config, capacity)
    B = tokens.shape[0]

    def running(carry):
        t, state, _, _ = carry
        return (t < max_new) & ~state.done.all()

    def step(carry):
        t, state, toks, logprobs = carry
        state, token, logprob = _draw(state, settings, stop, config.valid_vocab)
        toks = jax.lax.dynamic_update_index_in_dim(toks, token, t, axis=1)
        logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, logprob, t, axis=1)
        return t + 1, _feed(params, state, token, config), toks, logprobs

    empty = (jnp.zeros((B, steps), jnp.int32), jnp.zeros((B, steps), jnp.float32))
    t, state, toks, logprobs = jax.lax.while_loop(running, step, (jnp.zeros((), jnp.int32), state, *empty))
    after = jnp.arange(steps)[None, :] >= t  # steps never drawn because every row had stopped
    # On a mesh the (small) results come back whole, so every process can read them.
    return replicate((jnp.where(after, state.fill[:, None], toks), jnp.where(after, 0.0, logprobs), state.generated))


def _pad_rows(tree: Any, rows: int) -> Any:
    """Repeat every leaf's last row until it has `rows` rows."""

    def pad(a):
        extra = rows - a.shape[0]
        xp = np if isinstance(a, np.ndarray) else jnp
        return a if extra == 0 else xp.concatenate([a] + [a[-1:]] * extra)

    return jax.tree.map(pad, tree)


def _prepare(params: Params, config: GPT2Config, prompts: Any, key: jax.Array, max_new_tokens: int,
             temperature: Any, top_k: Any, top_p: Any, eos_id: int | None,
             stop_ids: Any) -> tuple[Batch, sampling.RowSettings, StopRule, Any]:
    """Validate everything on the host, before anything is traced -> (batch, settings, stop rule, the
    params' mesh or None). A mesh's data axis must divide the rows: copies of the last row fill up to
    a multiple of it (rows never affect each other, so the caller just drops the copies' results)."""
    mesh = mesh_of(params)
    row_multiple = data_size(mesh)
    batch = make_batch(prompts, config, max_new_tokens)
    B = batch.tokens.shape[0]
    settings = sampling.row_settings(temperature, top_k, top_p, B)
    eos, stops = check_stop_args(config.eos_id if eos_id == "config" else eos_id, stop_ids, config, MAX_STOP_IDS)
    rows = -(-B // row_multiple) * row_multiple
    tokens, lengths, keys, settings = _pad_rows((batch.tokens, batch.lengths, sampling.row_keys(key, B), settings),
                                                rows)  # fmt: skip
    return batch._replace(tokens=tokens, lengths=lengths, keys=keys), settings, StopRule(eos, stops), mesh


def generate(params: Params, config: GPT2Config, prompts: Any, key: jax.Array, *, max_new_tokens: int,
             temperature: Any = 1.0, top_k: Any = 0, top_p: Any = 1.0, eos_id: int | None | str = "config",
             stop_ids: Any = (), return_logprobs: bool = False) -> GenerateResult:
    """Prompts (lists of token ids, ragged) -> GenerateResult(tokens [B, N], lengths [B], logprobs [B, N]).

    key: one PRNG key (row b uses fold_in(key, b)) or one key per row [B]. temperature, top_k,
    top_p: scalars or per-row [B]. eos_id: "config" (the default) is the checkpoint's eos_token_id
    (GPT-2's <|endoftext|>, 50256), or no EOS when that id is outside the vocab (a small test model);
    an explicit id must be in the vocab; None never stops on EOS. stop_ids adds more stop tokens.
    Params sharded with gpt2_jax.sharding run on their mesh and give the same tokens."""
    batch, settings, stop, mesh = _prepare(params, config, prompts, key, max_new_tokens, temperature, top_k, top_p,
                                           eos_id, stop_ids)  # fmt: skip
    with on_mesh(mesh):
        toks, logprobs, lengths = _generate(
            params, batch.tokens, batch.lengths, batch.keys, settings, stop, jnp.int32(max_new_tokens), config,
            batch.capacity, batch.steps,
        )
    B, n = batch.rows, max_new_tokens
    return GenerateResult(
        np.asarray(toks)[:B, :n], np.asarray(lengths)[:B], np.asarray(logprobs)[:B, :n] if return_logprobs else None
    )


def generate_stream(params: Params, config: GPT2Config, prompts: Any, key: jax.Array, *, max_new_tokens: int,
                    temperature: Any = 1.0, top_k: Any = 0, top_p: Any = 1.0, eos_id: int | None | str = "config",
                    stop_ids: Any = ()) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Like generate, one decode_step at a time: yields (tokens [B], live [B]) per step, where
    live marks the rows whose token is newly generated (the others have stopped and repeat EOS)."""
    batch, settings, stop, mesh = _prepare(params, config, prompts, key, max_new_tokens, temperature, top_k, top_p,
                                           eos_id, stop_ids)  # fmt: skip
    B = batch.rows
    with on_mesh(mesh):
        state = prefill(params, batch.tokens, batch.lengths, batch.keys, config, batch.capacity)
    live = np.ones(B, bool)
    for _ in range(max_new_tokens):
        with on_mesh(mesh):
            state, token, _ = decode_step(params, state, settings, stop, config)
        yield np.asarray(token)[:B], live
        live = ~np.asarray(state.done)[:B]
        if not live.any():
            return
