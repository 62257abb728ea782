"""run_with_cache and run_with_hooks: the model's own forward (gpt2_jax.model.gpt2.apply) with a tap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.interp.hooks import Hooks, Tap, checked_hooks, select_names
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.gpt2 import apply, check_tokens
from gpt2_jax.model.params import Params

NO_EDITS = Hooks()  # the empty edit set (hashable: a static jit argument)


def traced(
    params: Params, tokens: jax.Array, config: GPT2Config, edits: Hooks = NO_EDITS, record: tuple[str, ...] = ()
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tokens [B, T] -> (logits [B, T, V], {name: activation}), unjitted: for use inside a caller's own
    jit, vmap or grad (the tools here build on it)."""
    tap = Tap(edits, record, config)
    logits = apply(params, tokens, config, tap=tap)
    return logits, {name: tap.captured[name] for name in record}


_traced = functools.partial(jax.jit, static_argnames=("config", "edits", "record"))(traced)


def _prepared(tokens, config: GPT2Config) -> jax.Array:
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    check_tokens(tokens, config)
    return jnp.asarray(tokens, jnp.int32)


def run_with_cache(
    params: Params, tokens, config: GPT2Config, names=None, hooks=None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """tokens int [B, T] -> (logits [B, T, V], cache): cache maps TransformerLens hook names to the
    activations there, in forward order. names: None (every point), one name, a list of exact names,
    or a predicate name -> bool; only those are kept (and held in memory). hooks ({name: fn}, as in
    run_with_hooks) edit the forward first; the cache holds the edited values. jit-compiled (a new
    names or hooks value compiles once); on a mesh when params are sharded.

    Shapes: hook_embed, hook_pos_embed, blocks.{l}.hook_resid_pre/mid/post, hook_attn_out, hook_mlp_out
    [B, T, D]; ln1/ln2/ln_final .hook_scale [B, T, 1] (sqrt(var + eps)) and .hook_normalized [B, T, D]
    ((x - mean) / scale, before the LayerNorm's weight and bias); attn.hook_q/k/v/z [B, T, H, K];
    attn.hook_attn_scores [B, H, T, T] (scaled, -inf where masked) and attn.hook_pattern [B, H, T, T];
    mlp.hook_pre/hook_post [B, T, F]."""
    tokens = _prepared(tokens, config)
    record, edits = select_names(names, config), checked_hooks(hooks, config)
    with on_mesh(mesh_of(params)):
        logits, cache = _traced(params, tokens, config, edits, record)
    return logits, {name: cache[name] for name in record}  # jit returns dicts sorted; forward order reads better


def run_with_hooks(params: Params, tokens, config: GPT2Config, hooks) -> jax.Array:
    """tokens int [B, T] -> logits [B, T, V] with each hook's fn applied where the forward reaches its
    name: hooks is {name: fn}, (name, fn) pairs or a Hooks; fn(activation) -> an array of the same
    shape, pure JAX (ablation, patching, steering). Differentiable (jax.grad through a hook's
    parameters is attribution patching) and usable under jax.vmap (a sweep of patches in one call).
    An identity fn gives the same logits as forward, bit for bit."""
    return run_with_cache(params, tokens, config, names=(), hooks=hooks)[0]
