"""GPT-2 itself: the params pytree, its blocks, attention, the KV cache and the forward pass.

  params.py      the params pytree (per-layer or stacked), shapes, init_params, checkpoint <-> tree layout
  checks.py      checkpoint tensors and params against a config, each error naming file, field and shapes
  layers.py      the textbook: gelu, layer_norm, linear, mlp, attend, attention, block, one pure function each
  invariant.py   what they pass through so a row's bits are its own: row padding, matmul dispatch, hook taps
  attention.py   attention's arithmetic (invariant's half): the block-by-block softmax, training's plain one
  kv_cache.py    the KV cache: allocated once, written in place, one write position per row
  paged_cache.py the paged KV cache: a pool of blocks shared by every row, a block table per row
  gpt2.py        embed, run_blocks (one scan over L), unembed, forward, forward_cached
  layer_loop.py  the layer scan's view of the params (weights read in place)
  axes.py        logical axes: constrain activations by shape letters, on a mesh or not
  dropout.py     inverted dropout, 16-bit decisions (training only)
  precision_type.py  Precision: the one precision type, parsed from a mode's name or read from params
  precision.py   the modes' conversions: float32-packed, bfloat16, int8 and w8a8 weights (with_precision)

Shape legend (gpt2_jax.config): B batch, T positions, S cache slots, D width, H heads, K head dim,
F MLP width, V vocab, L layers.
"""

from gpt2_jax.model.gpt2 import apply, forward
from gpt2_jax.model.kv_cache import KVCache, init_cache
from gpt2_jax.model.params import Params, cast_params, init_params, stack_layers, unstack_layers
from gpt2_jax.model.precision_type import Precision

__all__ = [
    "KVCache",
    "Params",
    "Precision",
    "apply",
    "cast_params",
    "forward",
    "init_cache",
    "init_params",
    "stack_layers",
    "unstack_layers",
]
