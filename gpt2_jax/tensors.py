"""Tensors read lazily from memory-mapped weight files, and host buffers that become device arrays.

Loading copies each tensor, a few MiB at a time, from the file's mapping into its slot of the
final buffer, so the model is never held twice. Two things keep the peak RSS near the weights:
- the pages read through a mapping count toward RSS for as long as it stays mapped, so a file is
  reopened (and the old mapping dropped) after every `budget` bytes read from it;
- host_buffer() is page-aligned, which lets jax.device_put on the CPU alias it instead of copying.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

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
            raise CheckpointError(f"{path}: tensor {name} has dtype {kind}; expected one of {sorted(_SAFETENSORS_DTYPES)}")
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

    def lazy(name: str, shape: tuple[int, ...], dtype: np.dtype) -> Lazy:
        count, at = int(np.prod(shape)), offsets[name]

        def read(index: Index) -> np.ndarray:
            view = lambda m: np.frombuffer(m, dtype, count, at).reshape(shape)[index]  # noqa: E731
            return file.read(part_bytes(shape, dtype.itemsize, index), view)

        return Lazy(shape, dtype, read)

    return {name: lazy(name, s, d) for name, (s, d) in tensors.items()}


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array for a leaf (or its shard): the one a `prefetching` block allocated ahead
    for it, else a new one (see _allocate)."""
    pool = _POOL
    found = None if pool is None else pool.take(tuple(shape), np.dtype(dtype))
    return _allocate(tuple(shape), np.dtype(dtype)) if found is None else found


def _allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A large buffer is its own page-aligned anonymous mapping, populated by the kernel in one call:
    faulting its pages in one at a time as they are first written is several times slower, in a VM
    especially. And jax.device_put on the CPU adopts such an aligned array instead of copying it."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < 1 << 20 or not hasattr(mmap, "MAP_POPULATE"):  # small, or not Linux
        return np.empty(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(region, dtype, int(np.prod(shape))).reshape(shape)
    if not _populate(out.ctypes.data, nbytes):  # kernels before 5.14: MAP_POPULATE, which holds the GIL
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        out = np.frombuffer(region, dtype, int(np.prod(shape))).reshape(shape)
    return out


def _populate(address: int, nbytes: int) -> bool:
    """madvise(MADV_POPULATE_WRITE) through ctypes, which releases the GIL (Python's mmap.mmap holds it
    while MAP_POPULATE runs, so a prefetching thread would stall the copies). False if unsupported.
    First MADV_HUGEPAGE (a hint; ignored where transparent huge pages are off): 2 MiB pages populate
    about 3.7x faster than 4 KiB ones here (11 against 3 GB/s), 512x fewer faults to zero and map."""
    global _MADVISE
    if _MADVISE is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _MADVISE = libc.madvise
        except (OSError, AttributeError):
            _MADVISE = False
    if not _MADVISE:
        return False
    _MADVISE(address, nbytes, _MADV_HUGEPAGE)
    return _MADVISE(address, nbytes, _MADV_POPULATE_WRITE) == 0


_MADVISE: Any = None
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23  # linux/mman.h (POPULATE_WRITE since 5.14)


class _Prefetch:
    """Allocates the buffers a loader will ask for, in its order, on one background thread, at most
    `ahead` bytes before it takes them. Populating fresh memory is the kernel's work (page faults, slow
    in a VM) and runs outside the GIL, so it overlaps the copies into the previous buffers. Every buffer
    made is one the loader takes, so the peak stays the weights. A request that was not foreseen (or
    that the thread has not started) is allocated by the caller, as without a pool."""

    def __init__(self, specs: list[tuple[tuple[int, ...], np.dtype]], ahead: int):
        self.specs, self.ahead = specs, ahead
        self.order: dict[Any, list[int]] = defaultdict(list)  # (shape, dtype) -> spec indices, in order
        for i, key in enumerate(specs):
            self.order[key].append(i)
        self.asked: dict[Any, int] = defaultdict(int)
        self.claimed: set[int] = set()
        self.ready: dict[int, np.ndarray] = {}
        self.held, self.stop, self.error = 0, False, None
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for i, (shape, dtype) in enumerate(self.specs):
                nbytes = int(np.prod(shape)) * dtype.itemsize
                with self.cv:
                    while self.ready and self.held + nbytes > self.ahead and not self.stop:
                        self.cv.wait()
                    if self.stop:
                        return
                    if i in self.claimed:
                        continue
                    self.claimed.add(i)
                buf = _allocate(shape, dtype)
                with self.cv:
                    self.ready[i], self.held = buf, self.held + nbytes
                    self.cv.notify_all()
        except BaseException as e:  # e.g. out of memory: the loader raises it when it asks
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        key = (shape, dtype)
        with self.cv:
            n, self.asked[key] = self.asked[key], self.asked[key] + 1
            if n >= len(self.order.get(key, ())):
                return None
            i = self.order[key][n]
            if i not in self.claimed:
                self.claimed.add(i)
                return None
            while i not in self.ready:
                if self.error is not None:
                    raise self.error
                self.cv.wait()
            buf = self.ready.pop(i)
            self.held -= buf.nbytes
            self.cv.notify_all()
            return buf

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.ready.clear()
            self.cv.notify_all()
        self.thread.join()


_POOL: _Prefetch | None = None


@contextlib.contextmanager
def prefetching(specs: list[tuple[tuple[int, ...], Any]], ahead: int) -> Iterator[None]:
    """Within the block, host_buffer() hands out buffers allocated ahead (see _Prefetch), in the order
    of `specs` (shape, dtype). One loader at a time: it is for the thread that loads."""
    global _POOL
    pool = _Prefetch([(tuple(s), np.dtype(d)) for s, d in specs], ahead)
    _POOL = pool
    try:
        yield
    finally:
        _POOL = None
        pool.close()
