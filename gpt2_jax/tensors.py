"""Tensors read lazily from memory-mapped weight files, and host buffers that become device arrays.

Loading copies each tensor, a few MiB at a time, from the file's mapping into its slot of the
final buffer, so the model is never held twice. Two things keep the peak RSS near the weights:
- the pages read through a mapping count toward RSS for as long as it stays mapped, so a file is
  reopened (and the old mapping dropped) after every `budget` bytes read from it;
- host_buffer() is page-aligned, which lets jax.device_put on the CPU alias it instead of copying.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from gpt2_jax.errors import CheckpointError

Index = tuple[slice, ...]
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


@dataclass(frozen=True)
class Lazy:
    """A tensor not read yet: its shape, dtype, and read(index) -> the numpy array at that index
    (a tuple of one slice per axis). lazy[index] reads part of it; np.asarray(lazy) all of it.
    chunk_axis: the axis to read it along, a few MiB at a time, so each chunk is contiguous in the
    file: 1 for a transposed one, whose rows are the file's columns (a chunk of those would touch
    every page of the tensor, and copy 4x slower)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[Index], np.ndarray]
    chunk_axis: int = 0

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        return self.read(index + (slice(None),) * (len(self.shape) - len(index)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.asarray(self.read((slice(None),) * len(self.shape)))
        return whole if dtype is None else whole.astype(dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def transposed(t: Lazy) -> Lazy:
    """A 2-D lazy tensor read as its transpose ([in, out] <-> [out, in]), chunked along the file's rows."""
    return Lazy(t.shape[::-1], t.dtype, lambda index: t.read(index[::-1]).T, chunk_axis=1 - t.chunk_axis)


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
    """Every tensor of a .safetensors file, lazily, through safetensors' numpy API (no torch)."""
    from safetensors import safe_open

    def opener():
        try:
            return safe_open(str(path), framework="np")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from None

    header = opener()  # kept as the first mapping
    tensors: dict[str, Lazy] = {}
    for name in header.keys():
        part = header.get_slice(name)
        kind = part.get_dtype()
        if kind not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {kind}; expected one of {sorted(_SAFETENSORS_DTYPES)}")
        shape, dtype = tuple(part.get_shape()), np.dtype(_SAFETENSORS_DTYPES[kind])
        tensors[name] = (shape, dtype)
    total = sum(int(np.prod(s)) * d.itemsize for s, d in tensors.values())
    file = Reopening(opener, budget or mapped_budget(total), first=header)
    del header, part

    def lazy(name: str, shape: tuple[int, ...], dtype: np.dtype) -> Lazy:
        def read(index: Index) -> np.ndarray:
            return file.read(part_bytes(shape, dtype.itemsize, index), lambda h: h.get_slice(name)[index])

        return Lazy(shape, dtype, read)

    return {name: lazy(name, s, d) for name, (s, d) in tensors.items()}


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array for a leaf (or its shard). A large one is its own page-aligned
    anonymous mapping, populated by the kernel in one call (MAP_POPULATE): faulting its pages in one
    at a time as they are first written is several times slower, in a VM especially. And
    jax.device_put on the CPU adopts such an aligned array instead of copying it."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < 1 << 20 or not hasattr(mmap, "MAP_POPULATE"):  # small, or not Linux
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return np.frombuffer(region, dtype, int(np.prod(shape))).reshape(shape)
