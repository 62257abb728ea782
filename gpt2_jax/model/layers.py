"""GPT-2's building blocks as the textbook writes them, one small pure function each (shape legend in
gpt2_jax.config): gelu, layer_norm, linear, mlp, attend (scores, mask, softmax, weighted sum), attention and
block. gpt2_jax.model.gpt2 adds the embedding, the layer loop and the tied unembedding.

Each function is the formula; what keeps a row's bits its own whatever its batch (rows padded for the
reductions, the kernels' dispatch, the blocked softmax), the weights' precision and the hook taps live in
gpt2_jax.model.invariant, which the functions pass through. Without a tap, a key or a cache they trace
exactly the plain program.

One `block` serves every path: the training loss, `forward`, prefill, decode, serving and speculation.
Without a cache it attends causally over its own T tokens; with one (a `cache.CacheView`) it first writes
its new K/V into the cache, then attends over the whole cache, so a token's attention reads the same keys in
the same slots whichever path computed it.

The residual stream is float32. Each matmul runs in the weights' dtype (float32 or bfloat16) and
accumulates in float32; LayerNorm and softmax always compute in float32.

Hooks: every function below takes an optional `tap`, called as `tap(name, x) -> x` at each of
TransformerLens's hook points (names relative to the function: "hook_resid_pre", "ln1.hook_scale",
"attn.hook_pattern", ...) and narrowed with `tap.within(prefix)`; gpt2_jax.interp builds taps that
record or edit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.model import invariant
from gpt2_jax.model.attention import NEG_INF, causal_mask
from gpt2_jax.model.axes import constrain
from gpt2_jax.model.dropout import dropout
from gpt2_jax.model.invariant import F32, at, heads_view, within
from gpt2_jax.model.layer_loop import take
from gpt2_jax.model.precision_type import Precision

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float

FLOAT = Precision.FLOAT32  # the functions' default: float weights, as init_params gives


def gelu(x: Float[Array, "*N"], approximate: bool) -> Float[Array, "*N"]:
    """GPT-2's tanh GELU when approximate, else the exact erf form (nanoGPT)."""
    return jax.nn.gelu(x, approximate=approximate)


def layer_norm(p: dict, x: Float[Array, "*B T D"], eps: float, tap=None) -> Float[Array, "*B T D"]:
    """[..., T, D] -> [..., T, D]: (x - mean) / sqrt(var + eps) * weight + bias over D (biased variance).
    Hook points (TransformerLens's): hook_scale sqrt(var + eps) [..., T, 1] and hook_normalized, before
    the weight and bias."""

    def normalize(x: jax.Array, T: int | None) -> jax.Array:
        mean = x.mean(-1, keepdims=True)
        var_eps = jnp.square(x - mean).mean(-1, keepdims=True) + eps
        normalized = invariant.tap_normalized(tap, (x - mean) * jax.lax.rsqrt(var_eps), var_eps, T)
        y = normalized * take(p["weight"]).astype(F32)
        return y + take(p["bias"]).astype(F32) if "bias" in p else y

    return invariant.over_rows(normalize, x.astype(F32))


def linear(p: dict, x: Float[Array, "*N I"], precision: Precision = FLOAT) -> Float[Array, "*N *O"]:
    """x [..., in] -> x @ W.T + b [..., out...] float32 (W [out..., in]; no b without biases)."""
    y = invariant.weight_matmul(p, x, precision)
    return y + take(p["bias"]).astype(F32) if "bias" in p else y


def mlp(
    p: dict, x: Float[Array, "B T D"], config: GPT2Config, key=None, tap=None, precision: Precision = FLOAT
) -> Float[Array, "B T D"]:
    """[B, T, D] -> [B, T, D]: c_proj(gelu(c_fc(x))), each position on its own, dropped out with a key.
    Hook points: hook_pre (before the GELU) and hook_post (after), [B, T, F]."""
    pre = at(tap, "hook_pre", linear(p["c_fc"], x, precision))
    hidden = at(tap, "hook_post", constrain(gelu(pre, config.gelu_approximate), "BTF"))  # F split on a mesh
    y = constrain(linear(p["c_proj"], hidden, precision), "BTD")  # on a mesh: the all-reduce of the row-split c_proj
    return dropout(y, config.resid_pdrop, key)


def attend(
    q: Float[Array, "B H T K"],
    k,
    v,
    mask: Bool[Array, "B|1 T S"],
    scale: Float[Array, ""],
    key=None,
    rate: float = 0.0,
    tap=None,
    plain: bool = False,
) -> Float[Array, "B H T K"]:
    """softmax(q . k * scale where mask allows) . v, per head: q [B, H, T, K], keys [B, H, K, S] (transposed,
    as the cache holds them; plain: [B, H, S, K]), values [B, H, S, K], mask [B or 1, T, S] -> [B, H, T, K].
    The one attention: the forward's and the cache's (gpt2_jax.model.attention.Blocked, a row's bits its own
    in any batch) and training's (plain=True: attention.Plain, XLA's ops, fast to differentiate). Dropout on
    the weights with a key; hook points hook_attn_scores and hook_pattern (Blocked's)."""
    way = invariant.Plain(q, k, v, mask) if plain else invariant.Blocked(q, k, v, mask, tap)
    scores = way.scores() * scale  # each query . each key
    scores = way.tap_scores(jnp.where(way.allowed(), scores, NEG_INF))  # a query sees only the keys mask allows
    weights = way.tap_pattern(dropout(way.softmax(scores), rate, key))  # softmax over the keys
    return way.weighted_sum(weights)  # the values, weighted


