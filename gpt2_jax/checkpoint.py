"""gpt2_jax's own checkpoint: a directory holding gpt2_jax.json (the GPT2Config) and params/ (orbax)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError
from gpt2_jax.files import atomic_dir
from gpt2_jax.params import Params, cast_params

CONFIG_FILE = "gpt2_jax.json"
PARAMS_DIR = "params"


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save(dst: str | Path, params: Params, config: GPT2Config, *, force: bool = False) -> Path:
    """Write params + config to dst atomically; an existing dst is replaced only with force=True."""
    dst = Path(dst).absolute()
    with atomic_dir(dst, force) as tmp:
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


def restore(path: str | Path, dtype: Any = None) -> tuple[Params, GPT2Config]:
    """Read a checkpoint written by save(); optionally cast the params to dtype."""
    path = Path(path).absolute()
    config = read_config(path)
    if not (path / PARAMS_DIR).is_dir():
        raise CheckpointError(f"{path}: has {CONFIG_FILE} but no {PARAMS_DIR}/ directory")
    try:
        params = _checkpointer().restore(path / PARAMS_DIR)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path / PARAMS_DIR}: cannot restore ({type(e).__name__}: {msg})") from None
    params = jax.tree.map(lambda a: a, params)  # plain dicts, as the other loaders return
    return (params if dtype is None else cast_params(params, dtype)), config
