"""The draw: one token per row from the distribution gpt2_jax.sampling.filters defines, fast.

Every row takes the cheapest exact program for its own settings and logits (never its neighbours'):
  greedy       temperature 0: the argmax (first maximum), no random numbers.
  plain        no top-k and top-p == 1: the race over all V weights (min-p applied to them).
  window       top-k <= C - 1, or top-p alone whose nucleus lies inside the C largest candidates:
               top_k_mask / top_p_mask on those C candidates only (lax.top_k, no sort of V).
  full         anything else: filters.filter_scaled, one int32-key sort of V's values (no token ids).
lax.cond skips a program that no row of the batch needs, so nothing recompiles, and since each row's
token comes from its own program a row draws the same token whatever batch it is in.

The draw itself is path-independent: an exponential race (the Gumbel-max trick). The row's key gives
every token id its own clock E_id ~ Exp(1); over the kept tokens' unnormalised weights
w = exp(scaled - row max) the token is argmax w / E (the first to ring of clocks E / w ~ Exp(w)), which
is token i with probability w_i / sum(w). The score w / E is computed once for all V and every program
only masks it, so windows only decide which tokens are kept. A window's top-p normalises by the mass
over all V, and adds the mass under the window to its cumulative sums; those double-float sums round
like the full sort's except within ~2^-44 of a boundary.

Why a race and not an inverse CDF (one uniform over ids in increasing order): two distributions drawn
with the same key then agree unless their races differ, about 1 - total variation when they are close.
Speculative decoding's coupled draw (gpt2_jax.generation.speculative.propose) rests on that; with an
inverse CDF they disagree wherever the shared uniform falls between the two CDFs at any of V ids.

Shape legend: B batch, V vocab rows, C candidates.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gpt2_jax.kernels import ffi
from gpt2_jax.kernels.invariance import min_rows, pad_rows
from gpt2_jax.sampling.filters import (
    apply_temperature,
    checked_logits,
    filter_scaled,
    min_p_mask,
    top_k_mask,
    top_p_mask,
)  # fmt: skip
from gpt2_jax.sampling.metadata import RowSettings, row_keys, row_settings

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int, Key

CANDIDATES = 1024  # C: the window; top_k <= C - 1 always fits it, a top-p nucleus often does


def exponential_clocks(keys: Key[Array, " B"], v: int) -> Float[Array, "B V"]:
    """One key per row -> E [B, V] iid Exp(1), each row's from its key alone: -log u with u = (m + 1/2) 2^-23
    from 23 random bits m, so 0 < u < 1 and E is finite and positive (E = 0 would make a zero weight's
    score 0 / 0). Drawn as [16, V / 16] per key: XLA's CPU threads split the outer axis of one key's
    threefry, not a flat [V]'s (several times faster)."""
    n = -(-v // 16)
    bits = jax.vmap(lambda k: jax.random.bits(k, (16, n), jnp.uint32).reshape(-1)[:v])(keys)
    u = (bits >> 9).astype(jnp.float32) * jnp.float32(2.0**-23) + jnp.float32(2.0**-24)  # exact: 24 bits
    return -jnp.log(u)


def race(score: Float[Array, "B N"]) -> Int[Array, " B"]:
    """Scores w / E [B, N] >= 0 (0 where a token is not kept) -> [B] int32 position of the winner: the first
    maximum, so among exact ties the smallest id wins on every program (candidates are in id order)."""
    return argmax(score)


def argmax(x: jax.Array) -> jax.Array:
    """[B, N] -> [B] int32, exactly jnp.argmax (first maximum; first NaN if any): the kernel's one pass on the
    CPU (gpt2_jax.kernels.ffi.argmax), else two plain reductions (several times cheaper on CPU than argmax's
    variadic reduction)."""
    n = x.shape[-1]

    def reductions(x):
        hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
        return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)

    x = x.astype(jnp.float32)
    return ffi.argmax(x, reductions) if ffi.fits(x) else reductions(x)


