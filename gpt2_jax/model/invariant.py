"""The machinery the textbook functions (gpt2_jax.model.layers, gpt2_jax.model.attention) pass through, so that
a row's bits are its own whatever else is computed with it: the batch, a prefill or a decode step, a forward
over T tokens or a cache of S slots.

  over_rows      reductions see at least MIN_REDUCE elements (rows padded along T, dropped after)
  matmul         the kernels' rowdot where they fit, else XLA's matmul in its row-count independent form
  weight_matmul  x @ W.T for a params' weight in its precision (float, packed or int8), read in place
  token_rows, tied_logits   the tied embedding's two ends in its precision
  Blocked        attention's arithmetic (gpt2_jax.model.attention, its own module for its size): keys in
                 blocks of KEY_BLOCK slots, each block's softmax mass summed alone, the kernels' chain and
                 softmax where they fit, XLA's with padded queries elsewhere
  Plain          training's attention arithmetic, XLA's textbook ops (a training row is never compared
                 across batch shapes or against a cache)
  at, within     hook taps (gpt2_jax.interp): the identity without one, so no hook changes a traced op

Shape legend (gpt2_jax.config): B batch, T positions, D width, H heads, K head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt2_jax.kernels.ffi import fits, round_rows_8bit, rowdot, rowdot_int8
from gpt2_jax.kernels.invariance import MIN_REDUCE, pad_rows
from gpt2_jax.kernels.packed import Packed, packed_rows, rowdot_packed
from gpt2_jax.model.attention import Blocked, Plain  # noqa: F401 (attention's half of this wrapper)
from gpt2_jax.model.layer_loop import apply_weight, take
from gpt2_jax.model.precision_type import Precision

F32 = jnp.float32
XLA_MIN_ROWS = 4  # XLA's matmul keeps a row's bits for any row count from here on (see matmul)


def at(tap, name: str, x: jax.Array) -> jax.Array:
    """x through the tap's hook point `name` (recorded or edited there); x itself without a tap."""
    return x if tap is None else tap(name, x)


def within(tap, prefix: str):
    """The tap as seen by a sub-module whose hook names start with `prefix.` ("ln1", "attn", "mlp")."""
    return None if tap is None else tap.within(prefix)


def heads_view(tap, name: str, x: jax.Array) -> jax.Array:
    """Head-major x [B, H, T, K] through hook point `name` as TransformerLens lays it out, [B, T, H, K]."""
    return x if tap is None else jnp.swapaxes(tap(name, jnp.swapaxes(x, 1, 2)), 1, 2)


def over_rows(fn, x: jax.Array) -> jax.Array:
    """fn(x', T) for x [..., T, D] padded with zero rows (finite) along T, the axis no mesh splits, so that
    a reduction over D sees at least MIN_REDUCE elements and rounds one token as among many (see
    gpt2_jax.kernels.invariance); the padded rows are dropped after. T is None for a single row [D]."""
    if x.ndim < 2:
        return fn(x, None)
    T = x.shape[-2]
    extra = max(0, -(-MIN_REDUCE // (x.size // T)) - T)  # x.size // T: elements per unit of T
    if extra == 0:
        return fn(x, T)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)])
    return fn(x, T)[..., :T, :]


