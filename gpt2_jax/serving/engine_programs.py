"""Which programs the engine runs, how each is built, and which ones a request waits for (the Engine's half that
talks to serving.programs).

  ("prefill", T)       one prompt chunk of T tokens (T: 16, 32, ... up to prefill_chunk)
  ("decode", R)        a decode step over rows [0, R) (R: 2, 8, 32, ... and max_batch); "decode+top" with top logprobs
  ("row", name)        the small programs that start a row ("start"), stop rows ("stop"), move constraint states
                       ("automaton")
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpt2_jax.generation import bucket, decode_rows, prefill_chunk, start_row, stop_rows
from gpt2_jax.sampling import MAX_TOP_LOGPROBS
from gpt2_jax.serving.programs import Programs
from gpt2_jax.serving.rows import Request, set_automaton

ROW_BUCKETS = (2, 8, 32, 128, 512)  # decode-step sizes: a lone stream never pays for 32 rows


class EnginePrograms:
    """Mixed into Engine (which has params, config, rows, max_batch, max_seq, prefill_chunk, blocks_per_row)."""

    def __init__(self, on_compiled: Any = None):
        self.on_compiled = on_compiled
        self.programs = Programs(self._compiled)

    def _compiled(self, key: tuple, seconds: float) -> None:
        """A program is ready (the compiler thread): wake the engine, whose queue may now move."""
        with self.lock:
            self.lock.notify_all()
        if self.on_compiled is not None:
            self.on_compiled(key, seconds)

    def row_buckets(self) -> list[int]:
        return sorted({b for b in ROW_BUCKETS if b < self.max_batch} | {self.max_batch})

    def chunk_buckets(self) -> list[int]:
        return sorted({bucket(n, self.prefill_chunk) for n in range(1, self.prefill_chunk + 1)})

    def buckets(self) -> list[int]:
        """The prompt buckets of whole-prompt scoring (echo with logprobs): powers of two from 16 to max_seq's."""
        return sorted({bucket(n, self.config.n_positions) for n in range(1, self.max_seq + 1)})

    def _build(self, key: tuple) -> Any:
        kind, n = key
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        state, rules, params, config = self.rows.state_spec, self.rows.rules_spec, self.params, self.config
        table = jax.ShapeDtypeStruct((self.blocks_per_row,), jnp.int32)
        if kind == "prefill":
            tokens = jax.ShapeDtypeStruct((n,), jnp.int32)
            return lambda: prefill_chunk.lower(params, state, table, tokens, i32, i32, config).compile()
        if kind in ("decode", "decode+top"):
            r = MAX_TOP_LOGPROBS if kind == "decode+top" else 0
            return lambda: decode_rows.lower(params, state, rules, config, n, r).compile()
        if n == "start":
            prompt = jax.ShapeDtypeStruct((self.capacity,), jnp.int32)
            logits = jax.ShapeDtypeStruct(state.logits.shape[1:], state.logits.dtype)
            key = jax.ShapeDtypeStruct((), state.keys.dtype)
            return lambda: start_row.lower(state, i32, table, prompt, i32, logits, key, i32).compile()
        rows = jax.ShapeDtypeStruct((self.max_batch,), bool)
        if n == "stop":
            return lambda: stop_rows.lower(state, rows, i32).compile()
        automata = jax.ShapeDtypeStruct((self.max_batch,), jnp.int32)
        return lambda: set_automaton.lower(state, automata).compile()

    def want(self, key: tuple, priority: float = 1.0) -> bool:
        """Ask for a program to be compiled (see the module docstring); True when it is ready."""
        return self.programs.want(key, self._build(key), priority)

    def program(self, key: tuple) -> Any:
        """A compiled program the engine runs now (compiled here, on the engine thread, only if it was never asked
        for: admission waits for every program a request needs)."""
        run = self.programs.get(key)
        if run is None:
            self.want(key, priority=-1.0)
            self.programs.wait([key])
            run = self.programs.get(key)
        return run

    def essential(self) -> list[tuple]:
        """The programs the first plain request needs: the smallest decode step and chunk, and the row programs."""
        return [("decode", self.row_buckets()[0]), ("prefill", self.chunk_buckets()[0]), ("row", "start"),
                ("row", "stop"), ("row", "automaton")]  # fmt: skip

    def compile(self, wait: bool = True, timeout: float | None = None) -> list[tuple]:
        """Queue every program the engine can need, the essential ones first, then larger decode steps and chunks,
        then the decode steps with top logprobs; with wait, block until they are built. Returns their keys."""
        keys = self.essential()
        keys += [("decode", r) for r in self.row_buckets()[1:]] + [("prefill", t) for t in self.chunk_buckets()[1:]]
        keys += [("decode+top", r) for r in self.row_buckets()]
        for i, key in enumerate(keys):
            self.want(key, priority=float(i))
        if wait:
            self.programs.wait(keys, timeout)
        return keys

    def decoder(self, rows: int, top: bool) -> tuple | None:
        """The compiled decode step to run for rows [0, rows): the smallest built one that covers them (with top
        logprobs if asked), or None."""
        kinds = ("decode+top",) if top else ("decode", "decode+top")
        built = [(r, kinds.index(k), (k, r)) for k in kinds for r in self.row_buckets()
                 if r >= rows and self.programs.get((k, r)) is not None]  # fmt: skip
        return min(built)[2] if built else None

    def chunks(self, request: Request, start: int) -> list[tuple]:
        """The prefill programs a prompt's chunks from token `start` on run."""
        left = len(request.prompt) - start
        keys = [("prefill", self.prefill_chunk)] if left > self.prefill_chunk else []
        last = left % self.prefill_chunk or self.prefill_chunk
        return keys + [("prefill", bucket(last, self.prefill_chunk))]

    def needs(self, request: Request) -> list[tuple]:
        """The programs a request asks for when it is queued (its prompt computed whole, in row 0)."""
        top = "decode+top" if request.sampling.top_logprobs else "decode"
        return [*self.essential(), (top, self.row_buckets()[0]), *self.chunks(request, 0)]

    def ready(self, request: Request, start: int, row: int) -> bool:
        """Whether the programs a request needs in `row`, its prompt computed from `start`, are built (asking for the
        missing ones); a decode step covering every decoding row and this one is enough."""
        decoding = [b for b, s in enumerate(self.slots) if s is not None]
        top = request.sampling.top_logprobs > 0 or any(self.slots[b].request.sampling.top_logprobs for b in decoding)
        rows = max([row, *decoding]) + 1
        missing = [k for k in [*self.essential()[2:], *self.chunks(request, start)] if self.programs.get(k) is None]
        if self.decoder(rows, top) is None:
            missing.append(("decode+top" if top else "decode", next(r for r in self.row_buckets() if r >= rows)))
        for key in missing:
            self.want(key, priority=0.0)
        return not missing
