"""GPT-2's building blocks as small pure functions (shape legend in gpt2_jax.config).

One `block` serves every path: the training loss, `forward`, prefill, decode and (later) serving
and speculation. Without a cache it attends causally over its own T tokens; with one (a
`cache.CacheView`) it first writes its new K/V into the cache, then attends over the whole cache,
so a token's attention reads the same keys in the same slots whichever path computed it. The
attention arithmetic itself (scores, the block-by-block softmax, the weighted sum) is gpt2_jax.model.attention.

The residual stream is float32. Each matmul runs in the weights' dtype (float32 or bfloat16) and
accumulates in float32; LayerNorm and softmax always compute in float32.

Hooks: every function below takes an optional `tap`, called as `tap(name, x) -> x` at each of
TransformerLens's hook points (names relative to the function: "hook_resid_pre", "ln1.hook_scale",
"attn.hook_pattern", ...) and narrowed with `tap.within(prefix)`; gpt2_jax.interp builds taps that
record or edit. Without one (None) the functions trace exactly the ops they did before hooks existed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt2_jax import kernels
from gpt2_jax.config import GPT2Config
from gpt2_jax.kernels.invariance import MIN_REDUCE, pad_rows
from gpt2_jax.model.attention import KEY_BLOCK, NEG_INF, attend, attend_causal, causal_mask  # noqa: F401 (the layer API)
from gpt2_jax.model.axes import constrain
from gpt2_jax.model.dropout import dropout
from gpt2_jax.model.layer_loop import apply_weight, take

F32 = jnp.float32
XLA_MIN_ROWS = 4  # XLA's matmul keeps a row's bits for any row count from here on (see matmul)


def at(tap, name: str, x: jax.Array) -> jax.Array:
    """x through the tap's hook point `name` (recorded or edited there); x itself without a tap."""
    return x if tap is None else tap(name, x)


def within(tap, prefix: str):
    """The tap as seen by a sub-module whose hook names start with `prefix.` ("ln1", "attn", "mlp")."""
    return None if tap is None else tap.within(prefix)


def layer_norm(p: dict, x: jax.Array, eps: float, tap=None) -> jax.Array:
    """[..., D] -> [..., D]: normalise over D (biased variance), then scale and shift. Hook points
    (TransformerLens's): hook_scale sqrt(var + eps) [..., T, 1], hook_normalized (x - mean) / scale
    [..., T, D], before the weight and bias."""
    x = x.astype(F32)
    # Enough rows that one token rounds as among many (see gpt2_jax.kernels.invariance); padded along T, the axis
    # no mesh splits, with zeros (finite), and dropped after.
    T, D = x.shape[-2:] if x.ndim >= 2 else (1, x.shape[-1])
    extra = max(0, -(-MIN_REDUCE // (x.size // T)) - T)  # x.size // T: elements per unit of T
    if x.ndim >= 2 and extra > 0:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)])
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    normalized = (x - mean) * jax.lax.rsqrt(var + eps)
    if tap is not None and x.ndim >= 2:
        normalized = tap_normalized(tap, normalized, var + eps, T)
    y = normalized * take(p["weight"]).astype(F32)
    y = y + take(p["bias"]).astype(F32) if "bias" in p else y
    return y[..., :T, :] if x.ndim >= 2 and extra > 0 else y


