"""Compiling less and knowing what it cost: the power-of-two buckets that shapes are rounded to (so a new
length rarely compiles a new program), `traced` (a host array typed as the jax.Array jit makes of it), and the
time JAX spent tracing, lowering and XLA compiling, summed from jax.monitoring's events."""

from __future__ import annotations

from typing import cast

import jax
import numpy as np


def use_persistent_cache(where: str | None) -> None:
    """Keep XLA's compiled programs in the directory `where` between processes, every program written (JAX's
    default skips those compiled in under a second), or, for None, no persistent cache at all: off means off, one
    that JAX_COMPILATION_CACHE_DIR in the environment switched on too."""
    if where is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum, 1): a shape rounded so that nearby sizes share a program."""
    return 1 << (max(n, minimum, 1) - 1).bit_length()


def traced(x: np.ndarray) -> jax.Array:
    """A host array as the jax.Array that jit traces it into (the identity). A pytree's fields are typed as
    the compiled program sees them, while concrete values stay host arrays, so no eager op compiles per value
    and the program's argument placement decides where they land."""
    return cast(jax.Array, x)


# JAX's own duration events for the three stages of turning a call into a program.
_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileTimer:
    """with CompileTimer() as timer: ...  then timer.seconds is the compile time inside the block (0 when
    every program was already compiled in this process; a program read back from the persistent compilation cache
    adds its tracing and the read)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _listen(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event in _EVENTS:
            self.seconds += duration_secs

    def __enter__(self) -> CompileTimer:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


class CompileCount:
    """Counts the programs XLA compiles in this process from start() on, and their seconds; a program read back
    from the persistent compilation cache counts too (JAX's event spans the lookup), with the read's seconds. The
    server's /metrics shows it: a long-lived process should compile nothing new once its programs are built."""

    def __init__(self) -> None:
        self.programs, self.seconds = 0, 0.0

    def _listen(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == _EVENTS[2]:
            self.programs += 1
            self.seconds += duration_secs

    def start(self) -> CompileCount:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def stop(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
