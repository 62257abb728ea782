"""Timing shared by the bench scripts (imported from beside them: python bench/<script>.py)."""

from __future__ import annotations

import time


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of `repeats` calls; fn must return only once its work has finished
    (host data, or block_until_ready)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
