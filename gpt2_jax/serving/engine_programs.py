"""The engine's compiled programs, by name: which ones it runs, how each is built, which ones a request waits for.

EnginePrograms is the Engine's registry of programs (held by the Engine, not mixed into it). Each program has a
named method that gives its compiled callable:
  prefill(T)           one prompt chunk of T tokens (T: 16, 32, ... up to prefill_chunk; while no row decodes, up
                       to IDLE_CHUNK where built: idle_chunk)
  decode(R, top)       the smallest built decode step over rows [0, R) (R: 1, 2, 8, 16, 32, ... and max_batch)
  ride(R, P)           a decode step over rows [0, R) with P prompts' chunks of prefill_chunk tokens riding in
                       its forward (R: the decode sizes from RIDE_ROWS up; P: 1 and the batched chunk sizes)
  speculate(R, top)    with speculation: the smallest built speculative round over rows [0, R)
  draft(T)             with a draft model: one prompt chunk of T tokens into the draft's pool
  start_row(), stop_rows(), set_automaton()   the small programs that start a row, stop rows, move constraint
                       states
serving.programs' background thread compiles them; its registry and log name each by a (kind, size) pair:
("prefill", 32), ("decode+top", 8), ("row", "start").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation import prompt_logprobs
from gpt2_jax.generation.batching import bucket
from gpt2_jax.generation.paged import decode_rows, decode_rows_with_chunk, prefill_chunk, start_row, stop_rows
from gpt2_jax.generation.speculative.paged import draft_chunk, speculate_rows
from gpt2_jax.model import Params
from gpt2_jax.sampling.checks import MAX_TOP_LOGPROBS
from gpt2_jax.serving.chunking import PROMPTS_PER_STEP, ROWS_PER_CHUNK
from gpt2_jax.serving.programs import Programs
from gpt2_jax.serving.slots import Request, set_automaton

ROW_BUCKETS = (1, 2, 8, 16, 32, 128, 512)  # decode-step sizes: a lone stream runs the fastest, one row
RIDE_ROWS = 8  # the smallest decode step a chunk rides: the steps that run while many prompts arrive
IDLE_CHUNK = 256  # the largest prompt chunk while no row decodes (nobody waits for it), where it is built
I32 = jax.ShapeDtypeStruct((), jnp.int32)
Compiled = jax.stages.Compiled


@functools.partial(jax.jit, static_argnames=("config", "rows", "r"), donate_argnames="state")
def _decode_and_done(params: Params, state: Any, rules: Any, config: Any, rows: int, r: int = 0) -> tuple:
    """decode_rows, and which rows are done after it as an output of its own: the engine hands a step's new state
    to the next step (donated) before it reads this step's results (EngineRows.chain), so it cannot read them
    from the state."""
    state, step = decode_rows(params, state, rules, config, rows, r)
    return state, step, state.done[:rows]


class Name(NamedTuple):
    """A program's name in the compiler's registry and log: ("prefill", 32), ("row", "stop")."""

    kind: str
    size: int | str


START, STOP, AUTOMATON = Name("row", "start"), Name("row", "stop"), Name("row", "automaton")
ROW_PROGRAMS = (START, STOP, AUTOMATON)


class Shapes(NamedTuple):
    """What the engine's programs are compiled for: its model, its batch's device state and rules, its sizes."""

    params: Params
    config: GPT2Config
    state: Any  # the batch's DecodeState as ShapeDtypeStructs (serving.batch.spec)
    rules: Any  # the batch's Rules as ShapeDtypeStructs
    max_batch: int
    max_seq: int
    prefill_chunk: int
    blocks_per_row: int
    capacity: int  # tokens a row's blocks hold
    speculation: Any = None  # serving.speculation.Speculation, or None
    draft_pool: Any = None  # the draft model's pool as ShapeDtypeStructs, or None


class EnginePrograms:
    """The engine's programs (see the module docstring). on_built(name, seconds) is called on the compiler
    thread as each one is built."""

    def __init__(self, shapes: Shapes, on_built: Callable[[Any, float], None] | None = None):
        self.shapes = shapes
        self.compiler = Programs(on_built)

    # ---- the programs the engine runs ------------------------------------------------------------
    def prefill(self, T: int, P: int = 1) -> Compiled:
        """generation.prefill_chunk: T prompt tokens of each of P rows into their blocks."""
        return self._now(self.want_prefill(T, priority=-1.0, P=P))

    def prefill_built(self, T: int, P: int) -> bool:
        """Whether the chunk of P rows x T tokens is built, with its draft chunk when there is a draft."""
        names = [_prefill_name("prefill", P, T)] + ([_prefill_name("draft", P, T)] if self._drafting() else [])
        return all(self.compiler.get(n) is not None for n in names)

    def decode(self, rows: int, top: bool) -> Compiled | None:
        """generation.decode_rows for rows [0, rows): the smallest built step that covers them (with top logprobs
        if asked), or None when none is built. It returns (state, Step, done [rows]): _decode_and_done."""
        name = self._built(rows, top, _decode_name)
        return None if name is None else self.compiler.get(name)

    def ride(self, rows: int, P: int) -> Compiled | None:
        """generation.decode_rows_with_chunk over the decode size that covers rows [0, rows), P prompts' chunks
        of prefill_chunk tokens riding it, or None when it is not built (compile queues it, last)."""
        R = next(r for r in self.row_buckets() if r >= rows)
        return self.compiler.get(_ride_name(R, P)) if R >= RIDE_ROWS else None

    def speculate(self, rows: int, top: bool) -> Compiled | None:
        """generation.speculative.paged.speculate_rows for rows [0, rows): the smallest built round that covers
        them, or None when none is built (a plain step runs instead; the round is asked for)."""
        name = self._built(rows, top, _speculate_name)
        if name is None:
            self.want_speculate(next(r for r in self.row_buckets() if r >= rows), top)
        return None if name is None else self.compiler.get(name)

    def idle_chunk(self, left: int) -> int | None:
        """The chunk size for a prompt with `left` tokens to go while no row decodes: the bucket covering them up
        to IDLE_CHUNK if its programs are built (they are built in the background), else None."""
        T = bucket(min(left, self.idle_cap()), self.idle_cap())
        return T if self.prefill_built(T, 1) else None

    def idle_cap(self) -> int:
        return max(self.shapes.prefill_chunk, min(IDLE_CHUNK, bucket(self.shapes.max_seq, self.shapes.max_seq)))

    def draft(self, T: int, P: int = 1) -> Compiled:
        """generation.speculative.paged.draft_chunk: T prompt tokens of each of P rows into the draft's pool."""
        return self._now(self.want_draft(T, priority=-1.0, P=P))

    def start_row(self) -> Compiled:
        """generation.start_row: a prefilled row joins the decode steps."""
        return self._now(self._want_row(START, -1.0))

    def stop_rows(self) -> Compiled:
        """generation.stop_rows: the masked rows stop and emit the filler."""
        return self._now(self._want_row(STOP, -1.0))

    def set_automaton(self) -> Compiled:
        """serving.slots.set_automaton: every row's constraint state, moved after the tables are repacked."""
        return self._now(self._want_row(AUTOMATON, -1.0))

    def _now(self, name: Name) -> Compiled:
        """A program the engine runs now (compiled on the engine thread only if it was never asked for before:
        admission waits for every program a request needs)."""
        self.compiler.wait([name])
        return self.compiler.get(name)

    def _built(self, rows: int, top: bool, named: Callable[[int, bool], Name]) -> Name | None:
        """The smallest built step of that kind (named(R, top)) over at least `rows` rows, with top logprobs if
        asked (a step with them serves a batch without), or None."""
        tops = (True,) if top else (False, True)
        built = [(r, t) for t in tops for r in self.row_buckets()
                 if r >= rows and self.compiler.get(named(r, t)) is not None]  # fmt: skip
        return named(*min(built)) if built else None

    # ---- asking for them: each want_ queues a build unless it is built or queued, and returns its name --------
    def want_prefill(self, T: int, priority: float = 1.0, P: int = 1) -> Name:
        s, (tables, tokens, rows) = self.shapes, _chunk_shapes(self.shapes, P, T)
        build = lambda: prefill_chunk.lower(s.params, s.state, tables, tokens, rows, rows, s.config).compile()
        self.compiler.want(_prefill_name("prefill", P, T), build, priority)
        return _prefill_name("prefill", P, T)

    def want_decode(self, rows: int, top: bool = False, priority: float = 1.0) -> Name:
        s, r = self.shapes, MAX_TOP_LOGPROBS if top else 0
        build = lambda: _decode_and_done.lower(s.params, s.state, s.rules, s.config, rows, r).compile()
        self.compiler.want(_decode_name(rows, top), build, priority)
        return _decode_name(rows, top)

    def want_ride(self, rows: int, P: int = 1, priority: float = 1.0) -> Name:
        s, (tables, tokens, ints) = self.shapes, _chunk_shapes(self.shapes, P, self.shapes.prefill_chunk)
        build = lambda: decode_rows_with_chunk.lower(s.params, s.state, s.rules, tables, tokens, ints, ints, s.config,
                                                     rows).compile()  # fmt: skip
        self.compiler.want(_ride_name(rows, P), build, priority)
        return _ride_name(rows, P)

    def want_speculate(self, rows: int, top: bool = False, priority: float = 1.0) -> Name:
        s, r = self.shapes, MAX_TOP_LOGPROBS if top else 0
        spec = s.speculation
        until, want = jax.ShapeDtypeStruct((s.max_batch,), jnp.int32), jax.ShapeDtypeStruct((s.max_batch,), bool)
        build = lambda: speculate_rows.lower(s.params, spec.draft_params, s.state, s.draft_pool, s.rules, until, want,
                                             s.config, spec.draft_config, rows, spec.k, r).compile()  # fmt: skip
        self.compiler.want(_speculate_name(rows, top), build, priority)
        return _speculate_name(rows, top)

    def want_draft(self, T: int, priority: float = 1.0, P: int = 1) -> Name:
        s, (tables, tokens, rows), spec = self.shapes, _chunk_shapes(self.shapes, P, T), self.shapes.speculation
        build = lambda: draft_chunk.lower(spec.draft_params, s.draft_pool, tables, tokens, rows,
                                          spec.draft_config).compile()  # fmt: skip
        self.compiler.want(_prefill_name("draft", P, T), build, priority)
        return _prefill_name("draft", P, T)

    def _want_row(self, name: Name, priority: float) -> Name:
        self.compiler.want(name, _row_builds(self.shapes)[name], priority)
        return name

    def want_scoring(self, priority: float = 100.0) -> None:
        """Queue echo's whole-prompt scoring pass (generation.prompt_logprobs) for every prompt bucket, without
        and with top logprobs (two widths); generate's jit cache keeps them."""
        s = self.shapes
        for i, b in enumerate(self.buckets()):
            n = min(b, s.max_seq)
            for kind, top in (("score", 0), ("score+top", 1)):
                build = lambda n=n, top=top: prompt_logprobs(s.params, s.config, [[0] * n], top) is not None
                self.compiler.want(Name(kind, b), build, priority + i)

    def essential(self, priority: float = 0.0) -> list[Name]:
        """Ask for the programs the first plain request needs: the smallest decode step and chunk, and the row
        programs."""
        return [want(priority) for want in self._essential()]

    def _essential(self) -> list[Callable[[float], Name]]:
        drafts = [lambda p: self.want_draft(self.chunk_buckets()[0], p)] if self._drafting() else []
        return [lambda p: self.want_decode(self.row_buckets()[0], priority=p),
                lambda p: self.want_prefill(self.chunk_buckets()[0], p), *drafts,
                *(functools.partial(self._want_row, name) for name in ROW_PROGRAMS)]  # fmt: skip

    def compile(self, wait: bool = True, timeout: float | None = None) -> list[Name]:
        """Queue every program the engine can need, the essential ones first, then larger decode steps and chunks,
        then the decode steps with top logprobs, the other chunks, speculation's programs, and last the decode
        steps that chunks ride; with wait, block until they are built. Returns their names."""
        s, wants = self.shapes, self._essential()
        wants += [functools.partial(self.want_decode, r, False) for r in self.row_buckets()[1:]]
        wants += [functools.partial(self.want_prefill, t) for t in self.chunk_buckets()[1:]]
        wants += [functools.partial(self.want_decode, r, True) for r in self.row_buckets()]
        wants += [functools.partial(self.want_prefill, t) for t in self.idle_buckets()]
        wants += [functools.partial(self.want_prefill, s.prefill_chunk, P=p) for p in self.prompt_buckets()]
        if self._drafting():
            wants += [functools.partial(self.want_draft, t) for t in self.chunk_buckets() + self.idle_buckets()]
            wants += [functools.partial(self.want_draft, s.prefill_chunk, P=p) for p in self.prompt_buckets()]
        if s.speculation is not None:
            wants += [
                functools.partial(self.want_speculate, r, top) for top in (False, True) for r in self.row_buckets()
            ]
        wants += [functools.partial(self.want_ride, r, p) for r in self.row_buckets() if r >= RIDE_ROWS
                  for p in (1, *self.prompt_buckets())]  # fmt: skip
        names = [want(float(i)) for i, want in enumerate(wants)]
        if wait:
            self.wait(names, timeout)
        return names

    def needs(self, request: Request) -> None:
        """Ask, ahead of every background build, for the programs a queued request runs (its prompt computed
        whole, in row 0)."""
        self.essential()
        self.want_decode(self.row_buckets()[0], request.sampling.top_logprobs > 0, priority=0.0)
        self._chunks(request, 0)

    def ready(self, request: Request, start: int, rows: int, top: bool) -> bool:
        """Whether the programs a request needs, its prompt computed from `start`, are built (asking for the
        missing ones): its chunks, the row programs, and a decode step over rows [0, rows), with top logprobs
        when top."""
        names = [*(self._want_row(n, 0.0) for n in ROW_PROGRAMS), *self._chunks(request, start)]
        missing = [n for n in names if self.compiler.get(n) is None]
        if self._built(rows, top, _decode_name) is None:
            missing.append(self.want_decode(next(r for r in self.row_buckets() if r >= rows), top, priority=0.0))
        return not missing

    def _chunks(self, request: Request, start: int) -> list[Name]:
        """Ask for the prefill programs a prompt's chunks from token `start` on run."""
        chunk, left = self.shapes.prefill_chunk, len(request.prompt) - start
        sizes = [chunk] if left > chunk else []
        sizes.append(bucket(left % chunk or chunk, chunk))
        drafts = [self.want_draft(T, priority=0.0) for T in sizes] if self._drafting() else []
        return [self.want_prefill(T, priority=0.0) for T in sizes] + drafts

    def _drafting(self) -> bool:
        spec = self.shapes.speculation
        return spec is not None and spec.draft is not None

    # ---- sizes and the compiler's state ----------------------------------------------------------
    def row_buckets(self) -> list[int]:
        return sorted({b for b in ROW_BUCKETS if b < self.shapes.max_batch} | {self.shapes.max_batch})

    def chunk_buckets(self) -> list[int]:
        chunk = self.shapes.prefill_chunk
        return sorted({bucket(n, chunk) for n in range(1, chunk + 1)})

    def prompt_buckets(self) -> list[int]:
        """The batched chunk sizes (prompts per chunk, past 1) that max_batch rows can use (serving.chunking; a
        speculative round's rows count k + 1 times)."""
        spec = self.shapes.speculation
        reach = self.shapes.max_batch * (1 if spec is None else spec.k + 1)
        return [p for p in PROMPTS_PER_STEP if 1 < p and p * ROWS_PER_CHUNK <= reach]

    def idle_buckets(self) -> list[int]:
        """The chunk sizes past prefill_chunk that a prompt takes while no row decodes (idle_chunk)."""
        cap = self.idle_cap()
        return sorted({bucket(n, cap) for n in range(self.shapes.prefill_chunk + 1, cap + 1)})

    def buckets(self) -> list[int]:
        """The prompt buckets of whole-prompt scoring (echo with logprobs): powers of two from 16 to max_seq's."""
        return sorted({bucket(n, self.shapes.config.n_positions) for n in range(1, self.shapes.max_seq + 1)})

    def wait(self, names: list[Name], timeout: float | None = None) -> bool:
        """Block until those programs are built (a failed build raises its error); False after timeout s."""
        return self.compiler.wait(names, timeout)

    def pending(self) -> list[Name]:
        """The programs queued or being compiled, the one compiling first."""
        return self.compiler.pending()

    def built(self) -> int:
        """How many programs are built."""
        return len(self.compiler.built)

    def close(self) -> None:
        self.compiler.close()


