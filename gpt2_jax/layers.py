"""GPT-2's building blocks as small pure functions (shape legend in gpt2_jax.config).

One `block` serves every path: the training loss, `forward`, prefill, decode and (later) serving
and speculation. Without a cache it attends causally over its own T tokens; with one (a
`cache.CacheView`) it first writes its new K/V into the cache, then attends over the whole cache,
so a token's attention reads the same keys in the same slots whichever path computed it.

The residual stream is float32. Each matmul runs in the weights' dtype (float32 or bfloat16) and
accumulates in float32; LayerNorm and softmax always compute in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.numerics import MIN_REDUCE
from gpt2_jax.scan import apply_weight, take
from gpt2_jax.sharding import constrain

F32 = jnp.float32
BF16 = jnp.bfloat16
NEG_INF = jnp.finfo(F32).min  # finite, so a fully masked row gives a uniform softmax, never NaN


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """[..., D] -> [..., D]: normalise over D (biased variance), then scale and shift."""
    x = x.astype(F32)
    # Enough rows that one token rounds as among many (see gpt2_jax.numerics); padded along T, the axis
    # no mesh splits, with zeros (finite), and dropped after.
    T, D = x.shape[-2:] if x.ndim >= 2 else (1, x.shape[-1])
    extra = max(0, -(-MIN_REDUCE // (x.size // T)) - T)  # x.size // T: elements per unit of T
    if x.ndim >= 2 and extra > 0:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)])
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps) * take(p["weight"]).astype(F32)
    y = y + take(p["bias"]).astype(F32) if "bias" in p else y
    return y[..., :T, :] if x.ndim >= 2 and extra > 0 else y


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out..., in] -> [..., out...] float32, as one matmul of the rows [M, in] (M = the
    leading dims) against w contracted on its last axis.

    In this form XLA's CPU kernel computes each row with the same instructions for any row count M >= 2,
    so a token's result does not depend on how many rows share the call (a batch, a prefill, a decode
    step). The barrier keeps XLA from choosing another output layout for the consumer's sake (which
    swaps the operands and the kernel). A single row takes a matrix-vector kernel, so it is computed as
    two. w's output axes are merged into one N (a free reshape): XLA would otherwise move the contraction
    axis first, which is the other, row-count-dependent kernel. Except on a mesh, where c_attn's split
    heads axis (under the unsplit q|k|v axis) cannot merge without gathering the weight; sharded results
    are equal to one device's to 1e-5, not bitwise, anyway."""
    lead, out = x.shape[:-1], w.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    x2 = jnp.concatenate([x2, x2]) if M == 1 else x2
    if jax.sharding.get_abstract_mesh().empty:
        y = jnp.einsum("MI,NI->MN", x2, w.reshape(-1, w.shape[-1]), preferred_element_type=F32)
    else:
        y = jnp.einsum("MI,...I->M...", x2, w, preferred_element_type=F32)
    return jax.lax.optimization_barrier(y)[:M].reshape(*lead, *out)


def linear(p: dict, x: jax.Array) -> jax.Array:
    """x [..., in] @ W[out..., in].T (+ b) -> [..., out...] float32. An int8 weight (gpt2_jax.precision)
    is used as bfloat16, its per-output scale applied after."""
    int8 = "scale" in p

    def product(w: jax.Array) -> jax.Array:
        a, w = (x.astype(BF16), w.astype(BF16)) if int8 else (x.astype(w.dtype), w)
        return matmul(a, w)

    y = apply_weight(p["weight"], product)  # a per-layer buffer is read in place (see params.apply_weight)
    y = y * take(p["scale"]) if int8 else y
    return y + take(p["bias"]).astype(F32) if "bias" in p else y


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
    (weight [3, D, D]: C = q|k|v, E = H x K outputs, D inputs)."""
    B, T, _ = x.shape
    fused = linear(p["c_attn"], x).reshape(B, T, 3, config.n_head, config.head_dim)  # [B, T, C, E]
    q, k, v = (constrain(a, "BHTK") for a in jnp.einsum("BTCHK->CBHTK", fused))
    return q, k, v


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D], heads concatenated."""
    B, H, T, K = x.shape
    return jnp.einsum("BHTK->BTHK", x).reshape(B, T, H * K)


