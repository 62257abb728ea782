"""Streaming speculative decoding: rounds on the device, one token per row per yielded step on the host.

A round keeps a different number of tokens per row, so each row's tokens wait in a host queue, and
a step is yielded once every live row has one: the stream has generate_stream's shape (tokens [B],
live [B] per step) and the same tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Bool, Int


def stream_rounds(
    spec: Any, state: Any, rules: Any, limits: Int[np.ndarray, " B"], matcher: Any, halt: Callable
) -> Iterator[tuple[Int[np.ndarray, " B"], Bool[np.ndarray, " B"]]]:
    """Yield (tokens [rows], live [rows]) per step from a prefilled state, rows = len(limits). A row stops
    after its stopping token (EOS, a stop id, or the token completing a stop string) or limits[b] tokens;
    stopped rows repeat their fill: their EOS, else their last token."""
    rows, n = len(limits), int(np.max(limits))
    eos = np.asarray(rules.stop.eos_id)[:rows]
    queue = [deque() for _ in range(rows)]
    finished = np.zeros(rows, bool)
    fill = np.maximum(eos, 0).astype(np.int64)
    made = np.zeros(rows, np.int64)
    done = np.zeros(rows, bool)
    width = spec.k + 1  # one round keeps at most k + 1 tokens
    for _ in range(n):
        while any(not finished[b] and not queue[b] for b in range(rows)):
            state, out, kept = spec.run(state, rules, n, width, 0, rounds=1)
            tokens = np.asarray(out.token)
            for b in range(rows):
                queue[b].extend(tokens[b, : kept[b]].tolist())
            done = np.asarray(state.done)[:rows]
        live = ~finished
        step = np.array([queue[b].popleft() if live[b] else fill[b] for b in range(rows)], np.int64)
        yield step.astype(np.int32), live
        made += live
        hit = np.zeros(len(np.asarray(state.done)), bool)
        for b in np.flatnonzero(live):
            if (matcher and matcher.feed(b, [int(step[b])]) is not None) or made[b] >= limits[b]:
                hit[b] = True
            if hit[b] or (done[b] and not queue[b]):
                finished[b] = True
                queue[b].clear()
                fill[b] = eos[b] if eos[b] >= 0 else step[b]
        if hit.any():
            state = halt(state, hit, rules.stop.eos_id)  # stop drawing for it on the device too
        if finished.all():
            return
