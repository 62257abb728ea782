"""Checkpoint conversion: any loadable GPT-2 checkpoint -> gpt2_jax (orbax) or a HuggingFace directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpt2_jax.checkpoints import hf, native
from gpt2_jax.checkpoints.atomic import atomic_dir, check_writable_destination
from gpt2_jax.checkpoints.loading import load, resolve_precision
from gpt2_jax.checkpoints.streaming import progress_bar
from gpt2_jax.errors import ConfigError
from gpt2_jax.model import precision
from gpt2_jax.model.params import is_int8, param_bytes, to_flat
from gpt2_jax.model.precision_type import Precision


def convert(src: str | Path, dst: str | Path, *, dtype: Any = None, force: bool = False, to_hf: bool = False,
            progress: bool = False) -> Path:  # fmt: skip
    """Read src (any format load() takes) and write dst atomically: orbax, or HF with to_hf=True.
    The tensors stream into their final buffers and are written from there, so the peak memory is
    about the weights once (to_hf: twice, as safetensors serialises the whole file in memory).
    progress: tqdm bars (bytes) on stderr, reading then writing."""
    dst = Path(dst).absolute()
    check_writable_destination(dst, force, native.CHECKPOINT_FILES)  # fail before the (slow) load, not after
    mode = resolve_precision(dtype)
    if mode is not None and mode not in (Precision.FLOAT32, Precision.BFLOAT16, Precision.INT8):
        raise ConfigError(f"convert writes float32, bfloat16 or int8; {mode.value} is chosen when loading: "
                          f"load(..., dtype={mode.value!r})")  # fmt: skip
    if to_hf and mode is Precision.INT8:
        raise ConfigError("--to-hf writes float weights (HuggingFace has no gpt2_jax int8 layout); "
                          "drop --dtype int8 or write a gpt2_jax checkpoint")  # fmt: skip
    params, config = load(src, dtype=mode, progress=progress, stacked=True)  # as stored
    if to_hf and is_int8(params):  # an int8 gpt2_jax checkpoint: the values it holds, in float32
        params = precision.with_precision(params, "float32")
    with progress_bar(param_bytes(params), progress, f"writing {dst}") as bar:
        if not to_hf:
            native.save(dst, params, config, force=force)
        else:
            with atomic_dir(dst, force, native.CHECKPOINT_FILES) as tmp:
                hf.write_dir(to_flat(params, config), config, tmp)
        bar.update(param_bytes(params))  # orbax and safetensors write in one call each, so the bar jumps
    return dst
