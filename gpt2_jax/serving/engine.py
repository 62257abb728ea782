"""The serving engine: continuous batching over a fixed set of slots that share one preallocated KV cache.

A request is one row of `generate`: its prompt is prefilled alone (the same `prefill`), its row state is
copied into a free slot, and from then on one decode step (the same `decode_step` generate_stream runs)
advances every slot at once. Each slot has its own position, key, sampling settings, processors, constraint
state and stop strings, so a request joins as soon as a slot is free and leaves the moment it finishes.
Because a row's bits never depend on its neighbours, the slot it got, the cache size or when it arrived, a
served request gives exactly the tokens and logprobs of `generate` run on it alone with the same key.

No request stalls the others. Every program the engine runs is compiled ahead of time off the engine thread
(serving.programs): a request whose prompt bucket is not compiled yet waits in the queue while the others
stream. The constraint tables have one fixed shape (every constraint, one decode program), and constraints
themselves are compiled in a child process (serving.constraint_worker) before their request is queued.

The engine runs in one background thread; `submit` may be called from any thread and reports back through
the request's callback (called on the engine thread).

Shape legend: B slots, S cache slots per row, V vocab; constraint tables G automata, Q states, C classes.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.generation import TOP_LOGPROBS, StopMatcher, decode_step, halt, prefill, prepare, token_bytes
from gpt2_jax.model import KEY_BLOCK, Params
from gpt2_jax.sampling import SamplingParams, constraints
from gpt2_jax.serving.programs import Programs
from gpt2_jax.serving.rows import Cancelled, QueueFull, Request, Slot, fit, fixed_processors, insert, set_automaton
from gpt2_jax.serving.rows import tell as _tell

__all__ = ["Cancelled", "Engine", "QueueFull", "Request"]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _spec(tree: Any) -> Any:
    """Shapes, dtypes and shardings of a pytree of arrays (what a program is compiled for)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)


