"""Which programs the engine runs, how each is built, and which ones a request waits for (the Engine's half that
talks to serving.programs).

Each program has a key type whose build() lowers and compiles it for the engine's shapes:
  Prefill(T)           one prompt chunk of T tokens (T: 16, 32, ... up to prefill_chunk)
  Decode(R, top)       a decode step over rows [0, R) (R: 2, 8, 32, ... and max_batch), with top logprobs or not
  START_ROW, STOP_ROWS, SET_AUTOMATON   the small programs that start a row, stop rows, move constraint states
A key is a (kind, size) tuple underneath, so the compiler's log and the registry read ("prefill", 32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.generation.batching import bucket
from gpt2_jax.generation.paged import decode_rows, prefill_chunk, start_row, stop_rows
from gpt2_jax.sampling.params import MAX_TOP_LOGPROBS
from gpt2_jax.serving.programs import Programs
from gpt2_jax.serving.slots import Request, set_automaton

if TYPE_CHECKING:
    from gpt2_jax.serving.engine import Engine

ROW_BUCKETS = (2, 8, 32, 128, 512)  # decode-step sizes: a lone stream never pays for 32 rows
I32 = jax.ShapeDtypeStruct((), jnp.int32)


class ProgramKey(NamedTuple):
    kind: str
    size: Any

    def build(self, e: Engine) -> Any:
        raise NotImplementedError


class Prefill(ProgramKey):
    """generation.prefill_chunk: T prompt tokens of one row into its blocks."""

    __slots__ = ()

    def __new__(cls, T: int) -> Prefill:
        return super().__new__(cls, "prefill", T)

    def build(self, e: Engine) -> Any:
        tokens, table = jax.ShapeDtypeStruct((self.size,), jnp.int32), _table(e)
        return lambda: prefill_chunk.lower(e.params, e.batch.state_spec, table, tokens, I32, I32, e.config).compile()


class Decode(ProgramKey):
    """generation.decode_rows: one draw for rows [0, rows), with the top logprobs when top."""

    __slots__ = ()

    def __new__(cls, rows: int, top: bool = False) -> Decode:
        return super().__new__(cls, "decode+top" if top else "decode", rows)

    def build(self, e: Engine) -> Any:
        r = MAX_TOP_LOGPROBS if self.kind == "decode+top" else 0
        return lambda: decode_rows.lower(e.params, e.batch.state_spec, e.batch.rules_spec, e.config, self.size,
                                         r).compile()  # fmt: skip


class StartRow(ProgramKey):
    """generation.start_row: a prefilled row joins the decode steps."""

    __slots__ = ()

    def __new__(cls) -> StartRow:
        return super().__new__(cls, "row", "start")

    def build(self, e: Engine) -> Any:
        state = e.batch.state_spec
        prompt = jax.ShapeDtypeStruct((e.capacity,), jnp.int32)
        logits = jax.ShapeDtypeStruct(state.logits.shape[1:], state.logits.dtype)
        key = jax.ShapeDtypeStruct((), state.keys.dtype)
        return lambda: start_row.lower(state, I32, _table(e), prompt, I32, logits, key, I32).compile()


class StopRows(ProgramKey):
    """generation.stop_rows: the masked rows stop and emit the filler."""

    __slots__ = ()

    def __new__(cls) -> StopRows:
        return super().__new__(cls, "row", "stop")

    def build(self, e: Engine) -> Any:
        rows = jax.ShapeDtypeStruct((e.max_batch,), bool)
        return lambda: stop_rows.lower(e.batch.state_spec, rows, I32).compile()


class SetAutomaton(ProgramKey):
    """serving.slots.set_automaton: every row's constraint state, moved after the tables are repacked."""

    __slots__ = ()

    def __new__(cls) -> SetAutomaton:
        return super().__new__(cls, "row", "automaton")

    def build(self, e: Engine) -> Any:
        automata = jax.ShapeDtypeStruct((e.max_batch,), jnp.int32)
        return lambda: set_automaton.lower(e.batch.state_spec, automata).compile()


