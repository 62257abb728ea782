"""The KV cache: allocated once at a fixed capacity S, written in place with dynamic_update_slice.

Ragged batches are left-padded: row b's prompt ends at the same slot as every other row's, so
each decode step writes one slot for the whole batch (a single dynamic_update_slice, no scatter).
Row b holds its tokens in slots [start[b], end); slots before start[b] are padding that
attention masks out. The token in slot s of row b sits at position s - start[b].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, H, K] keys of every layer
    v: jax.Array  # [L, B, S, H, K] values of every layer
    start: jax.Array  # [B] int32: first slot of each row (left padding before it)
    end: jax.Array  # [] int32: the next slot to write, the same for every row

    @property
    def capacity(self) -> int:
        """S, the number of slots."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """2 x L x B x S x D x itemsize."""
        return 2 * self.k.size * self.k.dtype.itemsize

    @property
    def lengths(self) -> jax.Array:
        """[B] int32: tokens held per row."""
        return jnp.maximum(self.end - self.start, 0)


def cache_bytes(config: GPT2Config, batch: int, capacity: int, dtype=jnp.float32) -> int:
    """Size of a cache without allocating it: 2 x L x B x S x D x itemsize."""
    return 2 * config.n_layer * batch * capacity * config.n_embd * jnp.dtype(dtype).itemsize


def init_cache(config: GPT2Config, start: jax.Array, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for len(start) rows and `capacity` slots."""
    shape = (config.n_layer, start.shape[0], capacity, config.n_head, config.head_dim)
    zeros = jnp.zeros(shape, dtype)
    return KVCache(zeros, zeros, start.astype(jnp.int32), jnp.zeros((), jnp.int32))


def write(cache_kv: jax.Array, new: jax.Array, slot: jax.Array) -> jax.Array:
    """cache [L, B, S, H, K] <- new [L, B, T, H, K] at slots [slot, slot + T), in place."""
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(cache_kv, new.astype(cache_kv.dtype), (zero, zero, slot, zero, zero))


def key_mask(cache: KVCache, T: int) -> jax.Array:
    """[B, T, S] bool: what T new queries may see in the cache: row b's slots [start[b], end)."""
    s = jnp.arange(cache.capacity)
    valid = (s[None, :] >= cache.start[:, None]) & (s[None, :] < cache.end)  # [B, S]
    return jnp.broadcast_to(valid[:, None, :], (valid.shape[0], T, valid.shape[1]))
