"""Precision modes for inference: float32 (plain or packed), bfloat16, and int8 weight-only quantisation.

  float32   everything in float32.
  float32-packed
            float32, bit for bit, with the tied wte and the blocks' c_attn, c_proj and c_fc held in 3.5 bytes a
            weight instead of 4 (gpt2_jax.kernels.packed.Packed, lossless: each weight's low 3 bytes, and a 4-bit code
            for its top byte, its sign and 7 exponent bits; the rare top byte outside a matrix's 15 most common is
            listed beside it). On a CPU the kernels rebuild them in registers and run rowdot's multiply-adds, so
            logits, tokens and logprobs equal float32's bit for bit at any batch, while a decode step reads 12.5%
            fewer bytes: faster at B=1, which is bound by the memory's speed, slower for many rows, which pay the
            rebuilding again per row tile (bench/peers.py). Elsewhere they are unpacked for XLA's matmul.
            Per-layer params only (load()'s form); for inference: to train or save, unpack with
            with_precision(params, "float32").
  bfloat16  weights, matmul inputs and the KV cache in bfloat16; matmuls accumulate in float32, and the
            residual stream, LayerNorm, softmax and logits stay float32 (see gpt2_jax.model.layers).
  int8      float32, but every matmul weight is int8 with one float32 scale per output: the blocks'
            c_attn, c_proj and c_fc ({"weight": int8 [out, in], "scale": [out]}) and the tied wte
            ("wte" int8 [V, D], "wte_scale" [V]: a token's row is both its embedding and its logit's
            weights). w ~= q * scale, q = round(w / scale) in [-127, 127], scale = max |w| over the row
            / 127. Everything else (wpe, LayerNorms, biases, the KV cache, the residual stream) stays
            float32. On a CPU each int8 matmul is gpt2_jax.kernels.ffi.rowdot_int8: the activation row
            rounded to int16 by its own scale (a step of 1/65534 of its largest element, 258x finer than
            the weights'), the dot products summed exactly in integers, one rounding at the end. So a
            row's bits never depend on its batch, and a decode step reads 1 byte per weight (a quarter
            of float32's). The embedding reads a second byte of the tied wte ("wte_residual" int8 [V, D],
            see embedding_residual): (q + r / 256)[token] * scale[token], within 1/256 of a step of the
            float32 row; only a step's B rows are looked up, so it costs memory, never bandwidth, and the
            head reads q alone. Elsewhere (GPU, no kernels) XLA's matmul of x and q as float32, then the
            scales.
  w8a8      int8's weights (the same q and scales), with each matmul's input row rounded to a byte instead
            of int16 (but c_attn's: see params.BYTE_INPUTS): 255 steps over the row's range (0 included)
            and a zero point, as ONNX Runtime's dynamic int8 rounds its activations, but per row. On a CPU
            with AVX512-VNNI a decode step's few rows and a prefill's many then multiply at twice the rate
            (gpt2_jax.kernels' a8.h and vnni_rows.h), for more logit error (bench/precision.py,
            bench/peers.py). The params hold each weight row's sum too ("qsum" int32 [out] beside the
            scales of c_proj and c_fc, "wte_qsum" [V]), which the kernel needs and which marks the mode;
            they are computed here, from q, never stored: a saved w8a8 checkpoint is int8's, and
            load(..., dtype="w8a8") adds them back.

bench/precision.py measures each mode's logit error against float32 (the table is in README.md), and
bench/peers.py int8 speed and error against other engines' int8. int8 params are for inference only:
they have no gradient. `gpt2-jax convert --dtype int8` stores them quantized; load() keeps them so.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt2_jax.errors import ConfigError
from gpt2_jax.kernels.packed import pack, unpack
from gpt2_jax.model.params import BYTE_INPUTS, MATMULS, Params, cast_params, is_int8, is_packed, is_w8a8
from gpt2_jax.model.precision_type import MODES, Precision  # noqa: F401 (MODES: the names with_precision takes)


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] -> (q int8 [..., out, in], scale float32 [..., out]): symmetric, per output."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero row: any scale reproduces it
    q = jnp.clip(jnp.round(w / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def _layers(params: Params, fn, names: tuple[str, ...] = MATMULS) -> Params:
    """params with fn applied to every block matmul's {"weight", ...} (per-layer or stacked "h") among names."""

    def layer(h: dict) -> dict:
        h = dict(h)
        for part in ("attn", "mlp"):
            h[part] = {name: fn(p) if name in names else p for name, p in h[part].items()}
        return h

    h = params["h"]
    return {**params, "h": [layer(p) for p in h] if isinstance(h, (list, tuple)) else layer(h)}


