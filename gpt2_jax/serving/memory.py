"""The server process's heap: glibc's malloc tuned for a long-lived process that runs XLA programs from many threads.

A server runs for weeks; its RSS should track what it holds. Two things make glibc's RSS creep under load while
the live memory stays flat (bench/soak.py: the same 85 device arrays and Python objects after every 100 requests):
each thread that finds the arenas busy gets an arena of its own (up to 8 per core), and memory freed inside an
arena stays in the process. So `gpt2-jax serve` caps the arenas at start-up and the engine hands free pages back
when it goes idle. Both are no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time

M_ARENA_MAX = -8  # glibc's mallopt parameter
TRIM_EVERY = 1.0  # seconds: at most one trim per second, however often the engine goes idle


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None  # musl has neither arenas nor malloc_trim
    except OSError:
        return None


_LIBC = _libc()
_last_trim = 0.0


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (MALLOC_ARENA_MAX in the environment wins). Call it early: threads that already
    have an arena keep it."""
    if _LIBC is not None and "MALLOC_ARENA_MAX" not in os.environ:
        _LIBC.mallopt(M_ARENA_MAX, arenas)


def release_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim), at most once per TRIM_EVERY seconds; the
    engine calls it when it goes idle, where the milliseconds it takes delay no token."""
    global _last_trim
    now = time.monotonic()
    if _LIBC is not None and now - _last_trim >= TRIM_EVERY:
        _last_trim = now
        _LIBC.malloc_trim(0)
