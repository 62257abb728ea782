"""The serving engine: continuous batching over a fixed set of slots that share one preallocated KV cache.

A request is one row of `generate`: its prompt is prefilled alone (the same `prefill`), its row state
is copied into a free slot, and from then on one jitted `decode_step` (the same one `generate_stream`
runs) advances every slot at once. Each slot has its own position, key, sampling settings,
processors, constraint state and stop strings, so a request joins as soon as a slot is free and
leaves the moment it finishes. Because a row's bits never depend on its neighbours, the slot it got,
the cache size or when it arrived, a served request gives exactly the tokens and logprobs of
`generate` run on it alone with the same key.

The engine runs in one background thread; `submit` may be called from any thread and reports back
through the request's callback (called on the engine thread).

Shape legend: B slots, S cache slots per row, V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, GPT2JaxError, InputError
from gpt2_jax.generation import (
    TOP_LOGPROBS,
    DecodeState,
    Rules,
    StopMatcher,
    decode_step,
    halt,
    prefill,
    prepare,
    token_bytes,
)
from gpt2_jax.model import KEY_BLOCK, Params
from gpt2_jax.sampling import SamplingParams, constraints

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
    prepared: Any = None  # generate's preparation of it, made by Engine.submit's check
    seed: int | None = None  # informational: the seed the key was made from, when there is one
    arrived: float = dataclasses.field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True


def _tell(request: Request, kind: str, payload: Any) -> None:
    """Report to a request; a failing callback is that request's problem, never the engine's."""
    try:
        request.on_event(kind, payload)
    except Exception:
        request.cancel()


@dataclasses.dataclass
class _Slot:
    request: Request
    made: int = 0
    stops: StopMatcher | None = None
    automaton: Any = None  # the compiled constraint, or None


def _fit(a: np.ndarray, shape: tuple, what: str) -> np.ndarray:
    """Zero-pad a per-row array to the engine's fixed shape (an error when it does not fit)."""
    if a.ndim == 0:
        return a
    if any(n > m for n, m in zip(a.shape, shape)):
        raise ConfigError(f"{what} is larger than this server supports ({a.shape} > {shape})")
    return np.pad(a, [(0, m - n) for n, m in zip(a.shape, shape)])


@functools.partial(jax.jit, donate_argnums=0)
def _insert(state: DecodeState, row: DecodeState, slot: jax.Array) -> DecodeState:
    """Copy a one-row state into slot `slot` of the engine's state (the cache's rows sit on axis 1)."""

    def put(big, small):
        return big.at[slot].set(small[0])

    cache = state.cache._replace(k=state.cache.k.at[:, slot].set(row.cache.k[:, 0]),
                                 v=state.cache.v.at[:, slot].set(row.cache.v[:, 0]),
                                 lengths=put(state.cache.lengths, row.cache.lengths))  # fmt: skip
    rest = jax.tree.map(put, state._replace(cache=None), row._replace(cache=None))
    return rest._replace(cache=cache)


@jax.jit
def _set_automaton(state: DecodeState, automaton: jax.Array) -> DecodeState:
    return state._replace(automaton=automaton)