def causal_mask(T: int) -> jax.Array:
    """[1, T, T] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((T, T), bool))[None]


KEY_BLOCK = 128  # keys are scored in blocks of this many slots (see attend)


def attend(q: jax.Array, k: jax.Array, vt: jax.Array, mask: jax.Array, scale: jax.Array,
           key: jax.Array | None = None, rate: float = 0.0) -> jax.Array:
    """q [B, H, T, K] over keys k [B, H, S, K] and values vt [B, H, K, S] (transposed) where mask
    [B or 1, T, S] allows -> [B, H, T, K].

    Built so that a query's result is the same bits whatever else is computed with it, and however
    many key slots follow its own (a forward over T tokens vs a cache of S slots): keys are padded to
    whole blocks of KEY_BLOCK slots and scored block by block (a fixed matmul shape), each block's
    softmax mass is summed alone and the blocks' sums added in order, so masked slots add exact zeros;
    the values are held transposed, the layout in which the weighted sum's kernel ignores S. A decode
    step's single query is padded with copies of itself (see matmul and MIN_REDUCE). Head-major
    operands keep (B, H) as the leading batch dims: the cache is never transposed."""
    B, H, T, K = q.shape
    S = k.shape[2]
    n = -(-S // KEY_BLOCK)
    pad = n * KEY_BLOCK - S
    mask = jnp.broadcast_to(mask, (mask.shape[0], T, S))
    if pad:
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        vt = jnp.pad(vt, ((0, 0), (0, 0), (0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))
    # At least 2 queries (matmul), and enough (query, block) rows for the softmax's reductions.
    Tq = max(2, T, -(-MIN_REDUCE // (B * H * n * KEY_BLOCK)))
    if Tq > T:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Tq - T), (0, 0)), mode="edge")
        mask = jnp.pad(mask, ((0, 0), (0, Tq - T), (0, 0)), mode="edge")
    Sp = n * KEY_BLOCK
    qb = jnp.broadcast_to(q[:, :, None], (B, H, n, Tq, K))  # each block's matmul gets its own operand
    kb = k.reshape(B, H, n, KEY_BLOCK, K)
    scores = jnp.einsum("BHNTK,BHNCK->BHNTC", qb, kb, preferred_element_type=F32) * scale
    blocked = mask.reshape(mask.shape[0], Tq, n, KEY_BLOCK).transpose(0, 2, 1, 3)[:, None]  # [B, 1, N, T, C]
    scores = jnp.where(blocked, scores, NEG_INF)
    e = jnp.exp(scores - jnp.max(scores, axis=(2, 4), keepdims=True))
    block_sums = e.sum(axis=-1)  # [B, H, N, T]
    total = block_sums[:, :, 0]
    for j in range(1, n):  # in block order, so blocks past the last key add exact zeros
        total = total + block_sums[:, :, j]
    weights = dropout(e / total[:, :, None, :, None], rate, key)
    weights = weights.transpose(0, 1, 3, 2, 4).reshape(B, H, Tq, Sp)
    out = jnp.einsum("BHTS,BHKS->BHTK", weights.astype(vt.dtype), vt, preferred_element_type=F32)
    return out[:, :, :T]


def attention(p: dict, x: jax.Array, config: GPT2Config, layer: jax.Array | int, cache=None,
              key: jax.Array | None = None):
    """[B, T, D] -> ([B, T, D], cache): causal multi-head self-attention, heads concatenated, then c_proj.
    With a cache (cache.CacheView), the new K/V are written into it first and attention reads the whole
    cache under its mask. With a key (training), dropout on the attention weights and on the output."""
    k_attn, k_resid = _split(key, 2)
    q, k, v = qkv(p, x, config)
    if cache is None:
        keys, values, mask = k, jnp.swapaxes(v, -1, -2), causal_mask(x.shape[1])
    else:
        cache = cache.write(layer, k, v)
        (keys, values), mask = cache.read(layer), cache.mask
    out = attend(q, keys, values, mask, attn_scale(config, layer), k_attn, config.attn_pdrop)
    return dropout(project_heads(p["c_proj"], out), config.resid_pdrop, k_resid), cache


def project_heads(p: dict, heads: jax.Array) -> jax.Array:
    """[B, H, T, K] -> [B, T, D]: heads concatenated, then c_proj (on a mesh: row-split, then all-reduced)."""
    return constrain(linear(p, merge_heads(heads)), "BTD")


def block(p: dict, x: jax.Array, config: GPT2Config, layer: jax.Array | int, cache=None,
          key: jax.Array | None = None):
    """x [B, T, D] -> (x [B, T, D], cache): pre-LN transformer block with residual connections.
    layer: this block's index (for the cache and inverse-layer scaling); dropout only with a key."""
    eps = config.layer_norm_epsilon
    k_attn, k_mlp = _split(key, 2)
    a, cache = attention(p["attn"], layer_norm(p["ln_1"], x, eps), config, layer, cache, k_attn)
    x = x + a
    return x + mlp(p["mlp"], layer_norm(p["ln_2"], x, eps), config, k_mlp), cache
