"""The forward pass: token ids [B, T] -> logits [B, T, V]; the same blocks with a KV cache for generation."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, TypeVar

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.model import invariant
from gpt2_jax.model.axes import constrain, mesh_of, on_mesh
from gpt2_jax.model.dropout import dropout
from gpt2_jax.model.invariant import F32, within
from gpt2_jax.model.kv_cache import CacheView, KVCache
from gpt2_jax.model.layer_loop import layer_at, n_layers, scan_layers
from gpt2_jax.model.layers import block, layer_norm
from gpt2_jax.model.paged_cache import PagedKVCache, PagedView
from gpt2_jax.model.params import Params
from gpt2_jax.model.precision_type import Precision

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float, Int

Cache = TypeVar("Cache", KVCache, PagedKVCache)  # forward_cached hands back the kind of cache it was given


def embed(
    params: Params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"] | Int[Array, " T"], tap=None
) -> Float[Array, "B T D"]:
    """tokens [B, T], positions [B, T] or [T] -> wte[tokens] + wpe[positions] [B, T, D] float32 (a token's
    row as its precision stores it: see invariant.token_rows). Hook points (see gpt2_jax.model.layers):
    hook_embed and hook_pos_embed, both [B, T, D].

    Out-of-range ids give NaN rather than a silently clamped row, so bad input never
    turns into plausible-looking logits inside a jit where it cannot raise."""
    tok = invariant.token_rows(params, tokens, Precision.of(params))
    pos = jnp.take(params["wpe"], positions, axis=0, mode="fill", fill_value=jnp.nan)
    if tap is not None:  # [T, D] positions broadcast as the sum would, so the hook sees [B, T, D]
        tok, pos = tap("hook_embed", tok.astype(F32)), tap("hook_pos_embed", jnp.broadcast_to(pos, tok.shape))
    return tok.astype(F32) + pos.astype(F32)


def unembed(params: Params, h: Float[Array, "B T D"], config: GPT2Config, tap=None) -> Float[Array, "B T V"]:
    """[B, T, D] -> logits [B, T, V] float32: ln_f(h) @ wte.T (tied to the embedding, no bias).
    Hook points: ln_final.hook_scale and ln_final.hook_normalized."""
    h = layer_norm(params["ln_f"], h, config.layer_norm_epsilon, within(tap, "ln_final"))
    return invariant.tied_logits(params, h, Precision.of(params))


def run_blocks(
    params: Params,
    x: Float[Array, "B T D"],
    config: GPT2Config,
    cache: CacheView | PagedView | None = None,
    key: jax.Array | None = None,
    tap=None,
    unroll: int = 1,
    remat: bool = False,
) -> tuple[Float[Array, "B T D"], CacheView | PagedView | None]:
    """x [B, T, D] -> (x [B, T, D], cache): the L blocks as one lax.scan over the layer index (compile
    time independent of L), per-layer or stacked params alike (see gpt2_jax.model.layer_loop). With a cache, each
    block writes its K/V into it; with a key, layer i's dropout uses fold_in(key, i). With a tap
    (gpt2_jax.interp.Tap), layer i's hook points are "blocks.{i}.*"; what the tap records rides in
    the carry (`store`; None, no leaves, without a tap) and is handed back to it after the loop.
    Training's options: unroll, layers per scan iteration (see gpt2_jax.training.step.TRAIN_UNROLL); remat,
    recompute each block's activations in the backward instead of keeping them (jax.checkpoint)."""
    layers, precision = scan_layers(params["h"]), Precision.of(params)
    S = x.shape[1] if cache is None else cache.mask.shape[-1]  # key slots each query attends over

    def step(carry, i):
        x, cache, store = carry
        layer_key = None if key is None else jax.random.fold_in(key, i)
        layer_tap = None if tap is None else tap.layer(i)
        x, cache = block(layer_at(layers, i), x, config, i, cache, layer_key, layer_tap, precision)
        return (x, cache, None if layer_tap is None else layer_tap.save(store)), None

    store = None if tap is None else tap.new_store(x.shape[0], x.shape[1], S)
    step = jax.checkpoint(step) if remat else step
    (x, cache, store), _ = jax.lax.scan(step, (x, cache, store), jnp.arange(n_layers(params["h"])), unroll=unroll)
    if tap is not None:
        tap.load(store)
    return x, cache


