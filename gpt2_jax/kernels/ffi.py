"""The kernels behind XLA's FFI: registration, the jax-side calls and their gradients (see gpt2_jax.kernels)."""

from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
TARGET = "gpt2_jax_rowdot"

try:
    from gpt2_jax.kernels import _cpu
except ImportError:  # built without a compiler: XLA's matmul everywhere
    _cpu = None

# GPT2_JAX_KERNELS=off runs XLA's own kernels even where these are built (to compare the two).
_DISABLED = os.environ.get("GPT2_JAX_KERNELS", "").strip().lower() in ("off", "0", "false", "no")
_REGISTERED = False
if _cpu is not None and _cpu.usable() and not _DISABLED:
    for _suffix, _handler in (("", _cpu.handler), ("_int8", _cpu.handler_int8), ("_w8a8", _cpu.handler_w8a8),
                              ("_at", _cpu.handler_at), ("_ends", _cpu.handler_ends),
                              ("_at_ends", _cpu.handler_at_ends), ("_chain", _cpu.handler_chain),
                              ("_chain_at", _cpu.handler_chain_at), ("_chain_paged", _cpu.handler_chain_paged),
                              ("_cumsum", _cpu.handler_cumsum), ("_argmax", _cpu.handler_argmax),
                              ("_softmax", _cpu.handler_softmax), ("_packed", _cpu.handler_packed),
                              ("_packed_rows", _cpu.handler_packed_rows)):  # fmt: skip
        jax.ffi.register_ffi_target(TARGET + _suffix, _handler(), platform="cpu")
    _REGISTERED = True

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


def available() -> str | None:
    """The instruction set the float32 kernels run with on this CPU ("avx512" or "avx2"), or None where XLA's
    matmul stands in (extension not built, or a CPU without AVX2 and FMA). Some row counts take another path
    (one row on AMD takes AVX2's tiles): report() says which path each op takes."""
    lib = dispatch_module()
    return None if lib is None else lib.isa()


def dispatch_module():
    """The compiled module whose `paths` and `features` say what dispatch.h picks (gpt2_jax.kernels.report),
    or None where the kernels do not run."""
    return _cpu if _REGISTERED else None


def fits(*operands) -> bool:
    """Whether a product of these operands runs in the kernels: all float32, the extension built for this
    CPU, and no mesh (XLA cannot split a custom call; a sharded product is XLA's)."""
    if available() is None:
        _warn_without_kernels()
        return False
    return jax.sharding.get_abstract_mesh().empty and all(a.dtype == F32 for a in operands)


_WARNED = False


def why_unavailable() -> str | None:
    """Why the kernels do not run here (None when they do)."""
    if _REGISTERED:
        return None
    if _DISABLED:
        return "GPT2_JAX_KERNELS=off"
    if _cpu is None:
        return "the extension gpt2_jax.kernels._cpu was not built (no C++ compiler at install time)"
    if not _cpu.usable():
        return "this CPU lacks AVX2 and FMA"
    return "they were switched off"


def _warn_without_kernels() -> None:
    """Warn once per process when a CPU computation runs without the kernels: every speed figure of the
    docs assumes them (the bits stay batch-invariant: XLA's matmul runs in its row-count independent form)."""
    global _WARNED
    if _WARNED or _DISABLED or jax.default_backend() != "cpu":
        return
    _WARNED = True
    warnings.warn(
        f"gpt2_jax is running on the CPU without its kernels ({why_unavailable()}): matmuls and attention run on "
        "XLA's own kernels, several times slower for decoding. To build them, install g++ and reinstall: "
        "pip install --no-build-isolation --force-reinstall --no-deps gpt2-jax (or pip install -e . from a clone); "
        "gpt2_jax.kernels.available() then says 'avx512' or 'avx2'.",
        RuntimeWarning,
        stacklevel=3,
    )


