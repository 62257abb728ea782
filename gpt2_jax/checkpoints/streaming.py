"""Flat lazy tensors -> the params pytree on its device(s), one slot at a time, in bounded memory.

Each leaf of params (see gpt2_jax.model.params) is built by jax.make_array_from_callback: for every
device the callback allocates that device's shard once, in the final dtype (hostmem.host_buffer,
which the CPU backend adopts without copying), and copies each layer's tensor into its slot a few
MiB at a time, casting on the way. So the peak is the weights plus a few MiB, the model is never
held twice, and on a mesh each device receives only its own shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from gpt2_jax.checkpoints.host_buffers import prefetching
from gpt2_jax.checkpoints.lazy import Index, Lazy, shard_index, then, transposed
from gpt2_jax.config import GPT2Config
from gpt2_jax.model.checks import check_flat
from gpt2_jax.model.params import Params, _set, layer_shapes, tree_shape
from gpt2_jax.model.tree_layout import _LINEAR_WEIGHTS

CHUNK_BYTES = 4 << 20  # per copy: small enough to stay in the allocator's warm memory


def as_tree_shape(name: str, t: Any) -> Lazy:
    """A block tensor (lazy or numpy; checkpoint layout, Conv1D [in, out]) read in its params layout (see
    params.tree_shape): linear weights as [out, in], c_attn's [D, 3D] as [3, D, D] (q, k and v each read
    from its own third of the columns), its bias [3D] as [3, D]."""
    shape, dtype, axis = tuple(t.shape), np.dtype(t.dtype), getattr(t, "chunk_axis", 0)
    tree, whole = tree_shape(name, shape), getattr(t, "whole", None)  # whole: only a file's Lazy has one
    if name == "attn.c_attn.weight":
        d = tree[1]

        def read_qkv(index: Index) -> np.ndarray:
            qkv, outs, ins = index
            o0, o1, _ = outs.indices(d)
            return np.stack([t[(ins, slice(k * d + o0, k * d + o1))].T for k in range(*qkv.indices(3))])

        # stored [out, in] as [3D, D] (nanoGPT, read here transposed), q | k | v are its three row blocks
        qkv = then(whole, lambda w: w.T.reshape(tree) if w.T.flags.c_contiguous else None)
        return Lazy(tree, dtype, read_qkv, 2 if axis == 0 else 1, qkv)  # chunks along the file's rows
    if name in _LINEAR_WEIGHTS:
        return transposed(t if isinstance(t, Lazy) else Lazy(shape, dtype, lambda index: t[index], axis))
    if tree == shape:
        return Lazy(shape, dtype, lambda index: t[index], axis, whole)
    return Lazy(tree, dtype, lambda index: np.asarray(t[(slice(None),)]).reshape(tree)[index],
                whole=then(whole, lambda w: w.reshape(tree)))  # c_attn's bias, [3D] -> [3, D]  # fmt: skip


def adoptable(src: Lazy, dtype: np.dtype) -> np.ndarray | None:
    """src as a view of its file's private mapping, if jax.device_put can take that view as the
    array's buffer as it is: the whole tensor, already in the params layout and dtype, C-contiguous
    and 64-byte aligned (the XLA CPU backend adopts such host arrays instead of copying them). Then
    loading it reads and copies nothing, and its pages are read from the page cache on first use.
    Writes never reach the file (copy-on-write). None otherwise: it is copied into a fresh buffer."""
    view = src.whole() if src.whole is not None and np.dtype(src.dtype) == dtype else None
    if view is None or view.shape != tuple(src.shape) or view.dtype != dtype:
        return None
    return view if view.flags.c_contiguous and view.ctypes.data % 64 == 0 else None


def leaf_sources(flat: Mapping[str, Any], config: GPT2Config) -> dict[str, tuple[bool, list[Lazy]]]:
    """Dotted params leaf -> (stacked on L?, its sources in params shape: one per layer, or the one)."""
    leaves = {"wte": (False, [as_tree_shape("", flat["wte.weight"])]),
              "wpe": (False, [as_tree_shape("", flat["wpe.weight"])])}  # fmt: skip
    for name in layer_shapes(config):
        leaves[f"h.{name}"] = (True, [as_tree_shape(name, flat[f"h.{i}.{name}"]) for i in range(config.n_layer)])
    for name in ("weight", "bias") if config.bias else ("weight",):
        leaves[f"ln_f.{name}"] = (False, [as_tree_shape("", flat[f"ln_f.{name}"])])
    return leaves


def copy_into(out: np.ndarray, src: Lazy, index: Index, progress: Any) -> None:
    """out[...] = src[index] (cast to out's dtype), CHUNK_BYTES at a time along src.chunk_axis."""
    if out.ndim == 0 or out.size == 0:
        out[...] = src[index]
        return
    axis = src.chunk_axis
    span = range(*index[axis].indices(src.shape[axis]))
    step = max(1, CHUNK_BYTES * len(span) // max(1, out.nbytes))
    for i in range(0, len(span), step):
        part = span[i : i + step]
        at = tuple(slice(i, i + len(part)) if a == axis else slice(None) for a in range(out.ndim))
        out[at] = src[tuple(slice(part.start, part.stop, span.step) if a == axis else s for a, s in enumerate(index))]
        progress.update(out[at].nbytes)


def fill_shard(shape: tuple[int, ...], dtype: Any, stacked: bool, sources: list[Lazy],
               index: Index, progress: Any) -> np.ndarray:  # fmt: skip
    """One device's shard of a leaf, read from its sources straight into a fresh host buffer."""
    from gpt2_jax.checkpoints.host_buffers import host_buffer

    index = tuple(s if isinstance(s, slice) else slice(s, s + 1) for s in index)
    index += (slice(None),) * (len(shape) - len(index))
    out = host_buffer(tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)), dtype)
    if not stacked:
        copy_into(out, sources[0], index, progress)
        return out
    for j, layer in enumerate(range(*index[0].indices(shape[0]))):
        copy_into(out[j], sources[layer], index[1:], progress)
    return out


