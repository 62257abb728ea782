"""Facts about XLA's CPU arithmetic that keep a row's result the same bits in any batch.

XLA's CPU row reductions (sum, max) take one code path below about MIN_REDUCE elements and another
above, and the two round differently; so does its matmul for one row against two or more (see
layers.matmul). Row-wise reductions therefore run on at least enough rows to take the large-input
path, padded with copies of the first row whose results are dropped.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

MIN_REDUCE = 16384  # elements
Rows = TypeVar("Rows", jax.Array, np.ndarray)  # pad_rows keeps a host array on the host


def min_rows(rows: int, row_size: int) -> int:
    """How many rows [rows, row_size] needs so its row-wise reductions round alike for any batch: enough
    for the large-input path, then whole groups of 8 rows and a last group of 1, 2 or 4. XLA reduces rows 8 at
    a time, and a last group of 3, 5, 6 or 7 rows rounds differently: a fused log_softmax over [R, 50257]
    of a model's logits rounds rows 8q .. 8q + 7 differently for R mod 8 in {3, 5, 6, 7} (on real logits for
    R = 1 .. 32; random normal rows rarely show it, which is how R = 11 or 15 can go unseen)."""
    r = max(rows, -(-MIN_REDUCE // max(row_size, 1)))
    whole, tail = divmod(r, 8)
    return 8 * whole + (0 if tail == 0 else 1 << (tail - 1).bit_length())


def pad_rows(x: Rows, rows: int) -> Rows:
    """x [B, ...] with copies of row 0 appended up to `rows` rows (a host array stays on the host)."""
    extra = rows - x.shape[0]
    if extra <= 0:
        return x
    if isinstance(x, np.ndarray):
        return np.concatenate([x, np.broadcast_to(x[:1], (extra, *x.shape[1:]))])
    return jnp.concatenate([x, jnp.broadcast_to(x[:1], (extra, *x.shape[1:]))])
