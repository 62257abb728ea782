"""The forward pass: token ids [B, T] -> logits [B, T, V], a lax.scan over the stacked blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.layers import F32, attn_scale, block, layer_norm
from gpt2_jax.params import Params


def embed(params: Params, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens [B, T], positions [B, T] or [T] -> [B, T, D] float32: wte[token] + wpe[position].

    Out-of-range ids give NaN rather than a silently clamped row, so bad input never
    turns into plausible-looking logits inside a jit where it cannot raise."""
    tok = jnp.take(params["wte"], tokens, axis=0, mode="fill", fill_value=jnp.nan)
    pos = jnp.take(params["wpe"], positions, axis=0, mode="fill", fill_value=jnp.nan)
    return tok.astype(F32) + pos.astype(F32)


def unembed(params: Params, h: jax.Array, config: GPT2Config) -> jax.Array:
    """[B, T, D] -> logits [B, T, V] float32: final LayerNorm, then h @ wte.T (tied, no bias)."""
    h = layer_norm(params["ln_f"], h, config.layer_norm_epsilon)
    wte = params["wte"]
    return jnp.einsum("BTD,VD->BTV", h.astype(wte.dtype), wte, preferred_element_type=F32)


def run_blocks(params: Params, x: jax.Array, config: GPT2Config) -> jax.Array:
    """[B, T, D] -> [B, T, D]: scan over the L stacked blocks (compile time independent of L)."""

    def step(x, layer):
        p, i = layer
        return block(p, x, config, attn_scale(config, i)), None

    x, _ = jax.lax.scan(step, x, (params["h"], jnp.arange(config.n_layer)))
    return x


@functools.partial(jax.jit, static_argnames="config")
def _forward(params: Params, tokens: jax.Array, config: GPT2Config) -> jax.Array:
    T = tokens.shape[1]
    x = embed(params, tokens, jnp.arange(T))
    return unembed(params, run_blocks(params, x, config), config)


def check_tokens(tokens, config: GPT2Config) -> None:
    """Raise InputError for a non-[B, T] integer array, T beyond the context, or ids outside the vocab."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"tokens must be an integer array [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.shape[1] > config.n_positions:
        raise InputError(
            f"sequence of {tokens.shape[1]} tokens is longer than the context n_positions={config.n_positions}"
        )
    if tokens.shape[1] == 0:
        raise InputError("tokens has no positions (T = 0)")
    if isinstance(tokens, jax.core.Tracer):
        return  # values unknown while tracing; embed() turns bad ids into NaN instead
    values = np.asarray(tokens)
    bad = (values < 0) | (values >= config.vocab_size)
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise InputError(
            f"token id {int(values[b, t])} at [{b}, {t}] is outside the vocab [0, {config.vocab_size})"
        )


def forward(params: Params, tokens, config: GPT2Config) -> jax.Array:
    """tokens int32 [B, T] -> logits float32 [B, T, V]. jit-compiled; no dropout."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    check_tokens(tokens, config)
    return _forward(params, jnp.asarray(tokens, jnp.int32), config)
