"""Constraints compiled in a child process, so that no request's constraint can stall the others.

outlines-core builds a pattern's index in Rust without releasing Python's GIL, for as long as the pattern
takes (seconds for a large JSON schema, minutes for a{100000}); in the server's process that would freeze
the engine thread and every stream with it. So the server sends each new constraint (its kind and payload)
to one of a few child processes, which builds the Constraint and its Automaton and sends back the tables; a
compile that outlasts the timeout is killed (its slot starts a fresh child). The parent then holds a Constraint
that needs no second check and has its Automaton remembered, so compile_constraint finds it at once.
"""

from __future__ import annotations

import multiprocessing
import queue
import threading
from typing import Any

from gpt2_jax.sampling import constraints
from gpt2_jax.sampling.constraints.automaton import Automaton, remember
from gpt2_jax.sampling.constraints.spec import MAX_STATES

KINDS = ("regex", "choice", "json_schema")


def _child(conn: Any) -> None:
    """The child's loop: (kind, payload, vocab_size, eos_id, max_states) in, ("ok", ...) or ("error", text) out."""
    import os

    from gpt2_jax.sampling import constraints as C
    from gpt2_jax.sampling.constraints.automaton import gpt2_vocabulary

    os.nice(10)  # the engine's decode steps come first when the cores are busy
    gpt2_vocabulary()  # built once, before the first request
    conn.send(("ready",))
    while True:
        try:
            kind, payload, vocab, eos, max_states = conn.recv()
        except EOFError:
            return
        try:
            c = getattr(C, kind)(payload, max_states=max_states)
            a = C.compile_constraint(c, vocab, eos)
            conn.send(("ok", c.source, c.description, a.class_of, a.next_state, a.accept, a.build_seconds))
        except Exception as e:  # a bad pattern is this request's error, never the child's end
            conn.send(("error", str(e)))


class _Worker:
    """One child process and the pipe to it."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds XLA's threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child,), name="gpt2-jax-constraints", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv() != ("ready",):
            self.kill()
            raise RuntimeError("the constraint compiler's process did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)


class ConstraintCompiler:
    """Compile constraints in `workers` child processes, each compile with a time limit, from any thread: a cheap
    constraint waits behind slow ones only when every worker is busy, and then at most the timeout. Sizes are
    checked in the calling thread first (milliseconds), so an oversized constraint never takes a worker."""

    def __init__(self, timeout: float = 30.0, max_states: int = MAX_STATES, workers: int = 2):
        self.timeout, self.max_states, self.workers = timeout, max_states, workers
        self.idle: queue.Queue = queue.Queue()  # started workers, or None: a slot whose worker starts on use
        self.lock = threading.Lock()
        self.live: set = set()
        self.cache: dict = {}
        for _ in range(workers):
            self.idle.put(None)

    def start(self) -> ConstraintCompiler:
        """Start the children now (each imports gpt2_jax and builds GPT-2's outlines vocabulary: a few seconds)."""
        slots = [self.idle.get() for _ in range(self.workers)]
        try:
            slots = [w or self._spawn() for w in slots]
        finally:
            for w in slots:
                self.idle.put(w)
        return self

    def _spawn(self) -> _Worker:
        w = _Worker()
        with self.lock:
            self.live.add(w)
        return w

    def _retire(self, w: _Worker) -> None:
        w.kill()
        with self.lock:
            self.live.discard(w)

    def stop(self) -> None:
        with self.lock:
            live, self.live = list(self.live), set()
        for w in live:
            w.kill()

    def compile(self, kind: str, payload: Any, vocab_size: int, eos_id: int) -> constraints.Constraint:
        """The Constraint for (kind, payload), its Automaton remembered for compile_constraint. ConstraintError
        for a bad pattern, one over max_states, or one that takes longer than the timeout to compile."""
        if kind not in KINDS:
            raise constraints.ConstraintError(f"constraint kind must be one of {KINDS}, got {kind!r}")
        if eos_id is None:
            raise constraints.ConstraintError("a constraint needs an EOS id to end on; this model has none")
        key = (kind, repr(payload), vocab_size, eos_id)
        if key in self.cache:
            return self.cache[key]
        getattr(constraints, kind)(payload, validate=False, max_states=self.max_states)  # the size, before a worker
        reply = self._run(kind, (kind, payload, vocab_size, eos_id, self.max_states))
        if reply[0] == "error":
            raise constraints.ConstraintError(reply[1])
        _, source, description, class_of, next_state, accept, seconds = reply
        c = constraints.Constraint(kind, source, description, validate=False, max_states=self.max_states)
        remember(c, vocab_size, eos_id, Automaton(class_of, next_state, accept, seconds))
        self.cache[key] = c
        if len(self.cache) > 256:
            self.cache.pop(next(iter(self.cache)))
        return c

    def _run(self, kind: str, job: tuple) -> tuple:
        """One compile on an idle worker (waiting for one); a worker past the timeout is killed and its slot
        starts a fresh one on next use."""
        w = self.idle.get()
        try:
            w = w or self._spawn()
            w.conn.send(job)
            if not w.conn.poll(self.timeout):
                self._retire(w)
                w = None
                raise constraints.ConstraintError(
                    f"the {kind} constraint did not compile within {self.timeout:g} s (the server's "
                    f"--constraint-timeout); simplify the pattern"
                )
            return w.conn.recv()
        except (OSError, EOFError):  # the child died: its slot starts a fresh one
            if w is not None:
                self._retire(w)
            w = None
            raise
        finally:
            self.idle.put(w)
