"""Attention's arithmetic, the half of gpt2_jax.model.invariant that the textbook attend
(gpt2_jax.model.layers) passes through: Blocked, built so that a query's result is the same bits whatever
else is computed with it, and Plain, training's XLA ops. Each gives the formula's steps (scores, the mask in
their layout, softmax, weighted sum) and the hook points between them.

Shape legend (gpt2_jax.config): B batch, H heads, T queries, S key slots, K head dim; here also N blocks
of C = KEY_BLOCK slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt2_jax.kernels.ffi import chain, fits, softmax
from gpt2_jax.kernels.invariance import MIN_REDUCE

F32 = jnp.float32
NEG_INF = jnp.finfo(F32).min  # finite, so a fully masked row gives a uniform softmax, never NaN
KEY_BLOCK = 128  # keys are scored in blocks of this many slots (see Blocked)


def causal_mask(T: int) -> jax.Array:
    """[1, T, T] bool: query t sees keys 0..t."""
    return jnp.tril(jnp.ones((T, T), bool))[None]


class Blocked:
    """Attention's arithmetic for q [B, H, T, K] over keys kt [B, H, K, S] (transposed) and values v
    [B, H, S, K] where mask [B or 1, T, S] allows. kt and v may be Entry (a layer of the KV cache,
    read in place) or Paged (a layer of the paged cache, read through its block table).

    Built so that a query's result is the same bits whatever else is computed with it, and however many key
    slots follow its own (a forward over T tokens vs a cache of S slots): each score is one multiply-add chain
    over K (see block_scores), the slots are grouped in whole blocks of KEY_BLOCK, each block's softmax mass
    is summed alone and the blocks' sums added in order, so masked slots add exact zeros; each output of the
    weighted sum is one chain over the slots (see weighted_values), to which masked slots add exact zeros
    too. With the kernels the softmax is one pass per query (gpt2_jax.kernels.ffi.softmax); without them XLA's,
    whose reductions need a decode step's single query padded with copies so they take their large-input
    path (see MIN_REDUCE). Head-major operands keep (B, H) as the leading batch dims, and the cache holds
    keys transposed, as the scores' kernel reads them (outputs along the slots): the cache is never
    transposed. Hook points: hook_attn_scores [B, H, T, S] (see tap_scores) and hook_pattern, the weights'
    real [T, S] corner (a padded query's row or a padded slot's column is never shown)."""

    def __init__(self, q: jax.Array, kt, v, mask: jax.Array, tap=None):
        B, H, T, K = q.shape
        S = kt.shape[-1]
        self.n = -(-S // KEY_BLOCK)
        mask = jnp.broadcast_to(mask, (mask.shape[0], T, S))
        self.kernel = fits(q, kt, v)
        # XLA's softmax reductions need enough (query, slot) elements to take their large-input path, and its
        # matmul 2 queries: padded queries (copies of the last) make them up. The kernels (chain, softmax)
        # compute each query's row on its own, so with them only the T real queries go through.
        Tq = T if self.kernel else max(T, -(-MIN_REDUCE // (B * H * self.n * KEY_BLOCK)), 2)
        if Tq > T:
            q = jnp.pad(q, ((0, 0), (0, 0), (0, Tq - T), (0, 0)), mode="edge")
            mask = jnp.pad(mask, ((0, 0), (0, Tq - T), (0, 0)), mode="edge")
        # Each query's last visible slot + 1 (all S for a query that sees nothing): the kernel skips the scores
        # past it and the weighted sum's products there (exact zeros), half the work of a causal prefill.
        # Not under hooks, which may edit masked scores or weights.
        self.ends = None
        if tap is None and self.kernel:
            last = jnp.max(jnp.where(mask, jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=-1)  # [B or 1, T]
            self.ends = jnp.broadcast_to(jnp.where(last > 0, last, S)[:, None], (B, H, T))
        self.q, self.kt, self.v, self.mask, self.tap, self.shape = q, kt, v, mask, tap, (B, H, T, S)

    def scores(self) -> jax.Array:
        """[B, H, T', N, C]: each query . each key, blocked."""
        return block_scores(self.q, self.kt, self.n, self.ends)

    def allowed(self) -> jax.Array:
        """The mask in the scores' blocked layout [B or 1, 1, T', N, C] (slots past S never allowed)."""
        return self.blocked

    @functools.cached_property
    def blocked(self) -> jax.Array:
        mask, Sp = self.mask, self.n * KEY_BLOCK
        blocked = jnp.pad(mask, ((0, 0), (0, 0), (0, Sp - mask.shape[-1])))
        return blocked.reshape(mask.shape[0], 1, mask.shape[1], self.n, KEY_BLOCK)

    def tap_scores(self, scores: jax.Array) -> jax.Array:
        """Masked scores through hook_attn_scores (see tap_scores)."""
        B, H, T, S = self.shape
        return scores if self.tap is None else tap_scores(self.tap, scores, self.blocked, self.mask[:, :T, :S])

    def softmax(self, scores: jax.Array) -> jax.Array:
        """Blocked weights: each block's mass summed alone (softmax in one pass, or block_softmax)."""
        return softmax(scores, block_softmax) if self.kernel else block_softmax(scores)

    def tap_pattern(self, weights: jax.Array) -> jax.Array:
        """Blocked weights -> [B, H, T', N x C], through hook_pattern's real [T, S] corner."""
        B, H, T, S = self.shape
        weights = weights.reshape(B, H, self.q.shape[2], self.n * KEY_BLOCK)
        if self.tap is not None:
            weights = weights.at[:, :, :T, :S].set(self.tap("hook_pattern", weights[:, :, :T, :S]))
        return weights

    def weighted_sum(self, weights: jax.Array) -> jax.Array:
        """[B, H, T, K]: the padded queries dropped."""
        return weighted_values(weights, self.v, self.ends)[:, :, : self.shape[2]]


class Plain:
    """Training's attention arithmetic for q, k, v [B, H, T, K] where mask [B or 1, T, S] allows: XLA's
    einsums and jax.nn.softmax (whose derivative is one rule, not autodiff through max, exp, sum and divide).
    A training row's bits are never compared across batch shapes or against a cache, so it skips Blocked's
    block-by-block sums, which slow the backward (docs/guides/training.md); its results equal Blocked's to
    float32 rounding. No hook points (a tap takes Blocked)."""

    def __init__(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
        self.q, self.k, self.v, self.mask = q, k, v, mask

    def scores(self) -> jax.Array:
        return jnp.einsum("BHTK,BHSK->BHTS", self.q, self.k, preferred_element_type=F32)

    def allowed(self) -> jax.Array:
        return self.mask[:, None]

    def tap_scores(self, scores: jax.Array) -> jax.Array:
        return scores

    def softmax(self, scores: jax.Array) -> jax.Array:
        return jax.nn.softmax(scores, axis=-1)

    def tap_pattern(self, weights: jax.Array) -> jax.Array:
        return weights

    def weighted_sum(self, weights: jax.Array) -> jax.Array:
        return jnp.einsum("BHTS,BHSK->BHTK", weights.astype(self.v.dtype), self.v, preferred_element_type=F32)


def block_softmax(scores: jax.Array) -> jax.Array:
    """Blocked scores [B, H, T', N, C] -> weights: the softmax over each query's N x C slots, each block's mass
    summed alone and the blocks' sums added in order (XLA's arithmetic; gpt2_jax.kernels.ffi.softmax is the same
    recipe in one pass per query)."""
    e = jnp.exp(scores - jnp.max(scores, axis=(3, 4), keepdims=True))
    block_sums = e.sum(axis=-1)  # [B, H, T', N]
    total = block_sums[..., 0]
    for j in range(1, scores.shape[3]):  # in block order, so blocks past the last key add exact zeros
        total = total + block_sums[..., j]
    return e / total[..., None, None]


def _array(a) -> jax.Array:
    """An operand as one array: a cache entry (Entry, Paged) gathered, a copy."""
    return a if isinstance(a, jax.Array) else a.get()


def block_scores(q: jax.Array, kt, n: int, ends: jax.Array | None = None) -> jax.Array:
    """q [B, H, T, K] . keys kt [B, H, K, S] -> scores [B, H, T, N, C] over n blocks of C = KEY_BLOCK slots
    (slots past S hold zeros). With the kernel (gpt2_jax.kernels.ffi.chain) each score is one multiply-add
    chain over K, whatever T and S (ends [B, H, T]: slots from ends on are not needed, and come back as
    0); XLA's matmul instead gets one fixed [T, C] shape per block (each block its own operand), as its
    kernel changes with S."""
    B, H, T, K = q.shape
    S, Sp = kt.shape[-1], n * KEY_BLOCK
    if fits(q, kt):
        scores = jnp.pad(chain(q, kt, out_ends=ends), ((0, 0), (0, 0), (0, 0), (0, Sp - S)))
        return scores.reshape(B, H, T, n, KEY_BLOCK)
    k = jnp.swapaxes(_array(kt), -1, -2)
    kb = jnp.pad(k, ((0, 0), (0, 0), (0, Sp - S), (0, 0))).reshape(B, H, n, KEY_BLOCK, K)
    qb = jnp.broadcast_to(q[:, :, None], (B, H, n, T, K))
    scores = jnp.einsum("BHNTK,BHNCK->BHNTC", qb, kb.astype(q.dtype), preferred_element_type=F32)
    return scores.transpose(0, 1, 3, 2, 4)


def weighted_values(weights: jax.Array, v, ends: jax.Array | None = None) -> jax.Array:
    """weights [B, H, T, S'] (S' >= S: slots past S weigh 0) . values v [B, H, S, K] -> [B, H, T, K]: one
    multiply-add chain over the slots per output (gpt2_jax.kernels.ffi.chain; ends [B, H, T]: the weights
    from ends on are 0, and their products are skipped), or XLA's matmul over the padded slots against
    the values transposed, the layout in which its kernel ignores S."""
    S, Sp = v.shape[-2], weights.shape[-1]
    if fits(weights, v):
        return chain(weights[..., :S], v, in_ends=ends)
    vt = jnp.pad(jnp.swapaxes(_array(v), -1, -2), ((0, 0), (0, 0), (0, 0), (0, Sp - S)))
    return jnp.einsum("BHTS,BHKS->BHTK", weights.astype(vt.dtype), vt, preferred_element_type=F32)


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
