"""The server process's heap: a malloc that gives memory back, for a long-lived process running XLA programs.

A server runs for weeks; its RSS should track what it holds. Under glibc's malloc it does not: over bench/soak.py
the live memory stays flat (the same device arrays and the same Python heap, by tracemalloc) while RSS climbs
with every request. The per-step buffers of XLA and numpy, of ever-different sizes between 64 KiB and 4 MiB,
freed among live chunks, leave holes in glibc's arenas that no trim returns. The choices, on the soak
(bench/RESULTS.md, "Soak", has the numbers):

  glibc, arenas capped at 2, trimmed when idle            RSS keeps climbing
  the same with a fixed 64 KiB mmap threshold             flat, but each step maps and faults its multi-MiB
                                                          temporaries afresh: a slower decode
  jemalloc, oversize_threshold:0, purged when idle         flat, at glibc's speed

So `gpt2-jax serve` runs on jemalloc where it is installed (Debian/Ubuntu: libjemalloc2): the CLI starts the
process again with it preloaded (`--allocator`, serve_allocator below). Where it is not, glibc is tuned as far as
it goes without slowing steps: its arenas capped and free pages handed back when the engine goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import time
from pathlib import Path

M_ARENA_MAX = -8  # glibc's mallopt parameter
TRIM_EVERY = 1.0  # seconds: at most one trim per second, however often the engine goes idle
# jemalloc's own default gives requests over 8 MiB an arena that returns their pages at once, so each step would
# map and fault its multi-MiB temporaries afresh (2,600 page faults and 6 ms of system time per gpt2-small B=8 step);
# 0 turns that off (83 faults, 0.9 ms: glibc's speed). A MALLOC_CONF in the environment wins.
JEMALLOC_CONF = "oversize_threshold:0"
JEMALLOC_PATHS = ["/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/local/lib/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2"]  # fmt: skip


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # musl has neither
    except OSError:
        return None


def _maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


_LIBC = _libc()
_JEMALLOC = "libjemalloc" in _maps()  # preloaded at the process's start, or never: read once
_MALLCTL = getattr(ctypes.CDLL(None), "mallctl", None) if _JEMALLOC else None  # preloaded: its symbols come first
MALLCTL_ARENAS_ALL = 4096  # jemalloc's "every arena" index in mallctl names
REEXEC = "GPT2_JAX_SERVE_PRELOADED"  # set when serve started itself again with a preloaded malloc (no second time)
_last_trim = 0.0


def active_allocator() -> str:
    """The malloc this process runs on: "jemalloc" (preloaded), "glibc", or "other"."""
    return "jemalloc" if _JEMALLOC else "glibc" if _LIBC is not None else "other"


def find_jemalloc() -> str | None:
    """The path of an installed libjemalloc, or None."""
    for path in JEMALLOC_PATHS:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("jemalloc") or None


def serve_allocator(choice: str, environ: dict) -> tuple[dict | None, str]:
    """What to do for --allocator {auto, jemalloc, glibc} -> (the environment to start the process again in, with
    jemalloc preloaded, or None to go on as it is; what to say). "jemalloc" without it installed is an error;
    "auto" falls back to glibc."""
    current = active_allocator()
    if choice == "glibc" or current == "jemalloc" or not sys.platform.startswith("linux"):
        return None, f"malloc: {current}"
    lib = find_jemalloc()
    if lib is None:
        if choice == "jemalloc":
            raise FileNotFoundError("--allocator jemalloc: libjemalloc is not installed (Debian/Ubuntu: apt install "
                                    "libjemalloc2); or run with --allocator glibc")  # fmt: skip
        return None, ("malloc: glibc (tuned); its RSS creeps over long runs: install libjemalloc2 (apt install "
                      "libjemalloc2) and gpt2-jax serve runs on it")  # fmt: skip
    if environ.get(REEXEC) == lib:  # started again with it, and it is still not loaded
        return None, f"malloc: {current} (tuned): {lib} could not be preloaded"
    preload = " ".join([lib, environ.get("LD_PRELOAD", "")]).strip()
    return {**environ, REEXEC: lib, "LD_PRELOAD": preload, "MALLOC_CONF": environ.get("MALLOC_CONF", JEMALLOC_CONF)}, (
        f"malloc: jemalloc ({lib})"
    )


def tune_malloc(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (MALLOC_ARENA_MAX in the environment wins) -> whether glibc took it. Call it early:
    threads that already have an arena keep it. Each thread that finds the arenas busy otherwise gets one of its
    own (up to 8 per core), and RSS grows with them."""
    if _LIBC is None or active_allocator() != "glibc":
        return False
    if "MALLOC_ARENA_MAX" in os.environ:
        return True
    return _LIBC.mallopt(M_ARENA_MAX, arenas) == 1


def release_free_memory() -> None:
    """Return the heap's free pages to the system, at most once per TRIM_EVERY seconds: jemalloc purges every
    arena's unused dirty pages (which it would otherwise return over its 10 s decay), glibc trims (malloc_trim).
    The engine calls it when it goes idle, where the milliseconds it takes delay no token."""
    global _last_trim
    now = time.monotonic()
    if now - _last_trim < TRIM_EVERY:
        return
    _last_trim = now
    if _MALLCTL is not None:
        _MALLCTL(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, ctypes.c_size_t(0))
    elif _LIBC is not None:
        _LIBC.malloc_trim(0)


def freeze_heap() -> None:
    """Collect once, then move every object alive now into the collector's permanent generation (gc.freeze).
    Loading and compiling leave hundreds of thousands of long-lived objects (jaxprs, traced functions, the
    compiled programs' Python side), and a full collection scans them all while holding the GIL: every thread,
    the engine's decode steps and the event loop, waits it out, a gap in every stream. The allocations of a
    first burst of requests trigger one. Frozen objects are never scanned again, so later collections scan only
    what requests made. The engine calls this when it goes idle after new programs were built, where the
    collection delays no token."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo freeze_heap (gc.unfreeze): every frozen object is scanned again, so a stopped engine's objects, once
    dropped, can be collected. The engine calls this when it stops."""
    gc.unfreeze()
