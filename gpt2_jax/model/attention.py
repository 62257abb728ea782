"""Attention's arithmetic: scores, the block-by-block softmax and the weighted sum, built so that a query's
result is the same bits whatever else is computed with it (see attend), plus training's textbook form.

The model-level attention (the projections, heads and the cache write) is gpt2_jax.model.layers.attention.
Shape legend (gpt2_jax.config): B batch, H heads, T queries, S key slots, K head dim; here also N blocks
of C = KEY_BLOCK slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt2_jax import kernels
from gpt2_jax.kernels.invariance import MIN_REDUCE
from gpt2_jax.model.dropout import dropout

F32 = jnp.float32
NEG_INF = jnp.finfo(F32).min  # finite, so a fully masked row gives a uniform softmax, never NaN


def causal_mask(T: int) -> jax.Array:
    """[1, T, T] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((T, T), bool))[None]


KEY_BLOCK = 128  # keys are scored in blocks of this many slots (see attend)


def attend(
    q: jax.Array, kt, v, mask: jax.Array, scale: jax.Array, key: jax.Array | None = None, rate: float = 0.0, tap=None
) -> jax.Array:
    """q [B, H, T, K] over keys kt [B, H, K, S] (transposed) and values v [B, H, S, K] where mask
    [B or 1, T, S] allows -> [B, H, T, K]. kt and v may be kernels.Entry (a layer of the KV cache,
    read in place) or kernels.Paged (a layer of the paged cache, read through its block table).

    Built so that a query's result is the same bits whatever else is computed with it, and however
    many key slots follow its own (a forward over T tokens vs a cache of S slots): each score is one
    multiply-add chain over K (see block_scores), the slots are grouped in whole blocks of KEY_BLOCK,
    each block's softmax mass is summed alone and the blocks' sums added in order, so masked slots add
    exact zeros; each output of the weighted sum is one chain over the slots (see weighted_values), to
    which masked slots add exact zeros too. With the kernels the softmax is one pass per query
    (gpt2_jax.kernels.softmax); without them XLA's, whose reductions need a decode step's single query
    padded with copies so they take their large-input path (see MIN_REDUCE). Head-major operands keep
    (B, H) as the leading batch dims, and the cache holds keys transposed, as the scores' kernel reads
    them (outputs along the slots): the cache is never transposed.
    Hook points: hook_attn_scores [B, H, T, S] (see tap_scores) and hook_pattern, the weights' real
    [T, S] corner (a padded query's row or a padded slot's column is never shown)."""
    B, H, T, K = q.shape
    S = kt.shape[-1]
    n = -(-S // KEY_BLOCK)
    Sp = n * KEY_BLOCK
    mask = jnp.broadcast_to(mask, (mask.shape[0], T, S))
    kernel = kernels.fits(q, kt, v)
    # XLA's softmax reductions need enough (query, slot) elements to take their large-input path, and its matmul
    # 2 queries: padded queries (copies of the last) make them up. The kernels (chain, softmax) compute each
    # query's row on its own, so with them only the T real queries go through.
    Tq = T if kernel else max(T, -(-MIN_REDUCE // (B * H * Sp)), 2)
    if Tq > T:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Tq - T), (0, 0)), mode="edge")
        mask = jnp.pad(mask, ((0, 0), (0, Tq - T), (0, 0)), mode="edge")
    # Each query's last visible slot + 1 (all S for a query that sees nothing): the kernel skips the scores
    # past it and the weighted sum's products there (exact zeros), half the work of a causal prefill.
    # Not under hooks, which may edit masked scores or weights.
    ends = None
    if tap is None and kernel:
        last = jnp.max(jnp.where(mask, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=-1)  # [B or 1, T]
        ends = jnp.broadcast_to(jnp.where(last > 0, last, S)[:, None], (B, H, T))
    scores = block_scores(q, kt, n, ends) * scale  # [B, H, T', N, C]
    blocked = jnp.pad(mask, ((0, 0), (0, 0), (0, Sp - S))).reshape(mask.shape[0], 1, Tq, n, KEY_BLOCK)
    scores = jnp.where(blocked, scores, NEG_INF)
    if tap is not None:
        scores = tap_scores(tap, scores, blocked, mask[:, :T, :S])
    weights = kernels.softmax(scores, block_softmax) if kernel else block_softmax(scores)
    weights = dropout(weights, rate, key).reshape(B, H, Tq, Sp)
    if tap is not None:
        weights = weights.at[:, :, :T, :S].set(tap("hook_pattern", weights[:, :, :T, :S]))
    return weighted_values(weights, v, ends)[:, :, :T]


def block_softmax(scores: jax.Array) -> jax.Array:
    """Blocked scores [B, H, T', N, C] -> weights: the softmax over each query's N x C slots, each block's mass
    summed alone and the blocks' sums added in order (XLA's arithmetic; gpt2_jax.kernels.softmax is the same
    recipe in one pass per query)."""
    e = jnp.exp(scores - jnp.max(scores, axis=(3, 4), keepdims=True))
    block_sums = e.sum(axis=-1)  # [B, H, T', N]
    total = block_sums[..., 0]
    for j in range(1, scores.shape[3]):  # in block order, so blocks past the last key add exact zeros
        total = total + block_sums[..., j]
    return e / total[..., None, None]


def _array(a) -> jax.Array:
    """An operand as one array: a cache entry (kernels.Entry, kernels.Paged) gathered, a copy."""
    return a if isinstance(a, jax.Array) else a.get()


def block_scores(q: jax.Array, kt, n: int, ends: jax.Array | None = None) -> jax.Array:
    """q [B, H, T, K] . keys kt [B, H, K, S] -> scores [B, H, T, N, C] over n blocks of C = KEY_BLOCK slots
    (slots past S hold zeros). With the kernel (gpt2_jax.kernels.chain) each score is one multiply-add
    chain over K, whatever T and S (ends [B, H, T]: slots from ends on are not needed, and come back as
    0); XLA's matmul instead gets one fixed [T, C] shape per block (each block its own operand), as its
    kernel changes with S."""
    B, H, T, K = q.shape
    S, Sp = kt.shape[-1], n * KEY_BLOCK
    if kernels.fits(q, kt):
        scores = jnp.pad(kernels.chain(q, kt, out_ends=ends), ((0, 0), (0, 0), (0, 0), (0, Sp - S)))
        return scores.reshape(B, H, T, n, KEY_BLOCK)
    k = jnp.swapaxes(_array(kt), -1, -2)
    kb = jnp.pad(k, ((0, 0), (0, 0), (0, Sp - S), (0, 0))).reshape(B, H, n, KEY_BLOCK, K)
    qb = jnp.broadcast_to(q[:, :, None], (B, H, n, T, K))
    scores = jnp.einsum("BHNTK,BHNCK->BHNTC", qb, kb.astype(q.dtype), preferred_element_type=F32)
    return scores.transpose(0, 1, 3, 2, 4)


def weighted_values(weights: jax.Array, v, ends: jax.Array | None = None) -> jax.Array:
    """weights [B, H, T, S'] (S' >= S: slots past S weigh 0) . values v [B, H, S, K] -> [B, H, T, K]: one
    multiply-add chain over the slots per output (gpt2_jax.kernels.chain; ends [B, H, T]: the weights
    from ends on are 0, and their products are skipped), or XLA's matmul over the padded slots against
    the values transposed, the layout in which its kernel ignores S."""
    S, Sp = v.shape[-2], weights.shape[-1]
    if kernels.fits(weights, v):
        return kernels.chain(weights[..., :S], v, in_ends=ends)
    vt = jnp.pad(jnp.swapaxes(_array(v), -1, -2), ((0, 0), (0, 0), (0, 0), (0, Sp - S)))
    return jnp.einsum("BHTS,BHKS->BHTK", weights.astype(vt.dtype), vt, preferred_element_type=F32)


def attend_causal(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: jax.Array, key: jax.Array | None = None, rate: float = 0.0
) -> jax.Array:
    """Training's attention: q, k, v [B, H, T, K] -> [B, H, T, K], causal over the call's own T tokens,
    written as the textbook does: scores, the mask, jax.nn.softmax (whose derivative is one rule, not
    autodiff through max, exp, sum and divide), dropout, the weighted sum.

    The training step's fast path, beside attend: a training row's bits are never compared across
    batch shapes or against a cache, so it skips attend's block-by-block sums, which cost 60% more
    in the backward (measured at B=8, H=6, T=256 on the CI machine: 60 ms against 39 ms). Its results
    equal attend's to float32 rounding."""
    T = q.shape[2]
    scores = jnp.einsum("BHTK,BHSK->BHTS", q, k, preferred_element_type=F32) * scale
    weights = jax.nn.softmax(jnp.where(causal_mask(T)[:, None], scores, NEG_INF), axis=-1)
    weights = dropout(weights, rate, key)
    return jnp.einsum("BHTS,BHSK->BHTK", weights.astype(v.dtype), v, preferred_element_type=F32)


def tap_scores(tap, scores: jax.Array, blocked: jax.Array, mask: jax.Array) -> jax.Array:
    """Blocked scores [B, H, T', N, C] (padded: T' >= T queries, N x C >= S slots) through
    hook_attn_scores as TransformerLens shows them, [B, H, T, S] with -inf where masked. Back in the
    blocked layout, masked slots stay the finite NEG_INF (and an edit's -inf becomes it), so a row
    the edit masks entirely gives a uniform softmax, not NaN; unmasked values are returned as given."""
    B, H, Tq, N, C = scores.shape
    T, S = mask.shape[-2:]
    flat = scores.reshape(B, H, Tq, N * C)
    shown = jnp.where(mask[:, None], flat[:, :, :T, :S], -jnp.inf)
    flat = flat.at[:, :, :T, :S].set(jnp.maximum(tap("hook_attn_scores", shown), NEG_INF))
    return jnp.where(blocked, flat.reshape(B, H, Tq, N, C), NEG_INF)
