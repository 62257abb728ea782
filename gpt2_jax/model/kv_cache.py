"""The KV cache: allocated once at a fixed capacity S, written in place, one write position per row.

Row b holds its tokens in slots [0, lengths[b]): slot s holds the token at position s, the same
position a full forward over the sequence gives it. So a row's attention reads its keys in the same
slots whether they came from a forward, a prefill or one decode step at a time, and rows at different
lengths (ragged prompts; later, requests that joined a running batch) share one cache. Slots at or
past lengths[b] hold padding or stale tokens; the mask hides them until a write replaces them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.kernels.products import Entry
from gpt2_jax.model.axes import constrain


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, H, K, S] keys of every layer, head-major and transposed (see gpt2_jax.model.attention)
    v: jax.Array  # [L, B, H, S, K] values, head-major (attention batches over B, H untransposed)
    lengths: jax.Array  # [B] int32: tokens held by row b; its next token goes to slot lengths[b]

    @property
    def capacity(self) -> int:
        """S, the number of slots."""
        return self.k.shape[-1]

    @property
    def nbytes(self) -> int:
        """2 x L x B x S x D x itemsize."""
        return self.k.nbytes + self.v.nbytes

    def view(self, T: int) -> CacheView:
        """The cache as the blocks see it while T new tokens per row go in (model.forward_cached)."""
        return CacheView(self.k, self.v, self.lengths, visible(self.lengths, T, self.capacity))

    def after(self, view: CacheView, T: int) -> KVCache:
        """The cache once the view's writes are in: every row T tokens longer."""
        return KVCache(view.k, view.v, self.lengths + T)


class CacheView(NamedTuple):
    """The cache as the blocks see it while T new tokens per row go in (built by model.forward_cached)."""

    k: jax.Array  # [L, B, H, K, S]
    v: jax.Array  # [L, B, H, S, K]
    start: jax.Array  # [B] int32: the slot of row b's first new token (its new tokens fill [start, start + T))
    mask: jax.Array  # [B, T, S] bool: new token t of row b sees slot s iff s <= start[b] + t

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> CacheView:
        """Layer `layer`'s new k, v [B, H, T, K] into their slots (in place)."""
        return self._replace(
            k=write_rows(self.k, layer, k, self.start, 4), v=write_rows(self.v, layer, v, self.start, 3)
        )

    def read(self, layer: jax.Array) -> tuple[Entry, Entry]:
        """Layer `layer`'s keys [B, H, K, S] (transposed) and values [B, H, S, K], as entries of the stacked
        cache that attention reads in place (kernels.Entry; .get() gives a copy)."""
        return Entry(self.k, layer), Entry(self.v, layer)


def write_rows(cache: jax.Array, layer: jax.Array, new: jax.Array, start: jax.Array, axis: int) -> jax.Array:
    """cache [L, B, H, ...] <- new [B, H, T, K] at layer `layer`, slots [start[b], start[b] + T) of row b,
    the slot axis being `axis` of the cache (4 for transposed keys [L, B, H, K, S], 3 for values
    [L, B, H, S, K]). One scatter on the cache as it lies, so XLA updates it in place (a vmap over rows
    would transpose the whole cache there and back). Slots past the capacity are dropped."""
    B, H, T, K = new.shape
    rows = jnp.arange(B)[:, None]  # [B, 1]
    slots = start[:, None] + jnp.arange(T)  # [B, T]
    update = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, T, H, K]: the indexed dims first, as numpy orders them
    if axis == 3:
        return cache.at[layer, rows, :, slots, :].set(update, mode="drop")
    return cache.at[layer, rows, :, :, slots].set(update, mode="drop")


def visible(start: jax.Array, T: int, capacity: int) -> jax.Array:
    """[B, T, S] bool: new token t of row b (at slot start[b] + t) sees slots 0 .. start[b] + t."""
    s = jnp.arange(capacity, dtype=jnp.int32)
    slots = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    return s[None, None, :] <= slots[:, :, None]


def cache_bytes(config: GPT2Config, batch: int, capacity: int, dtype=jnp.float32) -> int:
    """Size of a cache without allocating it: 2 x L x B x S x D x itemsize."""
    return 2 * config.n_layer * batch * capacity * config.n_embd * jnp.dtype(dtype).itemsize


def init_cache(config: GPT2Config, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `batch` rows and `capacity` slots. On a mesh (see sharding.on_mesh) rows are
    split over "data" and heads over "model"."""
    shape = (config.n_layer, batch, config.n_head, capacity, config.head_dim)
    k = constrain(jnp.zeros((*shape[:3], config.head_dim, capacity), dtype), "LBHKS")
    v = constrain(jnp.zeros(shape, dtype), "LBHSK")
    return KVCache(k, v, jnp.zeros(batch, jnp.int32))
