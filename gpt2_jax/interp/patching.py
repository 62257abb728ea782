"""Activation patching: which (layer, position) carries the information that makes a prediction.

Run the model on a corrupt prompt, but at one block's hook point and one position put back the value
it had on the clean prompt; if a metric of the logits (a logit difference, say) comes back toward its
clean value, that activation carried what the corruption removed. One jitted call sweeps every
layer and position: a vmap over positions inside a lax.map over layers.

Shape legend (gpt2_jax.config): B batch, T positions, V vocab rows, L layers.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.interp.hooks import BLOCK_POINTS, Hooks
from gpt2_jax.interp.run import _prepared, traced
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.params import Params

Metric = Callable[[jax.Array], jax.Array]  # logits [B, T, V] -> a scalar


class Patching(NamedTuple):
    """activation_patching's result: the metric of every patched run and of the two unpatched ones."""

    patched: dict[str, jax.Array]  # point -> [L, T]: the metric with the clean value put back at (layer, position)
    clean: jax.Array  # [] the metric of the clean run
    corrupt: jax.Array  # [] the metric of the corrupt run

    def effect(self, point: str) -> jax.Array:
        """[L, T]: how far patching moves the metric from corrupt (0) to clean (1)."""
        return (self.patched[point] - self.corrupt) / (self.clean - self.corrupt)


def position_axis(point: str) -> int:
    """The T axis of a block point: 2 for attention scores and patterns [B, H, T, S] (the query), else 1."""
    return 2 if point in ("attn.hook_attn_scores", "attn.hook_pattern") else 1


def patch_at(clean: jax.Array, layer: int, target_layer: jax.Array, position: jax.Array, axis: int):
    """The edit for block `layer`: its activation with position `position` (along `axis`) replaced by
    the clean run's value, when `layer` is the (traced) target; unchanged otherwise."""

    def edit(x: jax.Array) -> jax.Array:
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        hit = (jnp.arange(x.shape[axis]) == position).reshape(shape) & (layer == target_layer)
        return jnp.where(hit, clean, x)

    return edit


def patched_metric(
    params: Params,
    corrupt: jax.Array,
    config: GPT2Config,
    metric: Metric,
    point: str,
    clean: jax.Array,
    layer: jax.Array,
    position: jax.Array,
) -> jax.Array:
    """The metric of the corrupt run with clean [L, ...] put back at `point` of block `layer`, `position`.
    Every block gets the hook (the target layer is traced); only the target's changes anything."""
    axis = position_axis(point)
    edits = Hooks(tuple((f"blocks.{l}.{point}", patch_at(clean[l], l, layer, position, axis))
                        for l in range(config.n_layer)))  # fmt: skip
    return metric(traced(params, corrupt, config, edits)[0])


@functools.partial(jax.jit, static_argnames=("config", "metric", "points"))
def _patching(
    params: Params, clean: jax.Array, corrupt: jax.Array, config: GPT2Config, metric: Metric, points: tuple[str, ...]
) -> Patching:
    L, T = config.n_layer, clean.shape[1]
    record = tuple(f"blocks.{l}.{p}" for p in points for l in range(L))
    clean_logits, acts = traced(params, clean, config, Hooks(), record)
    patched = {}
    for point in points:
        values = jnp.stack([acts[f"blocks.{l}.{point}"] for l in range(L)])  # [L, ...]
        sweep = functools.partial(patched_metric, params, corrupt, config, metric, point, values)
        patched[point] = jax.lax.map(lambda l: jax.vmap(lambda t: sweep(l, t))(jnp.arange(T)), jnp.arange(L))
    return Patching(patched, metric(clean_logits), metric(traced(params, corrupt, config)[0]))


def activation_patching(
    params: Params, clean, corrupt, config: GPT2Config, metric: Metric, names: str | Sequence[str] = "hook_resid_pre"
) -> Patching:
    """For each block point in `names` ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "attn.hook_z",
    ... : hook names without "blocks.{l}."), the [L, T] grid of metric(logits) when the corrupt run
    gets that point's clean value back at one layer and one position (every row of the batch at once).
    clean and corrupt: token ids [B, T] of the same shape; metric: logits [B, T, V] -> a scalar, pure
    JAX (a new function compiles anew). Patching(...).effect(name) normalises to 0 (corrupt) .. 1 (clean)."""
    points = (names,) if isinstance(names, str) else tuple(names)
    for point in points:
        if point not in BLOCK_POINTS:
            close = difflib.get_close_matches(str(point), BLOCK_POINTS, n=5, cutoff=0.6)
            raise InputError(f"unknown block hook point {point!r} for activation_patching; "
                             f"{'close matches: ' + ', '.join(close) if close else 'points: ' + ', '.join(BLOCK_POINTS)}")  # fmt: skip
    clean, corrupt = _prepared(clean, config), _prepared(corrupt, config)
    if clean.shape != corrupt.shape:
        raise InputError(f"clean {tuple(clean.shape)} and corrupt {tuple(corrupt.shape)} token ids must have one shape")
    with on_mesh(mesh_of(params)):
        return _patching(params, clean, corrupt, config, metric, points)
