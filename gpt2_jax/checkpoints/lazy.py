"""Tensors read lazily from memory-mapped weight files, and host buffers that become device arrays.

Loading copies each tensor, a few MiB at a time, from the file's mapping into its slot of the
final buffer, so the model is never held twice. Two things keep the peak RSS near the weights:
- the pages read through a mapping count toward RSS for as long as it stays mapped, so a file is
  reopened (and the old mapping dropped) after every `budget` bytes read from it;
- host_buffer() is page-aligned, which lets jax.device_put on the CPU alias it instead of copying.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from gpt2_jax.errors import CheckpointError

Index = tuple[slice, ...]


def shard_index(index: Index | None) -> Index:
    """A device's shard of a leaf as jax hands it to a read callback: None only for a sharding these readers
    never build."""
    if index is None:
        raise CheckpointError("a shard without an index: the leaf's sharding names no slice of it")
    return index


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


@dataclass(frozen=True)
class Lazy:
    """A tensor not read yet: its shape, dtype, and read(index) -> the numpy array at that index
    (a tuple of one slice per axis). lazy[index] reads part of it; np.asarray(lazy) all of it.
    chunk_axis: the axis to read it along, a few MiB at a time, so each chunk is contiguous in the
    file: 1 for a transposed one, whose rows are the file's columns (a chunk of those would touch
    every page of the tensor, and copy 4x slower).
    whole: where the tensor may be a view of a file's private (copy-on-write) mapping, () -> that
    view, without reading or copying (None where the layout needs a copy); see streaming.adoptable."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[Index], np.ndarray]
    chunk_axis: int = 0
    whole: Callable[[], np.ndarray | None] | None = None

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        return self.read(index + (slice(None),) * (len(self.shape) - len(index)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.asarray(self.read((slice(None),) * len(self.shape)))
        return whole if dtype is None else whole.astype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def then(whole: Callable[[], np.ndarray | None] | None, fn: Callable[[np.ndarray], np.ndarray | None]):
    """A Lazy's `whole` followed by fn (a view of it), None staying None."""
    if whole is None:
        return None
    return lambda: (lambda w: None if w is None else fn(w))(whole())


def transposed(t: Lazy) -> Lazy:
    """A 2-D lazy tensor read as its transpose ([in, out] <-> [out, in]), chunked along the file's rows."""
    return Lazy(t.shape[::-1], t.dtype, lambda index: t.read(index[::-1]).T, chunk_axis=1 - t.chunk_axis,
                whole=then(t.whole, lambda w: w.T))  # fmt: skip


class Reopening:
    """A memory-mapped file, opened by `opener`, that is opened afresh after every `budget` bytes
    read through it: the pages read stay in the process's RSS while mapped, dropping the old
    mapping releases them (the page cache keeps them, so rereading is free)."""

    def __init__(self, opener: Callable[[], Any], budget: int, first: Any = None):
        self._open, self._budget, self._handle, self._read = opener, budget, first, 0

    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._open()
        return self._handle

    def read(self, nbytes: int, fn: Callable[[Any], np.ndarray]) -> np.ndarray:
        if self._read >= self._budget:
            self._handle, self._read = None, 0  # drop our reference before mapping again
        self._read += nbytes
        return fn(self.handle())


def mapped_budget(total_bytes: int) -> int:
    """How much of a file may stay mapped at once: 1/16 of the weights (at least 16 MiB), so the
    mapping adds at most ~6% to the peak whatever the model's size."""
    return max(total_bytes // 16, 16 << 20)


def part_bytes(shape: tuple[int, ...], itemsize: int, index: Index) -> int:
    return int(np.prod([len(range(*s.indices(n))) for s, n in zip(index, shape)])) * itemsize


def safetensors_file(path: Path, budget: int | None = None) -> dict[str, Lazy]:
    """Every tensor of a .safetensors file, lazily. safetensors' numpy API (no torch) opens and
    validates the file and gives each tensor's dtype and shape; the bytes are then read as numpy views
    of the file's own mapping at the header's offsets, so a chunk is copied once, from the page cache
    into its final buffer (get_slice would first copy it into an array of its own: 1.5 of gpt2-xl's
    7 s)."""
    from safetensors import safe_open

    try:
        header = safe_open(str(path), framework="np")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from None
    tensors: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for name in header.keys():
        part = header.get_slice(name)
        kind = part.get_dtype()
        if kind not in _SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name} has dtype {kind}; expected one of {sorted(_SAFETENSORS_DTYPES)}"
            )
        tensors[name] = (tuple(part.get_shape()), np.dtype(_SAFETENSORS_DTYPES[kind]))
    del header, part
    with open(path, "rb") as f:  # the layout safe_open has just validated: u64 n, n bytes of JSON, data
        n = int.from_bytes(f.read(8), "little")
        offsets = {k: v["data_offsets"][0] + 8 + n for k, v in json.loads(f.read(n)).items() if k in tensors}

    def opener() -> mmap.mmap:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    total = sum(int(np.prod(s)) * d.itemsize for s, d in tensors.values())
    file = Reopening(opener, budget or mapped_budget(total))
    kept: list[mmap.mmap] = []  # one private mapping for the tensors adopted whole, opened on first use

    def private() -> mmap.mmap:
        if not kept:
            with open(path, "rb") as f:
                kept.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        return kept[0]

    def lazy(name: str, shape: tuple[int, ...], dtype: np.dtype) -> Lazy:
        count, at = int(np.prod(shape)), offsets[name]

        def read(index: Index) -> np.ndarray:
            view = lambda m: np.frombuffer(m, dtype, count, at).reshape(shape)[index]
            return file.read(part_bytes(shape, dtype.itemsize, index), view)

        return Lazy(shape, dtype, read, whole=lambda: np.frombuffer(private(), dtype, count, at).reshape(shape))

    return {name: lazy(name, s, d) for name, (s, d) in tensors.items()}
