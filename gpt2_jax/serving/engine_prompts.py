"""The prompt side of the engine's rows: which prompt chunks go in next, and what putting one in does.

A mixin of serving.engine_rows.EngineRows, which owns the state named below: a prompt goes in chunk by chunk
(serving.chunking picks them), either in a forward of its own (`prefill`) or riding a decode step's forward
(EngineRows.decode, where `rides` allows), and once whole its row joins the decode steps (`_start`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from gpt2_jax.model import Params
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.serving import chunking
from gpt2_jax.serving.batch import DeviceBatch
from gpt2_jax.serving.blocks import BlockPool
from gpt2_jax.serving.engine_programs import EnginePrograms
from gpt2_jax.serving.slots import Slot
from gpt2_jax.serving.speculation import Speculation


class PromptChunks:
    """Prompt chunks into the rows' KV blocks; the state is EngineRows'."""

    params: Params
    lock: threading.Condition
    slots: list[Slot | None]
    batch: DeviceBatch
    pool: BlockPool
    programs: EnginePrograms
    speculation: Speculation | None
    prefill_chunk: int
    blocks_per_row: int
    capacity: int
    prefill_tokens: int
    per_row: float

    def _repack(self) -> None: ...

    def decoding(self) -> list[int]:
        """The rows whose prompt is in."""
        return [b for b, s in enumerate(self.slots) if s is not None and s.decoding]

    def _table(self, slot: Slot) -> np.ndarray:
        table = np.zeros(self.blocks_per_row, np.int32)  # NULL_BLOCK past the row's blocks
        table[: len(slot.blocks)] = slot.blocks
        return table

    def plan_chunk(self) -> chunking.Chunk | None:
        """The next prompt chunk(s) to put in (serving.chunking: which prompts, how many tokens), or None when no
        prompt is going in."""
        order = [
            b for _, b in sorted((s.order, b) for b, s in enumerate(self.slots) if s is not None and not s.decoding)
        ]
        if not order:
            return None
        waiting = [(b, self._slot(b).request.prompt, self._slot(b).prefilled) for b in order]
        P, T = chunking.plan(waiting, len(self.decoding()), self.prefill_chunk, self.programs, self.per_row)
        return chunking.build(waiting, [self._table(self._slot(b)) for b in order], P, T)

    def rides(self, c: chunking.Chunk) -> bool:
        """Whether the chunk may ride the next decode step (decode's `chunk`): a full one that ends no prompt. A
        prompt's last chunk goes in before the step, so that its row draws its first token in that step."""
        return c.tokens.shape[1] == self.prefill_chunk and all(
            self._slot(b).prefilled + int(n) < len(self._slot(b).request.prompt) for b, n in zip(c.rows, c.taken)
        )

    def prefill(self, c: chunking.Chunk) -> None:
        """Put the chunk in, in a forward of its own."""
        P, T = c.tokens.shape
        self.batch.state, logits = self.programs.prefill(T, P)(self.params, self.batch.state, c.tables, c.tokens,
                                                               c.start, c.taken - 1)  # fmt: skip
        self._put(c, logits)

    def _put(self, c: chunking.Chunk, logits: Any) -> None:
        """The chunk is in the target's pool: the draft model reads it into its own, its prompts count it, their
        full blocks are named, and a prompt now whole joins the decode steps."""
        if self.batch.draft_pool is not None:  # the draft model reads the same chunks into its pool
            spec = self.speculation
            assert spec is not None and spec.draft is not None, "a draft pool comes with a draft model"
            P, T = c.tokens.shape
            self.batch.draft_pool = self.programs.draft(T, P)(spec.draft_params, self.batch.draft_pool, c.tables,
                                                              c.tokens, c.start)  # fmt: skip
        logits = np.asarray(logits)  # on the host, a row of it is a view: slicing the device array would compile
        whole = []
        for i, b in enumerate(c.rows):
            slot = self._slot(b)
            slot.prefilled += int(c.taken[i])
            self.prefill_tokens += int(c.taken[i])
            self.pool.register(slot.blocks, slot.names, min(slot.prefilled // KEY_BLOCK, len(slot.names)))
            if slot.prefilled == len(slot.request.prompt):
                whole.append((slot, c.tables[i], logits[i]))
        for slot, table, row_logits in whole:  # by slot: _lowest may move a row of this chunk
            self._start(self._lowest(slot), slot, table, row_logits)

    def _slot(self, b: int) -> Slot:
        slot = self.slots[b]
        assert slot is not None, f"row {b} holds no request"
        return slot

    def _lowest(self, slot: Slot) -> int:
        """Move a row whose prompt is now whole to the lowest row that is not decoding (swapping with the prompt
        there, if any) -> its row. The decoding rows stay packed at the bottom, so a decode step runs over as few
        rows as decode (the step covers rows [0, highest decoding row]); rows stay where they are once decoding."""
        b = next(i for i, s in enumerate(self.slots) if s is slot)
        j = next(i for i, s in enumerate(self.slots) if s is None or not s.decoding)
        if j >= b:
            return b
        other = self.slots[j]  # None, or a prompt still going in
        with self.lock:
            self.slots[b], self.slots[j] = other, slot
        self.batch.swap_rows(b, j)
        if slot.automaton is not None or (other is not None and other.automaton is not None):
            self._repack()
        return j

    def _start(self, b: int, slot: Slot, table: np.ndarray, logits: Any) -> None:
        """Row b's prompt is in: it joins the decode steps."""
        prompt = slot.request.prompt
        padded = np.full(self.capacity, prompt[-1], np.int32)
        padded[: len(prompt)] = prompt
        key = slot.request.prepared.batch.keys[0]
        self.batch.state = self.programs.start_row()(
            self.batch.state, np.int32(b), table, padded, np.int32(len(prompt)), logits, key,
            np.int32(self.batch.start_state(b)),
        )  # fmt: skip
        slot.decoding = True
