"""The engine's rows and the work one step does on them: admission, one decode step, rows ending.

EngineRows holds the max_batch slots on the host (serving.slots), the pool of KV blocks they share
(serving.blocks) and their device batch (serving.batch), and runs the engine's programs over them
(serving.engine_programs); putting prompts in, chunk by chunk, is serving.engine_prompts' (its base class). The
Engine's lock guards the slots and the queue: the engine thread changes them, and submit, stats and drain read
them from other threads.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.chunks import token_bytes
from gpt2_jax.generation.stop_strings import StopMatcher
from gpt2_jax.model import Params
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.serving import chunking
from gpt2_jax.serving.batch import DeviceBatch
from gpt2_jax.serving.blocks import BlockPool
from gpt2_jax.serving.engine_checks import automaton
from gpt2_jax.serving.engine_programs import EnginePrograms, Shapes
from gpt2_jax.serving.engine_prompts import PromptChunks
from gpt2_jax.serving.slots import Cancelled, Request, Slot, tell
from gpt2_jax.serving.speculation import Policy, Speculation

Ended = tuple[int, str, Any]  # a row that ends: (row, event kind, payload)


class EngineRows(PromptChunks):
    """max_batch rows over num_blocks KV blocks of blocks_per_row each, and the programs that run on them."""

    def __init__(self, params: Params, config: GPT2Config, lock: threading.Condition, *, max_batch: int,
                 max_seq: int, num_blocks: int, prefill_chunk: int, max_constraint_states: int,
                 constraint_classes: int, on_built: Callable[[Any, float], None],
                 speculation: Speculation | None = None):  # fmt: skip
        self.params, self.config, self.lock = params, config, lock
        self.speculation = speculation
        self.policy = None if speculation is None else Policy(speculation)
        self.proposed = self.accepted = 0  # speculative decoding's proposals and the ones kept
        self.max_batch, self.num_blocks, self.prefill_chunk = max_batch, num_blocks, prefill_chunk
        self.blocks_per_row = -(-max_seq // KEY_BLOCK)
        self.capacity = self.blocks_per_row * KEY_BLOCK
        self.constraint_sizes = (max_constraint_states, constraint_classes)
        self.slots: list[Slot | None] = [None] * max_batch
        self.generated_tokens = self.prefill_tokens = self.admitted = 0
        self.rode_tokens = 0  # prompt tokens that went in inside a decode step's forward (decode's chunk)
        self.per_row = 1.0  # tokens each decoding row kept at the last step: the prompt chunks' pace (chunking.plan)
        self.reset()
        b = self.batch
        shapes = Shapes(params, config, b.state_spec, b.rules_spec, max_batch, max_seq, prefill_chunk,
                        self.blocks_per_row, self.capacity, speculation, b.draft_spec)  # fmt: skip
        self.programs = EnginePrograms(shapes, on_built)

    def reset(self) -> None:
        """Every block free, the prefix cache empty, the device batch new."""
        self.pool = BlockPool(self.num_blocks, KEY_BLOCK)
        draft = None if self.speculation is None else self.speculation.draft
        self.pending: tuple | None = None  # a plain step chain dispatched whose tokens are not handed out yet
        self.batch = DeviceBatch(self.params, self.config, self.max_batch, self.num_blocks, self.blocks_per_row,
                                 *self.constraint_sizes, draft)  # fmt: skip

    def fail(self, error: Exception) -> None:
        """Every request in flight gets the error, and the rows start over."""
        with self.lock:
            failed = [s for s in self.slots if s is not None]
            self.slots = [None] * self.max_batch
        for slot in failed:
            tell(slot.request, "error", error)
        self.reset()

    def active(self) -> list[Slot]:
        return [s for s in self.slots if s is not None]

    def busy(self) -> list[int]:
        """The rows in use."""
        return [b for b, s in enumerate(self.slots) if s is not None]

    def admit(self, queue: collections.deque[Request]) -> None:
        """Give free rows to queued requests that can start now, in queue order, lowest row first (one that only
        waits for programs or table room lets the ones behind it pass; one that waits for blocks does not)."""
        admitted, dropped = [], []
        with self.lock:
            free = [b for b in range(self.max_batch) if self.slots[b] is None]
            for request in list(queue):
                if not free:
                    break
                if request.cancelled:
                    queue.remove(request)
                    dropped.append(request)
                    continue
                a = automaton(request, self.config)
                if a is not None and not self.batch.fits([s.automaton for s in self.active()], a):
                    continue  # waits for room in the constraint tables
                n = len(request.prompt)
                plan = self.pool.plan(request.prompt, min(n + request.sampling.max_new_tokens, self.capacity))
                if plan is None:
                    break  # waits for blocks, and so does everyone behind it
                if self.pool.waits_for(plan, n) or not self._ready(request, len(plan.reused) * KEY_BLOCK, free[0]):
                    continue
                queue.remove(request)
                b = free.pop(0)
                stops = StopMatcher(request.prepared.stops, token_bytes(None)) if request.sampling.stop else None
                self.slots[b] = Slot(request, 0, stops, a, self.pool.take(plan, n), plan.names,
                                     len(plan.reused) * KEY_BLOCK, False, self.admitted)  # fmt: skip
                self.admitted += 1
                admitted.append((b, self.slots[b]))
        for request in dropped:
            tell(request, "error", Cancelled("cancelled before it started"))
        for b, slot in admitted:
            self.batch.set_row(b, slot.request.prepared.rules)
            self.batch.until[b], self.batch.want[b] = slot.request.sampling.max_new_tokens, slot.request.speculate
            if slot.automaton is not None:
                self._repack()

    def _ready(self, request: Request, start: int, row: int) -> bool:
        """Whether the programs the request needs in `row` are built; a decode step covering every busy row and
        this one is enough."""
        top = request.sampling.top_logprobs > 0 or any(s.request.sampling.top_logprobs for s in self.active())
        return self.programs.ready(request, start, max([row, *self.busy()]) + 1, top)

    def _repack(self) -> None:
        decoding = np.array([s is not None and s.decoding for s in self.slots])
        self.batch.repack([s.automaton if s is not None else None for s in self.slots], decoding,
                          self.programs.set_automaton())  # fmt: skip

    def decode(self, decoding: list[int], chunk: chunking.Chunk | None = None) -> None:
        """One decode step over the decoding rows, or one speculative round (serving.speculation): each row gets
        its token(s), and the rows that are done end. A chunk (one that rides) goes through the model in the
        step's own forward where that program is built, else on its own first."""
        slots = [(b, s) for b in decoding if (s := self.slots[b]) is not None]
        top = _wants_top(slots)
        rows = max(decoding) + 1
        run = self._round(rows, top, [s.request for _, s in slots])
        ride = None if chunk is None or run is not None or top else self.programs.ride(rows, len(chunk.rows))
        if chunk is not None and ride is None:
            self.prefill(chunk)
        t = time.perf_counter()
        batch, done = self.batch, None
        if run is not None:
            spec = self.speculation
            assert spec is not None, "a round runs only with speculation"
            batch.state, batch.draft_pool, out, kept = run(self.params, spec.draft_params, batch.state,
                                                           batch.draft_pool, batch.rules, batch.until,
                                                           batch.want)  # fmt: skip
            kept = np.asarray(kept)
        else:
            if ride is not None:
                assert chunk is not None, "a ride carries a chunk"
                batch.state, out, logits = ride(self.params, batch.state, batch.rules, chunk.tables, chunk.tokens,
                                                chunk.start, chunk.taken - 1)  # fmt: skip
                self._put(chunk, logits)
                self.rode_tokens += int(chunk.taken.sum())
            else:
                step = self.programs.decode(rows, top)
                if step is None:  # not compiled yet (admission waits for it, so only after a failure): try again soon
                    time.sleep(0.01)
                    return
                batch.state, out, done = step(self.params, batch.state, batch.rules)
            out, kept = _one_token(out)
        out = jax.tree.map(np.asarray, out)
        if ride is None:  # a step with a chunk in it is no plain step to time speculation against
            self._observe(rows, slots, kept, time.perf_counter() - t, out.token.shape[1] > 1)
        self.per_row = float(np.mean([kept[b] for b, _ in slots])) if slots else 1.0  # chunking's pace
        self._hand_out(slots, out, kept, np.asarray(self.batch.state.done if done is None else done))

    # ---- plain decode steps back to back -------------------------------------------------------------------
    def chainable(self) -> bool:
        """Whether the next step is a plain decode step whatever the last one's tokens say: rows decode, no prompt
        is going in, and no speculation policy chooses the step (the Engine also wants an empty queue)."""
        active = self.active()
        return self.policy is None and bool(active) and all(s.decoding for s in active)

    def chain(self) -> bool:
        """Dispatch the next plain decode step over the decoding rows, then hand out the last one's tokens while it
        runs: the dispatch and the host's work on the tokens overlap the step instead of adding to it. A row that
        ends on the last step's tokens (a stop string, a cancel) has run this step too; its token is dropped and
        its write lands in its own unnamed block, before stop_rows and before any later owner of the block. False
        (nothing dispatched) when the step's program is not built."""
        decoding = self.decoding()
        slots = [(b, self._slot(b)) for b in decoding]
        step = self.programs.decode(max(decoding) + 1, _wants_top(slots))
        if step is None:
            return False
        b = self.batch
        b.state, out, done = step(self.params, b.state, b.rules)
        last, self.pending = self.pending, (slots, out, done)
        if last is not None:
            self._settle(last)
        return True

    def settle(self) -> None:
        """Hand out the tokens of a step chain dispatched, if any."""
        last, self.pending = self.pending, None
        if last is not None:
            self._settle(last)

    def _settle(self, pending: tuple) -> None:
        slots, out, done = pending
        out, kept = _one_token(out)  # waits for the step
        self.per_row = 1.0
        self._hand_out(slots, out, kept, np.asarray(done))

    def _hand_out(self, slots: list[tuple[int, Slot]], out: Any, kept: np.ndarray, done: np.ndarray) -> None:
        """A step's tokens (out: a Step of [rows, j] arrays on the host, kept[b] of row b's) to its rows'
        requests, and the rows that are done end. A row that ended since the step was dispatched (chain) is
        skipped."""
        token, logprob, top_ids, top_lp = out.token, out.logprob, out.top_ids, out.top_logprobs
        ended: list[Ended] = []
        for b, slot in slots:
            if self.slots[b] is not slot:
                continue
            n = slot.request.sampling.top_logprobs
            for j in range(int(kept[b])):
                slot.made += 1
                self.generated_tokens += 1
                tell(slot.request, "token", (int(token[b, j]), float(logprob[b, j]), top_ids[b, j, :n].tolist(),
                                               top_lp[b, j, :n].tolist()))  # fmt: skip
                hit = slot.stops.feed(0, [int(token[b, j])]) if slot.stops else None
                if hit is not None:
                    ended.append((b, "done", ("stop", hit.stop)))
                    break
            else:
                if done[b]:
                    ended.append((b, "done", ("stop", None)))
                elif slot.made >= slot.request.sampling.max_new_tokens:
                    ended.append((b, "done", ("length", None)))
        self.finish(ended)

    def _round(self, rows: int, top: bool, requests: list[Request]) -> Any:
        """The speculative round to run over rows [0, rows) now, or None for a plain step."""
        if self.policy is None:
            return None
        run = self.programs.speculate(rows, top)
        return run if run is not None and self.policy.choose(self._size(rows), requests) else None

    def _size(self, rows: int) -> int:
        """The compiled row count a step over rows [0, rows) runs at: what the policy times it by."""
        return next(r for r in self.programs.row_buckets() if r >= rows)

    def _observe(self, rows: int, slots: list[tuple[int, Slot]], kept: np.ndarray, seconds: float,
                 speculated: bool) -> None:  # fmt: skip
        """Tell the policy what the step took and kept; count a round's proposals."""
        if self.policy is None:
            return
        size = self._size(rows)
        wanting = [(b, s) for b, s in slots if s.request.speculate]
        if speculated:
            k = self.policy.k
            self.proposed += k * len(wanting)
            self.accepted += sum(int(kept[b]) - 1 for b, _ in wanting)
        self.policy.observe(
            size, speculated, seconds, {id(s.request): int(kept[b]) for b, s in wanting} if speculated else {}
        )

    def finish(self, ended: list[Ended]) -> None:
        """End rows: halt them, free their blocks (named ones stay cached), tell their requests."""
        if not ended:
            return
        mask = np.zeros(self.max_batch, bool)
        slots: list[Slot] = []
        with self.lock:
            for b, _, _ in ended:
                slot, self.slots[b] = self.slots[b], None
                assert slot is not None, "only a busy row ends"
                mask[b] = True
                slots.append(slot)
            self.lock.notify_all()
        self.batch.state = self.programs.stop_rows()(self.batch.state, mask, np.int32(self.batch.filler))
        for slot in slots:
            self.pool.release(slot.blocks, slot.names)
            if self.policy is not None:
                self.policy.forget(slot.request)
        if any(s.automaton is not None for s in slots):
            self._repack()
        for slot, (_, kind, payload) in zip(slots, ended):
            tell(slot.request, kind, payload)


def _wants_top(slots: list[tuple[int, Slot]]) -> bool:
    """Whether a step over these rows needs the program with top logprobs."""
    return any(s.request.sampling.top_logprobs for _, s in slots)


def _one_token(out: Any) -> tuple[Any, np.ndarray]:
    """A plain step's Step (one token per row) on the host as [rows, 1] arrays, and kept: 1 for every row."""
    out = jax.tree.map(lambda a: np.asarray(a)[:, None], out)
    return out, np.ones(len(out.token), np.int32)
