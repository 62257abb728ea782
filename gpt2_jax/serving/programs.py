"""The engine's compiled programs, built ahead of time in a background thread, never on the engine thread.

Every program the engine runs (a prefill per prompt bucket, the decode step with and without top logprobs)
is compiled once, with jax's ahead-of-time API (`jit(f).lower(...).compile()`), by one compiler thread in
priority order. The engine asks for a program when a request needs it, admits the request once it is ready,
and meanwhile keeps stepping every other stream: a new bucket costs the request that needs it a wait, and
nobody else anything. XLA's compiler releases the GIL (a Python thread beside a long compile keeps ticking; bench/RESULTS.md),
so the engine thread runs on while it compiles.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any


class Programs:
    """Compiled programs by key: `want(key, build, priority)` queues a build (lower priorities first),
    `get(key)` gives the compiled callable or None, `wait(keys)` blocks until those are built."""

    def __init__(self, on_built: Callable[[Any, float], None] | None = None):
        self.built: dict[Any, Any] = {}
        self.failed: dict[Any, BaseException] = {}
        self.queued: set = set()
        self.heap: list = []
        self.order = itertools.count()
        self.cond = threading.Condition()
        self.on_built = on_built
        self.current: Any = None
        self.seconds = 0.0
        self.closed = False
        self._start()

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="gpt2-jax-compiler", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """End the compiler thread once the program being built (if any) is done; queued builds are dropped. Until
        then the thread holds this object, and with it every compiled program: an engine that is stopped and
        dropped is freed only after this. A later want() starts a new thread."""
        with self.cond:
            self.closed = True
            for _, _, key, _ in self.heap:
                self.queued.discard(key)
            self.heap.clear()
            self.cond.notify_all()

    def want(self, key: Any, build: Callable[[], Any], priority: float = 1.0) -> bool:
        """Queue `build` (which returns the compiled callable) unless key is built or queued; True if built."""
        with self.cond:
            if key in self.built:
                return True
            if self.closed:
                self.closed = False
                self._start()
            if key not in self.queued and key not in self.failed:
                self.queued.add(key)
                heapq.heappush(self.heap, (priority, next(self.order), key, build))
                self.cond.notify_all()
            return False

    def get(self, key: Any) -> Any:
        if key in self.failed:
            raise self.failed[key]
        return self.built.get(key)

    def wait(self, keys: list, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not all(k in self.built or k in self.failed for k in keys):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        for k in keys:
            self.get(k)  # raises a failed build's error
        return True

    def pending(self) -> list:
        """The keys queued or being compiled, the one compiling first."""
        with self.cond:
            rest = [k for _, _, k, _ in sorted(self.heap)]
            return ([self.current] if self.current is not None else []) + rest

    def _run(self) -> None:
        try:  # this thread (and the compiler threads it starts) yields the cores to the engine's decode steps
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self.cond:
                while not self.heap and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                _, _, key, build = heapq.heappop(self.heap)
                self.current = key
            t = time.perf_counter()
            try:
                program, error = build(), None
            except BaseException as e:
                program, error = None, e
            seconds = time.perf_counter() - t
            with self.cond:
                self.current = None
                self.queued.discard(key)
                if error is None:
                    self.built[key] = program
                    self.seconds += seconds
                else:
                    self.failed[key] = error
                self.cond.notify_all()
            if error is None and self.on_built is not None:
                self.on_built(key, seconds)
