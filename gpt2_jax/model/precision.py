"""Precision modes for inference: float32, bfloat16, and int8 weight-only quantisation.

  float32   everything in float32.
  bfloat16  weights, matmul inputs and the KV cache in bfloat16; matmuls accumulate in float32, and the
            residual stream, LayerNorm, softmax and logits stay float32 (see gpt2_jax.model.layers).
  int8      bfloat16 as above, but every block matmul weight (c_attn, c_proj, c_fc) is int8 with one
            float32 scale per output (a row of the [out, in] weight): w ~= q * scale, q = round(w / scale)
            in [-127, 127], scale = max |w| over the row / 127. The matmul converts q to bfloat16 (exactly: |q| <= 127
            fits bfloat16's 8-bit significand) and multiplies the float32 result by the scale. wte and wpe
            stay bfloat16: wte is both the embedding and the unembedding, whose error feeds every logit.
            For decode, which reads every weight once per token, this halves the bytes of the blocks.

bench/precision.py measures each mode's logit error against float32 (the table is in README.md).
int8 params are for inference only: they have no gradient, and checkpoints store float weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt2_jax.errors import ConfigError
from gpt2_jax.model.params import Params, cast_params

MODES = ("float32", "bfloat16", "int8")
_QUANTISED = ("c_attn", "c_proj", "c_fc")


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] -> (q int8 [..., out, in], scale float32 [..., out]): symmetric, per output."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero row: any scale reproduces it
    q = jnp.clip(jnp.round(w / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


@jax.jit
def quantize_int8(params: Params) -> Params:
    """bfloat16/float32 params -> int8 weight-only params (per-layer or stacked, as given): every block
    matmul's {"weight"} becomes {"weight": int8, "scale": float32 [(L,) out]}; everything else bfloat16."""
    params = cast_params(params, jnp.bfloat16)

    def layer(h: dict) -> dict:
        h = dict(h)
        for part in ("attn", "mlp"):
            h[part] = {name: _quantized(p) if name in _QUANTISED else p for name, p in h[part].items()}
        return h

    h = params["h"]
    return {**params, "h": [layer(p) for p in h] if isinstance(h, (list, tuple)) else layer(h)}


def _quantized(p: dict) -> dict:
    """One linear layer's {"weight", "bias"} -> {"weight": int8, "scale", "bias"}."""
    q, scale = quantize(p["weight"])
    return {**p, "weight": q, "scale": scale}


def with_precision(params: Params, mode: str) -> Params:
    """params in one of MODES (see the module docstring)."""
    if mode not in MODES:
        raise ConfigError(f"precision {mode!r} is not one of {', '.join(MODES)}")
    if mode == "int8":
        return quantize_int8(params)
    return cast_params(params, jnp.dtype(mode))
