"""The serving engine: continuous batching over rows that share one pool of KV blocks.

A request is one row of `generate`. At admission it gets the blocks its prompt and output need (serving.blocks),
the leading ones straight from the prefix cache when another request already computed the same tokens. Its prompt
then goes in chunk by chunk (at most prefill_chunk tokens per engine step, generation.paged.prefill_chunk), each
chunk between two decode steps or, a full one that ends no prompt, inside the decode step's forward
(generation.paged.decode_rows_with_chunk), so the running streams keep flowing while a long prompt arrives. Then it joins
the decode steps, which advance every decoding row at once (decode_rows over the first 1, 2, 8, 16, 32, ... rows,
the smallest compiled size that covers them; a row whose prompt is whole moves down to the lowest row not decoding,
so the decoding rows stay packed), and leaves the moment it finishes; its named blocks stay cached.
While every busy row decodes and nothing waits, steps run back to back: the next one is dispatched before the
last one's tokens are handed out (EngineRows.chain). With speculation (serving.speculation), a step may instead
be a speculative round that gives each row up to k + 1
tokens, the ones plain steps would give. Because a row's bits never depend on its neighbours, its row, its blocks, who computed a shared block, the chunks
its prompt was cut into or when it arrived, a served request gives exactly the tokens and logprobs of `generate`
run on it alone with the same key.

No request stalls the others: every program is compiled ahead of time off the engine thread (serving.programs),
and a request waits in the queue until its programs, blocks and constraint-table room are there, while the others
run (one that only waits for programs or table room lets the ones behind it pass; one that waits for blocks does
not, so a long request is not starved by short ones).

The engine runs in one background thread; `submit` may be called from any thread and reports back through the
request's callback (called on the engine thread). `drain` stops admitting and lets the requests in flight finish.
The rows and each step's work on them are serving.engine_rows'; the programs, serving.engine_programs'.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from gpt2_jax.config import GPT2Config
from gpt2_jax.model import Params
from gpt2_jax.serving.engine_checks import check_request, check_settings
from gpt2_jax.serving.engine_programs import Name
from gpt2_jax.serving.engine_rows import EngineRows
from gpt2_jax.serving.memory import freeze_heap, release_free_memory, thaw_heap
from gpt2_jax.serving.slots import Cancelled, QueueFull, Request, tell
from gpt2_jax.serving.speculation import Speculation

DEFAULT_PREFILL_CHUNK = 32  # tokens per prefill chunk: bench/serve.py measures gaps and time to first token


class Engine:
    """Continuous batching over max_batch rows sharing num_blocks KV blocks (see the module docstring).

    max_seq: prompt + max_tokens limit per request. prefill_chunk: the most prompt tokens computed between two
    decode steps. max_constraint_states / constraint_classes: the most states and token classes one request's
    constraint may have (the tables hold twice the states; a constrained request waits while they are full).
    on_compiled(name, seconds) is called on the compiler thread as each program is built. speculation: speculative
    decoding (serving.speculation), or None."""

    def __init__(self, params: Params, config: GPT2Config, *, max_batch: int = 32, max_queue: int = 64,
                 max_seq: int | None = None, num_blocks: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_constraint_states: int = 4096,
                 constraint_classes: int = 512, on_compiled: Callable[[Name, float], None] | None = None,
                 speculation: Speculation | None = None):  # fmt: skip
        max_seq, num_blocks = check_settings(config, max_batch, max_queue, max_seq, num_blocks, prefill_chunk,
                                             max_constraint_states, constraint_classes)  # fmt: skip
        if speculation is not None:
            speculation.check(config, max_seq)
        self.params, self.config, self.max_batch, self.max_queue = params, config, max_batch, max_queue
        self.max_seq, self.prefill_chunk, self.num_blocks = max_seq, prefill_chunk, num_blocks
        self.max_constraint_states, self.constraint_classes = max_constraint_states, constraint_classes
        self.on_compiled = on_compiled
        self.queue: collections.deque[Request] = collections.deque()
        self.lock = threading.Condition()
        self.running = self.stopped = self.draining = False
        self.abort_at: float | None = None
        self.thread: threading.Thread | None = None
        self.frozen_programs = -1  # how many programs were built when settle_heap last froze the heap
        self.rows = EngineRows(params, config, self.lock, max_batch=max_batch, max_seq=max_seq,
                               num_blocks=num_blocks, prefill_chunk=prefill_chunk,
                               max_constraint_states=max_constraint_states, constraint_classes=constraint_classes,
                               on_built=self._compiled, speculation=speculation)  # fmt: skip
        self.programs = self.rows.programs

    def _compiled(self, name: Name, seconds: float) -> None:
        """A program is ready (the compiler thread): wake the engine, whose queue may now move."""
        with self.lock:
            self.lock.notify_all()
        if self.on_compiled is not None:
            self.on_compiled(name, seconds)

    # ---- requests ------------------------------------------------------------------------------
    def check(self, request: Request) -> Any:
        """Validate a request as generate would (ConfigError / InputError) -> generate's preparation of it."""
        return check_request(self.params, self.config, request, self.max_seq, self.max_constraint_states,
                             self.constraint_classes)  # fmt: skip

    def submit(self, request: Request) -> None:
        """Queue a request (validated first: bad input raises here, before it is queued), and ask for the
        programs it needs. QueueFull when every row is busy and max_queue requests wait; Cancelled once the
        engine is draining or stopped. A request a caller already checked keeps its preparation."""
        if request.prepared is None:
            request.prepared = self.check(request)
        with self.lock:
            if self.stopped or self.draining:
                raise Cancelled("the server is shutting down")
            active = len(self.rows.active())
            if active + len(self.queue) >= self.max_batch + self.max_queue:
                raise QueueFull(f"server busy: {active} requests running and {len(self.queue)} queued "
                                f"(max_batch={self.max_batch}, max_queue={self.max_queue})")  # fmt: skip
            self.queue.append(request)
            self.lock.notify()
        self.programs.needs(request)  # a waiting request's programs come before the background's

    def stats(self) -> dict:
        rows = self.rows
        with self.lock:
            active = rows.active()
            return {"active": len(active), "queued": len(self.queue), "prefilling": sum(not s.decoding for s in active),
                    "generated_tokens": rows.generated_tokens, "prefill_tokens": rows.prefill_tokens,
                    "prefill_rode_tokens": rows.rode_tokens,
                    "speculative_proposed": rows.proposed, "speculative_accepted": rows.accepted,
                    "compiling": len(self.programs.pending()), **rows.pool.stats()}  # fmt: skip

    # ---- the loop --------------------------------------------------------------------------------
    def _abort_late(self) -> None:
        """Past the drain's deadline: every request still in flight ends now, finish_reason "abort"."""
        if self.abort_at is None or time.monotonic() < self.abort_at:
            return
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        self.rows.finish([(b, "done", ("abort", None)) for b in self.rows.busy()])
        for request in queued:
            tell(request, "done", ("abort", None))

    def step(self) -> bool:
        """Drop cancelled requests, admit waiting ones, put the next prompt chunk(s) in, then run one decode step
        (a chunk that rides goes in inside the step's forward: EngineRows.rides); or, while every busy row decodes
        and nothing waits, dispatch the next decode step and hand out the last one's tokens (EngineRows.chain),
        else hand those out first. False when idle (nothing
        running, nothing queued); while queued requests only wait (for their programs, for blocks), it sleeps
        until something changes (at most 0.1 s) and returns True."""
        self._abort_late()
        rows = self.rows
        rows.finish([(b, "error", Cancelled("cancelled")) for b, s in enumerate(rows.slots)
                     if s is not None and s.request.cancelled])  # fmt: skip
        if not self.queue and rows.chainable() and rows.chain():
            return True  # plain decode steps back to back: nothing waits to come in
        rows.settle()
        rows.admit(self.queue)
        chunk = rows.plan_chunk()
        riding = chunk is not None and bool(rows.decoding()) and rows.rides(chunk)
        if chunk is not None and not riding:
            rows.prefill(chunk)
        decoding = rows.decoding()
        if decoding:
            rows.decode(decoding, chunk if riding else None)
            return True
        if chunk is not None:
            return True
        with self.lock:
            if not self.queue and not rows.active():
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
                self.rows.fail(e)
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
        built = self.programs.built()
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
            while self.running and (self.queue or self.rows.active()):
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
        self.rows.finish([(b, "error", Cancelled("the server is shutting down")) for b in self.rows.busy()])
        with self.lock:
            queued, self.queue = list(self.queue), collections.deque()
        for request in queued:
            tell(request, "error", Cancelled("the server is shutting down"))