def tap_normalized(tap, normalized: jax.Array, var_eps: jax.Array, T: int) -> jax.Array:
    """normalized [..., T', D] (T' >= T: padded rows after T) through hook_scale and hook_normalized,
    which see the T real rows. An edited scale s' rescales normalized by s / s', which is exactly 1 for
    an unchanged one, so an identity hook keeps every bit (x / s' would round differently from the
    x * rsqrt the model computes)."""
    scale = jnp.sqrt(var_eps[..., :T, :])
    normalized = normalized.at[..., :T, :].multiply(scale / tap("hook_scale", scale))
    return normalized.at[..., :T, :].set(tap("hook_normalized", normalized[..., :T, :]))


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out..., in] -> [..., out...] float32, as one matmul of the rows [M, in] (M = the
    leading dims) against w contracted on its last axis, so that a token's result does not depend on
    how many rows share the call (a batch, a prefill, a decode step).

    float32 on a CPU: gpt2_jax.kernels.rowdot, whose every output is one dot product rounded the same
    way for any M. Otherwise (bfloat16 weights, GPU, or the kernel not built) XLA's matmul in the form
    its CPU kernel keeps row-count independent for M >= 2: w's output axes merged into one N (else XLA
    moves the contraction axis first, a row-count-dependent kernel), behind a barrier that keeps XLA
    from swapping the operands for its consumer's sake, and fewer than XLA_MIN_ROWS rows padded with copies
    of the first (one row takes a matrix-vector kernel; in bfloat16, on a Xeon with AMX measured 2026-12-02,
    two rows also round differently from three or more, while 3 to 2048 rows all agree). On a mesh, c_attn's split heads axis (under the unsplit q|k|v axis) cannot
    merge without gathering the weight, so w is contracted as it lies; sharded results equal one
    device's to 1e-5, not bitwise, anyway."""
    if isinstance(w, kernels.Packed):  # float32-packed (gpt2_jax.model.precision): rowdot's bits, fewer bytes
        return kernels.rowdot_packed(x.astype(F32), w)
    lead, out = x.shape[:-1], w.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if kernels.fits(x2, w):
        return kernels.rowdot(x2, w.reshape(-1, w.shape[-1])).reshape(*lead, *out)
    if not jax.sharding.get_abstract_mesh().empty:
        y = jnp.einsum("MI,...I->M...", x2, w, preferred_element_type=F32)
    else:
        x2 = pad_rows(x2, XLA_MIN_ROWS)
        y = jnp.einsum("MI,NI->MN", x2, w.reshape(-1, w.shape[-1]), preferred_element_type=F32)
    return jax.lax.optimization_barrier(y)[:M].reshape(*lead, *out)


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, qsum: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ (q [out..., in] int8 * scale [out...]).T -> [..., out...] float32 (gpt2_jax.model.precision's
    int8, or its w8a8 with qsum [out...], the weight rows' sums): on a CPU gpt2_jax.kernels.rowdot_int8,
    whose every output is one exact integer dot product, then times its scales, rounded the same way for any
    M; otherwise matmul's XLA form over q as float32 (x's rows rounded to bytes first for w8a8), then the
    scales."""
    lead, out = x.shape[:-1], q.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(F32)
    if kernels.fits(x2):
        flat = None if qsum is None else qsum.reshape(-1)
        return kernels.rowdot_int8(x2, q.reshape(-1, q.shape[-1]), scale.reshape(-1), flat).reshape(*lead, *out)
    x2 = x2 if qsum is None else kernels.round_rows_8bit(x2)
    return matmul(x2, q.astype(F32)).reshape(*lead, *out) * scale


def linear(p: dict, x: jax.Array) -> jax.Array:
    """x [..., in] @ W[out..., in].T (+ b) -> [..., out...] float32; an int8 W (gpt2_jax.model.precision)
    through int8_matmul with its per-output scale."""
    if "scale" in p:
        scale, qsum = take(p["scale"]), take(p["qsum"]) if "qsum" in p else None  # qsum: w8a8's
        y = apply_weight(p["weight"], lambda q: int8_matmul(x, q, scale, qsum))  # a per-layer buffer read in place
    else:
        y = apply_weight(p["weight"], lambda w: matmul(x.astype(w.dtype), w))  # (see layer_loop.apply_weight)
    return y + take(p["bias"]).astype(F32) if "bias" in p else y


def gelu(x: jax.Array, approximate: bool) -> jax.Array:
    """GPT-2's tanh GELU when approximate, else the exact erf form (nanoGPT)."""
    return jax.nn.gelu(x, approximate=approximate)


def _split(key: jax.Array | None, n: int) -> list:
    return [None] * n if key is None else list(jax.random.split(key, n))


def mlp(p: dict, x: jax.Array, config: GPT2Config, key: jax.Array | None = None, tap=None) -> jax.Array:
    """[B, T, D] -> [B, T, D]: c_fc (D->F), GELU, c_proj (F->D); each position on its own.
    Hook points: hook_pre (before the GELU) and hook_post (after), [B, T, F]."""
    pre = at(tap, "hook_pre", linear(p["c_fc"], x))
    hidden = at(tap, "hook_post", constrain(gelu(pre, config.gelu_approximate), "BTF"))  # F split on a mesh
    y = constrain(linear(p["c_proj"], hidden), "BTD")  # on a mesh: the all-reduce of the row-split c_proj
    return dropout(y, config.resid_pdrop, key)