def _shardings(leaves: dict[str, tuple[bool, list[Lazy]]], shapes: dict[str, tuple[int, ...]],
               config: GPT2Config, mesh: Any) -> dict[str, Sharding]:  # fmt: skip
    if mesh is None:
        return {k: SingleDeviceSharding(jax.local_devices()[0]) for k in leaves}
    from gpt2_jax.parallel.sharding import check_mesh, leaf_spec

    check_mesh(config, mesh)
    model = mesh.shape["model"]
    return {k: jax.sharding.NamedSharding(mesh, leaf_spec(tuple(k.split(".")), len(shapes[k]), config, model))
            for k in leaves}  # fmt: skip


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    """A tqdm bar in bytes, shown only when enabled and the work outlasts 2 s (quiet otherwise)."""
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
              delay=2.0, leave=False) as bar:  # fmt: skip
        yield bar


def build_params(flat: Mapping[str, Any], config: GPT2Config, source: str, dtype: Any = None, mesh: Any = None,
                 progress: bool = False, stacked: bool = False, config_source: str = "the config") -> Params:  # fmt: skip
    """Checked flat {name: lazy or numpy tensor} -> params on the default device (or the mesh), each
    leaf allocated once in its final dtype (the stored one if dtype is None): per-layer buffers (what
    load() gives), or block leaves stacked on L with stacked=True. config_source names where the config
    came from, for the error when it disagrees with the tensors."""
    check_flat(flat, config, source, config_source)
    leaves = leaf_sources(flat, config)
    shapes = {k: ((config.n_layer,) if st else ()) + src[0].shape for k, (st, src) in leaves.items()}
    shardings = _shardings(leaves, shapes, config, mesh)
    plan = []  # one entry per array built, in order: (layer or None, name, shape, sharding, dtype, stacked?, sources)
    for key, (on_l, sources) in leaves.items():
        dt = np.dtype(dtype or sources[0].dtype)
        if on_l and not stacked:  # one array per layer, sharded as the stacked leaf without its L axis
            sh = _drop_layer_axis(shardings[key])
            plan += [(i, key[2:], shapes[key][1:], sh, dt, False, [src]) for i, src in enumerate(sources)]
        else:
            plan.append((None, key, shapes[key], shardings[key], dt, on_l, sources))
    # on one device, a tensor stored exactly as its buffer must be is that buffer: the file's pages, no copy
    views = [adoptable(srcs[0], dt) if mesh is None and not on_l else None for _, _, _, _, dt, on_l, srcs in plan]
    # every host buffer the loop asks for, in its order (one per device shard): allocated ahead on a thread
    specs = [(sh.shard_shape(shape), dt) for (_, _, shape, sh, dt, _, _), v in zip(plan, views) if v is None
             for _ in sh.addressable_devices]  # fmt: skip
    total = sum(int(np.prod(sh.shard_shape(shape))) * dt.itemsize * len(sh.addressable_devices)
                for _, _, shape, sh, dt, _, _ in plan)  # fmt: skip
    params: Params = {} if stacked else {"h": [{} for _ in range(config.n_layer)]}
    with progress_bar(total, progress, f"loading {source}") as bar, prefetching(specs, max(total // 16, 16 << 20)):
        for (layer, name, shape, sh, dt, on_l, sources), view in zip(plan, views):
            if view is not None:
                array = jax.device_put(view, sh)
                bar.update(view.nbytes)
            else:
                array = jax.make_array_from_callback(
                    shape,
                    sh,
                    lambda index, t=shape, d=dt, st=on_l, s=sources: fill_shard(t, d, st, s, shard_index(index), bar),
                )
            _set(params if layer is None else params["h"][layer], name, array)
    return params


def _drop_layer_axis(sharding: Sharding) -> Sharding:
    """The sharding of one layer's slice of a stacked leaf (whose L axis is never split)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding
