"""gpt2_jax's own checkpoint: a directory holding gpt2_jax.json (the GPT2Config) and params/ (orbax).

params/ is a plain orbax PyTree checkpoint, block leaves stacked [L, ...], written uncompressed and
without OCDBT, so that each leaf's bytes are one file that a load on one device maps in place of
reading it (_mapped). Anything else orbax wrote (OCDBT, compressed, sharded over processes), a
cast on loading (dtype=) and a mesh are read by TensorStore into fresh buffers instead."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gpt2_jax.checkpoints import hf
from gpt2_jax.checkpoints.atomic import atomic_dir
from gpt2_jax.checkpoints.host_buffers import host_buffer, prefetching
from gpt2_jax.checkpoints.lazy import shard_index
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError, GPT2JaxError
from gpt2_jax.model.checks import check_tree
from gpt2_jax.model.params import Params, _set, stack_layers, unstack_layers
from gpt2_jax.model.precision import drop_row_sums
from gpt2_jax.model.tree_layout import dotted

CONFIG_FILE = "gpt2_jax.json"
PARAMS_DIR = "params"
# What save() and convert --force may replace: a directory holding only a checkpoint of either format.
CHECKPOINT_FILES = (CONFIG_FILE, PARAMS_DIR, *hf.FILES)


def _checkpointer():
    """Orbax, uncompressed: zstd made saving gpt2-xl 6x slower and doubled its peak memory, to save
    ~10% of fp32 bytes. And without OCDBT: each leaf is then a zarr array whose one chunk is a plain
    file of its raw bytes, which restore() maps instead of reading (see _mapped). Checkpoints written
    compressed or with OCDBT (gpt2_jax 0.2, the bundled Shakespeare model) still restore, by TensorStore."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False))


