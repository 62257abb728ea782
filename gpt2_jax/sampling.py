"""Next-token sampling: temperature, top-k and top-p (nucleus) filtering, then one draw per row.

Semantics are transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, then
softmax; temperature 0 means greedy. Settings are traced per-row values [B], never static: rows with
different settings share one compiled program, and changing a setting never recompiles.

Shape legend: B batch, V vocab rows.
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


def filter_logits(logits: jax.Array, settings: RowSettings, n_valid: int | None = None) -> jax.Array:
    """[B, V] logits -> [B, V] float32 log-weights, -inf where filtered out; no checks, jit/scan-safe."""
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    if n_valid is not None and n_valid < v:  # padding vocab rows: never a candidate, not even greedy
        logits = jnp.where(jnp.arange(v) < n_valid, logits, -jnp.inf)
    greedy = settings.temperature == 0
    # Greedy rows divide by 1, so even the branch that where() discards below stays NaN-free
    # (x/0 is +-inf and 0/0 NaN; jax_debug_nans and gradients would trip on them).
    scaled = logits / jnp.where(greedy, 1.0, settings.temperature)[:, None]

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
    best = jnp.argmax(logits, axis=-1)
    one_hot = jnp.where(jnp.arange(v) == best[:, None], 0.0, -jnp.inf)
    return jnp.where(greedy[:, None], one_hot, filtered)


def _sample_rows(
    keys: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None = None
) -> jax.Array:
    """One key per row [B], logits [B, V] -> tokens [B] int32; no checks, jit/scan-safe."""
    # categorical is Gumbel-max: -inf entries can never win, and draws follow softmax(filtered).
    return jax.vmap(jax.random.categorical)(keys, filter_logits(logits, settings, n_valid)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="n_valid")
def _probs_jit(logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    return jax.nn.softmax(filter_logits(logits, settings, n_valid), axis=-1)


@functools.partial(jax.jit, static_argnames="n_valid")
def _sample_jit(key: jax.Array, logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    if key.ndim == 0:  # one key: row i uses fold_in(key, i), so its draw does not depend on B
        key = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0]))
    return _sample_rows(key, logits, settings, n_valid)


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
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # legacy uint32 keys [2] or [B, 2]
    if key.ndim > 1 or (key.ndim == 1 and key.shape[0] != logits.shape[0]):
        raise ConfigError(f"key must be one PRNG key or one per row (shape ({logits.shape[0]},)), got {key.shape}")
    return _sample_jit(key, logits, row_settings(temperature, top_k, top_p, logits.shape[0]), n_valid)
