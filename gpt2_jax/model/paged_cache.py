"""The paged KV cache: a pool of fixed-size blocks shared by every row, and a block table per row.

Row b's slot s lives in block table[b, s // C], at offset s % C (C = KEY_BLOCK slots, the block attention
already sums its softmax by). A row holds only the blocks its tokens need, rows can share the blocks of a
common prefix, and the number of rows is bounded by blocks, not by rows x the longest sequence. The blocks
a row sees, in table order, are exactly the slots a contiguous cache would hold, so attention computes the
same bits through either (see gpt2_jax.model.attention): the paged cache is a storage layout, not another
arithmetic.

Block 0 is the null block: every table entry a row has not been given points to it. It is never handed
out; writes past a row's blocks (a halted row's filler, a chunk's padding) land there and are never read
unmasked, and it stays finite.

Shape legend: L layers, N blocks in the pool, H heads, K head dim, C slots per block, B rows, M blocks per row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.kernels.products import Paged
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.model.axes import constrain
from gpt2_jax.model.kv_cache import visible

NULL_BLOCK = 0


class PagedKVCache(NamedTuple):
    k: jax.Array  # [L, N, H, K, C] key blocks, transposed as the contiguous cache's keys are
    v: jax.Array  # [L, N, H, C, K] value blocks
    table: jax.Array  # [B, M] int32: row b's blocks, in slot order (NULL_BLOCK where it has none)
    lengths: jax.Array  # [B] int32: tokens held by row b; its next token goes to slot lengths[b]

    @property
    def capacity(self) -> int:
        """S = M x C, the slots a row's table can address."""
        return self.table.shape[1] * self.k.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def view(self, T: int) -> PagedView:
        """The cache as the blocks see it while T new tokens per row go in."""
        return PagedView(self.k, self.v, self.table, self.lengths, visible(self.lengths, T, self.capacity))

    def after(self, view: PagedView, T: int) -> PagedKVCache:
        return self._replace(k=view.k, v=view.v, lengths=self.lengths + T)


class PagedView(NamedTuple):
    k: jax.Array
    v: jax.Array
    table: jax.Array  # [B, M]
    start: jax.Array  # [B]: row b's new tokens fill slots [start, start + T)
    mask: jax.Array  # [B, T, S]

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> PagedView:
        """Layer `layer`'s new k, v [B, H, T, K] into their rows' blocks (in place); slots past a row's table
        land in the null block."""
        B, H, T, K = k.shape
        C = self.k.shape[-1]
        slots = self.start[:, None] + jnp.arange(T)  # [B, T]
        column = jnp.minimum(slots // C, self.table.shape[1] - 1)
        block = jnp.where(slots // C < self.table.shape[1], jnp.take_along_axis(self.table, column, axis=1), NULL_BLOCK)
        offset = slots % C
        new_k = jnp.einsum("BHTK->BTHK", k).astype(self.k.dtype)  # the indexed dims first, as numpy orders them
        new_v = jnp.einsum("BHTK->BTHK", v).astype(self.v.dtype)
        return self._replace(k=self.k.at[layer, block, :, :, offset].set(new_k),
                             v=self.v.at[layer, block, :, offset, :].set(new_v))  # fmt: skip

    def read(self, layer: jax.Array) -> tuple[Paged, Paged]:
        """Layer `layer`'s keys and values as attention reads them: through the block table, in place (kernels.Paged)."""
        return Paged(self.k, layer, self.table, True), Paged(self.v, layer, self.table, False)


def init_pool(config: GPT2Config, num_blocks: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """An empty pool of num_blocks blocks (block 0 the null block): keys [L, N, H, K, C], values [L, N, H, C, K]."""
    L, H, K, C = config.n_layer, config.n_head, config.head_dim, KEY_BLOCK
    k = constrain(jnp.zeros((L, num_blocks, H, K, C), dtype), "LNHKC")
    v = constrain(jnp.zeros((L, num_blocks, H, C, K), dtype), "LNHCK")
    return k, v


def pool_bytes(config: GPT2Config, num_blocks: int, dtype=jnp.float32) -> int:
    """Bytes of a pool of num_blocks blocks: 2 x L x N x C x D x itemsize."""
    return 2 * config.n_layer * num_blocks * KEY_BLOCK * config.n_embd * jnp.dtype(dtype).itemsize