def embedding_residual(w: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """The tied embedding's second byte: w [V, D] float32, its int8 q and scale [V] -> r int8 [V, D] with
    w ~= (q + r / 256) * scale within 1/256 of q's step (q rounds to nearest, so 256 (w / scale - q) is in
    [-128, 128]: rounded, and clipped to [-127, 127] where it reaches 128, it is a byte)."""
    return jnp.clip(jnp.round((w / scale[:, None] - q) * 256.0), -127, 127).astype(jnp.int8)


@jax.jit
def _quantize_int8(params: Params) -> Params:
    params = cast_params(params, jnp.float32)
    wte, wte_scale = quantize(params["wte"])
    residual = embedding_residual(params["wte"], wte, wte_scale)
    params = _layers(params, lambda p: {**p, **dict(zip(("weight", "scale"), quantize(p["weight"]), strict=True))})
    return {**params, "wte": wte, "wte_scale": wte_scale, "wte_residual": residual}


def quantize_int8(params: Params) -> Params:
    """float params -> int8 weight-only params (see the module docstring); int8 params as they are (w8a8's
    without their row sums)."""
    return drop_row_sums(params) if is_int8(params) else _quantize_int8(params)


def row_sums(q: jax.Array) -> jax.Array:
    """q int8 [..., out, in] -> each row's sum, int32 [..., out] (w8a8's qsum)."""
    return jnp.sum(q, axis=-1, dtype=jnp.int32)


@jax.jit
def _add_row_sums(params: Params) -> Params:
    params = _layers(params, lambda p: {**p, "qsum": row_sums(p["weight"])}, BYTE_INPUTS)
    return {**params, "wte_qsum": row_sums(params["wte"])}


def quantize_w8a8(params: Params) -> Params:
    """float or int8 params -> w8a8 params (int8's, with each weight row's sum); w8a8 params as they are."""
    return params if is_w8a8(params) else _add_row_sums(quantize_int8(params))


def drop_row_sums(params: Params) -> Params:
    """w8a8 params -> int8's (the same weights; what a checkpoint stores); other params as they are."""
    if not is_w8a8(params):
        return params
    params = _layers(params, lambda p: {k: v for k, v in p.items() if k != "qsum"})
    return {k: v for k, v in params.items() if k != "wte_qsum"}


@jax.jit
def _dequantize(params: Params) -> Params:
    def linear(p: dict) -> dict:
        p = dict(p)
        scale = p.pop("scale")
        return {**p, "weight": p["weight"].astype(jnp.float32) * scale[..., None]}

    params = dict(_layers(params, linear))
    scale = params.pop("wte_scale")
    params.pop("wte_residual", None)  # one float wte serves both ends: the head's q * scale
    return {**params, "wte": params["wte"].astype(jnp.float32) * scale[:, None]}


def dequantize(params: Params) -> Params:
    """int8 params -> float32 params holding the quantized values (q * scale); float params as they are."""
    return _dequantize(drop_row_sums(params)) if is_int8(params) else params


def float_weight(p: dict, precision: Precision) -> jax.Array:
    """One matmul's weight [out..., in] as the float32 values it holds (an int8 one's q * scale, a packed one
    unpacked): what dequantize and unpack_params give for the whole model, for one linear."""
    if precision.packed:
        return unpack(p["weight"])
    w = p["weight"].astype(jnp.float32)
    return w * p["scale"][..., None] if precision.quantized else w


def pack_params(params: Params) -> Params:
    """float32 params (per-layer, load()'s form) -> float32-packed params: wte and the block matmuls' weights
    packed (gpt2_jax.kernels.packed.pack), everything else as it is. float32-packed params as they are."""
    if is_packed(params):
        return params
    if not isinstance(params["h"], (list, tuple)):
        raise ConfigError("float32-packed needs per-layer params (load()'s form, or unstack_layers(params))")
    params = cast_params(dequantize(params), jnp.float32)
    return {**_layers(params, lambda p: {**p, "weight": pack(p["weight"])}), "wte": pack(params["wte"])}


def unpack_params(params: Params) -> Params:
    """float32-packed params -> the float32 params they hold (bit for bit); other params as they are."""
    if not is_packed(params):
        return params
    return {**_layers(params, lambda p: {**p, "weight": unpack(p["weight"])}), "wte": unpack(params["wte"])}


def with_precision(params: Params, mode: Precision | str) -> Params:
    """params in mode (a Precision or its name, one of MODES; see the module docstring), from float,
    float32-packed, int8 or w8a8 params."""
    mode = Precision.parse(mode)
    if mode.packed:
        return pack_params(params)
    params = unpack_params(params)
    if mode is Precision.INT8:
        return quantize_int8(params)
    if mode is Precision.W8A8:
        return quantize_w8a8(params)
    return cast_params(dequantize(params), jnp.dtype(mode.value))