def tap_normalized(tap, normalized: jax.Array, var_eps: jax.Array, T: int | None) -> jax.Array:
    """normalized [..., T', D] (T' >= T: padded rows after T) through hook_scale and hook_normalized,
    which see the T real rows. An edited scale s' rescales normalized by s / s', which is exactly 1 for
    an unchanged one, so an identity hook keeps every bit (x / s' would round differently from the
    x * rsqrt the model computes)."""
    if tap is None or T is None:
        return normalized
    scale = jnp.sqrt(var_eps[..., :T, :])
    normalized = normalized.at[..., :T, :].multiply(scale / tap("hook_scale", scale))
    return normalized.at[..., :T, :].set(tap("hook_normalized", normalized[..., :T, :]))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out..., in] -> [..., out...] float32, as one matmul of the rows [M, in] (M = the
    leading dims) against w contracted on its last axis, so that a token's result does not depend on
    how many rows share the call (a batch, a prefill, a decode step).

    float32 on a CPU: gpt2_jax.kernels.ffi.rowdot, whose every output is one dot product rounded the same
    way for any M (rowdot_packed for float32-packed weights). Otherwise (bfloat16 weights, GPU,
    or the kernel not built) XLA's matmul in the form its CPU kernel keeps row-count independent for
    M >= 2: w's output axes merged into one N (else XLA moves the contraction axis first, a
    row-count-dependent kernel), behind a barrier that keeps XLA from swapping the operands for its
    consumer's sake, and fewer than XLA_MIN_ROWS rows padded with copies of the first (one row takes a
    matrix-vector kernel, and in bfloat16 on CPUs with AMX two rows also round differently from three or
    more). On a mesh, c_attn's split heads axis (under the unsplit q|k|v axis) cannot merge without
    gathering the weight, so w is contracted as it lies; sharded results equal one device's to 1e-5, not
    bitwise, anyway."""
    if isinstance(w, Packed):
        return rowdot_packed(x.astype(F32), w)
    lead, out = x.shape[:-1], w.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if fits(x2, w):
        return rowdot(x2, w.reshape(-1, w.shape[-1])).reshape(*lead, *out)
    if not jax.sharding.get_abstract_mesh().empty:
        y = jnp.einsum("MI,...I->M...", x2, w, preferred_element_type=F32)
    else:
        x2 = pad_rows(x2, XLA_MIN_ROWS)
        y = jnp.einsum("MI,NI->MN", x2, w.reshape(-1, w.shape[-1]), preferred_element_type=F32)
    return jax.lax.optimization_barrier(y)[:M].reshape(*lead, *out)


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, qsum: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ (q [out..., in] int8 * scale [out...]).T -> [..., out...] float32 (gpt2_jax.model.precision's
    int8, or its w8a8 with qsum [out...], the weight rows' sums): on a CPU gpt2_jax.kernels.ffi.rowdot_int8,
    whose every output is one exact integer dot product, then times its scales, rounded the same way for any
    M; otherwise matmul's XLA form over q as float32 (x's rows rounded to bytes first for w8a8), then the
    scales."""
    lead, out = x.shape[:-1], q.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(F32)
    if fits(x2):
        flat = None if qsum is None else qsum.reshape(-1)
        return rowdot_int8(x2, q.reshape(-1, q.shape[-1]), scale.reshape(-1), flat).reshape(*lead, *out)
    x2 = x2 if qsum is None else round_rows_8bit(x2)
    return matmul(x2, q.astype(F32)).reshape(*lead, *out) * scale


def weight_matmul(p: dict, x: jax.Array, precision: Precision) -> jax.Array:
    """x [..., in] @ p's W[out..., in].T -> [..., out...] float32: matmul, or int8_matmul for a quantized
    W with its per-output scale (and its row sums where p holds them: w8a8's byte inputs). A per-layer W
    is read in place (gpt2_jax.model.layer_loop.apply_weight)."""
    if precision.quantized:
        scale, qsum = take(p["scale"]), take(p["qsum"]) if "qsum" in p else None
        return apply_weight(p["weight"], lambda q: int8_matmul(x, q, scale, qsum))
    return apply_weight(p["weight"], lambda w: matmul(x.astype(w.dtype), w))


def token_rows(params: dict, tokens: jax.Array, precision: Precision) -> jax.Array:
    """tokens [...] -> their wte rows [..., D] as stored in precision's form: float32-packed rows unpacked
    (packed_rows), int8 rows times their scales (plus the second byte r / 256 where the params hold
    one: int8 checkpoints written before it lack it). An id outside the vocab gives NaN, never a clamped row."""
    if precision.packed:
        return packed_rows(params["wte"], tokens)
    if not precision.quantized:
        return jnp.take(params["wte"], tokens, axis=0, mode="fill", fill_value=jnp.nan)
    tok = jnp.take(params["wte"], tokens, axis=0, mode="fill", fill_value=0).astype(F32)
    if "wte_residual" in params:  # q + r / 256 is exact in float32; then the scale
        tok = tok + jnp.take(params["wte_residual"], tokens, axis=0, mode="fill", fill_value=0).astype(F32) / 256.0
    return tok * jnp.take(params["wte_scale"], tokens, mode="fill", fill_value=jnp.nan)[..., None]


def tied_logits(params: dict, h: jax.Array, precision: Precision) -> jax.Array:
    """h [..., D] @ wte.T -> [..., V] float32 through matmul, or int8_matmul for a quantized wte (with w8a8's
    row sums where the params hold them)."""
    wte = params["wte"]
    if precision.quantized:
        return int8_matmul(h, wte, params["wte_scale"], params.get("wte_qsum"))
    return matmul(h.astype(wte.dtype), wte)