class Engine:
    """Continuous batching over max_batch slots of max_seq positions each (see the module docstring)."""

    def __init__(
        self, params: Params, config: GPT2Config, *, max_batch: int = 8, max_queue: int = 64, max_seq: int | None = None
    ):
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        max_seq = config.n_positions if max_seq is None else max_seq
        if not 1 <= max_seq <= config.n_positions:
            raise ConfigError(f"max_seq must be in [1, n_positions={config.n_positions}], got {max_seq}")
        self.params, self.config, self.max_batch, self.max_queue, self.max_seq = (
            params,
            config,
            max_batch,
            max_queue,
            max_seq,
        )
        self.capacity = -(-max_seq // KEY_BLOCK) * KEY_BLOCK
        self.slots: list[_Slot | None] = [None] * max_batch
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.running = self.stopped = False
        self.thread: threading.Thread | None = None
        self.generated_tokens = 0
        self._empty()

    # ---- state -------------------------------------------------------------------------------
    def _empty(self) -> None:
        """Every slot free: a state whose rows are all done, and neutral rules."""
        B = self.max_batch
        idle = [self.config.eos_id if self.config.eos_id is not None else 0]  # a halted slot's one token, never read
        prep = prepare(self.params, self.config, [idle] * B, jax.random.key(0), [SamplingParams(max_new_tokens=1)] * B)
        rules = prep.rules
        procs = rules.processors._replace(
            bias_ids=_fit(rules.processors.bias_ids, (B, MAX_LOGIT_BIAS_SLOTS), "logit_bias"),
            bias=_fit(rules.processors.bias, (B, MAX_LOGIT_BIAS_SLOTS), "logit_bias"),
            bad_words=_fit(rules.processors.bad_words, (B, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), "bad words"),
            bad_word_lengths=_fit(rules.processors.bad_word_lengths, (B, MAX_BAD_WORDS), "bad words"))  # fmt: skip
        self.rules_host = jax.tree.map(np.array, rules._replace(processors=procs))
        self.rules = jax.device_put(self.rules_host)
        state = prefill(self.params, prep.batch.tokens[:B], prep.batch.lengths[:B], prep.batch.keys[:B], self.config,
                        self.capacity)  # fmt: skip
        self.state = halt(state, np.ones(B, bool), self.rules.stop.eos_id)

    def _set_row_rules(self, b: int, rules: Rules) -> None:
        """Write a one-row Rules into row b of the engine's (fixed-shape) host rules."""

        def put(big, small):
            big[b] = _fit(np.asarray(small)[0], big.shape[1:], "a setting")

        jax.tree.map(put, self.rules_host.settings, rules.settings)
        jax.tree.map(put, self.rules_host.processors, rules.processors)
        jax.tree.map(put, self.rules_host.stop, rules.stop)

    def _repack_constraints(self) -> None:
        """Re-pack the active slots' automata into one table; constrained rows keep their local state."""
        old = self.rules_host.constraint
        automata = [s.automaton if s is not None else None for s in self.slots]
        new = constraints.pack(automata, self.config.vocab_size)
        states = np.asarray(self.state.automaton)
        local = np.where(old.group > 0, states - old.start, 0)
        moved = np.where(new.group > 0, new.start + local, 0).astype(np.int32)
        self.rules_host = self.rules_host._replace(constraint=new)
        self.state = _set_automaton(self.state, jnp.asarray(moved))

    # ---- requests ------------------------------------------------------------------------------
    def check(self, request: Request) -> Any:
        """Validate a request as generate would (ConfigError / InputError) -> generate's preparation of it."""
        n = request.sampling.max_new_tokens
        if len(request.prompt) + n > self.max_seq:
            raise InputError(f"{len(request.prompt)} prompt tokens + max_tokens={n} exceed "
                             f"this server's max_seq={self.max_seq}")  # fmt: skip
        prep = prepare(
            self.params, self.config, [request.prompt], request.key[None], [request.sampling.replace(seed=None)]
        )
        _fit(prep.rules.processors.bias_ids[:1], (1, MAX_LOGIT_BIAS_SLOTS), "logit_bias")
        _fit(prep.rules.processors.bad_words[:1], (1, MAX_BAD_WORDS, MAX_BAD_WORD_LEN), "bad words")
        return prep

    def submit(self, request: Request) -> None:
        """Queue a request (validated first: bad input raises here, before it is queued). QueueFull
        when every slot is busy and max_queue requests wait."""
        request.prepared = self.check(request)
        with self.lock:
            if self.stopped:
                raise Cancelled("the server is shutting down")
            active = sum(s is not None for s in self.slots)
            if active + len(self.queue) >= self.max_batch + self.max_queue:
                raise QueueFull(f"server busy: {active} requests running and {len(self.queue)} queued "
                                f"(max_batch={self.max_batch}, max_queue={self.max_queue})")  # fmt: skip
            self.queue.append(request)
            self.lock.notify()

    def stats(self) -> dict:
        with self.lock:
            return {"active": sum(s is not None for s in self.slots), "queued": len(self.queue),
                    "generated_tokens": self.generated_tokens}  # fmt: skip

    # ---- the loop --------------------------------------------------------------------------------
    def _admit(self, b: int, request: Request) -> None:
        """Prefill the request alone and copy its row into slot b (a failure is reported to it alone)."""
        try:
            prep = request.prepared or self.check(request)
            row = prefill(self.params, prep.batch.tokens[:1], prep.batch.lengths[:1], prep.batch.keys[:1],
                          self.config, self.capacity)  # fmt: skip
            c = request.sampling.constraint
            eos = request.sampling.eos(self.config)
            automaton = None if c is None else constraints.compile_constraint(c, self.config.vocab_size, eos)
        except Exception as e:
            _tell(request, "error", e)
            return
        stops = StopMatcher(prep.stops, token_bytes(None)) if request.sampling.stop else None
        self.slots[b] = _Slot(request, 0, stops, automaton)
        self._set_row_rules(b, prep.rules)
        self.state = _insert(self.state, row, jnp.int32(b))
        if automaton is not None:
            self._repack_constraints()
        self.rules = jax.device_put(self.rules_host)

    def _finish(self, b: int, kind: str, payload: Any) -> None:
        slot = self.slots[b]
        self.slots[b] = None
        self.state = halt(self.state, np.arange(self.max_batch) == b, self.rules.stop.eos_id)
        if slot.automaton is not None:
            self._repack_constraints()
            self.rules = jax.device_put(self.rules_host)
        _tell(slot.request, kind, payload)

    def step(self) -> bool:
        """Drop cancelled requests, admit waiting ones into free slots, then run one decode step. False when idle."""
        for b, slot in enumerate(self.slots):
            if slot is not None and slot.request.cancelled:
                self._finish(b, "error", Cancelled("cancelled"))
        with self.lock:
            admit = []
            for b in range(self.max_batch):
                if self.slots[b] is None and self.queue:
                    admit.append((b, self.queue.popleft()))
                    self.slots[b] = _Slot(admit[-1][1])  # reserved
        for b, request in admit:
            self.slots[b] = None
            if request.cancelled:
                _tell(request, "error", Cancelled("cancelled before it started"))
                continue
            self._admit(b, request)
        active = [b for b, s in enumerate(self.slots) if s is not None]
        if not active:
            return False
        r = TOP_LOGPROBS if any(self.slots[b].request.sampling.top_logprobs for b in active) else 0
        self.state, out = decode_step(self.params, self.state, self.rules, self.config, r)
        token, logprob = np.asarray(out.token), np.asarray(out.logprob)
        top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        done = np.asarray(self.state.done)
        for b in active:
            slot = self.slots[b]
            n = slot.request.sampling.top_logprobs
            slot.made += 1
            self.generated_tokens += 1
            _tell(slot.request, "token", (int(token[b]), float(logprob[b]), top_ids[b, :n].tolist(),
                                            top_lp[b, :n].tolist()))  # fmt: skip
            hit = slot.stops.feed(0, [int(token[b])]) if slot.stops else None
            if hit is not None:
                self._finish(b, "done", ("stop", hit.stop))
            elif done[b]:
                self._finish(b, "done", ("stop", None))
            elif slot.made >= slot.request.sampling.max_new_tokens:
                self._finish(b, "done", ("length", None))
        return True

    def run(self) -> None:
        """The engine thread: step while there is work, sleep on the condition otherwise."""
        while self.running:
            try:
                busy = self.step()
            except Exception as e:
                for b, slot in enumerate(self.slots):
                    if slot is not None:
                        self.slots[b] = None
                        _tell(slot.request, "error", e)
                self._empty()
                continue
            if not busy:
                with self.lock:
                    if self.running and not self.queue:
                        self.lock.wait(timeout=0.1)

    def start(self) -> Engine:
        self.running = True
        self.thread = threading.Thread(target=self.run, name="gpt2-jax-engine", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; every queued and running request gets a Cancelled error. Safe to call twice."""
        with self.lock:
            self.running, self.stopped = False, True
            self.lock.notify_all()
            thread, self.thread = self.thread, None
        if thread is None:
            return
        thread.join()  # a step is milliseconds to seconds; the loop checks `running` after each
        for b, slot in enumerate(self.slots):
            if slot is not None:
                self._finish(b, "error", Cancelled("the server is shutting down"))
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        for request in queued:
            _tell(request, "error", Cancelled("the server is shutting down"))
