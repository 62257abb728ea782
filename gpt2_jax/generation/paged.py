"""Generation over a paged KV cache (gpt2_jax.model.paged_cache): the serving engine's state.

generate's state holds one contiguous cache row per request. This one holds a pool of blocks shared by every row
and a block table per row: a request's prompt goes in chunk by chunk (prefill_chunk), after any leading blocks
another request already filled with the same tokens; its row then joins the decode steps (start_row), which run
over the first `rows` rows of the state (decode_rows) and leave the others as they are. A chunk can also ride a
decode step, in the same forward (decode_rows_with_chunk). A token's K/V, and
attention over them, are the same bits whatever block holds them, however the prompt was cut into chunks and
whoever computed a shared block (the model's batch invariance, see gpt2_jax.model.attention), so a row decoded
here gives generate's tokens and logprobs bit for bit.

A row that is not decoding (free, or its prompt still going in) is halted and its table points at the null block
only: the decode steps feed it a filler token whose K/V land in the null block, never in a block a row owns.

Shape legend: B rows, P prompts in one chunk, M blocks per row, N blocks in the pool, C slots per block, S = M x C, T chunk tokens, V vocab.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.decode import DecodeState, Rules, Step, draw, feed
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.model.gpt2 import forward_cached
from gpt2_jax.model.paged_cache import NULL_BLOCK, PagedKVCache, init_pool
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.processors import ProcessorState
from gpt2_jax.sampling.processors import init_state as init_processor_state

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int, Key


def init_paged(config: GPT2Config, rows: int, num_blocks: int, blocks_per_row: int, dtype=jnp.float32,
               filler: int = 0) -> DecodeState:  # fmt: skip
    """A state of `rows` halted rows over a fresh pool of num_blocks blocks (block 0 the null block), each row's
    table M = blocks_per_row null entries. A halted row emits and feeds `filler` (a valid token id)."""
    k, v = init_pool(config, num_blocks, dtype)
    S, V = blocks_per_row * KEY_BLOCK, config.vocab_size
    cache = PagedKVCache(k, v, jnp.full((rows, blocks_per_row), NULL_BLOCK, jnp.int32), jnp.zeros(rows, jnp.int32))
    history = ProcessorState(
        jnp.zeros((rows, S), jnp.int32), jnp.zeros((rows, V), bool), jnp.zeros((rows, V), jnp.int32)
    )
    keys = jax.random.split(jax.random.key(0), rows)
    zero = lambda: jnp.zeros(rows, jnp.int32)
    # DecodeState's cache is typed as generate's contiguous one; every decode step runs on either kind
    return DecodeState(cache, jnp.zeros((rows, V), jnp.float32), keys, jnp.ones(rows, bool),  # pyright: ignore[reportArgumentType]
                       zero() + filler, zero(), history, zero())  # fmt: skip


def fill_chunk(params: Params, pool: PagedKVCache, tables: Int[Array, "P M"], tokens: Int[Array, "P T"],
               start: Int[Array, " P"], last: Int[Array, " P"],
               config: GPT2Config) -> tuple[PagedKVCache, Float[Array, "P V"]]:  # fmt: skip
    """A chunk of tokens [P, T] of each of P prompts into slots [start, start + T) of the row whose blocks are
    tables[p], in `pool` (a model's blocks: the target's, or a draft model's own pool under the same tables) ->
    (pool, logits [P, V] of each chunk's token `last`). A row whose table holds only the null block is padding."""
    cache = PagedKVCache(pool.k, pool.v, tables, start)
    logits, cache = forward_cached(params, tokens, cache, config, last=last)
    return pool._replace(k=cache.k, v=cache.v), logits[:, 0]


@functools.partial(jax.jit, static_argnames="config", donate_argnames="state")
def prefill_chunk(params: Params, state: DecodeState, tables: Int[Array, "P M"], tokens: Int[Array, "P T"],
                  start: Int[Array, " P"], last: Int[Array, " P"],
                  config: GPT2Config) -> tuple[DecodeState, Float[Array, "P V"]]:  # fmt: skip
    """Chunks [P, T] of P prompts, each into slots [start, start + T) of the row whose blocks are tables[p]
    (written in place in the state's pool, donated) -> (state, logits [P, V] of each chunk's token `last`). Slots
    before `start` already hold the prompt's earlier tokens (earlier chunks, or shared blocks); tokens past the
    prompt (a chunk's padding) land in slots the row overwrites before it reads them, or in the null block. A
    row's K/V and logits are the same bits whatever the other rows of the chunk (the model's batch invariance)."""
    pool, logits = fill_chunk(params, _pool(state), tables, tokens, start, last, config)
    return state._replace(cache=pool), logits


@functools.partial(jax.jit, donate_argnames="state")
def start_row(state: DecodeState, row: Int[Array, ""], table: Int[Array, " M"], prompt: Int[Array, " S"],
              length: Int[Array, ""], logits: Float[Array, " V"], key: Key[Array, ""],
              automaton: Int[Array, ""]) -> DecodeState:  # fmt: skip
    """Row `row` starts decoding: its blocks table [M], its prompt [S] (padded) of `length` tokens, the logits [V]
    after it, its key and its constraint's start state -> the state generate's prefill leaves for that row."""
    S, V = state.history.history.shape[1], state.logits.shape[1]
    history = init_processor_state(prompt[None], length[None], S, V)
    at = lambda big, small: big.at[row].set(small)
    pool = _pool(state)
    cache = pool._replace(table=at(pool.table, table), lengths=at(pool.lengths, length))
    return state._replace(
        cache=cache, logits=at(state.logits, logits), keys=at(state.keys, key), done=at(state.done, False),
        fill=at(state.fill, 0), generated=at(state.generated, 0),
        history=jax.tree.map(lambda big, small: big.at[row].set(small[0]), state.history, history),
        automaton=at(state.automaton, automaton),
    )  # fmt: skip


@functools.partial(jax.jit, donate_argnames="state")
def stop_rows(state: DecodeState, rows: Bool[Array, " B"], filler: Int[Array, ""]) -> DecodeState:
    """Rows [B] bool stop decoding: halted (emitting `filler`) and their tables back to the null block, so the
    blocks they held can go to other rows."""
    pool = _pool(state)
    table = jnp.where(rows[:, None], NULL_BLOCK, pool.table)
    return state._replace(cache=pool._replace(table=table), done=state.done | rows,
                          fill=jnp.where(rows, filler, state.fill))  # fmt: skip


def _pool(state: DecodeState) -> PagedKVCache:
    """The state's paged cache: init_paged's states hold one, never generate's contiguous KVCache."""
    if not isinstance(state.cache, PagedKVCache):
        raise ConfigError(f"a paged decode step needs init_paged's state, got a {type(state.cache).__name__}")
    return state.cache


def _head(tree, rows: int):
    return jax.tree.map(lambda a: a[:rows], tree)


def head_rows(state: DecodeState, rules: Rules, rows: int) -> tuple[DecodeState, Rules]:
    """Rows [0, rows) of a paged state and of its rules: what a step over the first `rows` rows works on (the
    pool stays whole: it is shared)."""
    pool = _pool(state)
    head = _head(state._replace(cache=None), rows)._replace(
        cache=PagedKVCache(pool.k, pool.v, pool.table[:rows], pool.lengths[:rows])
    )
    c = rules.constraint
    settings, processors, stop = _head((rules.settings, rules.processors, rules.stop), rows)
    return head, Rules(settings, processors, stop, c._replace(group=c.group[:rows], start=c.start[:rows]))


def put_rows(state: DecodeState, head: DecodeState, rows: int) -> DecodeState:
    """head_rows' rows, stepped, back into the whole state (the pool as the step left it; tables unchanged)."""
    pool = _pool(state)
    put = lambda big, small: big.at[:rows].set(small)
    rest = jax.tree.map(put, state._replace(cache=None), head._replace(cache=None))
    return rest._replace(
        cache=pool._replace(k=head.cache.k, v=head.cache.v, lengths=put(pool.lengths, head.cache.lengths))
    )


@functools.partial(jax.jit, static_argnames=("config", "rows", "r"), donate_argnames="state")
def decode_rows(params: Params, state: DecodeState, rules: Rules, config: GPT2Config, rows: int,
                r: int = 0) -> tuple[DecodeState, Step]:  # fmt: skip
    """decode_step over rows [0, rows) of a paged state: draw a token [rows] per row, feed it back (the pool is
    shared, every other row is left as it is) -> (state, Step [rows])."""
    head, head_rules = head_rows(state, rules, rows)
    head, step = draw(head, head_rules, config.valid_vocab, r)
    head = feed(params, head, step.token, config)
    return put_rows(state, head, rows), step


@functools.partial(jax.jit, static_argnames=("config", "rows", "r"), donate_argnames="state")
def decode_rows_with_chunk(params: Params, state: DecodeState, rules: Rules, tables: Int[Array, "P M"],
                           tokens: Int[Array, "P T"], start: Int[Array, " P"], last: Int[Array, " P"],
                           config: GPT2Config, rows: int,
                           r: int = 0) -> tuple[DecodeState, Step, Float[Array, "P V"]]:  # fmt: skip
    """decode_rows and prefill_chunk in one forward: the rows [0, rows) draw their tokens, then those tokens and
    the chunk's P x T tokens go through the model together, each chunk token a one-token row of its own (its
    prompt's table, its own slot), so the weights are read once for both -> (state, Step [rows], logits [P, V] of
    each chunk's token `last`). Within a layer every row writes its K/V before any row attends, so a chunk token
    sees the ones before it, and every row's bits are the two programs' (the model's batch invariance)."""
    head, head_rules = head_rows(state, rules, rows)
    head, step = draw(head, head_rules, config.valid_vocab, r)
    P, T = tokens.shape
    pool = _pool(head)
    table = jnp.concatenate([pool.table, jnp.repeat(tables, T, axis=0)])  # [rows + P*T, M]
    slots = jnp.concatenate([pool.lengths, (start[:, None] + jnp.arange(T, dtype=jnp.int32)).reshape(-1)])
    fed = jnp.concatenate([step.token, tokens.reshape(-1)])[:, None]  # [rows + P*T, 1]
    picked = jnp.concatenate([jnp.arange(rows), rows + jnp.arange(P) * T + last])  # only these are unembedded
    logits, cache = forward_cached(params, fed, PagedKVCache(pool.k, pool.v, table, slots), config, rows=picked)
    head = head._replace(cache=pool._replace(k=cache.k, v=cache.v, lengths=cache.lengths[:rows]),
                         logits=logits[:rows, 0])  # fmt: skip
    return put_rows(state, head, rows), step, logits[rows:, 0]
