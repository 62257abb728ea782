"""The kernels' jax-side calls (see gpt2_jax.kernels): whether they run here, rowdot, rowdot_int8 and chain (their
operands and gradients in gpt2_jax.kernels.products), and the row-wise cumsum, softmax and argmax."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from gpt2_jax.kernels.products import Entry, einsum, product
from gpt2_jax.kernels.registry import DISABLED, TARGET, extension, registered

F32 = jnp.float32


def available() -> str | None:
    """The instruction set the float32 kernels run with on this CPU ("avx512" or "avx2"), or None where XLA's
    matmul stands in (extension not built, or a CPU without AVX2 and FMA). Some row counts take another path
    (one row on AMD takes AVX2's tiles): report() says which path each op takes."""
    lib = dispatch_module()
    return None if lib is None else lib.isa()


def dispatch_module():
    """The compiled module whose `paths` and `features` say what dispatch.h picks (gpt2_jax.kernels.report),
    or None where the kernels do not run."""
    return extension() if registered() else None


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
    lib = extension()
    if registered():
        return None
    if DISABLED:
        return "GPT2_JAX_KERNELS=off"
    if lib is None:
        return "the extension gpt2_jax.kernels._cpu was not built (no C++ compiler at install time)"
    if not lib.usable():
        return "this CPU lacks AVX2 and FMA"
    return "they were switched off"


def _warn_without_kernels() -> None:
    """Warn once per process when a CPU computation runs without the kernels: every speed figure of the
    docs assumes them (the bits stay batch-invariant: XLA's matmul runs in its row-count independent form)."""
    global _WARNED
    if _WARNED or DISABLED or jax.default_backend() != "cpu":
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
    return product(False, x, w, out_ends, in_ends)


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
        return einsum(round_rows_8bit(x) if qsum else x, q.astype(F32)) * scale

    if not registered():
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
    return product(True, x, w, out_ends, in_ends)


def _on_cpu(kernel, other, x: jax.Array) -> jax.Array:
    """kernel(x) where the compiling platform is the CPU and the kernels are registered, else other(x)."""
    return jax.lax.platform_dependent(x, cpu=kernel, default=other) if registered() else other(x)


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
