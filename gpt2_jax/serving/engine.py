"""The serving engine: continuous batching over rows that share one pool of KV blocks.

A request is one row of `generate`. At admission it gets the blocks its prompt and output need (serving.blocks),
the leading ones straight from the prefix cache when another request already computed the same tokens. Its prompt
then goes in chunk by chunk (at most prefill_chunk tokens per engine step, generation.paged.prefill_chunk), each
chunk between two decode steps, so the running streams keep flowing while a long prompt arrives. Then it joins
the decode steps, which advance every decoding row at once (decode_rows over the first 2, 8, 32, ... rows, the
smallest compiled size that covers them), and leaves the moment it finishes; its named blocks stay cached.
Because a row's bits never depend on its neighbours, its row, its blocks, who computed a shared block, the chunks
its prompt was cut into or when it arrived, a served request gives exactly the tokens and logprobs of `generate`
run on it alone with the same key.

No request stalls the others: every program is compiled ahead of time off the engine thread (serving.programs),
and a request waits in the queue until its programs, blocks and constraint-table room are there, while the others
run (one that only waits for programs or table room lets the ones behind it pass; one that waits for blocks does
not, so a long request is not starved by short ones).

The engine runs in one background thread; `submit` may be called from any thread and reports back through the
request's callback (called on the engine thread). `drain` stops admitting and lets the requests in flight finish.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.generation.batching import bucket, prepare
from gpt2_jax.generation.generator import token_bytes
from gpt2_jax.generation.stop_strings import StopMatcher
from gpt2_jax.model import Params
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.sampling import constraints
from gpt2_jax.serving.batch import DeviceBatch
from gpt2_jax.serving.blocks import BlockPool
from gpt2_jax.serving.engine_programs import SET_AUTOMATON, START_ROW, STOP_ROWS, EnginePrograms, Prefill
from gpt2_jax.serving.memory import freeze_heap, release_free_memory, thaw_heap
from gpt2_jax.serving.slots import Cancelled, QueueFull, Request, Slot, fixed_processors
from gpt2_jax.serving.slots import tell as _tell

OLD_SLOTS = 8  # the default pool holds the KV of the 8 max_seq-long slots the engine used to reserve
DEFAULT_PREFILL_CHUNK = 32  # tokens per prefill chunk: bench/serve.py measures gaps and time to first token


def default_blocks(max_seq: int) -> int:
    """The pool's default size: as many slots as OLD_SLOTS rows of max_seq, plus the null block."""
    return OLD_SLOTS * -(-max_seq // KEY_BLOCK) + 1


class Engine(EnginePrograms):
    """Continuous batching over max_batch rows sharing num_blocks KV blocks (see the module docstring).

    max_seq: prompt + max_tokens limit per request. prefill_chunk: the most prompt tokens computed between two
    decode steps. max_constraint_states / constraint_classes: the most states and token classes one request's
    constraint may have (the tables hold twice the states; a constrained request waits while they are full)."""

    def __init__(self, params: Params, config: GPT2Config, *, max_batch: int = 32, max_queue: int = 64,
                 max_seq: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_constraint_states: int = 4096,
                 constraint_classes: int = 512, on_compiled: Any = None):  # fmt: skip
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        max_seq = config.n_positions if max_seq is None else max_seq
        if not 1 <= max_seq <= config.n_positions:
            raise ConfigError(f"max_seq must be in [1, n_positions={config.n_positions}], got {max_seq}")
        if max_constraint_states < 1 or constraint_classes < 1:
            raise ConfigError("max_constraint_states and constraint_classes must be >= 1")
        if not 1 <= prefill_chunk <= config.n_positions:
            raise ConfigError(f"prefill_chunk must be in [1, n_positions={config.n_positions}], got {prefill_chunk}")
        self.blocks_per_row = -(-max_seq // KEY_BLOCK)
        num_blocks = default_blocks(max_seq) if num_blocks is None else num_blocks
        if num_blocks < self.blocks_per_row + 1:
            raise ConfigError(f"num_blocks must be >= {self.blocks_per_row + 1} (one max_seq={max_seq} request's "
                              f"{self.blocks_per_row} blocks of {KEY_BLOCK} tokens, plus the null block), "
                              f"got {num_blocks}")  # fmt: skip
        self.params, self.config, self.max_batch, self.max_queue = params, config, max_batch, max_queue
        self.max_seq, self.prefill_chunk, self.num_blocks = max_seq, prefill_chunk, num_blocks
        self.max_constraint_states, self.constraint_classes = max_constraint_states, constraint_classes
        self.capacity = self.blocks_per_row * KEY_BLOCK
        self.slots: list[Slot | None] = [None] * max_batch
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.running = self.stopped = self.draining = False
        self.abort_at: float | None = None
        self.thread: threading.Thread | None = None
        self.generated_tokens = self.prefill_tokens = self.admitted = 0
        self.frozen_programs = -1  # how many programs were built when settle_heap last froze the heap
        self._reset()
        EnginePrograms.__init__(self, on_compiled)

    def _reset(self) -> None:
        """Every row free, every block free, the prefix cache empty."""
        self.pool = BlockPool(self.num_blocks, KEY_BLOCK)
        self.batch = DeviceBatch(self.params, self.config, self.max_batch, self.num_blocks, self.blocks_per_row,
                                 self.max_constraint_states, self.constraint_classes)  # fmt: skip

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
        a = self._automaton(request)
        if a is not None:
            q, k = a.next_state.shape
            if q > self.max_constraint_states or k > self.constraint_classes:
                raise ConfigError(f"the constraint needs {q} states and {k} token classes; this server allows at "
                                  f"most {self.max_constraint_states} states and {self.constraint_classes} classes "
                                  f"(--max-constraint-states, --constraint-classes)")  # fmt: skip
        # generate's constraint tables for this one row (G x V: 400 KB even unconstrained) are not the engine's,
        # whose rows share one fixed set (batch.py): kept for the request's lifetime they would leave long-lived
        # buffers of many sizes all through the heap, which is what made RSS creep (serving/memory.py).
        return prep._replace(rules=prep.rules._replace(constraint=None))

    def _automaton(self, request: Request) -> Any:
        c = request.sampling.constraint
        if c is None:
            return None
        return constraints.compile_constraint(c, self.config.vocab_size, request.sampling.eos(self.config))

    def submit(self, request: Request) -> None:
        """Queue a request (validated first: bad input raises here, before it is queued), and ask for the
        programs it needs. QueueFull when every row is busy and max_queue requests wait; Cancelled once the
        engine is draining or stopped. A request a caller already checked keeps its preparation."""
        if request.prepared is None:
            request.prepared = self.check(request)
        with self.lock:
            if self.stopped or self.draining:
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
            active = [s for s in self.slots if s is not None]
            return {"active": len(active), "queued": len(self.queue), "prefilling": sum(not s.decoding for s in active),
                    "generated_tokens": self.generated_tokens, "prefill_tokens": self.prefill_tokens,
                    "compiling": len(self.programs.pending()), **self.pool.stats()}  # fmt: skip

    # ---- the loop --------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Give free rows to queued requests that can start now, in queue order, lowest row first."""
        admitted, dropped = [], []
        with self.lock:
            free = [b for b in range(self.max_batch) if self.slots[b] is None]
            for request in list(self.queue):
                if not free:
                    break
                if request.cancelled:
                    self.queue.remove(request)
                    dropped.append(request)
                    continue
                automaton = self._automaton(request)
                held = [s.automaton for s in self.slots if s is not None]
                if automaton is not None and not self.batch.fits(held, automaton):
                    continue  # waits for room in the constraint tables
                n = len(request.prompt)
                plan = self.pool.plan(request.prompt, min(n + request.sampling.max_new_tokens, self.capacity))
                if plan is None:
                    break  # waits for blocks, and so does everyone behind it
                if self.pool.waits_for(plan, n) or not self.ready(request, len(plan.reused) * KEY_BLOCK, free[0]):
                    continue
                self.queue.remove(request)
                b = free.pop(0)
                stops = StopMatcher(request.prepared.stops, token_bytes(None)) if request.sampling.stop else None
                self.slots[b] = Slot(request, 0, stops, automaton, self.pool.take(plan, n), plan.names,
                                     len(plan.reused) * KEY_BLOCK, False, self.admitted)  # fmt: skip
                self.admitted += 1
                admitted.append(b)
        for request in dropped:
            _tell(request, "error", Cancelled("cancelled before it started"))
        for b in admitted:
            slot = self.slots[b]
            self.batch.set_row(b, slot.request.prepared.rules)
            if slot.automaton is not None:
                self._repack()

    def _repack(self) -> None:
        decoding = np.array([s is not None and s.decoding for s in self.slots])
        self.batch.repack([s.automaton if s is not None else None for s in self.slots], decoding,
                          self.program(SET_AUTOMATON))  # fmt: skip

    def _table(self, slot: Slot) -> np.ndarray:
        table = np.zeros(self.blocks_per_row, np.int32)  # NULL_BLOCK past the row's blocks
        table[: len(slot.blocks)] = slot.blocks
        return table

    def _prefill(self) -> bool:
        """One chunk of the prompt admitted first among those still going in; False when none is."""
        waiting = [(s.order, b) for b, s in enumerate(self.slots) if s is not None and not s.decoding]
        if not waiting:
            return False
        b = min(waiting)[1]
        slot = self.slots[b]
        prompt, start = slot.request.prompt, slot.prefilled
        n = min(len(prompt) - start, self.prefill_chunk)
        tokens = np.full(bucket(n, self.prefill_chunk), prompt[start + n - 1], np.int32)  # padding: a real token
        tokens[:n] = prompt[start : start + n]
        table = self._table(slot)
        run = self.program(Prefill(len(tokens)))
        self.batch.state, logits = run(self.params, self.batch.state, table, tokens, np.int32(start), np.int32(n - 1))
        slot.prefilled += n
        self.prefill_tokens += n
        self.pool.register(slot.blocks, slot.names, min(slot.prefilled // KEY_BLOCK, len(slot.names)))
        if slot.prefilled == len(prompt):
            padded = np.full(self.capacity, prompt[-1], np.int32)
            padded[: len(prompt)] = prompt
            key = slot.request.prepared.batch.keys[0]
            self.batch.state = self.program(START_ROW)(
                self.batch.state, np.int32(b), table, padded, np.int32(len(prompt)), logits, key,
                np.int32(self.batch.start_state(b)),
            )  # fmt: skip
            slot.decoding = True
        return True

    def _decode(self, decoding: list[int]) -> None:
        top = any(self.slots[b].request.sampling.top_logprobs for b in decoding)
        key = self.decoder(max(decoding) + 1, top)
        if key is None:  # not compiled yet (admission waits for it, so only after a failure): try again soon
            time.sleep(0.01)
            return
        self.batch.state, out = self.program(key)(self.params, self.batch.state, self.batch.rules)
        token, logprob = np.asarray(out.token), np.asarray(out.logprob)
        top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        done = np.asarray(self.batch.state.done)
        ended = []
        for b in decoding:
            slot = self.slots[b]
            n = slot.request.sampling.top_logprobs
            slot.made += 1
            self.generated_tokens += 1
            _tell(slot.request, "token", (int(token[b]), float(logprob[b]), top_ids[b, :n].tolist(),
                                            top_lp[b, :n].tolist()))  # fmt: skip
            hit = slot.stops.feed(0, [int(token[b])]) if slot.stops else None
            if hit is not None:
                ended.append((b, "done", ("stop", hit.stop)))
            elif done[b]:
                ended.append((b, "done", ("stop", None)))
            elif slot.made >= slot.request.sampling.max_new_tokens:
                ended.append((b, "done", ("length", None)))
        self._finish(ended)

    def _finish(self, ended: list[tuple[int, str, Any]]) -> None:
        """End rows [(row, kind, payload)]: halt them, free their blocks (named ones stay cached), tell them."""
        if not ended:
            return
        mask = np.zeros(self.max_batch, bool)
        slots = []
        with self.lock:
            for b, _, _ in ended:
                mask[b] = True
                slots.append(self.slots[b])
                self.slots[b] = None
            self.lock.notify_all()
        self.batch.state = self.program(STOP_ROWS)(self.batch.state, mask, np.int32(self.batch.filler))
        for slot in slots:
            self.pool.release(slot.blocks, slot.names)
        if any(s.automaton is not None for s in slots):
            self._repack()
        for slot, (_, kind, payload) in zip(slots, ended):
            _tell(slot.request, kind, payload)

    def _abort_late(self) -> None:
        """Past the drain's deadline: every request still in flight ends now, finish_reason "abort"."""
        if self.abort_at is None or time.monotonic() < self.abort_at:
            return
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        self._finish([(b, "done", ("abort", None)) for b, s in enumerate(self.slots) if s is not None])
        for request in queued:
            _tell(request, "done", ("abort", None))

    def step(self) -> bool:
        """Drop cancelled requests, admit waiting ones, put one prompt chunk in, then run one decode step. False
        when idle (nothing running, nothing queued); while queued requests only wait (for their programs, for
        blocks), it sleeps until something changes (at most 0.1 s) and returns True."""
        self._abort_late()
        self._finish([(b, "error", Cancelled("cancelled")) for b, s in enumerate(self.slots)
                      if s is not None and s.request.cancelled])  # fmt: skip
        self._admit()
        prefilled = self._prefill()
        decoding = [b for b, s in enumerate(self.slots) if s is not None and s.decoding]
        if decoding:
            self._decode(decoding)
            return True
        if prefilled:
            return True
        with self.lock:
            if not self.queue and not any(s is not None for s in self.slots):
                return False
            self.lock.wait(timeout=0.1)  # woken when a program is built or a row ends
        return True

    def run(self) -> None:
        """The engine thread: step while there is work, sleep on the condition otherwise."""
        worked = False
        while self.running:
            try:
                busy = self.step()
                worked |= busy
            except Exception as e:  # fail the requests in flight, keep serving
                with self.lock:
                    failed = [s for s in self.slots if s is not None]
                    self.slots = [None] * self.max_batch
                for slot in failed:
                    _tell(slot.request, "error", e)
                self._reset()
                continue
            if not busy:
                if worked:  # just went idle: hand the heap's free pages back (serving.memory)
                    release_free_memory()
                    self.settle_heap()
                    worked = False
                with self.lock:
                    if self.running:
                        self.lock.wait(timeout=0.1)

    def settle_heap(self) -> None:
        """Freeze the heap (serving.memory.freeze_heap) if programs were built since it was last frozen."""
        built = len(self.programs.built)
        if built != self.frozen_programs:
            freeze_heap()
            self.frozen_programs = built

    def start(self) -> Engine:
        self.running = True
        self.thread = threading.Thread(target=self.run, name="gpt2-jax-engine", daemon=True)
        self.thread.start()
        self.ident = self.thread.ident  # the engine thread's, kept after stop (tests check what ran on it)
        return self

    def drain(self, timeout: float) -> bool:
        """Stop admitting new requests (submit raises Cancelled) and wait for the ones in flight, queued ones
        included, to finish; those still running after `timeout` seconds end with finish_reason "abort". True if
        every request finished on its own."""
        deadline = time.monotonic() + timeout
        with self.lock:
            self.draining, self.abort_at = True, deadline
            self.lock.notify_all()
            while self.running and (self.queue or any(s is not None for s in self.slots)):
                self.lock.wait(timeout=0.05)
        return time.monotonic() < deadline

    def stop(self) -> None:
        """Stop the loop; every queued and running request gets a Cancelled error. Safe to call twice."""
        with self.lock:
            self.running, self.stopped = False, True
            self.lock.notify_all()
            thread, self.thread = self.thread, None
        self.programs.close()  # its compiler thread would otherwise keep this engine and its programs alive
        thaw_heap()  # frozen, this engine's cycles could never be collected once it is dropped
        if thread is None:
            return
        thread.join()  # a step is milliseconds to seconds; the loop checks `running` after each
        self._finish([(b, "error", Cancelled("the server is shutting down")) for b, s in enumerate(self.slots)
                      if s is not None])  # fmt: skip
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        for request in queued:
            _tell(request, "error", Cancelled("the server is shutting down"))
