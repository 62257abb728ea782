"""The sampling reference: temperature -> top-k -> top-p -> min-p -> softmax, one small pure function per concept.

The semantics are transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper ->
MinPLogitsWarper; temperature 0 means greedy. They run after the logits processors
(gpt2_jax.sampling.processors, whose docstring gives the whole order). `filter_logits` composes the pieces over a full sort of V, and `next_token_probs` is the
exact distribution every draw follows. The fast run-time programs (gpt2_jax.sampling.draw) reuse
top_k_mask and top_p_mask on a window of candidates.

Shape legend: B batch, V vocab rows, N values per row (V, or a window of candidates).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.kernels import ffi
from gpt2_jax.sampling.metadata import RowSettings, row_settings
from gpt2_jax.sampling.processors import process_logits

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a + b as float32 (sum, exact rounding error), Knuth's branch-free form."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis [B, N] -> [B, N], each prefix accurate to ~2^-44 and rounded to
    float32, the same for a row alone or in any batch."""

    # Two paths, both needed. torch's CPU cumsum accumulates float32 in float64, and top-p compares these sums
    # with its threshold, so a sum one ulp off can move the boundary. On the CPU the kernel does what torch
    # does (one sequential float64 pass per row). Where it does not run (GPU, a mesh, no compiler) XLA's own
    # float32 cumsum is not good enough: over 50,257 sorted probabilities it was up to 3 ulps off torch's,
    # on about half the prefixes of random rows; so a (hi, lo) float32 pair carries
    # ~48 bits through a log-depth scan instead, which XLA compiles slowly for a 50k vocabulary (about 2 s
    # each time it appears), the reason the kernel path exists.
    def add(a, b):
        s, e = _two_sum(a[0], b[0])
        return _two_sum(s, e + a[1] + b[1])

    def double_float(x):
        return jax.lax.associative_scan(add, (x, jnp.zeros_like(x)), axis=-1)[0]

    x = x.astype(jnp.float32)
    return ffi.cumsum(x, double_float) if ffi.fits(x) else double_float(x)


