"""Speculative rounds over the serving engine's paged state (gpt2_jax.generation.paged).

A round here is generate's round (gpt2_jax.generation.speculative.verify.speculate_round) over the first `rows`
rows of the paged state: the target checks each row's k proposals in one forward over k + 1 tokens per row,
written through the rows' block tables, and keeps exactly the tokens plain decode steps would draw. A draft
model keeps its K/V in a pool of its own under the same block tables and lengths as the target's, so a block
shared by prefix caching holds both models' K/V of the same tokens, and a prompt's chunks fill both pools.
Proposals past a row's blocks, or a rejected guess's K/V, land in the null block or in slots the row
overwrites before it reads them, as a chunk's padding does.

Per row: `until` [B], the row's max_new_tokens (a round never keeps a token past it), and `want` [B], whether the
row speculates at all (a row that does not keeps one token per round, the one plain decoding draws).

Shape legend: B rows, P prompts in one chunk, M blocks per row, T chunk tokens, k proposals, R top-logprob entries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.decode import DecodeState, Rules, Step
from gpt2_jax.generation.paged import fill_chunk, head_rows, put_rows
from gpt2_jax.generation.speculative.verify import speculate_round
from gpt2_jax.model.paged_cache import PagedKVCache, init_pool
from gpt2_jax.model.params import Params

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Int

DraftPool = tuple[jax.Array, jax.Array]  # the draft model's key and value blocks ([L, N, H, K, C], [L, N, H, C, K])


def init_draft_pool(draft_config: GPT2Config, num_blocks: int, dtype=jnp.float32) -> DraftPool:
    """The draft model's empty pool: the same num_blocks blocks (block numbers shared with the target's tables)."""
    return init_pool(draft_config, num_blocks, dtype)


@functools.partial(jax.jit, static_argnames="draft_config", donate_argnames="pool")
def draft_chunk(draft_params: Params, pool: DraftPool, tables: Int[Array, "P M"], tokens: Int[Array, "P T"],
                start: Int[Array, " P"], draft_config: GPT2Config) -> DraftPool:  # fmt: skip
    """Prompt chunks [P, T] into the draft's pool, at the slots the target's chunks fill (donated, in place)."""
    paged = PagedKVCache(pool[0], pool[1], tables, start)
    paged, _ = fill_chunk(draft_params, paged, tables, tokens, start, jnp.zeros_like(start), draft_config)
    return paged.k, paged.v


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "rows", "k", "r"),
                   donate_argnames=("state", "pool"))  # fmt: skip
def speculate_rows(params: Params, draft_params: Params | None, state: DecodeState, pool: DraftPool | None,
                   rules: Rules, until: Int[Array, " B"], want: Bool[Array, " B"], config: GPT2Config,
                   draft_config: GPT2Config | None, rows: int, k: int,
                   r: int = 0) -> tuple[DecodeState, DraftPool | None, Step, Int[Array, " rows"]]:  # fmt: skip
    """One speculative round over rows [0, rows) (module docstring; draft_config None: prompt lookup) -> (state,
    the draft's pool, Steps [rows, k + 1], tokens kept [rows]: each row's first kept[b] steps are its tokens)."""
    head, head_rules = head_rows(state, rules, rows)
    limit = jnp.where(want[:rows], until[:rows], head.generated + 1)  # a row that does not speculate keeps one
    dcache: Any = None
    if pool is not None:
        dcache = PagedKVCache(pool[0], pool[1], head.cache.table, head.cache.lengths)  # pyright: ignore[reportAttributeAccessIssue]
    head, dcache, steps, kept = speculate_round(params, draft_params, head, dcache, head_rules, limit, config,
                                                draft_config, k, r)  # fmt: skip
    return put_rows(state, head, rows), None if dcache is None else (dcache.k, dcache.v), steps, kept
