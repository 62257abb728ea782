"""Compiled kernels: `rowdot`, the float32 matmul whose every output rounds the same way for any row count.

    rowdot(x [..., M, I], w [..., N, I]) -> y [..., M, N] = x @ w.T  (float32; w as checkpoints hold it,
                                                                 [out, in]; w 2-D or with x's leading dims)

Why: XLA's CPU matmul chooses its kernel, and so its rounding, by shape: one row, a few rows and many
rows each round differently. A token's logits would then change with its batch, and a decode step
(M = B rows) would not reproduce a forward over the same sequence (M = B x T rows). rowdot (C++:
the arithmetic in rowdot.h, called from rowdot.cc through XLA's FFI on XLA's own threads) computes each
output as one dot product by the same instructions whatever M is, and streams the weights at close to
the memory's speed for a decode step's few rows.

Where it does not apply, `rowdot` is XLA's einsum: on GPU/TPU, inside a mesh (see layers.matmul) and
where the extension was not built (no C++ compiler at install time) or the CPU lacks AVX2/FMA.
`available()` says which. Its gradient is XLA's matmuls: gradients are compared to a tolerance, never
bitwise across batch shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32
TARGET = "gpt2_jax_rowdot"

try:
    from gpt2_jax.kernels import _rowdot
except ImportError:  # built without a compiler: XLA's matmul everywhere
    _rowdot = None

_REGISTERED = False
if _rowdot is not None and _rowdot.usable():
    jax.ffi.register_ffi_target(TARGET, _rowdot.handler(), platform="cpu")
    jax.ffi.register_ffi_target(TARGET + "_at", _rowdot.handler_at(), platform="cpu")
    _REGISTERED = True


class Entry(NamedTuple):
    """Entry `index` of a stacked array, e.g. one layer of the KV cache, as rowdot's w: the kernel reads
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


def available() -> str | None:
    """The instruction set rowdot runs with on this CPU ("avx512" or "avx2"), or None where XLA's
    matmul stands in (extension not built, or a CPU without AVX2 and FMA)."""
    return _rowdot.isa() if _REGISTERED else None


def _einsum(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, jnp.swapaxes(w, -1, -2), preferred_element_type=F32)  # leading dims broadcast


def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[-2]), F32)
    # Under vmap, an unbatched operand gets a leading 1 and the kernel broadcasts it (no copies).
    return jax.ffi.ffi_call(TARGET, out, vmap_method="expand_dims")(x, w)


def _primal(x: jax.Array, w: jax.Array) -> jax.Array:
    if not _REGISTERED:
        return _einsum(x, w)
    # The kernel on CPU, XLA's matmul elsewhere; only the branch for the compiling platform is lowered.
    return jax.lax.platform_dependent(x, w, cpu=_kernel, default=_einsum)


def rowdot(x: jax.Array, w: jax.Array | Entry) -> jax.Array:
    """x [..., M, I] float32 @ w [..., N, I].T float32 -> [..., M, N] float32, each output rounded the same
    way for any M. w is 2-D (shared by every leading index of x) or has x's leading dims; an Entry is
    read in place (not differentiable: it serves the KV cache)."""
    if isinstance(w, Entry):
        return _entry(x, w)
    return _dense(x, w)


def _entry(x: jax.Array, w: Entry) -> jax.Array:
    def kernel(x, stacked, index):
        out = jax.ShapeDtypeStruct((*x.shape[:-1], stacked.shape[-2]), F32)
        return jax.ffi.ffi_call(TARGET + "_at", out, vmap_method="sequential")(x, stacked, index)

    def other(x, stacked, index):
        return _einsum(x, Entry(stacked, index).get())

    index = jnp.asarray(w.index, jnp.int32)
    if not _REGISTERED:
        return other(x, w.stacked, index)
    return jax.lax.platform_dependent(x, w.stacked, index, cpu=kernel, default=other)


@jax.custom_vjp
def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return _primal(x, w)


def _fwd(x, w):
    return _primal(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    dw = "...MN,...MI->NI" if w.ndim == 2 else "...MN,...MI->...NI"  # a shared w sums over the batch
    return (jnp.einsum("...MN,...NI->...MI", g, w, preferred_element_type=F32).astype(x.dtype),
            jnp.einsum(dw, g, x, preferred_element_type=F32).astype(w.dtype))


_dense.defvjp(_fwd, _bwd)
