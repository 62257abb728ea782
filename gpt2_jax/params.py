"""The params pytree: names follow the checkpoint, block weights are stacked on a leading L axis.

    params = {
      "wte": [V, D], "wpe": [P, D],
      "h": {                                   # every leaf has a leading L axis
        "ln_1": {"weight": [L, D], "bias": [L, D]},
        "attn": {"c_attn": {"weight": [L, D, 3, D], "bias": [L, 3, D]},  # q | k | v
                 "c_proj": {"weight": [L, D, D],  "bias": [L, D]}},
        "ln_2": {"weight": [L, D], "bias": [L, D]},
        "mlp":  {"c_fc":   {"weight": [L, D, F],  "bias": [L, F]},
                 "c_proj": {"weight": [L, F, D],  "bias": [L, D]}},
      },
      "ln_f": {"weight": [D], "bias": [D]},
    }

Linear weights are stored [in, out], as HuggingFace's Conv1D stores them, so y = x @ W + b.
c_attn's fused [D, 3D] is kept as [D, 3, D] (a free reshape of the checkpoint's tensor): q, k and v
side by side, each with its heads concatenated, so a mesh can split every one of them by heads
(see gpt2_jax.sharding). Without biases (nanoGPT bias=False) the "bias" leaves are absent.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError

Params = dict[str, Any]

# Flat checkpoint name of the embeddings -> their key in the params pytree.
_EMBEDDINGS = {"wte.weight": "wte", "wpe.weight": "wpe"}


def layer_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Shapes of one block's tensors, keyed by their name inside h.{i}."""
    d, f = config.n_embd, config.mlp_dim
    shapes = {
        "ln_1.weight": (d,), "ln_1.bias": (d,),
        "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,), "ln_2.bias": (d,),
        "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,),
    }  # fmt: skip
    return {k: s for k, s in shapes.items() if config.bias or not k.endswith(".bias")}


def tree_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A block tensor's shape in the params pytree, from its checkpoint shape: only c_attn differs,
    its 3D output axis split into (3, D) = (q|k|v, heads x head_dim)."""
    if name == "attn.c_attn.weight":
        return (shape[0], 3, shape[1] // 3)
    if name == "attn.c_attn.bias":
        return (3, shape[0] // 3)
    return shape


def flat_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint by its flat name (h.{i}.attn.c_attn.weight, ...) and shape."""
    d = config.n_embd
    shapes = {"wte.weight": (config.vocab_size, d), "wpe.weight": (config.n_positions, d)}
    for i in range(config.n_layer):
        shapes.update({f"h.{i}.{k}": s for k, s in layer_shapes(config).items()})
    shapes["ln_f.weight"] = (d,)
    if config.bias:
        shapes["ln_f.bias"] = (d,)
    return shapes


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: Mapping, dotted: str) -> Any:
    for p in dotted.split("."):
        tree = tree[p]
    return tree


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_flat(flat: Mapping[str, Any], config: GPT2Config, source: str) -> None:
    """Raise CheckpointError naming every missing or unexpected key, or the first wrong shape."""
    expected = flat_shapes(config)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {_listing(missing)} for {config.n_layer}-layer config")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {_listing(unexpected)}")
    for key, shape in expected.items():
        got = tuple(flat[key].shape)
        if got != shape:
            raise CheckpointError(f"{source}: tensor {key} has shape {got}, expected {shape}")


def dotted(path) -> str:
    """A pytree key path -> its dotted name (h.attn.c_attn.weight)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_tree(shapes: Any, config: GPT2Config, source: str) -> None:
    """Raise CheckpointError unless a (stacked) params pytree, of arrays or shape metadata, has exactly
    the leaves and shapes that config implies; the message names the first difference."""
    want = {dotted(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda: init_params(jax.random.key(0), config)))[0]}  # fmt: skip
    got = {dotted(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        what = f"missing {_listing(missing)}" if missing else f"unexpected {_listing(unexpected)}"
        raise CheckpointError(f"{source}: {what} for the {config.n_layer}-layer config beside it")
    for name, shape in want.items():
        if got[name] != shape:
            hint = " (a layout older than gpt2_jax 0.2: convert the source checkpoint again)" if "c_attn" in name else ""
            raise CheckpointError(f"{source}: {name} has shape {got[name]}, expected {shape}{hint}")


def to_flat(params: Params, config: GPT2Config) -> dict[str, np.ndarray]:
    """Params pytree -> flat {h.{i}.name: array} in checkpoint shapes, layer axis unstacked (numpy, host)."""
    flat = {name: np.asarray(params[key]) for name, key in _EMBEDDINGS.items()}
    for name, shape in layer_shapes(config).items():
        stacked = np.asarray(_get(stack_layers(params)["h"], name))
        flat.update({f"h.{i}.{name}": stacked[i].reshape(shape) for i in range(config.n_layer)})
    for name in ("weight", "bias") if config.bias else ("weight",):
        flat[f"ln_f.{name}"] = np.asarray(params["ln_f"][name])
    return flat


def init_params(key: jax.Array, config: GPT2Config, dtype: Any = jnp.float32) -> Params:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm gains,
    and residual projections (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2 L)."""
    shapes = flat_shapes(config.replace(n_layer=1))
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    resid_std = 0.02 / math.sqrt(2 * config.n_layer)
    params: Params = {"h": {}}
    for name, shape in shapes.items():
        layer = name.startswith("h.0.")
        full = (config.n_layer, *tree_shape(name[len("h.0."):], shape)) if layer else shape
        if name.startswith(("ln_", "h.0.ln_")):
            value = jnp.ones(full, dtype) if name.endswith("weight") else jnp.zeros(full, dtype)
        elif name.endswith("bias"):
            value = jnp.zeros(full, dtype)
        else:
            std = resid_std if name.endswith("c_proj.weight") else 0.02
            value = (std * jax.random.normal(keys[name], full, jnp.float32)).astype(dtype)
        if layer:
            _set(params["h"], name[len("h.0."):], value)
        else:
            _set(params, _EMBEDDINGS.get(name, name), value)
    return params


def cast_params(params: Params, dtype: Any) -> Params:
    """Every leaf cast to dtype (float32 or bfloat16)."""
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def param_bytes(params: Params) -> int:
    """Total bytes of all leaves."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def unstack_layers(params: Params) -> Params:
    """params with "h" as a list of L per-layer dicts, each leaf its own buffer (faster decode on CPU)."""
    if isinstance(params["h"], (list, tuple)):
        return params
    n_layer = jax.tree.leaves(params["h"])[0].shape[0]
    h = [jax.tree.map(lambda a: jnp.array(a[i]), params["h"]) for i in range(n_layer)]
    return {**params, "h": h}


def stack_layers(params: Params) -> Params:
    """The inverse of unstack_layers: "h" leaves stacked on a leading L axis."""
    if not isinstance(params["h"], (list, tuple)):
        return params
    return {**params, "h": jax.tree.map(lambda *a: jnp.stack(a), *params["h"])}
