"""Which prompt chunks go in at one engine step: how many prompts, how many tokens each.

A step puts prompt chunks in before its decode step, so the decoding rows wait for them; the chunks are sized so
that the wait stays a fraction of a step while prompts still get in as fast as they arrive:
  nobody decodes      one prompt, up to IDLE_CHUNK tokens at once (nobody waits), where that program is built;
  a few rows decode   one prompt, prefill_chunk tokens (the server's --prefill-chunk);
  many rows decode    one more prompt's chunk for every ROWS_PER_CHUNK decoding rows, in one batched forward (up
                      to PROMPTS_PER_STEP): a step over many rows costs enough that the chunks are a small part
                      of it, and when many streams are running, their next prompts arrive that much faster.
  speculative rounds  those chunks times the tokens a row kept per step at the last step: a round keeps several
                      tokens per row and lasts as long, so prompts go in at the pace tokens come out, as with
                      plain steps (one chunk per round would leave the waiting prompts k + 1 times slower).
Every prompt's K/V and logits are the same bits whatever the chunks it was cut into and whatever other prompts
shared its forward (the model's batch invariance), so this decides speed only.

Shape legend: P prompts in the chunk, T tokens each, M blocks per row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from gpt2_jax.generation.batching import bucket

ROWS_PER_CHUNK = 16  # decoding rows per extra prompt chunk in a step
PROMPTS_PER_STEP = (1, 2, 4)  # the batched chunk sizes compiled: P prompts in one forward


class Chunk(NamedTuple):
    rows: list[int]  # the engine rows whose prompts go in, in admission order
    tokens: np.ndarray  # [P, T] int32, each row's next tokens, padded with its chunk's last token
    tables: np.ndarray  # [P, M] int32
    start: np.ndarray  # [P] int32: the slot of each row's first chunk token
    taken: np.ndarray  # [P] int32: the prompt tokens of each row in the chunk (the rest is padding)


def plan(waiting: list[tuple[int, list, int]], decoding: int, chunk: int, programs: Any,
         per_row: float = 1.0) -> tuple[int, int]:  # fmt: skip
    """waiting: (row, prompt, tokens already in) in admission order, at least one; decoding rows; per_row: the
    tokens each decoding row kept at the last step (1 for a plain step) -> (P prompts, T tokens)."""
    _, prompt, done = waiting[0]
    left = len(prompt) - done
    if decoding == 0 and left > chunk:
        T = programs.idle_chunk(left)
        if T is not None:
            return 1, T
    want = min(len(waiting), round(max(1, decoding // ROWS_PER_CHUNK) * max(per_row, 1.0)))
    P = max(p for p in PROMPTS_PER_STEP if p <= want and (p == 1 or programs.prefill_built(chunk, p)))
    return P, (chunk if P > 1 else bucket(min(left, chunk), chunk))


def build(waiting: list[tuple[int, list, int]], tables: list[np.ndarray], P: int, T: int) -> Chunk:
    """The arrays of the first P waiting prompts' next T tokens."""
    rows, tokens = [w[0] for w in waiting[:P]], np.zeros((P, T), np.int32)
    start, taken = np.zeros(P, np.int32), np.zeros(P, np.int32)
    for i, (_, prompt, done) in enumerate(waiting[:P]):
        n = min(len(prompt) - done, T)
        tokens[i] = prompt[done + n - 1]  # padding: a real token, into slots the row overwrites (or the null block)
        tokens[i, :n] = prompt[done : done + n]
        start[i], taken[i] = done, n
    return Chunk(rows, tokens, np.stack(tables[:P]), start, taken)