class Engine:
    """Continuous batching over max_batch slots of max_seq positions each (see the module docstring).

    max_constraint_states / constraint_classes: the most states and token classes one request's constraint
    may have; the engine's tables hold twice the states (several constraints at once), and a constrained
    request waits in the queue while they are full."""

    def __init__(self, params: Params, config: GPT2Config, *, max_batch: int = 8, max_queue: int = 64,
                 max_seq: int | None = None, max_constraint_states: int = 4096, constraint_classes: int = 512,
                 on_compiled: Any = None):  # fmt: skip
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        max_seq = config.n_positions if max_seq is None else max_seq
        if not 1 <= max_seq <= config.n_positions:
            raise ConfigError(f"max_seq must be in [1, n_positions={config.n_positions}], got {max_seq}")
        if max_constraint_states < 1 or constraint_classes < 1:
            raise ConfigError("max_constraint_states and constraint_classes must be >= 1")
        self.params, self.config, self.max_batch, self.max_queue = params, config, max_batch, max_queue
        self.max_seq, self.max_constraint_states, self.constraint_classes = (
            max_seq,
            max_constraint_states,
            constraint_classes,
        )
        self.capacity = -(-max_seq // KEY_BLOCK) * KEY_BLOCK
        self.table_shape = (_pow2(max_batch + 1), _pow2(2 * max_constraint_states + 1), _pow2(constraint_classes))
        self.slots: list[Slot | None] = [None] * max_batch
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.running = self.stopped = False
        self.thread: threading.Thread | None = None
        self.generated_tokens = 0
        self.on_compiled = on_compiled
        self.programs = Programs(self._compiled)
        self._empty()
        self.state_spec, self.rules_spec = _spec(self.state), _spec(self.rules)

    # ---- state -------------------------------------------------------------------------------
    def _empty(self) -> None:
        """Every slot free: a state whose rows are all done, and neutral rules at the engine's fixed widths."""
        B = self.max_batch
        idle = [self.config.eos_id if self.config.eos_id is not None else 0]  # a halted slot's one token, never read
        prep = prepare(self.params, self.config, [idle] * B, jax.random.key(0), [SamplingParams(max_new_tokens=1)] * B)
        rules = prep.rules._replace(processors=fixed_processors(prep.rules.processors, B))
        tables = constraints.pack([None] * B, self.config.vocab_size, self.table_shape)
        self.rules_host = jax.tree.map(np.array, rules._replace(constraint=tables))
        self.tables = jax.device_put(self.rules_host.constraint)  # re-sent only when the constraints change
        self.rules = self._device_rules()
        state = prefill(self.params, prep.batch.tokens[:B], prep.batch.lengths[:B], prep.batch.keys[:B], self.config,
                        self.capacity)  # fmt: skip
        self.state = halt(state, np.ones(B, bool), self.rules.stop.eos_id)

    def _device_rules(self) -> Any:
        r = self.rules_host
        return r._replace(settings=jax.device_put(r.settings), processors=jax.device_put(r.processors),
                          stop=jax.device_put(r.stop), constraint=self.tables)  # fmt: skip

    def _set_row_rules(self, b: int, rules: Any) -> None:
        """Write a one-row Rules into row b of the engine's (fixed-shape) host rules."""

        def put(big, small):
            big[b] = fit(np.asarray(small)[0], big.shape[1:], "a setting")

        for part in ("settings", "processors", "stop"):
            jax.tree.map(put, getattr(self.rules_host, part), getattr(rules, part))

    def _pack(self, automata: list) -> constraints.ConstraintTables:
        return constraints.pack(automata, self.config.vocab_size, self.table_shape)

    def _repack_constraints(self) -> None:
        """Re-pack the active slots' automata into the fixed tables; constrained rows keep their local state."""
        old = self.rules_host.constraint
        new = self._pack([s.automaton if s is not None else None for s in self.slots])
        states = np.asarray(self.state.automaton)
        local = np.where(old.group > 0, states - old.start, 0)
        moved = np.where(new.group > 0, new.start + local, 0).astype(np.int32)
        self.rules_host = self.rules_host._replace(constraint=new)
        self.tables = jax.device_put(new)
        self.state = set_automaton(self.state, jnp.asarray(moved))

    # ---- compiled programs -------------------------------------------------------------------
    def _compiled(self, key: tuple, seconds: float) -> None:
        """A program is ready (the compiler thread): wake the engine, whose queue may now move."""
        with self.lock:
            self.lock.notify_all()
        if self.on_compiled is not None:
            self.on_compiled(key, seconds)

    def want(self, key: tuple, priority: float = 1.0) -> bool:
        """Ask for a program ("prefill", P) or ("decode", R) to be compiled; True when it is ready."""
        kind, n = key
        if kind == "prefill":
            tokens, lengths = jax.ShapeDtypeStruct((1, n), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
            keys = jax.ShapeDtypeStruct((1,), self.state.keys.dtype)
            build = lambda: prefill.lower(self.params, tokens, lengths, keys, self.config, self.capacity).compile()
        else:
            build = lambda: decode_step.lower(self.params, self.state_spec, self.rules_spec, self.config, n).compile()
        return self.programs.want(key, build, priority)

    def buckets(self) -> list[int]:
        """The prompt buckets a request can need (powers of two from 16 up to max_seq's)."""
        from gpt2_jax.generation import bucket

        return sorted({bucket(n, self.config.n_positions) for n in range(1, self.max_seq + 1)})

    def compile(self, wait: bool = True, timeout: float | None = None) -> list[tuple]:
        """Queue every program the engine can need (the decode step with and without top logprobs, each prompt
        bucket's prefill, smallest first); with wait, block until they are built. Returns their keys."""
        keys = [("decode", 0), ("prefill", self.buckets()[0]), ("decode", TOP_LOGPROBS)]
        keys += [("prefill", b) for b in self.buckets()[1:]]
        for i, key in enumerate(keys):
            self.want(key, priority=float(i))
        if wait:
            self.programs.wait(keys, timeout)
        return keys

    def needs(self, request: Request) -> list[tuple]:
        """The programs a request's admission waits for."""
        r = TOP_LOGPROBS if request.sampling.top_logprobs else 0
        return [("decode", 0), ("decode", r), ("prefill", request.prepared.batch.tokens.shape[1])]

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
        fixed_processors(prep.rules.processors, 1)  # a 400 now, not later, for too many biases or bad words
        c = request.sampling.constraint
        if c is not None:
            a = constraints.compile_constraint(c, self.config.vocab_size, request.sampling.eos(self.config))
            q, k = a.next_state.shape
            if q > self.max_constraint_states or k > self.constraint_classes:
                raise ConfigError(f"the constraint needs {q} states and {k} token classes; this server allows at "
                                  f"most {self.max_constraint_states} states and {self.constraint_classes} classes "
                                  f"(--max-constraint-states, --constraint-classes)")  # fmt: skip
        return prep

    def submit(self, request: Request) -> None:
        """Queue a request (validated first: bad input raises here, before it is queued), and ask for the
        programs it needs. QueueFull when every slot is busy and max_queue requests wait."""
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
        for key in self.needs(request):
            self.want(key, priority=0.0)  # a waiting request's programs come before the background's

    def stats(self) -> dict:
        with self.lock:
            return {"active": sum(s is not None for s in self.slots), "queued": len(self.queue),
                    "generated_tokens": self.generated_tokens, "compiling": len(self.programs.pending())}  # fmt: skip

    # ---- the loop --------------------------------------------------------------------------------
    def _fits(self, request: Request) -> bool:
        """Whether a request can start now: its programs are compiled and its constraint fits the tables."""
        if not all(self.programs.get(k) is not None for k in self.needs(request)):
            return False
        c = request.sampling.constraint
        if c is None:
            return True
        a = constraints.compile_constraint(c, self.config.vocab_size, request.sampling.eos(self.config))
        held = {id(s.automaton): s.automaton for s in self.slots if s is not None and s.automaton is not None}
        held[id(a)] = a  # the tables store each distinct automaton once (see constraints.pack)
        G, Q, _ = self.table_shape
        return len(held) + 1 <= G and 1 + sum(x.next_state.shape[0] for x in held.values()) <= Q  # else: wait

    def _admit(self, b: int, request: Request) -> None:
        """Prefill the request alone and copy its row into slot b (a failure is reported to it alone)."""
        try:
            prep = request.prepared
            run = self.programs.get(("prefill", prep.batch.tokens.shape[1]))
            row = run(self.params, prep.batch.tokens[:1], prep.batch.lengths[:1], prep.batch.keys[:1])
            c = request.sampling.constraint
            eos = request.sampling.eos(self.config)
            automaton = None if c is None else constraints.compile_constraint(c, self.config.vocab_size, eos)
        except Exception as e:
            _tell(request, "error", e)
            return
        stops = StopMatcher(prep.stops, token_bytes(None)) if request.sampling.stop else None
        self.slots[b] = Slot(request, 0, stops, automaton)
        self._set_row_rules(b, prep.rules)
        self.state = insert(self.state, row, jnp.int32(b))
        if automaton is not None:
            self._repack_constraints()
        self.rules = self._device_rules()

    def _finish(self, b: int, kind: str, payload: Any) -> None:
        slot = self.slots[b]
        self.slots[b] = None
        self.state = halt(self.state, np.arange(self.max_batch) == b, self.rules.stop.eos_id)
        if slot.automaton is not None:
            self._repack_constraints()
            self.rules = self._device_rules()
        _tell(slot.request, kind, payload)

    def _take(self) -> list[tuple[int, Request]]:
        """Pair free slots with queued requests that can start now, in queue order (one that waits for its
        programs or for room in the constraint tables lets the ones behind it pass)."""
        admit = []
        with self.lock:
            free = [b for b in range(self.max_batch) if self.slots[b] is None]
            for request in list(self.queue):
                if not free:
                    break
                if request.cancelled or self._fits(request):
                    self.queue.remove(request)
                    b = free.pop(0)
                    admit.append((b, request))
                    self.slots[b] = Slot(request)  # reserved
        return admit

    def step(self) -> bool:
        """Drop cancelled requests, admit waiting ones into free slots, then run one decode step. False when idle
        (nothing running, nothing queued); while queued requests only wait for their programs, it sleeps until
        one is built (at most 0.1 s) and returns True."""
        for b, slot in enumerate(self.slots):
            if slot is not None and slot.request.cancelled:
                self._finish(b, "error", Cancelled("cancelled"))
        for b, request in self._take():
            self.slots[b] = None
            if request.cancelled:
                _tell(request, "error", Cancelled("cancelled before it started"))
                continue
            self._admit(b, request)
        active = [b for b, s in enumerate(self.slots) if s is not None]
        if not active:
            with self.lock:
                if not self.queue:
                    return False
                self.lock.wait(timeout=0.1)  # woken when a program is built (_compiled)
            return True
        r = TOP_LOGPROBS if any(self.slots[b].request.sampling.top_logprobs for b in active) else 0
        self.state, out = self.programs.get(("decode", r))(self.params, self.state, self.rules)
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
            except Exception as e:  # fail the requests in flight, keep serving
                for b, slot in enumerate(self.slots):
                    if slot is not None:
                        self.slots[b] = None
                        _tell(slot.request, "error", e)
                self._empty()
                continue
            if not busy:
                with self.lock:
                    if self.running:
                        self.lock.wait(timeout=0.1)

    def start(self) -> Engine:
        self.running = True
        self.thread = threading.Thread(target=self.run, name="gpt2-jax-engine", daemon=True)
        self.thread.start()
        self.ident = self.thread.ident  # the engine thread's, kept after stop (tests check what ran on it)
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