def apply_temperature(logits: jax.Array, settings: RowSettings, n_valid: int | None = None) -> jax.Array:
    """[B, V] logits -> [B, V] float32 logits / temperature, -inf in padding vocab columns (>= n_valid,
    never a candidate, not even for greedy). Greedy rows (temperature 0) divide by 1: their scaled logits
    are the logits, and no branch ever computes x/0."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    if n_valid is not None and n_valid < v:
        logits = jnp.where(jnp.arange(v) < n_valid, logits, -jnp.inf)
    return logits / jnp.where(settings.temperature == 0, 1.0, settings.temperature)[:, None]


def top_k_mask(asc: jax.Array, k: jax.Array) -> jax.Array:
    """asc [B, N] sorted ascending, k [B] in [1, N] -> keep [B, N]: the k largest and every value tying
    with the k-th (TopKLogitsWarper removes only values below the k-th)."""
    kth = jnp.take_along_axis(asc, (asc.shape[-1] - k)[:, None], axis=-1)
    return asc >= kth


def suffix(keep: jax.Array) -> jax.Array:
    """keep [B, N] over values in ascending order -> [B, N]: everything from the first kept position on.
    Every filter removes a lowest part of the sorted row; this makes that shape exact even where a rounded
    cumulative sum or exp is not monotone, so one threshold per row describes the kept set."""
    n = keep.shape[-1]
    first = jnp.min(jnp.where(keep, jnp.arange(n, dtype=jnp.int32), n), axis=-1, keepdims=True)
    return jnp.arange(n, dtype=jnp.int32) >= first


def top_p_mask(probs: jax.Array, drop: jax.Array, below: jax.Array | float = 0.0) -> jax.Array:
    """probs [B, N] in ascending order (0 where already removed), drop [B] = float32(1 - top_p) ->
    keep [B, N]: TopPLogitsWarper's rule, drop a token whose ascending cumulative probability is
    <= 1 - top_p, always keeping the most likely one. below [B]: the mass of tokens under the first
    (when probs is a window of the largest candidates)."""
    cum = cumsum(probs) + jnp.asarray(below)[..., None]
    return suffix(~(cum <= drop[:, None]).at[:, -1].set(False))


def min_p_mask(probs: jax.Array, min_p: jax.Array) -> jax.Array:
    """probs [B, N] (any positive scale, 0 where removed), min_p [B] -> keep [B, N]: MinPLogitsWarper's rule,
    drop a token less likely than min_p times the most likely one (which always stays)."""
    top = jnp.max(probs, axis=-1, keepdims=True)
    return (probs >= min_p[:, None] * top) | (probs == top)


def filter_logits(logits: jax.Array, settings: RowSettings, n_valid: int | None = None) -> jax.Array:
    """[B, V] logits -> [B, V] float32 log-weights, -inf where filtered out (a one-hot for greedy rows)."""
    return filter_scaled(apply_temperature(logits, settings, n_valid), settings)


def sort_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 whose integer order is the floats' total order (-inf < ... < -0.0 < 0.0 < ... < inf).
    The map is its own inverse. On CPU XLA sorts int32 ~5x faster than float32, ~10x faster than argsort."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return i ^ ((i >> 31) & 0x7FFFFFFF)  # negative floats: reverse the order of their magnitude bits


def sort_ascending(x: jax.Array) -> jax.Array:
    """[B, N] float32 -> [B, N] the same values in ascending order (values only: which of several tied
    tokens sits where changes no value, so no token ids ride along)."""
    return jax.lax.bitcast_convert_type(sort_key(jax.lax.sort(sort_key(x), dimension=-1)), jnp.float32)


def kept_tokens(scaled: jax.Array, asc: jax.Array) -> jax.Array:
    """scaled [B, V], asc [B, V] = sort_ascending(scaled) with a lowest part set to -inf -> keep [B, V]: the
    tokens of the kept suffix, ties at its lowest value resolved as a stable ascending sort would: the
    higher ids sit later, so they are the ones kept. (-inf tokens may go either way; their weight is 0.)"""
    v = scaled.shape[-1]
    n_keep = jnp.sum(asc > -jnp.inf, axis=-1, dtype=jnp.int32)[:, None]
    lowest = jnp.take_along_axis(asc, jnp.clip(v - n_keep, 0, v - 1), axis=-1)  # [B, 1]
    above, tied = scaled > lowest, scaled == lowest
    need = n_keep - jnp.sum(above, axis=-1, dtype=jnp.int32, keepdims=True)  # ties that make the count
    rank = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)  # 1-based among the ties, by id
    n_tied = rank[:, -1:]
    return (n_keep > 0) & (above | (tied & (rank > n_tied - need)))


def filter_scaled(scaled: jax.Array, settings: RowSettings) -> jax.Array:
    """filter_logits after the temperature: top-k, top-p and min-p over one ascending sort of V."""
    b, v = scaled.shape
    # One sort serves every filter. Each removes only a lowest part of the row, so the kept tokens' order
    # is the order transformers' top-p sort sees. Among exactly tied values the lower id counts as the
    # smaller, as in a stable sort and in torch's CPU sort for V <= 16 (above that its tie order is
    # unspecified; only which of the tied tokens survive can then differ, not how many).
    asc = sort_ascending(scaled)
    k = jnp.where(settings.top_k <= 0, v, jnp.minimum(settings.top_k, v))  # 0 (off) or >= V keep all
    asc = jnp.where(top_k_mask(asc, k), asc, -jnp.inf)
    asc = jnp.where(top_p_mask(jax.nn.softmax(asc, axis=-1), settings.top_p_drop), asc, -jnp.inf)
    asc = jnp.where(suffix(min_p_mask(jax.nn.softmax(asc, axis=-1), settings.min_p)), asc, -jnp.inf)
    filtered = jnp.where(kept_tokens(scaled, asc), scaled, -jnp.inf)
    # Greedy is a one-hot in log space, so softmax and categorical give the argmax exactly
    # (argmax resolves ties to the lowest index).
    best = jnp.argmax(scaled, axis=-1)
    one_hot = jnp.where(jnp.arange(v) == best[:, None], 0.0, -jnp.inf)
    return jnp.where((settings.temperature == 0)[:, None], one_hot, filtered)


def checked_logits(logits: Any, n_valid: int | None) -> Float[Array, "B V"]:
    """Logits [B, V] as a jax array, checked (InputError, ConfigError) with n_valid, the ids that can be drawn."""
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise InputError(f"logits must have shape [B, V], got shape {logits.shape}")
    if n_valid is not None and not (isinstance(n_valid, int) and 0 < n_valid <= logits.shape[1]):
        raise ConfigError(f"n_valid must be an int in [1, V={logits.shape[1]}], got {n_valid!r}")
    return logits


@functools.partial(jax.jit, static_argnames="n_valid")
def _probs_jit(logits: jax.Array, settings: RowSettings, n_valid: int | None) -> jax.Array:
    return jax.nn.softmax(filter_logits(logits, settings, n_valid), axis=-1)


def next_token_probs(logits: Float[Array, "B V"], *, temperature: Any, top_k: Any, top_p: Any, min_p: Any = 0.0,
                     n_valid: int | None = None, prompts: Any = None, outputs: Any = None, eos_id: int | None = None,
                     stop_ids: Any = (), **processors: Any) -> Float[Array, "B V"]:  # fmt: skip
    """[B, V] logits -> [B, V] float32: the exact distribution `sample` draws each row from. With
    processors (generate's repetition_penalty, logit_bias, ...), prompts [B] and outputs [B] (token-id
    lists) give each row's text so far, and the logits are processed first (gpt2_jax.sampling.processors.process_logits)."""
    logits = checked_logits(logits, n_valid)
    if processors or prompts is not None:
        prompts = [[] for _ in range(logits.shape[0])] if prompts is None else prompts
        logits = process_logits(logits, prompts=prompts, outputs=outputs, eos_id=eos_id, stop_ids=stop_ids,
                                **processors)  # fmt: skip
    return _probs_jit(logits, row_settings(temperature, top_k, top_p, logits.shape[0], min_p), n_valid)
