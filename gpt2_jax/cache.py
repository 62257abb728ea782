"""The KV cache: allocated once at a fixed capacity S, written in place with dynamic_update_slice.

Ragged batches are left-padded: row b's prompt ends at the same slot as every other row's, so
each decode step writes one slot for the whole batch (a single dynamic_update_slice, no scatter).
Row b holds its tokens in slots [start[b], end); slots before start[b] are padding that
attention masks out. The token in slot s of row b sits at position s - start[b].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.sharding import constrain


class KVCache(NamedTuple):
    # Keys and values of every layer: one [L, B, H, S, K] array (stacked params), or a tuple of
    # L arrays [B, H, S, K] (unstacked params; faster decode on CPU, see model.forward_cached).
    # Head-major, so attention's matmuls batch over (B, H) without transposing the cache.
    k: Any
    v: Any
    start: jax.Array  # [B] int32: first slot of each row (left padding before it)
    end: jax.Array  # [] int32: the next slot to write, the same for every row

    @property
    def capacity(self) -> int:
        """S, the number of slots."""
        return jax.tree.leaves(self.k)[0].shape[-2]

    @property
    def nbytes(self) -> int:
        """2 x L x B x S x D x itemsize."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((self.k, self.v)))

    @property
    def lengths(self) -> jax.Array:
        """[B] int32: tokens held per row."""
        return jnp.maximum(self.end - self.start, 0)


def cache_bytes(config: GPT2Config, batch: int, capacity: int, dtype=jnp.float32) -> int:
    """Size of a cache without allocating it: 2 x L x B x S x D x itemsize."""
    return 2 * config.n_layer * batch * capacity * config.n_embd * jnp.dtype(dtype).itemsize


def init_cache(config: GPT2Config, start: jax.Array, capacity: int, dtype=jnp.float32,
               per_layer: bool = False) -> KVCache:
    """An empty cache for len(start) rows and `capacity` slots, stacked or one array per layer.
    On a mesh (see sharding.on_mesh) rows are split over "data" and heads over "model"."""
    shape = (start.shape[0], config.n_head, capacity, config.head_dim)
    if per_layer:
        k = tuple(constrain(jnp.zeros(shape, dtype), "BHSK") for _ in range(config.n_layer))
        v = tuple(constrain(jnp.zeros(shape, dtype), "BHSK") for _ in range(config.n_layer))
    else:
        k = v = constrain(jnp.zeros((config.n_layer, *shape), dtype), "LBHSK")
    return KVCache(k, v, start.astype(jnp.int32), jnp.zeros((), jnp.int32))


def write(cache_kv: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """cache [(L,) B, H, S, K] <- new [(L,) B, H, T, K] at slots [slot, slot + T), in place."""
    start = [jnp.zeros((), jnp.int32)] * cache_kv.ndim
    start[-2] = slot
    return jax.lax.dynamic_update_slice(cache_kv, new.astype(cache_kv.dtype), start)


def key_mask(cache: KVCache, T: int) -> jax.Array:
    """[B, T, S] bool: what T new queries may see in the cache: row b's slots [start[b], end)."""
    s = jnp.arange(cache.capacity)
    valid = (s[None, :] >= cache.start[:, None]) & (s[None, :] < cache.end)  # [B, S]
    return jnp.broadcast_to(valid[:, None, :], (valid.shape[0], T, valid.shape[1]))
