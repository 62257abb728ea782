"""Next-token sampling: temperature, top-k and top-p (nucleus) filtering, then one draw per row.

Semantics are transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, then
softmax; temperature 0 means greedy. Settings are traced per-row values [B], never static: rows with
different settings share one compiled program, and changing a setting never recompiles.

Draws (`sample_rows`) pick one of four programs at run time with lax.cond on the traced settings,
so nothing recompiles: all-greedy batches take an argmax; batches without top-k/top-p the plain
softmax; batches whose top-k is small filter only the top-128 candidates; anything else runs the full
sort that `filter_logits` (and `next_token_probs`, the transformers-parity reference) uses. A row's
token does not depend on which program its batch took (see `sample_rows`).

Shape legend: B batch, V vocab rows, C candidates (128).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.errors import ConfigError, InputError


class RowSettings(NamedTuple):
    """Validated settings broadcast to one value per row; a pytree, so jit traces (not hashes) it."""

    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    # [B] float32: float32(1 - top_p), the sorted-ascending cumulative mass at or below which top-p
    # drops tokens. transformers subtracts in float64 and compares in float32; doing the same here on
    # the host keeps exact-boundary cases identical (1 - float32(0.9) is 3 ulps away from float32(0.1)).
    top_p_drop: jax.Array


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_sampling_args(temperature: Any, top_k: Any, top_p: Any, batch_size: int) -> None:
    """Raise ConfigError for a bad setting; each is a scalar or one value per row [B]. Tracers are skipped."""
    rules = {
        "temperature": ("a finite number >= 0 (0 means greedy)", lambda v: np.isfinite(v) & (v >= 0)),
        "top_k": ("an integer >= 0 (0 means off)", lambda v: v >= 0),
        "top_p": ("a number in (0, 1] (1 means off)", lambda v: (v > 0) & (v <= 1)),
    }
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if _is_tracer(value):
            continue  # inside a user's jit: values are unknown until run time
        allowed, ok = rules[name]
        v = np.asarray(value)
        if v.ndim > 1 or (v.ndim == 1 and v.shape[0] != batch_size):
            raise ConfigError(
                f"{name} must be a scalar or one value per row (shape ({batch_size},)), got shape {v.shape}"
            )
        integral = np.issubdtype(v.dtype, np.integer)
        if v.dtype == bool or not (integral or (name != "top_k" and np.issubdtype(v.dtype, np.floating))):
            raise ConfigError(f"{name} must be {allowed}, got {value!r} of dtype {v.dtype}")
        bad = np.flatnonzero(~np.atleast_1d(ok(v.astype(np.float64))))  # NaN fails every rule
        if bad.size:
            where = f"{name}[{bad[0]}]" if v.ndim else name
            raise ConfigError(f"{where} must be {allowed}, got {np.atleast_1d(v)[bad[0]].item()!r}")


def row_settings(temperature: Any, top_k: Any, top_p: Any, batch_size: int) -> RowSettings:
    """Validate (when concrete) and broadcast scalar or [B] settings to RowSettings of [B] arrays."""
    check_sampling_args(temperature, top_k, top_p, batch_size)
    shape = (batch_size,)

    def rows(x, dtype):  # concrete values stay host arrays, so no eager op compiles per value
        if _is_tracer(x):
            return jnp.broadcast_to(jnp.asarray(x, dtype), shape)
        return np.broadcast_to(np.asarray(x).astype(dtype), shape)

    k = top_k if _is_tracer(top_k) else np.minimum(np.asarray(top_k), np.iinfo(np.int32).max)
    if _is_tracer(top_p):  # float32 subtraction: can sit a few ulps from transformers' threshold
        drop = 1 - jnp.asarray(top_p, jnp.float32)
    else:
        drop = (1.0 - np.asarray(top_p, np.float64)).astype(np.float32)
    return RowSettings(rows(temperature, np.float32), rows(k, np.int32), rows(drop, np.float32))


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a + b as float32 (sum, exact rounding error), Knuth's branch-free form."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis [B, V] -> [B, V], in double-float32, rounded to float32."""
    # torch's CPU cumsum accumulates float32 in float64; a float32 scan drifts by several ulps over
    # 50k tokens, enough to move the top-p boundary. A (hi, lo) pair carries ~48 bits instead.
    def add(a, b):
        s, e = _two_sum(a[0], b[0])
        return _two_sum(s, e + a[1] + b[1])

    return jax.lax.associative_scan(add, (x, jnp.zeros_like(x)), axis=-1)[0]


