"""float32 weights packed losslessly in 3.5 bytes each, and the products that read them (packed.h).

A weight keeps its low 3 bytes (its mantissa and its exponent's last bit) and a 4-bit code for its top byte (its
sign and 7 exponent bits): the matrix's 15 most common top bytes get codes, any other is an escape listed beside
the rows (k << 8 | top byte, row by row). In N(0, 0.02) weights, random or trained, 15 top bytes cover all but
~1e-3 of the values. Unpacked, every float is the one packed, bit for bit; rowdot_packed runs rowdot's multiply-adds
on them in rowdot's order, so its outputs equal rowdot's over the unpacked weight, bit for bit, at every row count,
from 12.5% fewer bytes (a decode step at B=1 reads each weight once: it runs at the memory's speed).

    pack(w [out..., K] float32, K a multiple of 16) -> Packed (host numpy, then device arrays)
    unpack(p) -> [out..., K] float32 (jnp: the fallback off the CPU, and the tests' reference)
    rowdot_packed(x [..., K], p) -> [..., out...]  = x @ w.T
    packed_rows(p, ids [...]) -> [..., K]          = w[ids] (NaN rows for ids outside [0, N))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.errors import ConfigError
from gpt2_jax.kernels import ffi, registry

GROUP, GROUP_BYTES, ESCAPE = 16, 56, 15  # floats per group, their bytes, the escape's code (packed.h)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A float32 weight [out..., K] packed by `pack`: data [N, K / 16 x 56] uint8 (N = prod(out)), lut [16]
    int32, esc_off [N + 1] int32, esc [E + 1] int32 (a sentinel last, so never empty); `shape` is the weight's."""

    def __init__(self, data, lut, esc_off, esc, shape: tuple[int, ...]):
        self.data, self.lut, self.esc_off, self.esc, self.shape = data, lut, esc_off, esc, tuple(shape)

    def tree_flatten(self):
        return (self.data, self.lut, self.esc_off, self.esc), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        data, lut, esc_off, esc = children
        return cls(data, lut, esc_off, esc, shape)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def escapes(self) -> int:
        return int(self.esc.shape[0]) - 1

    def __repr__(self) -> str:
        return f"Packed(shape={self.shape}, {self.escapes} escapes)"


def pack(w) -> Packed:
    """w [out..., K] float32 (K a multiple of 16) -> Packed, lossless (see the module docstring)."""
    w = np.ascontiguousarray(np.asarray(w))
    if w.dtype != np.float32 or w.ndim < 2 or w.shape[-1] % GROUP != 0:
        raise ConfigError(f"pack: a float32 weight [out..., K] with K a multiple of {GROUP} is needed, "
                          f"not {w.dtype} {w.shape}")  # fmt: skip
    *out, K = w.shape
    N, G = math.prod(out), K // GROUP
    bits = w.reshape(N, K).view(np.uint32)
    top = (bits >> 24).astype(np.uint8)
    counts = np.bincount(top.ravel(), minlength=256)
    common = np.argsort(-counts, kind="stable")[:ESCAPE]
    common = common[counts[common] > 0]
    code_of = np.full(256, ESCAPE, np.uint8)
    code_of[common] = np.arange(len(common), dtype=np.uint8)
    lut = np.zeros(16, np.uint32)
    lut[: len(common)] = common.astype(np.uint32) << 24
    codes = code_of[top].reshape(N, G, GROUP)
    data = np.empty((N, G, GROUP_BYTES), np.uint8)
    data[:, :, :48] = bits.view(np.uint8).reshape(N, K, 4)[:, :, :3].reshape(N, G, 48)  # little-endian bytes 0-2
    data[:, :, 48:] = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)  # float i's code in bits 4i .. 4i+3
    rows, ks = np.nonzero(codes.reshape(N, K) == ESCAPE)  # row by row, k ascending
    esc = np.append((ks.astype(np.int32) << 8) | top[rows, ks].astype(np.int32), np.int32(0))
    esc_off = np.zeros(N + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=N), out=esc_off[1:])
    return Packed(jnp.asarray(data.reshape(N, G * GROUP_BYTES)), jnp.asarray(lut.view(np.int32)),
                  jnp.asarray(esc_off), jnp.asarray(esc), w.shape)  # fmt: skip


