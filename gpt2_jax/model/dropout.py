"""Inverted dropout with 16-bit decisions, for training only (inference passes no key)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DROP_BITS = 16  # random bits per dropout decision


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout: zero each element with probability rate, scale the rest by 1/(1-rate).
    key None (inference) means no dropout at all.

    Each decision reads 16 random bits (jax.random.bits as uint16: half the threefry work of
    bernoulli's 32-bit uniforms, which was a third of a training attention's time). So the rate is
    used as the nearest multiple of 2^-16 (0.1 -> 0.100006), and the kept values are scaled by one
    over that multiple's keep probability, so the expectation is exactly x."""
    if key is None or rate == 0.0:
        return x
    dropped = min(round(rate * 2**DROP_BITS), 2**DROP_BITS - 1)  # an element drops when bits < dropped
    keep = jax.random.bits(key, x.shape, jnp.uint16) >= dropped
    return jnp.where(keep, x * (2**DROP_BITS / (2**DROP_BITS - dropped)), 0.0)
