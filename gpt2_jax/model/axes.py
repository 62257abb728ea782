"""Logical axes: activations named by their shape-legend letters ("BTD", "BHSK"), and the ("data", "model")
mesh they map to when params are sharded. Every model function pins its activations with `constrain`;
outside a mesh (one device) each call is a no-op, so the same code runs sharded and unsharded.

  B (batch)  -> "data"     rows split over data-parallel devices
  H (heads), F (MLP width) -> "model"   Megatron-style tensor parallelism
  every other letter       -> whole on every device

How params are laid out on the mesh (partition specs, loading shard by shard) is gpt2_jax.parallel.sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gpt2_jax.errors import ConfigError

AXES = ("data", "model")
# Shape-legend letter -> the mesh axis that splits it; every other letter stays whole.
_LETTER_AXIS = {"B": "data", "H": "model", "F": "model"}


def mesh_of(params: dict) -> Mesh | None:
    """The ("data", "model") mesh params are laid out on, or None for a single device."""
    sharding = getattr(params["wte"], "sharding", None)
    if isinstance(sharding, NamedSharding) and set(AXES) <= set(sharding.mesh.axis_names):
        mesh = sharding.mesh
        if not isinstance(mesh, Mesh):  # a concrete array's sharding names its devices; a traced one's may not
            raise ConfigError("mesh_of needs the params themselves, not values traced from them")
        return mesh if mesh.size > 1 else None
    return None


def data_size(mesh: Mesh | None) -> int:
    """Rows per batch must be a multiple of this: the mesh's data axis (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["data"]


@contextlib.contextmanager
def on_mesh(mesh: Mesh | None) -> Iterator[None]:
    """Trace and run under this mesh, so constrain() takes effect; without a mesh, nothing changes."""
    if mesh is None:
        yield
    else:
        with jax.set_mesh(mesh):
            yield


def constrain(x: jax.Array, dims: str) -> jax.Array:
    """Pin x's layout by its shape-legend letters, e.g. "BHSK": B over "data", H and F over "model",
    every other letter whole. A no-op outside on_mesh, and for any dimension its axis doesn't divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names):
        return x
    if len(dims) != x.ndim:
        raise ValueError(f"constrain: dims {dims!r} for an array of shape {x.shape}")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec = []
    for letter, n in zip(dims, x.shape):
        axis = _LETTER_AXIS.get(letter)
        spec.append(axis if axis is not None and sizes[axis] > 1 and n % sizes[axis] == 0 else None)
    return jax.lax.with_sharding_constraint(x, P(*spec))


def replicate(tree: Any) -> Any:
    """Every leaf whole on every device (so every process can read it); a no-op outside on_mesh."""
    return jax.tree.map(lambda a: constrain(a, "." * a.ndim), tree)
