"""The layer loop's view of the params: layer i's tensors inside one lax.scan over the layer index.

A scan compiles the block once, whatever the depth. What it must avoid is copying weights: XLA's CPU
matmul reads its operand from a buffer of its own, so `stacked[i]` inside the loop first copies the
slice (for decode, which reads each weight once per token, that doubles the traffic). So:

  stacked params (every "h" leaf [L, ...])     layer_at indexes them (the training step: the copy is
                                               nothing next to B x T tokens of compute, and its
                                               backward stays a plain scan)
  per-layer params ("h" a list of L dicts)     the matmul weights stay L separate buffers, and each
                                               matmul runs inside a lax.switch on the layer index
                                               (apply_weight), reading the chosen buffer in place;
                                               the small leaves (biases, LayerNorms, int8 scales) are
                                               stacked once per call, where copying costs nothing

Both give bit-identical results: the same matmul on the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.kernels.packed import Packed
from gpt2_jax.model.params import MATMULS


class PerLayer(NamedTuple):
    """One matmul weight of layer `index`, chosen at run time among L separate buffers."""

    buffers: tuple  # L arrays, one per layer
    index: jax.Array  # [] int32


def apply_weight(w: Any, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """fn(w) for a weight array; for a PerLayer weight, fn of the chosen buffer inside a lax.switch,
    so the buffer is read where it lies (only fn's result leaves the switch)."""
    if isinstance(w, PerLayer):
        return jax.lax.switch(w.index, [functools.partial(fn, b) for b in w.buffers])
    return fn(w)


def take(w: Any) -> jax.Array:
    """The array itself (small leaves are always plain arrays inside the loop; PerLayer for safety)."""
    return apply_weight(w, lambda a: a)


def _is_matmul(path) -> bool:
    names = [getattr(k, "key", None) for k in path]
    return names[-1] == "weight" and names[-2] in MATMULS


def scan_layers(h: Any) -> Any:
    """params["h"] -> what layer_at reads inside the scan: stacked leaves as they are; per-layer dicts
    as one dict whose matmul weights are tuples of L buffers and whose other leaves are stacked."""
    if not isinstance(h, (list, tuple)):
        return h

    def gather(path, *layers):
        return tuple(layers) if _is_matmul(path) else jnp.stack(layers)

    return jax.tree_util.tree_map_with_path(gather, h[0], *h[1:], is_leaf=lambda x: isinstance(x, Packed))


def layer_at(layers: Any, i: jax.Array) -> dict:
    """Layer i's params from scan_layers(h): plain arrays, matmul weights of per-layer params as PerLayer."""

    def pick(x):
        if isinstance(x, tuple):
            return PerLayer(x, i)
        return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)

    return jax.tree.map(pick, layers, is_leaf=lambda x: isinstance(x, tuple))


def n_layers(h: Any) -> int:
    """L, from per-layer or stacked params["h"]."""
    return len(h) if isinstance(h, (list, tuple)) else jax.tree.leaves(h)[0].shape[0]
