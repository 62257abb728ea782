"""generate's loop on the host: a prepared batch prefilled (start), then the jitted decode loop called in
chunks (decode_chunks), each row's new tokens fed to the stop matcher between two calls.

All of max_new_tokens runs in one call, or DECODE_CHUNK steps per call when some row has stop strings (the
tokens after the completing one are dropped later, by generate) or speculative rounds run instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.batching import Prepared
from gpt2_jax.generation.decode import DecodeState, Step, decode_chunk, halt, prefill
from gpt2_jax.generation.speculative.speculator import Speculator
from gpt2_jax.generation.stop_strings import StopHit, StopMatcher
from gpt2_jax.model.axes import on_mesh
from gpt2_jax.model.params import Params

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Int

DECODE_CHUNK = 16  # steps per jitted call when stop strings are checked on the host


def encoding(tokenizer: Any = None) -> Any:
    """The tokenizer stop strings and text are decoded with: the one given, else the gpt2 encoding."""
    if tokenizer is None:
        from gpt2_jax.tokenizer import tokenizer as gpt2

        return gpt2()
    return tokenizer


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """token id -> its bytes, for stop strings (the tokenizer given, else the gpt2 encoding)."""
    return encoding(tokenizer).decode_single_token_bytes


def stop_matcher(stops: list, tokenizer: Any) -> StopMatcher:
    """Each row's stop strings (stops[b]), matched on the host. The tokenizer loads only when some row has one:
    without, the matcher never decodes a token."""
    return StopMatcher(stops, token_bytes(tokenizer) if any(stops) else _no_bytes)


def _no_bytes(token: int) -> bytes:
    return b""


def start(params: Params, config: GPT2Config, prep: Prepared) -> DecodeState:
    """The prefilled DecodeState of a prepared batch (its cache holding every prompt)."""
    batch = prep.batch
    with on_mesh(prep.mesh):
        return prefill(params, batch.tokens, batch.lengths, batch.keys, config, batch.capacity,
                       prep.rules.constraint.start, prep.hooks)  # fmt: skip


def decode_chunks(
    params: Params, config: GPT2Config, prep: Prepared, n: int, tokenizer: Any, r: int, spec: Speculator | None
) -> tuple[Step, Int[Array, " B"], Bool[Array, " B"], list[StopHit | None]]:
    """Prefill, then the decode loop in chunks -> (Steps [B, n], generated [B], done [B], each row's stop hit).
    Between calls each row's new tokens go to the stop matcher, which halts the rows whose stop string
    completed. Speculative rounds (spec) run the same way."""
    batch, rules = prep.batch, prep.rules
    B = batch.rows
    matcher = stop_matcher(prep.stops, tokenizer)
    state = start(params, config, prep)
    size = DECODE_CHUNK if matcher else batch.steps
    chunks, t = [], 0
    before = np.zeros(B, np.int64)
    while t < n:
        count = min(size, n - t)
        if spec is None:
            state, out, made = decode_chunk(params, state, rules, jnp.int32(count), config, size, r, prep.hooks)
        else:
            state, out, made = spec.run(state, rules, t + count, size, r)
            made = made.max(initial=0)
        made = int(made)
        chunks.append(jax.tree.map(lambda x: np.asarray(x)[:, :made], out))
        if matcher:
            generated = np.asarray(state.generated)[:B]
            toks = chunks[-1].token
            for b in range(B):
                if generated[b] > before[b]:
                    matcher.feed(b, toks[b, : generated[b] - before[b]].tolist())
            before = generated
            hit = np.array([h is not None for h in matcher.hits] + [False] * (batch.tokens.shape[0] - B))
            if hit.any():
                state = halt(state, hit, rules.stop.eos_id)
        t += made
        if made == 0 or np.asarray(state.done).all():
            break
    out = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *chunks)
    pad = n - out.token.shape[1]
    fill = np.asarray(state.fill)
    out = out._replace(token=np.concatenate([out.token, np.repeat(fill[:, None], pad, 1)], 1),
                       logprob=np.pad(out.logprob, ((0, 0), (0, pad))),
                       top_ids=np.pad(out.top_ids, ((0, 0), (0, pad), (0, 0))),
                       top_logprobs=np.pad(out.top_logprobs, ((0, 0), (0, pad), (0, 0))))  # fmt: skip
    return out, state.generated, state.done, matcher.hits
