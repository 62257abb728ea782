"""GPT-2's building blocks as small pure functions (shape legend in gpt2_jax.config).

The residual stream is float32. Each matmul runs in the weights' dtype (float32 or
bfloat16) and accumulates in float32; LayerNorm and softmax always compute in float32.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.sharding import constrain

F32 = jnp.float32
BF16 = jnp.bfloat16
NEG_INF = jnp.finfo(F32).min  # finite, so a fully masked row gives a uniform softmax, never NaN


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [..., D]: normalise over D (biased variance), then scale and shift."""
    x = x.astype(F32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * p["weight"].astype(F32)
    return y + p["bias"].astype(F32) if "bias" in p else y


def linear(p: dict, x: jax.Array, spec: str = "...i,io->...o") -> jax.Array:
    """[..., in] @ W[in, out] (+ b) -> [..., out] float32 (spec: the einsum, for weights of other ranks).
    An int8 weight (gpt2_jax.precision) is used as bfloat16, its per-column scale applied to the result."""
    w = p["weight"]
    if "scale" in p:
        y = jnp.einsum(spec, x.astype(BF16), w.astype(BF16), preferred_element_type=F32) * p["scale"]
    else:
        y = jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=F32)
    return y + p["bias"].astype(F32) if "bias" in p else y


def gelu(x: jax.Array, approximate: bool) -> jax.Array:
    """GPT-2's tanh GELU when approximate, else the exact erf form (nanoGPT)."""
    return jax.nn.gelu(x, approximate=approximate)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout: zero each element with probability rate, scale the rest by 1/(1-rate).
    key None (inference) means no dropout at all."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def _split(key: jax.Array | None, n: int) -> list:
    return [None] * n if key is None else list(jax.random.split(key, n))


def mlp(p: dict, x: jax.Array, config: GPT2Config, key: jax.Array | None = None) -> jax.Array:
    """[B, T, D] -> [B, T, D]: c_fc (D->F), GELU, c_proj (F->D); each position on its own."""
    hidden = constrain(gelu(linear(p["c_fc"], x), config.gelu_approximate), "BTF")  # F split on a mesh
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
    (weight [D, 3, D]: C = q|k|v, E = H x K)."""
    B, T, _ = x.shape
    fused = linear(p["c_attn"], x, "BTD,DCE->BTCE").reshape(B, T, 3, config.n_head, config.head_dim)
    q, k, v = (constrain(a, "BHTK") for a in jnp.einsum("BTCHK->CBHTK", fused))
    return q, k, v


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D], heads concatenated."""
    B, H, T, K = x.shape
    return jnp.einsum("BHTK->BTHK", x).reshape(B, T, H * K)


def attend(q: jax.Array, kv_blocks: list[tuple[jax.Array, jax.Array, jax.Array]], scale: jax.Array,
           key: jax.Array | None = None, rate: float = 0.0) -> jax.Array:
    """q [B, H, T, K] over blocks of (k [B, H, S, K], v [B, H, S, K], mask bool [B or 1, T, S]) -> [B, H, T, K].

    One softmax spans all blocks, so keys split between a cache and the new tokens need no
    concatenation (which would copy the cache). Head-major operands keep (B, H) as leading
    batch dims of both matmuls, so XLA never transposes the cache."""
    scores = [
        jnp.where(mask[:, None], jnp.einsum("BHTK,BHSK->BHTS", q, k, preferred_element_type=F32) * scale, NEG_INF)
        for k, _, mask in kv_blocks
    ]
    sizes = [s.shape[-1] for s in scores]
    weights = dropout(jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1), rate, key)
    parts = jnp.split(weights, list(itertools.accumulate(sizes))[:-1], axis=-1)
    return sum(
        jnp.einsum("BHTS,BHSK->BHTK", w.astype(v.dtype), v, preferred_element_type=F32)
        for w, (_, v, _) in zip(parts, kv_blocks)
    )


def causal_mask(T: int) -> jax.Array:
    """[1, T, T] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((T, T), bool))[None]


def attention(p: dict, x: jax.Array, config: GPT2Config, scale: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """[B, T, D] -> [B, T, D]: causal multi-head self-attention, heads concatenated, then c_proj.
    With a key (training), dropout on the attention weights and on the output."""
    k_attn, k_resid = _split(key, 2)
    q, k, v = qkv(p, x, config)
    out = attend(q, [(k, v, causal_mask(x.shape[1]))], scale, k_attn, config.attn_pdrop)
    return dropout(project_heads(p["c_proj"], out), config.resid_pdrop, k_resid)


def project_heads(p: dict, heads: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D]: heads concatenated, then c_proj (on a mesh: row-split, then all-reduced)."""
    return constrain(linear(p, merge_heads(heads)), "BTD")


def block(p: dict, x: jax.Array, config: GPT2Config, scale: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """[B, T, D] -> [B, T, D]: pre-LN transformer block with residual connections (dropout only with a key)."""
    eps = config.layer_norm_epsilon
    k_attn, k_mlp = _split(key, 2)
    x = x + attention(p["attn"], layer_norm(p["ln_1"], x, eps), config, scale, k_attn)
    return x + mlp(p["mlp"], layer_norm(p["ln_2"], x, eps), config, k_mlp)