def unpack(p: Packed) -> jax.Array:
    """Packed -> the float32 weight [out..., K] it holds (jnp; bit for bit the packed one)."""
    N, K = p.data.shape[0], p.shape[-1]
    g = p.data.reshape(N, K // GROUP, GROUP_BYTES).astype(jnp.uint32)
    b = g[:, :, :48].reshape(N, K // GROUP, GROUP, 3)
    low = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = jnp.stack([g[:, :, 48:] & 0xF, g[:, :, 48:] >> 4], axis=-1).reshape(N, K // GROUP, GROUP)
    bits = (low | p.lut.astype(jnp.uint32)[codes]).reshape(N, K)
    E = p.esc.shape[0] - 1
    if E:
        esc = p.esc[:E]
        rows = jnp.searchsorted(p.esc_off, jnp.arange(E), side="right") - 1
        cols = esc >> 8
        fixed = (bits[rows, cols] & jnp.uint32(0x00FFFFFF)) | ((esc & 0xFF).astype(jnp.uint32) << 24)
        bits = bits.at[rows, cols].set(fixed)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(p.shape)


def rowdot_packed(x: jax.Array, p: Packed) -> jax.Array:
    """x [..., K] float32 @ w.T for the packed w [out..., K] -> [..., out...] float32: on a CPU with the kernels,
    bit for bit rowdot(x, w) (packed.h); elsewhere XLA's matmul over unpack(p)."""
    lead, out = x.shape[:-1], p.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    result = jax.ShapeDtypeStruct((x2.shape[0], p.data.shape[0]), jnp.float32)

    def kernel(x2, data, lut, esc_off, esc):
        return jax.ffi.ffi_call(registry.TARGET + "_packed", result, vmap_method="expand_dims")(
            x2, data, lut, esc_off, esc
        )

    def other(x2, data, lut, esc_off, esc):
        w = unpack(Packed(data, lut, esc_off, esc, p.shape))
        return ffi.rowdot(x2, w.reshape(-1, w.shape[-1]))

    operands = (x2, p.data, p.lut, p.esc_off, p.esc)
    y = jax.lax.platform_dependent(*operands, cpu=kernel, default=other) if ffi.available() else other(*operands)
    return y.reshape(*lead, *out)


def packed_rows(p: Packed, ids: jax.Array) -> jax.Array:
    """Rows ids [...] of the packed w [N, K] -> [..., K] float32; an id outside [0, N) gives a row of NaNs."""
    flat = ids.reshape(-1).astype(jnp.int32)
    result = jax.ShapeDtypeStruct((flat.shape[0], p.shape[-1]), jnp.float32)

    def kernel(data, lut, esc_off, esc, flat):
        return jax.ffi.ffi_call(registry.TARGET + "_packed_rows", result, vmap_method="expand_dims")(
            data, lut, esc_off, esc, flat
        )

    def other(data, lut, esc_off, esc, flat):
        w = unpack(Packed(data, lut, esc_off, esc, p.shape)).reshape(-1, p.shape[-1])
        rows = jnp.take(w, flat, axis=0, mode="fill", fill_value=jnp.nan)  # NaN past N; before 0, as the kernel:
        return jnp.where((flat >= 0)[:, None], rows, jnp.nan)  # (jnp.take counts a negative id from the end)

    operands = (p.data, p.lut, p.esc_off, p.esc, flat)
    y = jax.lax.platform_dependent(*operands, cpu=kernel, default=other) if ffi.available() else other(*operands)
    return y.reshape(*ids.shape, p.shape[-1])