def rowdot(
    x: jax.Array, w: jax.Array | Entry, *, out_ends: jax.Array | None = None, in_ends: jax.Array | None = None
) -> jax.Array:
    """x [..., M, I] float32 @ w [..., N, I].T float32 -> [..., M, N] float32, each output rounded the same
    way for any M. w is 2-D (shared by every leading index of x) or has x's leading dims; an Entry is
    read in place (not differentiable: it serves the KV cache).

    Work a row does not need can be skipped without changing any output it does need, through one int32
    per row, [..., M] (x's dims but the last):
      out_ends: outputs y[m, n] with n >= out_ends[m] are not needed; they come back as 0.
      in_ends:  a promise that x[m, i] == 0 for i >= in_ends[m]; those products are skipped (each would
                add an exact zero to its dot product, so the bits do not change).
    """
    return _product(False, x, w, out_ends, in_ends)


def rowdot_int8(x: jax.Array, q: jax.Array, scale: jax.Array, qsum: jax.Array | None = None) -> jax.Array:
    """x [..., M, I] float32 @ (q [N, I] int8 * scale [N, 1]).T -> [..., M, N] float32, each output a function
    of its own row and weight row alone (int8.h): the row rounded to int16 with one scale per row, the dot
    product summed exactly in integers, then one rounding to float32 of total * row scale * scale[n]. So
    no batch, tiling, thread split or instruction set changes a bit, and a decode step reads one byte
    per weight. Inference only (no gradient).

    With qsum [N] int32 (q's row sums: gpt2_jax.model.precision's w8a8) the row is rounded to bytes
    instead, 255 steps over its range with a zero point (int8.h's QuantizeRow8), which VNNI multiplies at
    twice the rate (a8.h, vnni_rows.h); the rest is the same, so the bits are again the row's own.

    Where the kernel does not run: XLA's matmul of x (so rounded, for w8a8) and q as float32, then the
    scales: close to the kernel's values, not its bits."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], q.shape[-2]), F32)
    operands = (x, q, scale) if qsum is None else (x, q, scale, qsum)

    def kernel(*operands):
        return jax.ffi.ffi_call(TARGET + ("_int8" if qsum is None else "_w8a8"), out, vmap_method="expand_dims")(
            *operands
        )

    def other(x, q, scale, *qsum):
        return _einsum(round_rows_8bit(x) if qsum else x, q.astype(F32)) * scale

    if not _REGISTERED:
        return other(*operands)
    return jax.lax.platform_dependent(*operands, cpu=kernel, default=other)


def round_rows_8bit(x: jax.Array) -> jax.Array:
    """x [..., I] float32 -> each row rounded to bytes as rowdot_int8 with qsum rounds it (values, not bits):
    over the row's range with 0 in it, s = (max - min) / 255 and zero point z = round(-min / s), x ~= s * (u - z)
    with u = clip(round(x / s) + z, 0, 255)."""
    lo = jnp.minimum(jnp.min(x, axis=-1, keepdims=True), 0.0)
    s = (jnp.maximum(jnp.max(x, axis=-1, keepdims=True), 0.0) - lo) / 255.0
    s = jnp.where(s > 0, s, 1.0)
    z = jnp.round(-lo / s)
    return (jnp.clip(jnp.round(x / s) + z, 0, 255) - z) * s


def int8_isa() -> str | None:
    """The instruction set rowdot_int8 runs with here ("amx-int8", "avx512-vnni", "avx512" or "avx2"), or None where
    XLA's matmul stands in."""
    lib = dispatch_module()
    return None if lib is None else lib.isa_int8()


def chain(
    x: jax.Array, w: jax.Array | Entry, *, out_ends: jax.Array | None = None, in_ends: jax.Array | None = None
) -> jax.Array:
    """x [..., M, I] float32 @ w [..., I, N] float32 -> [..., M, N] float32, each output one fused
    multiply-add chain over i in order (acc = fma(x[m, i], w[i, n], acc)), so rounded the same way for
    any M. Otherwise as rowdot (w's layout aside)."""
    return _product(True, x, w, out_ends, in_ends)


def _product(is_chain: bool, x, w, out_ends, in_ends) -> jax.Array:
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


def _on_cpu(kernel, other, x: jax.Array) -> jax.Array:
    """kernel(x) where the compiling platform is the CPU and the kernels are registered, else other(x)."""
    return jax.lax.platform_dependent(x, cpu=kernel, default=other) if _REGISTERED else other(x)


