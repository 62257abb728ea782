"""load(path): any supported GPT-2 checkpoint -> (params, config), the format detected from the path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpt2_jax.checkpoints import hf, nanogpt, native, torch_files
from gpt2_jax.checkpoints.lazy import Lazy
from gpt2_jax.checkpoints.streaming import build_params
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError
from gpt2_jax.model import precision as precision_modes
from gpt2_jax.model.params import Params
from gpt2_jax.model.precision_type import MODES, Precision
from gpt2_jax.parallel.sharding import shard_params

FORMATS = (
    "a gpt2_jax checkpoint directory (gpt2_jax.json + params/), "
    "a HuggingFace directory (config.json + model.safetensors / pytorch_model.bin / *.index.json), "
    "a .safetensors or .bin state dict, or a nanoGPT ckpt.pt (or its out_dir)"
)
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_GIVEN = "the config= argument"


def resolve_precision(dtype: Any) -> Precision | None:
    """load()'s dtype= -> its Precision: None (keep the stored one), a mode's name (one of MODES), a jnp
    dtype or a Precision. The one place a user's string becomes the mode; everything after branches on it."""
    if dtype is None:
        return None
    try:
        return Precision.parse(dtype)
    except ConfigError:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {', '.join(MODES)}") from None


def in_precision(params: Params, config: GPT2Config, precision: Precision | None, mesh: Any) -> Params:
    """Loaded params in precision (None: as loaded): quantized, packed, dequantized or cast where the
    readers' params are in another mode; laid out on the mesh again where that changed them."""
    if precision is None or Precision.of(params) is precision:
        return params
    params = precision_modes.with_precision(params, precision)
    return shard_params(params, config, mesh) if mesh is not None else params


def _read_file(path: Path, config: GPT2Config | None) -> tuple[dict[str, Lazy], GPT2Config, str]:
    """A single weight file -> (tensors, config, where the config came from): the argument, a config.json
    beside it, or the shapes."""
    if path.suffix == ".safetensors" or path.name.endswith(".index.json"):
        raw = hf.read_weights(path)
    elif path.suffix in _TORCH_SUFFIXES:
        obj = torch_files.torch_load(path)
        if nanogpt.is_nanogpt(obj):
            flat, nano_config = nanogpt.read_checkpoint(obj, path)
            return flat, config or nano_config, _GIVEN if config else f"{path} model_args"
        raw = torch_files.tensors_of(obj, path)
    else:
        raise CheckpointError(f"{path}: unknown checkpoint format; expected {FORMATS}")
    flat = hf.normalize_keys(raw, str(path))
    if config is not None:
        return flat, config, _GIVEN
    if (path.parent / "config.json").is_file():
        return flat, hf.read_config(path.parent / "config.json"), str(path.parent / "config.json")
    return flat, hf.infer_config(flat, str(path)), f"the config inferred from {path}"


def _training_run(path: Path) -> Path:
    """A gpt2-jax train --out directory (or one of its checkpoints) -> the run's model/; other paths unchanged.
    The training checkpoints hold params and optimizer state but no config, so they are not loaded."""
    run = path.parent.parent if path.parent.name == "checkpoints" and path.name.isdigit() else path
    if not (run / "checkpoints").is_dir() or native.is_checkpoint(path):
        return path
    if native.is_checkpoint(run / "model") and run == path:
        return run / "model"
    what = "a training checkpoint (params + optimizer state, no config)" if run != path else "a training run"
    if native.is_checkpoint(run / "model"):
        raise CheckpointError(f"{path}: {what}; load the run's final model: --model {run / 'model'}")
    raise CheckpointError(
        f"{path}: {what} that has not written model/ yet; finish it with gpt2-jax train "
        f"--resume --out {run} (same arguments), then use --model {run / 'model'}"
    )


def load(
    path: str | Path,
    *,
    dtype: Any = None,
    config: GPT2Config | None = None,
    mesh: Any = None,
    progress: bool = False,
    stacked: bool = False,
) -> tuple[Params, GPT2Config]:
    """Any supported checkpoint -> (params, config), each layer's tensors their own buffers (the fast form
    for every path; see gpt2_jax.model.params). A gpt2-jax train --out directory loads its model/.
    dtype: keep the stored one (None), float32, bfloat16 or int8 (weight-only, gpt2_jax.model.precision:
    quantized on loading, or kept where convert --dtype int8 stored it so), or w8a8 (int8's weights, so
    loaded as int8, and the 8-bit activation rows its matmuls take: see gpt2_jax.model.precision), or
    float32-packed (float32's values in 3.5 bytes a weight, packed on loading; per-layer, no mesh). mesh (gpt2_jax.parallel.sharding.make_mesh): lay the params out on it, each device receiving only its shards.
    Tensors stream from the memory-mapped file into their final buffers (cast on the way), so the
    peak memory is about the weights once. progress: a tqdm bar (bytes) on stderr for loads over 2 s.
    stacked=True: block leaves stacked on L instead (the form checkpoints store; convert writes it)."""
    path = Path(path)
    precision = resolve_precision(dtype)
    if precision is Precision.FLOAT32_PACKED and (mesh is not None or stacked):
        raise ConfigError("float32-packed params are per-layer and on one device: drop mesh= / stacked=")
    params, config = _load(path, None if precision is None else precision.read_dtype, config, mesh, progress, stacked)
    return in_precision(params, config, precision, mesh), config


def _load(path: Path, dtype: Any, config: GPT2Config | None, mesh: Any, progress: bool, stacked: bool):
    """load() before the precision mode: float tensors read in dtype (None: as stored), int8 ones as stored."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    path = _training_run(path)
    if native.is_checkpoint(path):
        return native.restore(path, dtype, mesh, progress, stacked)
    if path.is_dir() and (path / "config.json").is_file():
        source, origin = hf.weight_file(path), str(path / "config.json")
        flat, found = hf.read_dir(path)
    elif path.is_dir() and (path / "ckpt.pt").is_file():
        source = path / "ckpt.pt"
        flat, found = nanogpt.read(source)
        origin = f"{source} model_args"
    elif path.is_dir():
        raise CheckpointError(f"{path}: unknown checkpoint format; expected {FORMATS}")
    else:
        source = path
        flat, found, origin = _read_file(path, config)
    origin = _GIVEN if config is not None else origin
    config = config or found
    return build_params(flat, config, str(source), dtype, mesh, progress, stacked, config_source=origin), config