def _masked(logits: jax.Array, n_valid: int | None) -> jax.Array:
    """[B, V] -> float32 [B, V], -inf in padding vocab columns (>= n_valid): never a candidate, not even greedy."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if n_valid is not None and n_valid < v:
        logits = jnp.where(jnp.arange(v) < n_valid, logits, -jnp.inf)
    return logits


def _divisor(settings: RowSettings) -> jax.Array:
    """[B, 1] temperature to divide by. Greedy rows divide by 1, so even the branch that where() discards
    stays NaN-free (x/0 is +-inf and 0/0 NaN; jax_debug_nans and gradients would trip on them)."""
    return jnp.where(settings.temperature == 0, 1.0, settings.temperature)[:, None]


def _argmax(x: jax.Array) -> jax.Array:
    """[B, N] -> [B] int32, exactly jnp.argmax (first maximum; first NaN if any). Two plain reductions,
    several times cheaper on CPU than argmax's variadic (value, index) reduction."""
    n = x.shape[-1]
    hit = (x == jnp.max(x, axis=-1, keepdims=True)) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def filter_logits(logits: jax.Array, settings: RowSettings, n_valid: int | None = None) -> jax.Array:
    """[B, V] logits -> [B, V] float32 log-weights, -inf where filtered out; no checks, jit/scan-safe."""
    return _filter_scaled(_masked(logits, n_valid) / _divisor(settings), settings)


def _filter_scaled(scaled: jax.Array, settings: RowSettings) -> jax.Array:
    """filter_logits on scaled = masked logits / divisor [B, V] (greedy rows: the masked logits)."""
    b, v = scaled.shape
    greedy = settings.temperature == 0

    # One stable ascending sort serves both filters. Top-k only removes the lowest values, so the
    # kept tokens' order is the order transformers' top-p sort sees. Among exactly tied values, a
    # stable sort puts the lower index first, as torch's CPU sort does for V <= 16 (above that its
    # tie order is unspecified; only which of the tied tokens survive can then differ, not how many).
    order = jnp.argsort(scaled, axis=-1, stable=True)
    asc = jnp.take_along_axis(scaled, order, axis=-1)

    # Top-k: the k-th largest value is a traced per-row threshold; every token tying with it stays,
    # as in TopKLogitsWarper (scores < kth are removed). k = 0 or k >= V keeps everything.
    k = jnp.where(settings.top_k <= 0, v, jnp.minimum(settings.top_k, v))
    kth = jnp.take_along_axis(asc, (v - k)[:, None], axis=-1)
    asc = jnp.where(asc >= kth, asc, -jnp.inf)

    # Top-p, TopPLogitsWarper's rule: drop tokens whose ascending cumulative probability is
    # <= 1 - p, but always keep the last (most likely) one so the nucleus is never empty.
    cum = _cumsum(jax.nn.softmax(asc, axis=-1))
    drop = (cum <= settings.top_p_drop[:, None]).at[:, -1].set(False)
    asc = jnp.where(drop, -jnp.inf, asc)
    filtered = jnp.zeros_like(asc).at[jnp.arange(b)[:, None], order].set(asc)  # undo the sort

    # Greedy is a one-hot in log space, so softmax and categorical give the argmax exactly
    # (argmax resolves ties to the lowest index).
    best = jnp.argmax(scaled, axis=-1)  # greedy rows divided by 1: their masked logits
    one_hot = jnp.where(jnp.arange(v) == best[:, None], 0.0, -jnp.inf)
    return jnp.where(greedy[:, None], one_hot, filtered)


CANDIDATES = 128  # C: the top-k path's fixed window; top_k <= C - 1 qualifies for it


def _inverse_cdf(w: jax.Array, u: jax.Array) -> jax.Array:
    """Weights w [B, N] >= 0 in increasing-id order, uniforms u [B] in [0, 1) -> [B] int32 position of
    the first weight whose cumulative sum exceeds u * total. Zero weights are never chosen."""
    n = w.shape[-1]
    cum = _cumsum(w)  # double-float: the rounded prefix sums barely depend on how zeros interleave
    pos = w > 0
    # total = the largest positive-weight prefix (the last one, unless rounding says otherwise), so a
    # positive weight always has cum > u * total: float32 u <= 1 - 2^-23 makes u * total < total.
    total = jnp.max(jnp.where(pos, cum, 0.0), axis=-1)
    hit = pos & (cum > (u * total)[:, None])
    first = jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
    return jnp.minimum(first, n - 1)  # only NaN logits leave no hit; keep the index in range anyway


