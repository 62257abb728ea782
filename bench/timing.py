"""Timing and memory readings shared by the bench scripts (imported from beside them: python bench/<script>.py)."""

from __future__ import annotations

import time


def timed(fn) -> float:
    """Wall time of one call; fn must return only once its work has finished (host data, or
    block_until_ready)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of `repeats` calls (see timed)."""
    return min(timed(fn) for _ in range(repeats))


def best_of_each(fns, repeats: int) -> list[float]:
    """Shortest wall time of each fn over `repeats` rounds, the fns taking turns within a round, so that
    a slow spell of a shared machine (its speed drifts over minutes) falls on every side alike."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for t, fn in zip(times, fns):
            t.append(timed(fn))
    return [min(t) for t in times]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split(key + ":")[1].split()[0]) * 1024  # kB


def rss_now() -> int:
    """This process's resident set, bytes (Linux)."""
    return _status("VmRSS")


def peak_rss() -> int:
    """This process's own peak RSS (VmHWM), bytes. getrusage's ru_maxrss would be the same but for one
    thing: a child's starts at its parent's RSS when forked, hiding a peak smaller than that."""
    return _status("VmHWM")
