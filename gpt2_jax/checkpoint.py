"""gpt2_jax's own checkpoint: a directory holding gpt2_jax.json (the GPT2Config) and params/ (orbax)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError
from gpt2_jax.files import atomic_dir
from gpt2_jax.params import Params, check_tree, stack_layers

CONFIG_FILE = "gpt2_jax.json"
PARAMS_DIR = "params"


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save(dst: str | Path, params: Params, config: GPT2Config, *, force: bool = False) -> Path:
    """Write params (per-layer or stacked; stored stacked) + config to dst atomically; an existing dst is
    replaced only with force=True."""
    dst = Path(dst).absolute()
    params = stack_layers(params)
    with atomic_dir(dst, force) as tmp:
        if jax.process_index() == 0:  # with several processes: one config file, every process's shards
            (tmp / CONFIG_FILE).write_text(config.to_json())
        ckptr = _checkpointer()
        ckptr.save(tmp / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    return dst


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_config(path: Path) -> GPT2Config:
    try:
        return GPT2Config.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: invalid config ({e})") from None


def _error(path: Path, e: Exception) -> CheckpointError:
    msg = str(e).splitlines()[0] if str(e) else ""
    return CheckpointError(f"{path}: cannot restore ({type(e).__name__}: {msg})")


def restore(path: str | Path, dtype: Any = None, mesh: Any = None) -> tuple[Params, GPT2Config]:
    """Read a checkpoint written by save(), optionally cast to dtype. With a mesh, every device
    reads only its own shards (orbax restores into the target sharding), so the model never has to
    fit on one device; without, it lands on this process's first device."""
    from jax.sharding import SingleDeviceSharding

    from gpt2_jax.sharding import check_mesh, param_shardings

    path = Path(path).absolute()
    config = read_config(path)
    if not (path / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{path}: has {CONFIG_FILE} but no {PARAMS_DIR}/ directory")
    ckptr = _checkpointer()
    try:
        stored = ckptr.metadata(path / PARAMS_DIR).item_metadata.tree
    except Exception as e:
        raise _error(path / PARAMS_DIR, e) from None
    check_tree(stored, config, str(path / PARAMS_DIR))
    if mesh is not None:
        check_mesh(config, mesh)
        shardings = param_shardings(stored, config, mesh)
    else:
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), stored)
    target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=sh), stored, shardings)
    try:
        params = ckptr.restore(path / PARAMS_DIR, target)
    except Exception as e:
        raise _error(path / PARAMS_DIR, e) from None
    return jax.tree.map(lambda a: a, params), config  # plain dicts, as the other loaders return