def cumsum(x: jax.Array, other) -> jax.Array:
    """x [..., N] float32 -> [..., N]: each prefix sum accumulated in float64 and rounded to float32 (as
    torch's CPU cumsum does), one sequential pass per row; `other(x)` where the kernel does not run (not
    built, or not the compiling platform; inside a mesh, where XLA cannot split it, see `fits`)."""

    def kernel(x):
        return jax.ffi.ffi_call(TARGET + "_cumsum", jax.ShapeDtypeStruct(x.shape, F32), vmap_method="broadcast_all")(x)

    return _on_cpu(kernel, other, x)


def softmax(scores: jax.Array, other) -> jax.Array:
    """Attention's blocked scores [..., N, C] float32 (masked slots a large negative number) -> weights, each
    row's N x C softmax with its sum added block by block (softmax.h): a row's bits depend on its scores
    alone. `other(scores)` where the kernel does not run; the gradient is the softmax's."""
    return _on_cpu(_softmax, other, scores)


@jax.custom_vjp
def _softmax(scores: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(scores.shape, F32)
    return jax.ffi.ffi_call(TARGET + "_softmax", out, vmap_method="broadcast_all")(scores)


def _softmax_fwd(scores):
    w = _softmax(scores)
    return w, w


def _softmax_bwd(w, g):
    return (w * (g - jnp.sum(g * w, axis=(-2, -1), keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def argmax(x: jax.Array, other) -> jax.Array:
    """x [..., N] float32 -> [...] int32: jnp.argmax's answer (the first maximum, the first NaN if any) in one
    kernel pass per row; `other(x)` where the kernel does not run (as for cumsum). Comparisons only, so
    both give the same answer."""

    def kernel(x):
        out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
        return jax.ffi.ffi_call(TARGET + "_argmax", out, vmap_method="broadcast_all")(x)

    return _on_cpu(kernel, other, x)


def _einsum(x: jax.Array, w: jax.Array, is_chain: bool = False) -> jax.Array:
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
        return _masked(_einsum(x, Entry(stacked, index).get(), is_chain), ends[0] if ends else None, mode)

    index = jnp.asarray(w.index, jnp.int32)
    args = (x, w.stacked, index) + (() if ends is None else (ends,))
    if not _REGISTERED:
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=other)


def _paged(x: jax.Array, w: Paged, ends: jax.Array, mode: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[-1]), F32)

    def kernel(x, pool, layer, table, ends):
        call = jax.ffi.ffi_call(TARGET + "_chain_paged", out, vmap_method="sequential")
        return call(x, pool, layer, table, ends, mode=np.int32(mode), keys=np.int32(w.keys))

    def other(x, pool, layer, table, ends):
        return _masked(_einsum(x, Paged(pool, layer, table, w.keys).get(), True), ends, mode)

    args = (x, w.pool, jnp.asarray(w.layer, jnp.int32), jnp.asarray(w.table, jnp.int32), ends)
    if not _REGISTERED:
        return other(*args)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=other)


def _primal(x: jax.Array, w: jax.Array) -> jax.Array:
    def kernel(x, w):
        # Under vmap, an unbatched operand gets a leading 1 and the kernel broadcasts it (no copies).
        return jax.ffi.ffi_call(TARGET, _out_shape(x, w.shape, False), vmap_method="expand_dims")(x, w)

    if not _REGISTERED:
        return _einsum(x, w)
    # The kernel on CPU, XLA's matmul elsewhere; only the branch for the compiling platform is lowered.
    return jax.lax.platform_dependent(x, w, cpu=kernel, default=_einsum)


def _primal_ends(x: jax.Array, w: jax.Array, ends: jax.Array, mode: int, is_chain: bool) -> jax.Array:
    def kernel(x, w, ends):
        name = TARGET + ("_chain" if is_chain else "_ends")
        call = jax.ffi.ffi_call(name, _out_shape(x, w.shape, is_chain), vmap_method="broadcast_all")
        return call(x, w, ends, mode=np.int32(mode))

    def other(x, w, ends):
        return _masked(_einsum(x, w, is_chain), ends, mode)

    if not _REGISTERED:
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
