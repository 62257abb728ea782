"""The matmul kernels' calls behind rowdot and chain: over dense weights (with their gradients), an Entry of a
stacked array or a Paged operand read where they lie, with per-row ends; XLA's matmul where the kernels do not run."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.kernels.registry import TARGET, registered

F32 = jnp.float32
NONE, OUTPUTS, INPUTS = 0, 1, 2  # what a row's end bounds (rowdot::Ends in rowdot.h)


class Entry(NamedTuple):
    """Entry `index` of a stacked array, e.g. one layer of the KV cache, as a kernel's w: the kernel reads
    it where it lies, where slicing it out first (any XLA op on it) would copy it."""

    stacked: jax.Array  # [L, ...]
    index: jax.Array  # [] int32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype

    def get(self) -> jax.Array:
        """The entry as an array of its own (a copy)."""
        return jax.lax.dynamic_index_in_dim(self.stacked, self.index, keepdims=False)


class Paged(NamedTuple):
    """One layer of a paged KV cache (gpt2_jax.model.paged_cache) as chain's w: a pool of blocks of C slots and a
    block table per row. As an array it is each row's blocks in table order, keys [B, H, K, M x C] (transposed)
    or values [B, H, M x C, K]; chain reads the blocks where they lie in the pool, `get()` gathers them (a copy)."""

    pool: jax.Array  # [L, N, H, K, C] keys or [L, N, H, C, K] values
    layer: jax.Array  # [] int32
    table: jax.Array  # [B, M] int32: row b's blocks, in slot order
    keys: bool  # the keys' transposed layout (slots last) or the values' (slots second to last)

    @property
    def shape(self) -> tuple[int, ...]:
        _, _, H, a, b = self.pool.shape
        B, M = self.table.shape
        return (B, H, a, M * b) if self.keys else (B, H, M * a, b)

    @property
    def dtype(self):
        return self.pool.dtype

    def get(self) -> jax.Array:
        """The rows' blocks in table order as one array: [B, H, K, M x C] or [B, H, M x C, K]."""
        blocks = jnp.take(jax.lax.dynamic_index_in_dim(self.pool, self.layer, keepdims=False), self.table, axis=0,
                          mode="clip")  # fmt: skip
        B, M, H, a, b = blocks.shape  # [B, M, H, K, C] or [B, M, H, C, K]
        if self.keys:
            return jnp.einsum("BMHKC->BHKMC", blocks).reshape(B, H, a, M * b)
        return jnp.einsum("BMHCK->BHMCK", blocks).reshape(B, H, M * a, b)


def product(is_chain: bool, x, w, out_ends, in_ends) -> jax.Array:
    if out_ends is not None and in_ends is not None:
        raise ValueError("take out_ends or in_ends, not both")
    ends, mode = (out_ends, OUTPUTS) if out_ends is not None else (in_ends, INPUTS if in_ends is not None else NONE)
    if ends is not None:
        ends = jnp.broadcast_to(jnp.asarray(ends, jnp.int32), x.shape[:-1])
    elif is_chain:
        ends = jnp.zeros(x.shape[:-1], jnp.int32)  # chain's targets always take ends; NONE ignores them
    if isinstance(w, Entry):
        return _entry(is_chain, x, w, ends, mode)
    if isinstance(w, Paged):
        if not is_chain or ends is None:  # chain always has ends (zeros when none are given)
            raise ValueError("a paged operand is chain's (attention's keys and values)")
        return _paged(x, w, ends, mode)
    if ends is None:
        return _dense(x, w)
    return _dense_ends(x, w, ends, mode, is_chain)


def einsum(x: jax.Array, w: jax.Array, is_chain: bool = False) -> jax.Array:
    w = w if is_chain else jnp.swapaxes(w, -1, -2)
    return jnp.matmul(x, w, preferred_element_type=F32)  # leading dims broadcast


def _masked(y: jax.Array, ends: jax.Array | None, mode: int) -> jax.Array:
    """The outputs the kernels skip under out_ends, as 0 (XLA's stand-in, and the gradient's mask)."""
    if ends is None or mode != OUTPUTS:
        return y
    return jnp.where(jnp.arange(y.shape[-1]) < ends[..., None], y, 0.0)


def _out_shape(x, w_shape, is_chain: bool) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((*x.shape[:-1], w_shape[-1] if is_chain else w_shape[-2]), F32)


