"""The params pytree: names follow the checkpoint; each layer's tensors are their own buffers.

    params = {
      "wte": [V, D], "wpe": [P, D],
      "h": [                                   # L per-layer dicts (load() and init_params give this)
        {"ln_1": {"weight": [D], "bias": [D]},
         "attn": {"c_attn": {"weight": [3, D, D], "bias": [3, D]},  # q | k | v, each [out, in]
                  "c_proj": {"weight": [D, D],  "bias": [D]}},
         "ln_2": {"weight": [D], "bias": [D]},
         "mlp":  {"c_fc":   {"weight": [F, D],  "bias": [F]},     # [out, in]
                  "c_proj": {"weight": [D, F],  "bias": [D]}}},
        ...],
      "ln_f": {"weight": [D], "bias": [D]},
    }

The same blocks may also be held stacked (`stack_layers`: "h" one dict, every leaf [L, ...]), the form
checkpoints store and the training step differentiates. Every model path runs the layers as one
lax.scan over the layer index either way, so compile time does not grow with depth. Why per-layer
buffers: XLA's CPU matmul reads its weight from a buffer of its own, so slicing layer i out of a
stacked [L, ...] weight inside the loop copies the slice first, and decode (one weight read per
token) then reads every weight twice. With per-layer buffers each matmul runs inside a lax.switch on
the layer index (`apply_weight`) and reads the chosen buffer in place; the small leaves (biases,
LayerNorms) are stacked once per call (`scan_layers`), where a copy costs nothing.

Linear weights are held [out, in] (as torch.nn.Linear and nanoGPT store them; HuggingFace's Conv1D
stores [in, out], transposed on loading), so y = x @ W.T + b. Why: XLA's CPU matmul then computes every
output row with the same instruction sequence for any number of rows >= 2, so a token's activations
are the same bits in a batch of 1 or 64, in a prefill or a decode step (see layers.linear); with
[in, out] weights the kernel, and so the rounding, changes with the row count. c_attn's fused [D, 3D]
is held as [3, D, D]: q, k and v side by side, each [out, in] with its heads concatenated, so a mesh can
split every one of them by heads (see gpt2_jax.parallel.sharding). Without biases (nanoGPT bias=False) the
"bias" leaves are absent.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.kernels.packed import packed_rows
from gpt2_jax.model.precision_type import Precision
from gpt2_jax.model.tree_layout import (
    _EMBEDDINGS,
    _get,
    _set,
    flat_shapes,
    from_tree,
    layer_shapes,
    tree_shape,
)

Params = dict[str, Any]

# The block's matmuls, each a "weight" [out, in]: the per-layer buffers the layer loop reads in place
# (gpt2_jax.model.layer_loop), the weights training decays and int8 quantizes (gpt2_jax.model.precision); and
# those of them whose input rows w8a8 rounds to bytes: all but c_attn, whose input (ln_1's output) becomes the queries and keys, where a byte's rounding
# moves the attention scores and, through a sharp softmax, the rest (on a random gpt2-small, bench/peers.py's
# checkpoint, byte inputs to c_attn too gave 1.48e-01 logit error against 1.16e-01; int8's is 1.08e-01; on the
# trained bundled model no difference). c_attn keeps int8's int16 rows.
MATMULS = ("c_attn", "c_proj", "c_fc")
BYTE_INPUTS = ("c_proj", "c_fc")


def to_flat(params: Params, config: GPT2Config) -> dict[str, np.ndarray]:
    """Params pytree -> flat {h.{i}.name: array} in checkpoint shapes, layer axis unstacked (numpy, host)."""
    flat = {name: np.asarray(params[key]) for name, key in _EMBEDDINGS.items()}
    for name in layer_shapes(config):
        stacked = np.asarray(_get(stack_layers(params)["h"], name))
        flat.update({f"h.{i}.{name}": np.ascontiguousarray(from_tree(name, stacked[i])) for i in range(config.n_layer)})
    for name in ("weight", "bias") if config.bias else ("weight",):
        flat[f"ln_f.{name}"] = np.asarray(params["ln_f"][name])
    return flat


def init_params(key: jax.Array, config: GPT2Config, dtype: Any = jnp.float32, *, stacked: bool = False) -> Params:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm gains, and residual
    projections (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2 L). Per-layer buffers (the form load()
    gives), or stacked [L, ...] leaves with stacked=True."""
    shapes = flat_shapes(config.replace(n_layer=1))
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    resid_std = 0.02 / math.sqrt(2 * config.n_layer)
    params: Params = {"h": {}}
    for name, shape in shapes.items():
        layer = name.startswith("h.0.")
        full = (config.n_layer, *tree_shape(name[len("h.0.") :], shape)) if layer else shape
        if name.startswith(("ln_", "h.0.ln_")):
            value = jnp.ones(full, dtype) if name.endswith("weight") else jnp.zeros(full, dtype)
        elif name.endswith("bias"):
            value = jnp.zeros(full, dtype)
        else:
            std = resid_std if name.endswith("c_proj.weight") else 0.02
            value = (std * jax.random.normal(keys[name], full, jnp.float32)).astype(dtype)
        if layer:
            _set(params["h"], name[len("h.0.") :], value)
        else:
            _set(params, _EMBEDDINGS.get(name, name), value)
    return params if stacked else unstack_layers(params)