def attend_causal(
    q: Float[Array, "B H T K"], k: Float[Array, "B H T K"], v: Float[Array, "B H T K"], scale, key=None, rate=0.0
) -> Float[Array, "B H T K"]:
    """Training's attention: attend, plain, causal over the call's own T tokens (q, k, v [B, H, T, K])."""
    return attend(q, k, v, causal_mask(q.shape[2]), scale, key, rate, plain=True)


def attn_scale(config: GPT2Config, layer: jax.Array | int) -> jax.Array:
    """The factor on layer `layer`'s attention scores: 1/sqrt(K), optionally also 1/(layer+1)."""
    scale = jnp.asarray(config.head_dim**-0.5 if config.scale_attn_weights else 1.0, F32)
    if config.scale_attn_by_inverse_layer_idx:
        scale = scale / (jnp.asarray(layer, F32) + 1.0)
    return scale


def qkv(p: dict, x: Float[Array, "B T D"], config: GPT2Config, precision=FLOAT) -> tuple[Float[Array, "B H T K"], ...]:
    """[B, T, D] -> q, k, v each [B, H, T, K] (head-major, the KV cache's layout), from the fused c_attn
    (weight [3, D, D]: C = q|k|v, E = H x K outputs, D inputs)."""
    B, T, _ = x.shape
    fused = linear(p["c_attn"], x, precision).reshape(B, T, 3, config.n_head, config.head_dim)  # [B, T, C, E]
    q, k, v = (constrain(a, "BHTK") for a in jnp.einsum("BTCHK->CBHTK", fused))
    return q, k, v


def merge_heads(x: Float[Array, "B H T K"]) -> Float[Array, "B T D"]:
    """[B, H, T, K] -> [B, T, D], heads concatenated."""
    B, H, T, K = x.shape
    return jnp.einsum("BHTK->BTHK", x).reshape(B, T, H * K)


def split_key(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """A dropout key split in two for a function's two dropouts; (None, None) without one (no dropout)."""
    if key is None:
        return None, None
    a, b = jax.random.split(key)
    return a, b


def attention(p: dict, x: Float[Array, "B T D"], config: GPT2Config, layer: jax.Array | int, cache=None,
              key: jax.Array | None = None, tap=None,
              precision: Precision = FLOAT) -> tuple[Float[Array, "B T D"], Any]:  # fmt: skip
    """[B, T, D] -> ([B, T, D], cache): causal multi-head self-attention, heads concatenated, then c_proj.
    Its three callers of attend: training (a key, no cache or tap: plain), causal over the call's own
    tokens, and cached: the new K/V written into the cache (cache.CacheView) first, attention reading the
    whole cache under its mask. Hook points: hook_q/k/v (edited K/V are what the cache stores) and hook_z
    [B, T, H, K]; attend's."""
    k_attn, k_resid = split_key(key)
    q, k, v = (heads_view(tap, f"hook_{n}", a) for n, a in zip("qkv", qkv(p, x, config, precision)))
    T, rate = x.shape[1], config.attn_pdrop
    if cache is None and key is not None and tap is None:  # training (a key is only ever given there)
        out = attend_causal(q, k, v, attn_scale(config, layer), k_attn, rate)
    else:
        if cache is None:  # causal over the call's own tokens
            keys, values, mask = jnp.swapaxes(k, -1, -2), v, causal_mask(T)
        else:  # over the cache, this call's K/V written in first
            cache = cache.write(layer, k, v)
            (keys, values), mask = cache.read(layer), cache.mask
        out = heads_view(tap, "hook_z", attend(q, keys, values, mask, attn_scale(config, layer), k_attn, rate, tap))
    out = constrain(linear(p["c_proj"], merge_heads(out), precision), "BTD")  # on a mesh: row-split, all-reduced
    return dropout(out, config.resid_pdrop, k_resid), cache


def block(p: dict, x: Float[Array, "B T D"], config: GPT2Config, layer: jax.Array | int, cache=None,
          key: jax.Array | None = None, tap=None,
          precision: Precision = FLOAT) -> tuple[Float[Array, "B T D"], Any]:  # fmt: skip
    """x [B, T, D] -> (x [B, T, D], cache): pre-LN transformer block, x + attn(ln_1(x)), then + mlp(ln_2(x)).
    layer: this block's index (for the cache and inverse-layer scaling); dropout only with a key.
    Hook points [B, T, D]: hook_resid_pre, hook_attn_out, hook_resid_mid, hook_mlp_out,
    hook_resid_post; and those of ln1, attn, ln2 and mlp."""
    eps = config.layer_norm_epsilon
    k_attn, k_mlp = split_key(key)
    x = at(tap, "hook_resid_pre", x)
    a, cache = attention(p["attn"], layer_norm(p["ln_1"], x, eps, within(tap, "ln1")), config, layer, cache, k_attn,
                         within(tap, "attn"), precision)  # fmt: skip
    x = at(tap, "hook_resid_mid", x + at(tap, "hook_attn_out", a))
    m = mlp(p["mlp"], layer_norm(p["ln_2"], x, eps, within(tap, "ln2")), config, k_mlp, within(tap, "mlp"), precision)
    return at(tap, "hook_resid_post", x + at(tap, "hook_mlp_out", m)), cache