def _entry(is_chain: bool, x: jax.Array, w: Entry, ends: jax.Array | None, mode: int) -> jax.Array:
    if is_chain:
        name = TARGET + "_chain_at"
    else:
        name = TARGET + ("_at" if ends is None else "_at_ends")

    def kernel(x, stacked, index, *ends):
        call = jax.ffi.ffi_call(name, _out_shape(x, stacked.shape, is_chain), vmap_method="sequential")
        return call(x, stacked, index, *ends, **({} if not ends else {"mode": np.int32(mode)}))

    def other(x, stacked, index, *ends):
        return _masked(einsum(x, Entry(stacked, index).get(), is_chain), ends[0] if ends else None, mode)

    index = jnp.asarray(w.index, jnp.int32)
    args = (x, w.stacked, index) + (() if ends is None else (ends,))
    if not registered():
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=other)


def _paged(x: jax.Array, w: Paged, ends: jax.Array, mode: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[-1]), F32)

    def kernel(x, pool, layer, table, ends):
        call = jax.ffi.ffi_call(TARGET + "_chain_paged", out, vmap_method="sequential")
        return call(x, pool, layer, table, ends, mode=np.int32(mode), keys=np.int32(w.keys))

    def other(x, pool, layer, table, ends):
        return _masked(einsum(x, Paged(pool, layer, table, w.keys).get(), True), ends, mode)

    args = (x, w.pool, jnp.asarray(w.layer, jnp.int32), jnp.asarray(w.table, jnp.int32), ends)
    if not registered():
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=other)


def _primal(x: jax.Array, w: jax.Array) -> jax.Array:
    def kernel(x, w):
        # Under vmap, an unbatched operand gets a leading 1 and the kernel broadcasts it (no copies).
        return jax.ffi.ffi_call(TARGET, _out_shape(x, w.shape, False), vmap_method="expand_dims")(x, w)

    if not registered():
        return einsum(x, w)
    # The kernel on CPU, XLA's matmul elsewhere; only the branch for the compiling platform is lowered.
    return jax.lax.platform_dependent(x, w, cpu=kernel, default=einsum)


def _primal_ends(x: jax.Array, w: jax.Array, ends: jax.Array, mode: int, is_chain: bool) -> jax.Array:
    def kernel(x, w, ends):
        name = TARGET + ("_chain" if is_chain else "_ends")
        call = jax.ffi.ffi_call(name, _out_shape(x, w.shape, is_chain), vmap_method="broadcast_all")
        return call(x, w, ends, mode=np.int32(mode))

    def other(x, w, ends):
        return _masked(einsum(x, w, is_chain), ends, mode)

    if not registered():
        return other(x, w, ends)
    return jax.lax.platform_dependent(x, w, ends, cpu=kernel, default=other)


def _grads(x, w, g, is_chain: bool):
    """d/dx and d/dw of y = x @ w.T (rowdot) or x @ w (chain), given dy = g; a shared 2-D w sums over the batch."""
    lead = "" if w.ndim == 2 else "..."
    dx = jnp.einsum("...MN,...KN->...MK" if is_chain else "...MN,...NK->...MK", g, w, preferred_element_type=F32)
    dw = jnp.einsum(f"...MK,...MN->{lead}KN" if is_chain else f"...MN,...MK->{lead}NK", *((x, g) if is_chain else (g, x)),
                    preferred_element_type=F32)  # fmt: skip
    return dx.astype(x.dtype), dw.astype(w.dtype)


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return _primal(x, w)


_dense.defvjp(lambda x, w: (_primal(x, w), (x, w)), lambda res, g: _grads(res[0], res[1], g, False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense_ends(x: jax.Array, w: jax.Array, ends: jax.Array, mode: int, is_chain: bool) -> jax.Array:
    return _primal_ends(x, w, ends, mode, is_chain)


def _fwd_ends(x, w, ends, mode, is_chain):
    return _primal_ends(x, w, ends, mode, is_chain), (x, w, ends)


def _bwd_ends(mode, is_chain, res, g):
    x, w, ends = res
    return (*_grads(x, w, _masked(g, ends, mode), is_chain), None)  # skipped outputs are constant zeros


_dense_ends.defvjp(_fwd_ends, _bwd_ends)
