"""Start-up: compile the programs the first requests need, serve, and build the rest in the background.

The essential set (the smallest decode step and prompt chunk, and the small programs that start and stop rows) is
compiled before the server reports ready, and one request of each kind runs through the engine (a plain one, a
constrained one). Everything else is queued behind: the larger decode steps and chunks, the decode steps with
top logprobs, the echo scoring pass of each prompt bucket. A request that needs
one of those before it is built waits for it; every other request is served meanwhile (serving.programs).
/health and the log say what is still compiling.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.sampling import SamplingParams, constraints
from gpt2_jax.serving.engine import Engine
from gpt2_jax.serving.slots import Request, row_key


def schedule(engine: Engine, *, echo: bool = True) -> list:
    """Queue every program, the essential ones first; returns the essential programs' names."""
    engine.programs.compile(wait=False)
    essential = engine.programs.essential()  # the smallest decode step and prompt chunk, and the row programs
    if echo:
        engine.programs.want_scoring()  # echo's prompt scores, behind the engine's own programs
    return essential


def _run_one(engine: Engine, sampling: SamplingParams, timeout: float) -> None:
    done, result = threading.Event(), []

    def on_event(kind: str, payload: Any) -> None:
        if kind != "token":
            result.append((kind, payload))
            done.set()

    engine.submit(Request([0], sampling, row_key(0, 0), on_event))
    if not done.wait(timeout):
        raise GPT2JaxError(f"warm-up: the engine did not answer within {timeout:.0f} s")
    if result[0][0] == "error":
        raise result[0][1]


def warm_up(engine: Engine, *, constrained: bool = True, echo: bool = True, wait_all: bool = False,
            timeout: float = 600.0, compiler: Any = None) -> float:  # fmt: skip
    """Compile the essential programs and run a request of each kind through the (started) engine; with
    wait_all, also wait for every background program. Returns the seconds it took."""
    t0 = time.perf_counter()
    essential = schedule(engine, echo=echo)
    if not engine.programs.wait(essential, timeout):
        raise GPT2JaxError(f"warm-up: the essential programs did not compile within {timeout:.0f} s")
    _run_one(engine, SamplingParams(max_new_tokens=1), timeout)
    if constrained and engine.config.eos_id is not None:
        c = (constraints.choice(["a", "b"]) if compiler is None
             else compiler.compile("choice", ["a", "b"], engine.config.vocab_size, engine.config.eos_id))  # fmt: skip
        _run_one(engine, SamplingParams(max_new_tokens=1, constraint=c), timeout)
    if wait_all:
        engine.programs.wait(engine.programs.pending(), timeout)
    engine.settle_heap()  # before the first request, not in the middle of a burst (serving.memory.freeze_heap)
    return time.perf_counter() - t0