def _program(settings: RowSettings, v: int, n_valid: int | None) -> tuple[jax.Array, jax.Array]:
    """-> (effective top_k [B] int32, V where off; the program `sample_rows` runs, a traced int32 0..3).
    Program 2 may still fall back to 3 at run time, when ties at the k-th value reach the window's end."""
    c = min(CANDIDATES, v)
    nv = v if n_valid is None else min(n_valid, v)
    greedy = settings.temperature == 0
    # top_k at or above the valid vocab keeps every valid token, exactly as the full path's rule does.
    no_k = (settings.top_k <= 0) | (settings.top_k >= nv)
    k = jnp.where(no_k, v, settings.top_k)
    no_p = settings.top_p_drop <= 0  # top_p == 1 (top_p above 1 as well, if traced)
    small_k = k <= (c - 1 if c < v else v)  # with C == V the window holds everything
    all_ = lambda row_ok: jnp.all(greedy | row_ok)  # noqa: E731  greedy rows fit every program
    return k, jnp.where(all_(False), 0, jnp.where(all_(no_k & no_p), 1, jnp.where(all_(small_k), 2, 3)))


def sample_rows(keys: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None = None) -> jax.Array:
    """One key per row [B], logits [B, V] -> tokens [B] int32; no checks, jit/scan-safe.

    Each row's token follows softmax(filter_logits(...)) (greedy rows: the argmax). Which program runs
    is chosen at run time for the whole batch (lax.cond on traced settings; nothing recompiles):
      0. every row greedy: argmax only; no sort, no random numbers.
      1. no row filters (top_k off or >= n_valid, top_p == 1): softmax over V; no sort.
      2. every sampled row has 0 < top_k <= C - 1: top-k then top-p on the top C candidates only, and
         only if ties at the k-th value cannot reach past the window (else program 3).
      3. anything else: the full stable sort of `filter_logits`.
    The draw is path-independent: inverse-CDF sampling with one uniform u per row (from that row's key)
    over token ids in increasing order, on unnormalised weights exp(scaled - row max) of the kept tokens:
    the token is the first id whose cumulative weight exceeds u * total, total = the kept weights' sum
    (so u * total < total, and zero-weight ids can never be chosen). The weights are computed once and
    only copied by each program, and the kept set and id order are the same on every path, so a row
    draws the same token whatever program its neighbours select - up to float rounding: the top-p
    boundary compares cumulative softmax probabilities whose normaliser is summed over V or over the C
    candidates (ulps apart), and the double-float prefix sums round alike only up to ~2^-44 relative
    (they see different runs of zero weights); either matters only when a value lands within an ulp of
    a threshold. One uniform per row, instead of V Gumbel draws.
    """
    b, v = logits.shape
    c = min(CANDIDATES, v)
    greedy = settings.temperature == 0
    k, branch = _program(settings, v, n_valid)
    # Every program reads this one materialised array. XLA turns x / t into x * (1 / t) and, fused into a
    # consumer such as exp(x / t - max), may contract that into an FMA (seen: ~8 ulps in a weight), so
    # per-program recomputations could disagree. Greedy rows divide by 1: theirs is the masked logits.
    scaled = jax.lax.optimization_barrier(_masked(logits, n_valid) / _divisor(settings))

    def all_greedy():
        return _argmax(scaled)

    def draw():
        # The unnormalised weights exp(scaled - row max), computed once: every program below only copies
        # them, because XLA CPU's exp rounds differently by context (vector loop vs tail: ~1 ulp).
        weight = jax.lax.optimization_barrier(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)))
        u = jax.vmap(jax.random.uniform)(keys)  # one float32 in [0, 1) per row

        def window():
            # [B, C] descending; everything outside the window is <= vals[:, -1]. The barrier keeps XLA
            # from folding later slices into top_k's, which turns it back into a full sort of V (~60x slower).
            # Greedy rows are top-1 with lowest-index tie-break: their max must not tie past the window.
            # (kk rides through the barrier too: a barrier over exactly top_k's two outputs becomes a
            # barrier over the top_k tuple itself once partitioned for a mesh, which crashes XLA's
            # TopkDecomposer: "optimization_barrier ... cannot be downcasted to GetTupleElement".)
            kk = jnp.clip(jnp.where(greedy, 1, k), 1, c)
            vals, idx, kk = jax.lax.optimization_barrier((*jax.lax.top_k(scaled, c), kk))
            kth = jnp.take_along_axis(vals, (kk - 1)[:, None], axis=-1)  # [B, 1]: the k-th largest value
            # Every value >= kth must be inside the window: the C-th value strictly below the k-th.
            fits = jnp.bool_(True) if c == v else jnp.all(vals[:, -1:] < kth)
            return vals, idx, kth, fits

        def no_window():
            f32, i32 = jnp.float32, jnp.int32
            return jnp.zeros((b, c), f32), jnp.zeros((b, c), i32), jnp.zeros((b, 1), f32), jnp.bool_(False)

        # top_k runs for program 2 only; a window too small for the ties at the k-th value sends it to 3.
        vals, idx, kth, fits = jax.lax.cond(branch == 2, window, no_window)
        final = jnp.where((branch == 2) & ~fits, 3, branch)

        def candidates():  # program 2
            # Ascending by (value, id): the full path's stable ascending order restricted to the window.
            asc, ids = jax.lax.sort((vals, idx), dimension=-1, num_keys=2)
            in_k = asc >= kth
            cum = _cumsum(jax.nn.softmax(jnp.where(in_k, asc, -jnp.inf), axis=-1))
            drop = (cum <= settings.top_p_drop[:, None]).at[:, -1].set(False)  # the most likely token stays
            keep = in_k & ~drop
            ids, keep = jax.lax.sort((ids, keep), dimension=-1, num_keys=1)  # increasing id order
            w = jnp.where(keep, jnp.take_along_axis(weight, ids, axis=-1), 0.0)
            token = jnp.take_along_axis(ids, _inverse_cdf(w, u)[:, None], axis=-1)[:, 0]
            # All ties at the max are in the window (fits): the smallest of their ids is the argmax.
            best = jnp.min(jnp.where(vals == vals[:, :1], idx, v), axis=-1)
            return jnp.where(greedy, best, token)

        def over_vocab():  # programs 1 and 3: the inverse CDF over all V weights
            # Program 1 keeps every token (padding has weight exp(-inf) = 0); program 3 the full filter's.
            kept = jax.lax.cond(
                final == 3, lambda: _filter_scaled(scaled, settings) > -jnp.inf, lambda: jnp.ones((b, v), bool)
            )
            token = _inverse_cdf(jnp.where(kept, weight, 0.0), u)
            # (Program 3 already drew greedy rows' one-hot exactly; program 1 needs the argmax.)
            return jax.lax.cond(jnp.any(greedy), lambda: jnp.where(greedy, _argmax(scaled), token), lambda: token)

        return jax.lax.cond(final == 2, candidates, over_vocab)

    token = jax.lax.cond(branch == 0, all_greedy, draw)
    return token.astype(jnp.int32)