def save(dst: str | Path, params: Params, config: GPT2Config, *, force: bool = False) -> Path:
    """Write params (per-layer or stacked; stored stacked) + config to dst atomically; an existing dst is
    replaced only with force=True, and only where it is a checkpoint (CHECKPOINT_FILES) or empty."""
    dst = Path(dst).absolute()
    params = stack_layers(drop_row_sums(params))  # w8a8 is stored as int8's weights (its row sums come back on load)
    with atomic_dir(dst, force, CHECKPOINT_FILES) as tmp:
        if jax.process_index() == 0:  # with several processes: one config file, every process's shards
            (tmp / CONFIG_FILE).write_text(config.to_json())
        import orbax.checkpoint as ocp

        _checkpointer().save(tmp / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    return dst


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_config(path: Path) -> GPT2Config:
    try:
        d = json.loads((path / CONFIG_FILE).read_bytes())
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, found {type(d).__name__}")
        return GPT2Config.from_dict(d)
    except (ValueError, RecursionError) as e:  # RecursionError: thousands of nested brackets
        raise CheckpointError(f"{path / CONFIG_FILE}: invalid config ({str(e)[:300]})") from None


def _error(path: Path, e: Exception) -> CheckpointError:
    msg = str(e).splitlines()[0] if str(e) else ""
    return CheckpointError(f"{path}: cannot restore ({type(e).__name__}: {msg})")


def _stores(path: Path, stored: Any) -> dict[str, Any] | None:
    """Each leaf's TensorStore array, opened from orbax's own metadata, or None for a layout this
    reader does not know (then orbax restores it)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    try:
        meta = json.loads((path / "_METADATA").read_text())
        context = ocp.type_handlers.get_ts_context(use_ocdbt=meta["use_ocdbt"])
        stores = {}
        for name in (dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]):
            info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(path), use_zarr3=meta["use_zarr3"],
                                               ts_context=context)  # fmt: skip
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=meta["use_ocdbt"])
            stores[name] = ts.open(spec, context=context, open=True, read=True).result()
        return stores
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mapped(path: Path, stored: Any, dtype: Any) -> dict[str, np.ndarray] | None:
    """Every leaf's stored bytes memory-mapped copy-on-write, with no read and no copy, where the
    checkpoint allows it: zarr v2 without OCDBT (what save() writes), each leaf one uncompressed C-order
    chunk in one file of exactly its bytes, stored in the dtype asked for. None otherwise (then
    TensorStore reads it, and reports whatever is wrong with it)."""
    import ml_dtypes

    try:
        meta = json.loads((path / "_METADATA").read_text())
        if meta.get("use_ocdbt", True) or meta.get("use_zarr3", False):
            return None
        out = {}
        for name, leaf in ((dotted(p), t) for p, t in jax.tree_util.tree_flatten_with_path(stored)[0]):
            zarray = json.loads((path / name / ".zarray").read_text())
            kind = ml_dtypes.bfloat16 if zarray["dtype"] == "bfloat16" else zarray["dtype"]
            shape, stored_dtype = tuple(zarray["shape"]), np.dtype(kind)
            chunk = path / name / ".".join(["0"] * max(len(shape), 1))
            if (zarray.get("compressor") or zarray.get("filters") or zarray.get("order") != "C"
                    or tuple(zarray["chunks"]) != shape or shape != tuple(leaf.shape)
                    or stored_dtype != np.dtype(dtype or leaf.dtype)
                    or chunk.stat().st_size != int(np.prod(shape)) * stored_dtype.itemsize):  # fmt: skip
                return None
            out[name] = np.memmap(chunk, stored_dtype, mode="c", shape=shape)
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mapped_shard(array: np.ndarray, index: tuple, bar: Any) -> np.ndarray:
    """One device's shard of a mapped leaf: a view of the checkpoint's own file pages, which
    jax.device_put on the CPU adopts as the buffer (it does so for 64-byte-aligned host arrays: each
    file is page-aligned, and every GPT-2 layer slice a multiple of 64 bytes), so loading takes no time
    and no memory of its own; the first pass over the weights reads them from the page cache, as
    transformers' memory-mapped load does (an accelerator's device_put copies from the mapping). The
    mapping is private (copy-on-write): nothing written to a buffer reaches the file, and replacing the
    checkpoint (save() renames a new directory into place) leaves the mapped files intact."""
    view = array[index]
    bar.update(view.nbytes)
    return view


def _read_shard(store: Any, dtype: np.dtype, index: tuple, bar: Any) -> np.ndarray:
    """One device's shard of a leaf, read by TensorStore straight into a fresh host buffer (cast on the way)."""
    import tensorstore as ts

    part = store[index]
    out = host_buffer(tuple(part.shape), dtype)
    ts.array(out, copy=False, write=True).write(ts.cast(part, ts.dtype(dtype.name))).result()
    bar.update(out.nbytes)
    return out


