"""Many devices: a ("data", "model") mesh, Megatron-style tensor parallelism and data parallelism.

Parameters (PartitionSpecs; the L axis of stacked leaves is never split):
  attn.c_attn  weight [L, 3, D, D], bias [L, 3, D]  split by heads: the output axis (H x K) over "model"
  attn.c_proj  weight [L, D, D]                     split by heads: its input axis over "model"
  mlp.c_fc     weight [L, F, D],   bias [L, F]      split by outputs: F over "model"
  mlp.c_proj   weight [L, D, F]                     split by inputs: F over "model"
  (linear weights are [out, in]; per-layer params have the same leaves without the L axis)
  c_proj biases, LayerNorms, wpe                    replicated (each bias is added once, after the reduction)
  wte [V, D]   vocab rows over "model" when "model" divides V (nanoGPT's padded 50304), else replicated.
               GPT-2's V = 50257 = 29 x 1733 divides by no mesh size below 29, and JAX shards only
               evenly; padding it would change the logits' shape. Replicated, wte costs every device
               V x D (77 MB fp32 for gpt2, 161 MB bf16 for gpt2-xl: 5% of its weights).
Activations: the batch over "data"; the residual stream [B, T, D] is whole on every "model" device;
q, k, v and the KV cache [(L,) B, H, S, K] are split by heads, the MLP's hidden [B, T, F] by columns.
So a block's only communication is one all-reduce after each c_proj (attention's and the MLP's);
no weight ever moves. The constraints below pin that layout; XLA's partitioner inserts the collectives.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.model.axes import AXES, constrain, data_size, mesh_of, on_mesh, replicate  # noqa: F401 (public here too)
from gpt2_jax.model.params import Params

# (module, leaf) -> the axis of that leaf split over "model" (negative: counted from the end,
# so stacked [L, ...] and per-layer leaves share the rule). int8 "scale" (and w8a8's "qsum") follows its
# output axis.
_MODEL_AXIS: dict[tuple[str, ...], int] = {
    ("c_attn", "weight"): -2, ("c_attn", "bias"): -1, ("c_attn", "scale"): -1,
    ("c_fc", "weight"): -2, ("c_fc", "bias"): -1, ("c_fc", "scale"): -1, ("c_fc", "qsum"): -1,
    ("c_proj", "weight"): -1,
}  # fmt: skip


def make_mesh(data: int | None = None, model: int | None = None, devices: list | None = None) -> Mesh:
    """A [data, model] mesh over `devices` (default: all). One size given: the other uses the rest;
    none: data parallelism over every device. A mesh may use fewer devices than there are."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, size in (("data", data), ("model", model)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ConfigError(f"mesh {name} size must be an int >= 1, got {size!r}")
    if model is None:  # the model axis takes the devices the data axis leaves (none given: 1)
        model = 1 if data is None else _rest(n, data, "data")
    if data is None:
        data = _rest(n, model, "model")
    if data * model > n:
        raise ConfigError(f"mesh data={data} x model={model} needs {data * model} devices, but {n} are available")
    if data * model < n and jax.process_count() > 1:
        raise ConfigError(f"mesh data={data} x model={model} must use all {n} devices when running on "
                          f"{jax.process_count()} processes")  # fmt: skip
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: data * model])


def _rest(n: int, given: int, name: str) -> int:
    """The other axis's size when `name` has `given` of the n devices."""
    if n % given:
        raise ConfigError(f"mesh {name}={given} does not divide the {n} available devices")
    return n // given


def parse_mesh(text: str) -> Mesh:
    """'data=2,model=4' (either part optional, e.g. 'model=8') -> make_mesh(data=2, model=4)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(data|model)=(\d+)", part)
        if not m or m.group(1) in sizes:
            raise ConfigError(f"--mesh {text!r}: expected data=N,model=M (e.g. data=2,model=4)")
        sizes[m.group(1)] = int(m.group(2))
    return make_mesh(data=sizes.get("data"), model=sizes.get("model"))


def check_mesh(config: GPT2Config, mesh: Mesh) -> None:
    """Raise ConfigError unless the model axis divides the heads and the MLP width."""
    model = mesh.shape["model"]
    for what, n in (("n_head", config.n_head), ("the MLP width", config.mlp_dim)):
        if n % model:
            raise ConfigError(f"mesh model axis of size {model} does not divide {what} = {n}")


def _names(path) -> tuple[str, ...]:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def leaf_spec(names: tuple[str, ...], ndim: int, config: GPT2Config, model: int) -> P:
    """The PartitionSpec of one parameter, by its path in the pytree (see the module docstring)."""
    if names in (("wte",), ("wte_scale",), ("wte_qsum",), ("wte_residual",)):  # int8's wte_* follow wte's rows
        split = model > 1 and config.vocab_size % model == 0
        return P("model", *[None] * (ndim - 1)) if split else P()
    axis = _MODEL_AXIS.get(names[-2:])
    if axis is None:
        return P()
    spec: list[str | None] = [None] * ndim
    spec[axis] = "model"
    return P(*spec)


def param_shardings(params: Params, config: GPT2Config, mesh: Mesh) -> Params:
    """A NamedSharding per leaf of params (arrays or ShapeDtypeStructs; stacked or per-layer)."""
    model = mesh.shape["model"]
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, leaf_spec(_names(path), len(a.shape), config, model)), params
    )


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """x (numpy or jax) -> a jax.Array with that sharding. Host arrays go shard by shard, so the whole
    tensor never lands on one device; with several processes each one places its own devices' shards
    (every process must hold the same values)."""
    if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params: Params, config: GPT2Config, mesh: Mesh) -> Params:
    """params (host or device, stacked or per-layer) -> the same pytree laid out on the mesh."""
    check_mesh(config, mesh)
    return jax.tree.map(put, params, param_shardings(params, config, mesh))


def onto_mesh(tree: Any, mesh: Mesh) -> Any:
    """Every leaf not yet on the mesh (step counters, say) placed on it whole, so that a restore
    targeting this tree, and the jitted step reading it, see a single layout."""

    def place(a):
        if isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == mesh:
            return a
        return put(a, NamedSharding(mesh, P()))

    return jax.tree.map(place, tree)
