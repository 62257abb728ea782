"""Facts about XLA's CPU arithmetic that keep a row's result the same bits in any batch.

XLA's CPU row reductions (sum, max) take one code path below about MIN_REDUCE elements and another
above, and the two round differently; so does its matmul for one row against two or more (see
layers.matmul). Row-wise reductions therefore run on at least enough rows to take the large-input
path, padded with copies of the first row whose results are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_REDUCE = 16384  # elements


def min_rows(rows: int, row_size: int) -> int:
    """How many rows [rows, row_size] needs so its row-wise reductions round alike for any batch: enough
    for the large-input path, and below 8 a power of two. (A fused log_softmax over [R, 50257] rounded
    row 0 differently for R = 3, 5, 6, 7 than for R = 1, 2, 4 and every R >= 8, measured up to 69.)"""
    r = max(rows, -(-MIN_REDUCE // max(row_size, 1)))
    return r if r >= 8 else 1 << (r - 1).bit_length()


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """x [B, ...] with copies of row 0 appended up to `rows` rows (a host array stays on the host)."""
    extra = rows - x.shape[0]
    xp = np if isinstance(x, np.ndarray) else jnp
    return x if extra <= 0 else xp.concatenate([x, xp.broadcast_to(x[:1], (extra, *x.shape[1:]))])
