"""The training loss head: the unembedding (h @ wte.T) and the mean next-token cross-entropy, fused and
computed a chunk of tokens at a time, with its own derivative.

Why: at V = 50257 the head is most of a small model's training step. Autodiff through
log_softmax + take_along_axis over the whole [B, T, V] logits wrote and read several arrays that size
(exp(logp), a zero array the targets are scattered into, their sum). Here each chunk's logits are
made, used and dropped, and the gradients (softmax - onehot) / (B T) and their two matmuls are
computed in the same pass as the loss, so the backward only scales them. On the CI machine this took
the bundled model's 8 x 128 step from 0.60 s to 0.43 s (bench/train.py); it equals the plain
log_softmax loss and its gradients to float32 rounding (tests/test_train.py).
"""

from __future__ import annotations

import math
from typing import Literal, overload

import jax
import jax.numpy as jnp

from gpt2_jax.model.layers import F32


def head_rows(D: int) -> int:
    """Tokens per chunk of the loss head: about as many as the model is wide (a power of 2 from 128 to
    1024). Each chunk's three matmuls contract over D, V and the chunk's rows, and XLA's CPU matmul
    needs the rows to grow with D to run near its best (a narrow model is fastest with small chunks, a
    wide one with large; bench/train.py). A chunk's float32 logits are rows x V x 4 bytes (206 MB at
    1024 rows), three such arrays live at once."""
    return min(1024, 128 * 2 ** max(0, math.ceil(math.log2(D / 128))))