def cast_params(params: Params, dtype: Any) -> Params:
    """Every leaf cast to dtype (float32 or bfloat16). Not for int8 params, whose int8 leaves would lose
    their scales, nor float32-packed ones: gpt2_jax.model.precision.with_precision takes those."""
    precision = Precision.of(params)
    if precision.packed:
        raise ConfigError("these params are float32-packed (gpt2_jax.model.precision); cast them with "
                          "precision.with_precision(params, 'float32' or 'bfloat16'), which unpacks first")  # fmt: skip
    if precision.quantized:
        raise ConfigError("these params are int8 (gpt2_jax.model.precision); cast them with "
                          "precision.with_precision(params, 'float32' or 'bfloat16'), which dequantizes first")  # fmt: skip
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def is_int8(params: Params) -> bool:
    """Whether params are gpt2_jax.model.precision's int8 weight-only params, w8a8's included (the same weights)."""
    return Precision.of(params).quantized


def is_packed(params: Params) -> bool:
    """Whether params are gpt2_jax.model.precision's float32-packed params (wte and the block matmuls Packed)."""
    return Precision.of(params).packed


def is_w8a8(params: Params) -> bool:
    """Whether params are gpt2_jax.model.precision's w8a8 params (int8's with the weight rows' sums)."""
    return Precision.of(params) is Precision.W8A8


def check_trainable(params: Params) -> None:
    """Raise unless params can take gradient updates (float32 or bfloat16 leaves). int8, w8a8 and
    float32-packed params (gpt2_jax.model.precision) are inference forms: their integer or packed leaves have
    no gradient, so training them would fail deep inside jax.grad."""
    precision = Precision.of(params)
    if not precision.trainable:
        raise ConfigError(f"{precision.value} params are for inference only and cannot be trained: load them with "
                          "dtype='float32' or 'bfloat16', or convert them with "
                          "precision.with_precision(params, 'float32')")  # fmt: skip


def wte_rows(params: Params, ids: jax.Array) -> jax.Array:
    """ids [...] -> their rows of the tied embedding [..., D] float32 (an int8 wte's times their scales)."""
    precision = Precision.of(params)
    if precision.packed:
        return packed_rows(params["wte"], ids)
    rows = params["wte"][ids].astype(jnp.float32)
    return rows * params["wte_scale"][ids][..., None] if precision.quantized else rows


def float_dtype(params: Params) -> Any:
    """The dtype the model computes activations and keeps its KV cache in: float32, or bfloat16 for
    bfloat16 params (wpe's, the one matrix no precision mode quantizes)."""
    return params["wpe"].dtype


def param_bytes(params: Params) -> int:
    """Total bytes of all leaves."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def unstack_layers(params: Params) -> Params:
    """params with "h" as a list of L per-layer dicts, each leaf its own buffer (the form load() gives).
    Leaf by leaf: when the caller holds no other reference to the stacked params (a loader), each stacked
    leaf is freed once its layers are copied out, so the model is never held twice."""
    if isinstance(params["h"], (list, tuple)):
        return params
    flat, treedef = jax.tree.flatten(params["h"])
    n_layer = flat[0].shape[0]
    per_leaf = []
    for i in range(len(flat)):
        stacked, flat[i] = flat[i], None
        per_leaf.append([jnp.array(stacked[j]) for j in range(n_layer)])
        del stacked
    h = [jax.tree.unflatten(treedef, [leaf[j] for leaf in per_leaf]) for j in range(n_layer)]
    return {**params, "h": h}


def stack_layers(params: Params) -> Params:
    """The inverse of unstack_layers: "h" leaves stacked on a leading L axis (the checkpoint form)."""
    if Precision.of(params).packed:
        raise ConfigError("float32-packed params are for inference only (gpt2_jax.model.precision): unpack them with "
                          "precision.with_precision(params, 'float32') to train or save them")  # fmt: skip
    if not isinstance(params["h"], (list, tuple)):
        return params
    return {**params, "h": jax.tree.map(lambda *a: jnp.stack(a), *params["h"])}