def attn_scale(config: GPT2Config, layer: jax.Array | int) -> jax.Array:
    """The factor on layer `layer`'s attention scores: 1/sqrt(K), optionally also 1/(layer+1)."""
    scale = jnp.asarray(config.head_dim**-0.5 if config.scale_attn_weights else 1.0, F32)
    if config.scale_attn_by_inverse_layer_idx:
        scale = scale / (jnp.asarray(layer, F32) + 1.0)
    return scale


def qkv(p: dict, x: jax.Array, config: GPT2Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, T, D] -> q, k, v each [B, H, T, K] (head-major, the KV cache's layout), from the fused c_attn
    (weight [3, D, D]: C = q|k|v, E = H x K outputs, D inputs)."""
    B, T, _ = x.shape
    fused = linear(p["c_attn"], x).reshape(B, T, 3, config.n_head, config.head_dim)  # [B, T, C, E]
    q, k, v = (constrain(a, "BHTK") for a in jnp.einsum("BTCHK->CBHTK", fused))
    return q, k, v


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D], heads concatenated."""
    B, H, T, K = x.shape
    return jnp.einsum("BHTK->BTHK", x).reshape(B, T, H * K)


def heads_view(tap, name: str, x: jax.Array) -> jax.Array:
    """Head-major x [B, H, T, K] through hook point `name` as TransformerLens lays it out, [B, T, H, K]."""
    return jnp.swapaxes(tap(name, jnp.swapaxes(x, 1, 2)), 1, 2)


def attention(
    p: dict,
    x: jax.Array,
    config: GPT2Config,
    layer: jax.Array | int,
    cache=None,
    key: jax.Array | None = None,
    tap=None,
):
    """[B, T, D] -> ([B, T, D], cache): causal multi-head self-attention, heads concatenated, then c_proj.
    With a cache (cache.CacheView), the new K/V are written into it first and attention reads the whole
    cache under its mask. With a key (training: attend_causal), dropout on the attention weights and the output.
    Hook points: hook_q/k/v (edited K/V are what the cache stores) and hook_z [B, T, H, K]; attend's."""
    k_attn, k_resid = _split(key, 2)
    q, k, v = qkv(p, x, config)
    if tap is not None:
        q, k, v = (heads_view(tap, name, a) for name, a in (("hook_q", q), ("hook_k", k), ("hook_v", v)))
    if cache is None and key is not None and tap is None:  # training (a key is only ever given there)
        out = attend_causal(q, k, v, attn_scale(config, layer), k_attn, config.attn_pdrop)
        return dropout(project_heads(p["c_proj"], out), config.resid_pdrop, k_resid), cache
    if cache is None:
        keys, values, mask = jnp.swapaxes(k, -1, -2), v, causal_mask(x.shape[1])
    else:
        cache = cache.write(layer, k, v)
        (keys, values), mask = cache.read(layer), cache.mask
    out = attend(q, keys, values, mask, attn_scale(config, layer), k_attn, config.attn_pdrop, tap)
    out = out if tap is None else heads_view(tap, "hook_z", out)
    return dropout(project_heads(p["c_proj"], out), config.resid_pdrop, k_resid), cache


def project_heads(p: dict, heads: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D]: heads concatenated, then c_proj (on a mesh: row-split, then all-reduced)."""
    return constrain(linear(p, merge_heads(heads)), "BTD")


def block(
    p: dict,
    x: jax.Array,
    config: GPT2Config,
    layer: jax.Array | int,
    cache=None,
    key: jax.Array | None = None,
    tap=None,
):
    """x [B, T, D] -> (x [B, T, D], cache): pre-LN transformer block with residual connections.
    layer: this block's index (for the cache and inverse-layer scaling); dropout only with a key.
    Hook points [B, T, D]: hook_resid_pre, hook_attn_out, hook_resid_mid, hook_mlp_out,
    hook_resid_post; and those of ln1, attn, ln2 and mlp."""
    eps = config.layer_norm_epsilon
    k_attn, k_mlp = _split(key, 2)
    x = at(tap, "hook_resid_pre", x)
    ln1 = layer_norm(p["ln_1"], x, eps, within(tap, "ln1"))
    a, cache = attention(p["attn"], ln1, config, layer, cache, k_attn, within(tap, "attn"))
    x = at(tap, "hook_resid_mid", x + at(tap, "hook_attn_out", a))
    m = mlp(p["mlp"], layer_norm(p["ln_2"], x, eps, within(tap, "ln2")), config, k_mlp, within(tap, "mlp"))
    return at(tap, "hook_resid_post", x + at(tap, "hook_mlp_out", m)), cache