def apply(
    params: Params, tokens: Int[Array, "B T"], config: GPT2Config, key: jax.Array | None = None, tap=None
) -> Float[Array, "B T V"]:
    """tokens [B, T] -> logits [B, T, V], unjitted and unchecked. A key turns on dropout (training only);
    a tap (gpt2_jax.interp) records or edits the activations at TransformerLens's hook points."""
    return unembed(params, trunk(params, tokens, config, key, tap), config, tap)


def trunk(
    params: Params,
    tokens: Int[Array, "B T"],
    config: GPT2Config,
    key: jax.Array | None = None,
    tap=None,
    unroll: int = 1,
    remat: bool = False,
) -> Float[Array, "B T D"]:
    """tokens [B, T] -> the last block's output [B, T, D]: embeddings (dropped out with a key), then the
    blocks (run_blocks; unroll and remat are the training step's options). apply's body before unembed."""
    k_embd, k_blocks = (None, None) if key is None else jax.random.split(key)
    x = constrain(embed(params, tokens, jnp.arange(tokens.shape[1]), tap), "BTD")  # on a mesh: rows over "data"
    x = dropout(x, config.embd_pdrop, k_embd)
    return run_blocks(params, x, config, None, k_blocks, tap, unroll, remat)[0]


@functools.partial(jax.jit, static_argnames="config")
def _forward(params: Params, tokens: Int[Array, "B T"], config: GPT2Config) -> Float[Array, "B T V"]:
    return apply(params, tokens, config)  # no key: inference never applies dropout


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
        raise InputError(f"token id {int(values[b, t])} at [{b}, {t}] is outside the vocab [0, {config.vocab_size})")


def forward(params: Params, tokens, config: GPT2Config) -> Float[Array, "B T V"]:
    """tokens int32 [B, T] -> logits float32 [B, T, V]. jit-compiled; no dropout."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    check_tokens(tokens, config)
    with on_mesh(mesh_of(params)):  # sharded params: rows over "data", Megatron over "model"
        return _forward(params, jnp.asarray(tokens, jnp.int32), config)


def forward_cached(
    params: Params,
    tokens: Int[Array, "B T"],
    cache: Cache,
    config: GPT2Config,
    last: Int[Array, " B"] | None = None,
    hooks=None,
    rows: Int[Array, " K"] | None = None,
) -> tuple[Float[Array, "B T V"] | Float[Array, "B 1 V"] | Float[Array, "K T V"], Cache]:
    """tokens [B, T] into row b's slots [lengths[b], lengths[b] + T) -> (logits [B, T, V], cache with
    lengths + T). last [B]: return only the logits at that index of each row ([B, 1, V]; a prefill
    needs just each prompt's last token). rows [K]: return only those rows' logits ([K, T, V]; the
    unembedding reads all of wte, so rows whose logits nobody reads skip it). The blocks are the ones
    forward runs: each writes its new K/V into the cache, then attends over every slot up to the token's own.

    hooks: a gpt2_jax.interp.Hooks (hashable, so it can be a static jit argument) edits activations
    as in run_with_hooks; here each hook sees this call's T new tokens ([B, T, ...]; attention
    scores and patterns [B, H, T, S] over the cache's slots). None or no edits traces exactly the plain program.
    The model never imports interp: a Hooks builds its own tap (`hooks.tap(config)`), as any object with
    that method may."""
    tap = hooks.tap(config) if hooks else None  # Hooks() is falsy
    B, T = tokens.shape
    slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]: = the tokens' positions
    view = cache.view(T)  # a contiguous KVCache or a paged one (model.paged_cache): the same blocks either way
    # Slots past the context only ever hold padding (a finished row, a prompt's right padding): clamping
    # their position keeps the cache finite, since a masked slot's value still meets a zero weight.
    x = constrain(embed(params, tokens, jnp.minimum(slots, config.n_positions - 1), tap), "BTD")
    x, written = run_blocks(params, x, config, view, None, tap)
    if last is not None:
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    if rows is not None:
        x = x[rows]  # [K, T, D]
    return unembed(params, x, config, tap), _after(cache, written, T)


def _after(cache: Cache, view: CacheView | PagedView | None, T: int) -> Cache:
    """The cache once its view (the one cache.view made, written by the blocks) took T more tokens per row."""
    if isinstance(cache, KVCache) and isinstance(view, CacheView):
        return cache.after(view, T)
    if isinstance(cache, PagedKVCache) and isinstance(view, PagedView):
        return cache.after(view, T)
    raise InputError(f"a {type(cache).__name__} came back from the blocks as a {type(view).__name__}")