START_ROW, STOP_ROWS, SET_AUTOMATON = StartRow(), StopRows(), SetAutomaton()


def _table(e: Engine) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((e.blocks_per_row,), jnp.int32)


class EnginePrograms:
    """Mixed into Engine (which has params, config, rows, max_batch, max_seq, prefill_chunk, blocks_per_row)."""

    def __init__(self, on_compiled: Any = None):
        self.on_compiled = on_compiled
        self.programs = Programs(self._compiled)

    def _compiled(self, key: ProgramKey, seconds: float) -> None:
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

    def want(self, key: ProgramKey, priority: float = 1.0) -> bool:
        """Ask for a program to be compiled (see the module docstring); True when it is ready."""
        return self.programs.want(key, key.build(self), priority)

    def program(self, key: ProgramKey) -> Any:
        """A compiled program the engine runs now (compiled here, on the engine thread, only if it was never asked
        for: admission waits for every program a request needs)."""
        run = self.programs.get(key)
        if run is None:
            self.want(key, priority=-1.0)
            self.programs.wait([key])
            run = self.programs.get(key)
        return run

    def essential(self) -> list[ProgramKey]:
        """The programs the first plain request needs: the smallest decode step and chunk, and the row programs."""
        return [Decode(self.row_buckets()[0]), Prefill(self.chunk_buckets()[0]), START_ROW, STOP_ROWS, SET_AUTOMATON]

    def compile(self, wait: bool = True, timeout: float | None = None) -> list[ProgramKey]:
        """Queue every program the engine can need, the essential ones first, then larger decode steps and chunks,
        then the decode steps with top logprobs; with wait, block until they are built. Returns their keys."""
        keys = self.essential()
        keys += [Decode(r) for r in self.row_buckets()[1:]] + [Prefill(t) for t in self.chunk_buckets()[1:]]
        keys += [Decode(r, top=True) for r in self.row_buckets()]
        for i, key in enumerate(keys):
            self.want(key, priority=float(i))
        if wait:
            self.programs.wait(keys, timeout)
        return keys

    def decoder(self, rows: int, top: bool) -> Decode | None:
        """The compiled decode step to run for rows [0, rows): the smallest built one that covers them (with top
        logprobs if asked), or None."""
        tops = (True,) if top else (False, True)
        built = [(r, t, Decode(r, t)) for t in tops for r in self.row_buckets()
                 if r >= rows and self.programs.get(Decode(r, t)) is not None]  # fmt: skip
        return min(built)[2] if built else None

    def chunks(self, request: Request, start: int) -> list[Prefill]:
        """The prefill programs a prompt's chunks from token `start` on run."""
        left = len(request.prompt) - start
        keys = [Prefill(self.prefill_chunk)] if left > self.prefill_chunk else []
        last = left % self.prefill_chunk or self.prefill_chunk
        return keys + [Prefill(bucket(last, self.prefill_chunk))]

    def needs(self, request: Request) -> list[ProgramKey]:
        """The programs a request asks for when it is queued (its prompt computed whole, in row 0)."""
        top = request.sampling.top_logprobs > 0
        return [*self.essential(), Decode(self.row_buckets()[0], top), *self.chunks(request, 0)]

    def ready(self, request: Request, start: int, row: int) -> bool:
        """Whether the programs a request needs in `row`, its prompt computed from `start`, are built (asking for the
        missing ones); a decode step covering every decoding row and this one is enough."""
        decoding = [b for b, s in enumerate(self.slots) if s is not None]
        top = request.sampling.top_logprobs > 0 or any(self.slots[b].request.sampling.top_logprobs for b in decoding)
        rows = max([row, *decoding]) + 1
        missing = [k for k in [*self.essential()[2:], *self.chunks(request, start)] if self.programs.get(k) is None]
        if self.decoder(rows, top) is None:
            missing.append(Decode(next(r for r in self.row_buckets() if r >= rows), top))
        for key in missing:
            self.want(key, priority=0.0)
        return not missing
