"""--model resolution: a local checkpoint path, or a HuggingFace hub id downloaded once and cached converted;
and the small Shakespeare model shipped in the package."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpt2_jax.errors import CheckpointError

# A small GPT-2 trained on Shakespeare's plays, shipped so that generate works offline (see its README.md).
BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "shakespeare"

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
HUB_FILES = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors"]


def cache_root() -> Path:
    """Where converted hub checkpoints live: $GPT2_JAX_CACHE, else ~/.cache/gpt2_jax."""
    return Path(os.environ.get("GPT2_JAX_CACHE") or Path.home() / ".cache" / "gpt2_jax")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{repo_id!r} is not a local path, and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:
        raise CheckpointError(
            f"{repo_id!r} is not a local path and could not be downloaded from the HuggingFace hub "
            f"({type(e).__name__}); offline, download the model elsewhere (config.json + model.safetensors) "
            f"and pass --model /path/to/that/dir, or convert it with: gpt2-jax convert SRC DST"
        ) from None


def resolve_model(name: str) -> Path:
    """A path that load() reads: name itself if it exists, else the cached conversion of hub id `name`."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not HUB_ID.match(name):
        raise CheckpointError(f"{name}: no such file or directory (and not a HuggingFace hub id)")
    cached = cache_root() / name.replace("/", "--")
    if cached.exists():
        return cached
    from gpt2_jax.checkpoints.conversion import convert

    return convert(_download(name), cached)