def _window(scaled, weight, score, settings, k, use_k, use_p):
    """The window program for every row -> (token [B], exact [B]: whether the window decides this row)."""
    b, v = scaled.shape
    c = min(CANDIDATES, v)
    kk = jnp.clip(jnp.where(use_k, k, c), 1, c)
    # The barrier keeps XLA from folding later slices into top_k's, which turns it back into a full sort.
    # (kk rides through it too: a barrier over exactly top_k's two outputs becomes one over the top_k tuple
    # once partitioned for a mesh, which crashes XLA's TopkDecomposer.)
    vals, idx, kk = jax.lax.optimization_barrier((*jax.lax.top_k(scaled, c), kk))  # [B, C] descending
    asc, ids = jax.lax.sort((vals[:, ::-1], idx[:, ::-1]), dimension=-1, num_keys=2)  # ascending (value, id)
    keep = top_k_mask(asc, kk)
    kth = jnp.take_along_axis(asc, (c - kk)[:, None], axis=-1)
    # top-k alone: exact when no value tying with the k-th lies outside the window.
    fits_k = (c == v) | (vals[:, -1] < kth[:, 0])
    # top-p: probabilities normalised over all V (the full program's softmax), plus the mass under the window;
    # exact when that mass is dropped anyway (every token outside has cumulative mass <= it <= 1 - top_p).
    mass = jnp.sum(weight, axis=-1)
    probs = jnp.where(keep, jnp.take_along_axis(weight, ids, axis=-1), 0.0)
    below = jnp.where(use_k, 0.0, 1.0 - jnp.sum(probs, axis=-1) / mass)
    probs = jnp.where(use_k[:, None], jax.nn.softmax(jnp.where(keep, asc, -jnp.inf), axis=-1), probs / mass[:, None])
    keep = keep & top_p_mask(probs, settings.top_p_drop, below)
    fits_p = use_k | (c == v) | (below <= settings.top_p_drop)
    ids, keep = jax.lax.sort((ids, keep), dimension=-1, num_keys=1)  # increasing id order
    w = jnp.where(keep, jnp.take_along_axis(weight, ids, axis=-1), 0.0)
    keep = keep & min_p_mask(w, settings.min_p)
    token = jnp.take_along_axis(ids, race(jnp.where(keep, jnp.take_along_axis(score, ids, axis=-1), 0.0))[:, None], -1)
    token = token[:, 0]
    return token, (use_k | use_p) & fits_k & fits_p


GREEDY, PLAIN, WINDOW, FULL = range(4)


def row_programs(settings: RowSettings, v: int, n_valid: int | None = None) -> jax.Array:
    """[B] int32: the program each row's settings select, GREEDY, PLAIN, WINDOW or FULL. A WINDOW row
    whose candidates cannot decide it (ties at the k-th value, or a nucleus wider than the window)
    still runs FULL at draw time."""
    nv = v if n_valid is None else min(n_valid, v)
    greedy = settings.temperature == 0
    no_k = (settings.top_k <= 0) | (settings.top_k >= nv)  # top_k >= the valid vocab keeps every token
    no_p = settings.top_p_drop <= 0  # top_p == 1 (or above, if traced)
    window = (~no_k & (settings.top_k <= min(CANDIDATES, v) - 1)) | (no_k & ~no_p)
    return jnp.where(greedy, GREEDY, jnp.where(no_k & no_p, PLAIN, jnp.where(window, WINDOW, FULL))).astype(jnp.int32)


def samples(settings: RowSettings) -> jax.Array:
    """[] bool: whether some row samples (is not greedy), the condition under which a draw makes clocks."""
    return jnp.any(settings.temperature != 0)