def _read_leaves(read: Callable[[str, np.dtype, tuple, Any], np.ndarray], target: Any, progress: bool,
                 source: str, stacked: bool, prefetch: bool) -> Params:  # fmt: skip
    """Every leaf's shards, read(name, dtype, index, bar) -> a host array (_read_shard: TensorStore into
    a fresh buffer; _mapped_shard: a view of the file), as params, largest first: TensorStore decodes a
    whole chunk before copying it, and that transient is smallest when little else is held yet.
    Checkpoints store each block tensor stacked [L, ...] as one chunk, so a per-layer leaf is not read
    layer by layer (that decodes the whole chunk L times: 4 minutes for gpt2-xl instead of seconds):
    each device's shard of the stacked leaf is read once, and layer i's array is a view of its slice
    i, which jax.device_put on the CPU adopts without a copy."""
    from gpt2_jax.checkpoints.streaming import _drop_layer_axis, progress_bar

    leaves = {dotted(p): t for p, t in jax.tree_util.tree_flatten_with_path(target)[0]}
    order = sorted(leaves, key=lambda n: -int(np.prod(leaves[n].shape)))
    # every host buffer the loop asks for (one per device shard of each stored leaf), in its order:
    # allocated ahead on a thread (hostmem.prefetching) while TensorStore fills the previous ones
    specs = [(leaves[n].sharding.shard_shape(leaves[n].shape), np.dtype(leaves[n].dtype))
             for n in order for _ in leaves[n].sharding.addressable_devices]  # fmt: skip
    total = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in specs)
    n_layer = next(t.shape[0] for name, t in leaves.items() if name.startswith("h."))
    params: Params = {} if stacked else {"h": [{} for _ in range(n_layer)]}
    with progress_bar(total, progress, f"loading {source}") as bar, \
            prefetching(specs if prefetch else [], max(total // 16, 16 << 20)):  # fmt: skip
        for name in order:
            t, d = leaves[name], np.dtype(leaves[name].dtype)
            if stacked or not name.startswith("h."):
                _set(
                    params,
                    name,
                    jax.make_array_from_callback(
                        t.shape, t.sharding, lambda index, n=name: read(n, d, shard_index(index), bar)
                    ),
                )
                continue
            shape, sharding = t.shape[1:], _drop_layer_axis(t.sharding)
            shards = {dev: read(name, d, (slice(None), *shard_index(index)), bar)  # [L, *shard]
                      for dev, index in sharding.addressable_devices_indices_map(shape).items()}  # fmt: skip
            for i in range(n_layer):
                _set(
                    params["h"][i],
                    name[2:],
                    jax.make_array_from_single_device_arrays(
                        shape, sharding, [jax.device_put(buf[i], dev) for dev, buf in shards.items()]
                    ),
                )
    return params


def restore(
    path: str | Path, dtype: Any = None, mesh: Any = None, progress: bool = False, stacked: bool = False
) -> tuple[Params, GPT2Config]:
    """Read a checkpoint written by save(), optionally cast to dtype. On one device (no mesh) and in
    the stored dtype, the params are the checkpoint's own file pages, mapped (_mapped_shard); else
    every leaf is allocated once in its final layout and dtype and read into. With a mesh, every
    device reads only its own shards, so the model never has to fit on one device; without, it lands
    on this process's first device."""
    from jax.sharding import SingleDeviceSharding

    from gpt2_jax.parallel.sharding import check_mesh, param_shardings

    path = Path(path).absolute()
    config = read_config(path)
    if not (path / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{path}: has {CONFIG_FILE} but no {PARAMS_DIR}/ directory")
    ckptr = _checkpointer()
    try:
        item = ckptr.metadata(path / PARAMS_DIR).item_metadata
    except Exception as e:
        raise _error(path / PARAMS_DIR, e) from None
    if item is None:
        raise CheckpointError(f"{path / PARAMS_DIR}: orbax finds no metadata of the stored params")
    stored = item.tree
    check_tree(stored, config, str(path / PARAMS_DIR), str(path / CONFIG_FILE))
    if mesh is not None:
        check_mesh(config, mesh)
        shardings = param_shardings(stored, config, mesh)
    else:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), stored)
    if "wte_scale" in stored:  # int8 (gpt2_jax.model.precision): read as stored, load() casts the whole
        dtype = None  # params (dequantized), where casting int8 leaves alone would drop their scales
    target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=sh), stored, shardings)
    try:
        mapped = None if mesh is not None else _mapped(path / PARAMS_DIR, stored, dtype)
        if mapped is not None:
            read = lambda name, d, index, bar: _mapped_shard(mapped[name], index, bar)
            return _read_leaves(read, target, progress, str(path), stacked, prefetch=False), config
        stores = _stores(path / PARAMS_DIR, stored)
        if stores is not None:
            read = lambda name, d, index, bar: _read_shard(stores[name], d, index, bar)
            return _read_leaves(read, target, progress, str(path), stacked, prefetch=True), config
        import orbax.checkpoint as ocp

        params = ckptr.restore(path / PARAMS_DIR, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))  # fmt: skip
    except GPT2JaxError:
        raise
    except Exception as e:
        raise _error(path / PARAMS_DIR, e) from None
    params = jax.tree.map(lambda a: a, params)  # plain dicts, as the other loaders return
    return (params if stacked else unstack_layers(params)), config