def _chunks(h: jax.Array, targets: jax.Array, weights: jax.Array | None = None):
    """[B, T, D], [B, T] (and weights [B, T]) -> [N, B, C, D], [N, B, C], valid [N, B, C] (and weights [N, B, C]):
    T cut into N chunks of C positions (B x C ~ head_rows(D) rows; T padded with zero rows, invalid). Along T,
    the axis no mesh splits."""
    B, T, D = h.shape
    C = min(T, max(1, head_rows(D) // B))
    n = -(-T // C)
    pad = n * C - T
    valid = jnp.arange(n * C) < T
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    split = lambda a: jnp.moveaxis(a.reshape(B, n, C, *a.shape[2:]), 1, 0)
    w = None if weights is None else split(jnp.pad(weights, ((0, 0), (0, pad))))
    return split(h), split(targets), jnp.broadcast_to(valid.reshape(n, 1, C), (n, B, C)), w


Grads = tuple[jax.Array, jax.Array]  # dh [B, T, D], dwte [V, D]


@overload
def _head(
    h: jax.Array, wte: jax.Array, targets: jax.Array, grads: Literal[False], weights: jax.Array | None = None
) -> jax.Array: ...
@overload
def _head(
    h: jax.Array, wte: jax.Array, targets: jax.Array, grads: Literal[True], weights: jax.Array | None = None
) -> tuple[jax.Array, Grads]: ...
def _head(
    h: jax.Array, wte: jax.Array, targets: jax.Array, grads: bool, weights: jax.Array | None = None
) -> jax.Array | tuple[jax.Array, Grads]:
    """Mean cross-entropy of logits = h @ wte.T against targets (with weights [B, T]: the weighted sum
    instead), a chunk of positions at a time, and with grads its gradients (dh [B, T, D], dwte [V, D])
    computed in the same pass.

    Each chunk's M = B x C rows are held transposed, logits.T [V, M]: in that orientation XLA's CPU
    matmuls run fastest for all three products (logits.T = wte x.T, dx = (d.T).T wte, dwte += d.T x;
    [M, V] would need d transposed for the dwte product, a copy of [V, M] per chunk), and
    dwte comes out in wte's own layout. The first chunk seeds the dwte sum (no zero [V, D] to write).
    exp is computed once and kept (the barrier): the sum and the gradient both read it."""
    hc, tc, valid, wc = _chunks(h, targets, weights)
    count = targets.size

    def chunk(x, t, ok, w):  # x [B, C, D], t, ok and w [B, C] -> (summed loss, dx [B, C, D], dwte part [V, D])
        xm, t, ok = x.reshape(-1, x.shape[-1]).astype(wte.dtype), t.reshape(-1), ok.reshape(-1)
        logits = jnp.einsum("VD,MD->VM", wte, xm, preferred_element_type=F32)  # [V, M]
        top = logits.max(0, keepdims=True)
        e = jax.lax.optimization_barrier(jnp.exp(logits - top))  # once, for the sum and the gradient
        s = e.sum(0, keepdims=True)
        picked = jnp.take_along_axis(logits, t[None], axis=0)
        ce = (jnp.log(s) + top - picked)[0]
        total = jnp.where(ok, ce if w is None else w.reshape(-1) * ce, 0.0).sum()
        if not grads:
            return total, None, None
        onehot = jnp.arange(logits.shape[0], dtype=t.dtype)[:, None] == t[None]
        if w is None:
            d = e * (1.0 / (s * count)) - onehot / count  # dloss/dlogits.T
        else:
            d = e * (w.reshape(1, -1) / s) - onehot * w.reshape(1, -1)
        d = jnp.where(ok[None], d, 0.0).astype(wte.dtype)
        dx = jnp.einsum("VM,VD->MD", d, wte, preferred_element_type=F32).reshape(x.shape)
        return total, dx, jnp.einsum("VM,MD->VD", d, xm, preferred_element_type=F32)

    first_total, first_dx, first_dwte = chunk(hc[0], tc[0], valid[0], None if wc is None else wc[0])

    def step(carry, xs):
        total, dwte = carry
        part, dx, dw = chunk(*xs)
        return (total + part, None if dwte is None else dwte + dw), dx

    xs = (hc[1:], tc[1:], valid[1:], None if wc is None else wc[1:])
    (total, dwte), dx = jax.lax.scan(step, (first_total, first_dwte), xs)
    loss = total / count if weights is None else total
    if not grads:
        return loss
    if first_dx is None or dx is None or dwte is None:  # chunk gives its gradients whenever grads is set
        raise ValueError("the loss head's chunks gave no gradients")
    B, T, D = h.shape
    dx = jnp.concatenate([first_dx[None], dx])
    dh = jnp.moveaxis(dx, 0, 1).reshape(B, -1, D)[:, :T]
    return loss, (dh.astype(h.dtype), dwte.astype(wte.dtype))


@jax.custom_vjp
def head_loss(h: jax.Array, wte: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean over [B, T] of logsumexp(h @ wte.T) - (h @ wte.T)[target]: the unembedding and the loss, a
    chunk of head_rows(D) tokens at a time, never the whole [B, T, V] logits. Differentiated, the
    gradients (softmax - onehot) / (B T) and their two matmuls are computed in the same forward pass,
    so the backward only scales them. Autodiff through log_softmax + take_along_axis over [B, T, V]
    wrote and read several such arrays (exp(logp), a zero array the targets are scattered into,
    their sum), which at V = 50257 dominated a small model's step."""
    return _head(h, wte, targets, grads=False)


def _head_fwd(h, wte, targets):
    return _head(h, wte, targets, grads=True)  # (loss, the gradients the backward scales)


def _scaled(grads, g):
    """(dh, dwte) times the loss's cotangent g (a float32 scalar), each kept in its primal's dtype: a custom VJP
    must give bfloat16 params bfloat16 gradients, and bfloat16 x float32 would promote."""
    return tuple((d * g).astype(d.dtype) for d in grads)


def _head_bwd(grads, g):
    return *_scaled(grads, g), None


head_loss.defvjp(_head_fwd, _head_bwd)


@jax.custom_vjp
def weighted_head_loss(h: jax.Array, wte: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over [B, T] of weights x (logsumexp(h @ wte.T) - (h @ wte.T)[target]): head_loss with a weight per
    token instead of the mean (gpt2_jax.rl's backward: the cotangent of each token's logprob), chunked the
    same way, its gradient computed in the forward pass. Not differentiable in weights."""
    return _head(h, wte, targets, grads=False, weights=weights)


def _weighted_fwd(h, wte, targets, weights):
    return _head(h, wte, targets, grads=True, weights=weights)


def _weighted_bwd(grads, g):
    return *_scaled(grads, g), None, None


weighted_head_loss.defvjp(_weighted_fwd, _weighted_bwd)