def _prefill_name(kind: str, P: int, T: int) -> Name:
    """("prefill", 32) for one row's chunk, ("prefill x4", 32) for four rows' chunks of 32 tokens."""
    return Name(kind if P == 1 else f"{kind} x{P}", T)


def _chunk_shapes(s: Shapes, P: int, T: int) -> tuple:
    """A chunk's tables [P, M], tokens [P, T] and per-row ints [P] (start, last), as ShapeDtypeStructs."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return i32(P, s.blocks_per_row), i32(P, T), i32(P)


def _decode_name(rows: int, top: bool) -> Name:
    return Name("decode+top" if top else "decode", rows)


def _ride_name(rows: int, P: int) -> Name:
    """("decode+chunk", 32): a chunk of one prompt riding the step over 32 rows; ("decode+chunk x2", 32): two."""
    return Name("decode+chunk" if P == 1 else f"decode+chunk x{P}", rows)


def _speculate_name(rows: int, top: bool) -> Name:
    return Name("speculate+top" if top else "speculate", rows)


def _row_builds(s: Shapes) -> dict[Name, Callable[[], Compiled]]:
    """How each row program is built, by name."""
    table = jax.ShapeDtypeStruct((s.blocks_per_row,), jnp.int32)
    prompt = jax.ShapeDtypeStruct((s.capacity,), jnp.int32)
    logits = jax.ShapeDtypeStruct(s.state.logits.shape[1:], s.state.logits.dtype)
    key = jax.ShapeDtypeStruct((), s.state.keys.dtype)
    rows, automata = jax.ShapeDtypeStruct((s.max_batch,), bool), jax.ShapeDtypeStruct((s.max_batch,), jnp.int32)
    return {
        START: lambda: start_row.lower(s.state, I32, table, prompt, I32, logits, key, I32).compile(),
        STOP: lambda: stop_rows.lower(s.state, rows, I32).compile(),
        AUTOMATON: lambda: set_automaton.lower(s.state, automata).compile(),
    }