def sample_rows(keys: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None = None,
                clocks: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """One key per row [B], logits [B, V] -> tokens [B] int32, each row from softmax(filter_logits(...))
    (greedy rows: the argmax); no checks, jit/scan-safe. See the module docstring for the programs.
    clocks: exponential_clocks(keys, V) made beforehand, for a caller that draws twice with the same keys
    (speculative decoding's draft and check); read only when samples(settings)."""
    b, v = logits.shape
    rows = min_rows(b, v)  # reductions round alike for 1 row or many (see gpt2_jax.kernels.invariance)
    keys, logits, settings, clocks = jax.tree.map(lambda x: pad_rows(x, rows), (keys, logits, settings, clocks))
    program = row_programs(settings, v, n_valid)
    greedy, plain = program == GREEDY, program == PLAIN
    nv = v if n_valid is None else min(n_valid, v)
    no_k = (settings.top_k <= 0) | (settings.top_k >= nv)
    k = jnp.where(no_k, v, settings.top_k)
    use_k = (program == WINDOW) & ~no_k
    use_p = (program == WINDOW) & no_k
    # One materialised array for every program: XLA may contract x / t into an FMA inside a consumer
    # fusion, so per-program recomputations could disagree in the last bit.
    scaled = jax.lax.optimization_barrier(apply_temperature(logits, settings, n_valid))
    zeros = jnp.zeros(rows, jnp.int32)

    def sampled():  # every program but greedy's: only run when some row samples
        weight = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # the conds' operand: one array for all
        # The race's scores, materialised once like weight: every program masks these very bits.
        score = jax.lax.optimization_barrier(weight / (exponential_clocks(keys, v) if clocks is None else clocks))
        plain_score = lambda: jnp.where(min_p_mask(weight, settings.min_p), score, 0.0)
        full_plain = jax.lax.cond(jnp.any(plain), lambda: race(plain_score()), lambda: zeros)
        win, exact = jax.lax.cond(jnp.any(use_k | use_p), lambda: _window(scaled, weight, score, settings, k, use_k, use_p),
                                  lambda: (zeros, jnp.zeros(rows, bool)))  # fmt: skip
        need_full = ~greedy & ~plain & ~exact

        def full():
            kept = filter_scaled(scaled, settings) > -jnp.inf
            return race(jnp.where(kept, score, 0.0))

        full_tok = jax.lax.cond(jnp.any(need_full), full, lambda: zeros)
        return jnp.where(plain, full_plain, jnp.where(exact, win, full_tok))

    token = jnp.where(greedy, argmax(scaled), jax.lax.cond(samples(settings), sampled, lambda: zeros))
    return token[:b].astype(jnp.int32)


def log_probs(logits: jax.Array) -> jax.Array:
    """Raw logits [B, V] -> log_softmax [B, V] float32, rounded alike for 1 row or many (the rows are padded
    to the reduction's large-input path, see gpt2_jax.kernels.invariance)."""
    b, v = logits.shape
    return jax.nn.log_softmax(pad_rows(logits.astype(jnp.float32), min_rows(b, v)), axis=-1)[:b]


def token_logprobs(logits: Float[Array, "B V"], tokens: Int[Array, " B"]) -> Float[Array, " B"]:
    """log p(token) [B] under the raw logits [B, V] (no temperature or filters), rounded alike for 1 row or many."""
    return jnp.take_along_axis(log_probs(logits), tokens[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames="n_valid")
def _sample_jit(keys: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    return sample_rows(keys, logits, settings, n_valid)


def sample(key: jax.Array, logits: Float[Array, "B V"], *, temperature: Any, top_k: Any, top_p: Any, min_p: Any = 0.0,
           n_valid: int | None = None) -> Int[Array, " B"]:  # fmt: skip
    """One PRNG key or one per row [B], logits [B, V] -> next tokens [B] int32."""
    logits = checked_logits(logits, n_valid)
    B = logits.shape[0]
    return _sample_jit(row_keys(key, B), logits, row_settings(temperature, top_k, top_p, B, min_p), n_valid)
