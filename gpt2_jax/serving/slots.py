"""The engine's slots, on the host: a Request (one row to generate), the Slot it holds while it runs (its
blocks, its prompt's progress), and the fixed widths every row's rules are padded to.

Every per-row setting has a fixed width in the engine (logit_bias entries, bad words, constraint tables), so
one decode program serves every request; a request that does not fit gets a 400 naming the limit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gpt2_jax.errors import ConfigError, GPT2JaxError
from gpt2_jax.generation.decode import DecodeState
from gpt2_jax.generation.stop_strings import StopMatcher
from gpt2_jax.sampling import SamplingParams

MAX_LOGIT_BIAS_SLOTS = 512  # the engine's fixed logit_bias width (OpenAI allows 300 entries)
MAX_BAD_WORDS, MAX_BAD_WORD_LEN = 16, 8


class QueueFull(GPT2JaxError):
    """Every slot is busy and the queue holds max_queue requests."""


class Cancelled(GPT2JaxError):
    """The request was cancelled (its client went away, or the engine shut down)."""


@dataclasses.dataclass
class Request:
    """One row to generate. on_event(kind, payload) is called on the engine thread with
    ("token", (token, logprob, top_ids, top_logprobs)), then ("done", (finish_reason, stop_string))
    or ("error", exception)."""

    prompt: list
    sampling: SamplingParams  # what generate would get for this row (its seed aside: the key below is used)
    key: Any  # this row's PRNG key (generate's row key: fold_in(request key, row index))
    on_event: Callable[[str, Any], None]
    cancelled: bool = False
    prepared: Any = None  # generate's preparation of it (Engine.check), made once per row
    seed: int | None = None  # informational: the seed the key was made from, when there is one
    speculate: bool = True  # on a server with speculative decoding: whether this request's rows take part
    arrived: float = dataclasses.field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True


def row_key(seed: int, index: int) -> jax.Array:
    """Choice `index`'s key: generate's key for row `index` of a batch sampled with jax.random.key(seed)."""
    return jax.random.fold_in(jax.random.key(seed), index)


def tell(request: Request, kind: str, payload: Any) -> None:
    """Report to a request; a failing callback is that request's problem, never the engine's."""
    try:
        request.on_event(kind, payload)
    except Exception:
        request.cancel()


@dataclasses.dataclass
class Slot:
    """A row in use: its request, and where its prompt and blocks stand."""

    request: Request
    made: int = 0  # tokens generated
    stops: StopMatcher | None = None
    automaton: Any = None  # the compiled constraint, or None
    blocks: list = dataclasses.field(default_factory=list)  # the row's KV blocks, in slot order
    names: list = dataclasses.field(default_factory=list)  # the names of its prompt's full blocks (serving.blocks)
    prefilled: int = 0  # prompt tokens in the cache (reused or computed)
    decoding: bool = False  # the prompt is in: the row takes part in the decode steps
    order: int = 0  # admission order: prompts go in first come, first served


def fit(a: np.ndarray, shape: tuple, what: str) -> np.ndarray:
    """Zero-pad a per-row array to the engine's fixed shape (an error when it does not fit)."""
    if a.ndim == 0:
        return a
    if any(n > m for n, m in zip(a.shape, shape)):
        raise ConfigError(f"{what} is larger than this server supports ({a.shape} > {shape})")
    return np.pad(a, [(0, m - n) for n, m in zip(a.shape, shape)])


def fixed_processors(procs: Any, B: int) -> Any:
    """A batch's ProcessorSettings at the engine's fixed widths."""
    return procs._replace(
        bias_ids=fit(procs.bias_ids, (B, MAX_LOGIT_BIAS_SLOTS), "logit_bias"),
        bias=fit(procs.bias, (B, MAX_LOGIT_BIAS_SLOTS), "logit_bias"),
        bad_words=fit(procs.bad_words, (B, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), "bad words"),
        bad_word_lengths=fit(procs.bad_word_lengths, (B, MAX_BAD_WORDS), "bad words"),
    )


@jax.jit
def set_automaton(state: DecodeState, automaton: jax.Array) -> DecodeState:
    return state._replace(automaton=automaton)
