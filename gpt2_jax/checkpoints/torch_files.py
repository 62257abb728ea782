"""PyTorch .bin/.pt files read lazily: memory-mapped through torch, each tensor a Lazy view of the file."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpt2_jax.checkpoints.lazy import Index, Lazy, Reopening, mapped_budget, part_bytes
from gpt2_jax.errors import CheckpointError


def torch_load(path: Path) -> Any:
    """torch.load on CPU with weights_only=True (no arbitrary pickled code), errors made readable.
    Zip-format files (every torch.save since 1.6) are memory-mapped: tensors are views of the file,
    read only when copied; a legacy file is read whole."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{path}: reading PyTorch .bin/.pt files needs torch; install it with pip install 'gpt2-jax[torch]'"
        ) from None
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path}: cannot read PyTorch file ({type(e).__name__}: {msg})") from None


def torch_to_numpy(t: Any) -> np.ndarray:
    """A torch tensor -> numpy without copying (a view of a mapped file stays one), bfloat16 as ml_dtypes'."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _state_dict(state: Any, path: Path) -> dict[str, Any]:
    import torch

    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors, found {type(state).__name__}")
    return state


def tensors_of(loaded: Any, path: Path, select: Callable[[Any], Any] = lambda obj: obj) -> dict[str, Lazy]:
    """The state dict select(loaded) of a torch_load(path) result as lazy tensors; anything else is
    an error. Reading goes through a Reopening file, so the pages read do not pile up in RSS."""
    state = _state_dict(select(loaded), path)
    views = {k: torch_to_numpy(v) for k, v in state.items()}
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in views.items()}
    budget = mapped_budget(sum(v.nbytes for v in views.values()))
    del views
    file = Reopening(lambda: _state_dict(select(torch_load(path)), path), budget, first=state)
    kept: list[dict[str, Any]] = []  # a mapping of its own for the tensors adopted whole (torch maps privately)
    mapped = zipfile.is_zipfile(path)  # a legacy file is not mapped: its tensors are plain memory

    def whole(name: str) -> np.ndarray | None:
        if not mapped:
            return None
        if not kept:
            kept.append(_state_dict(select(torch_load(path)), path))
        return torch_to_numpy(kept[0][name])

    def lazy(name: str, shape: tuple[int, ...], dtype: np.dtype) -> Lazy:
        def read(index: Index) -> np.ndarray:
            return file.read(part_bytes(shape, dtype.itemsize, index), lambda state: torch_to_numpy(state[name])[index])

        return Lazy(shape, dtype, read, whole=lambda: whole(name))

    return {name: lazy(name, s, d) for name, (s, d) in shapes.items()}