@functools.partial(jax.jit, static_argnames="n_valid")
def _probs_jit(logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    return jax.nn.softmax(filter_logits(logits, settings, n_valid), axis=-1)


@functools.partial(jax.jit, static_argnames="n_valid")
def _sample_jit(keys: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    return sample_rows(keys, logits, settings, n_valid)


def row_keys(key: Any, batch_size: int) -> jax.Array:
    """One key (row b gets fold_in(key, b)) or one per row [B] -> [B] typed PRNG keys."""
    key = jnp.asarray(key)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.shape[-1:] != (2,):
            raise ConfigError(f"key must be a jax.random.key (or legacy PRNGKey), got {key.dtype} {key.shape}")
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(batch_size))
    if key.shape != (batch_size,):
        raise ConfigError(f"key must be one PRNG key or one per row (shape ({batch_size},)), got shape {key.shape}")
    return key


def _check_logits(logits: jax.Array, n_valid: int | None) -> None:
    if logits.ndim != 2:
        raise InputError(f"logits must have shape [B, V], got shape {logits.shape}")
    if n_valid is not None and not (isinstance(n_valid, int) and 0 < n_valid <= logits.shape[1]):
        raise ConfigError(f"n_valid must be an int in [1, V={logits.shape[1]}], got {n_valid!r}")


def next_token_probs(
    logits: jax.Array, *, temperature: Any, top_k: Any, top_p: Any, n_valid: int | None = None
) -> jax.Array:
    """[B, V] logits -> [B, V] float32: the exact distribution `sample` draws each row from."""
    logits = jnp.asarray(logits)
    _check_logits(logits, n_valid)
    return _probs_jit(logits, row_settings(temperature, top_k, top_p, logits.shape[0]), n_valid)


def sample(
    key: jax.Array, logits: jax.Array, *, temperature: Any, top_k: Any, top_p: Any, n_valid: int | None = None
) -> jax.Array:
    """One PRNG key or one per row [B], logits [B, V] -> next tokens [B] int32."""
    logits = jnp.asarray(logits)
    _check_logits(logits, n_valid)
    B = logits.shape[0]
    return _sample_jit(row_keys(key, B), logits, row_settings(temperature, top_k, top_p, B), n_valid)
