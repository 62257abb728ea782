"""generate and generate_stream: prompts and SamplingParams in, tokens out.

One path: `prepare` checks the prompts and one SamplingParams per row on the host, `prefill` writes the
prompts into a fresh cache, and `decode_chunk` runs the jitted decode loop over it: all of max_new_tokens in
one call, or chunks.DECODE_CHUNK steps per call when some row has stop strings (matched on the host between
chunks; the tokens after the completing one are dropped) or speculative rounds run instead.

Shapes are bucketed (prompt length P and step count N round up to powers of two), and every setting,
key and stop id is a traced value, so a new value never recompiles. A row's randomness is
fold_in(row_key, absolute position): its tokens depend only on its prompt, key and settings, never on
its batch neighbours, the batch size, the padding or the cache size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.batching import Prepared, as_prompts, prepare
from gpt2_jax.generation.chunks import decode_chunks, start, stop_matcher
from gpt2_jax.generation.decode import decode_chunk, decode_step, halt
from gpt2_jax.generation.speculative.speculator import Speculator
from gpt2_jax.generation.speculative.stream import stream_rounds
from gpt2_jax.model.axes import on_mesh
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.checks import MAX_TOP_LOGPROBS
from gpt2_jax.sampling.params import SamplingParams, sampling_rows

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Bool, Int

_generate = decode_chunk  # the jitted decode loop (tests count its compiles)


class GenerateResult(NamedTuple):
    tokens: np.ndarray  # [B, N] int32 (N: the largest max_new_tokens); after a row stops: its EOS (else its last token)
    lengths: np.ndarray  # [B] int32: generated tokens per row, the stopping token included
    logprobs: np.ndarray | None  # [B, N] float32 log p(token) under the raw logits (when a row asked: logprobs=True)
    finish_reason: list | None = None  # [B] "stop" (EOS, a stop id or a stop string) or "length"
    stop_string: list | None = None  # [B] the stop string that ended the row, else None
    top_ids: np.ndarray | None = None  # [B, N, R] the R most likely ids (raw logits; R: the most any row asked)
    top_logprobs: np.ndarray | None = None  # [B, N, R] their log-probabilities
    proposed: np.ndarray | None = None  # [B] speculative decoding: tokens proposed to the row
    accepted: np.ndarray | None = None  # [B] ... of which kept (each round also keeps one drawn token)


def settings_rows(sampling: Any, n: int, settings: dict) -> list[SamplingParams]:
    """One SamplingParams per row of n (sampling.params.sampling_rows). Keyword settings are sugar for one
    SamplingParams; return_logprobs is the older name of logprobs."""
    if "return_logprobs" in settings:
        settings["logprobs"] = settings.pop("return_logprobs")
    return sampling_rows(sampling, n, settings)


def _prepared(params: Params, config: GPT2Config, prompts: Any, key: Any, sampling: Any, hooks: Any,
              settings: dict) -> tuple[list[SamplingParams], Prepared]:  # fmt: skip
    """generate's inputs -> (one SamplingParams per prompt, the prepared batch): generate_stream's too."""
    prompts = as_prompts(prompts)
    rows = settings_rows(sampling, len(prompts), settings)
    return rows, prepare(params, config, prompts, key, rows, hooks)


def generate(params: Params, config: GPT2Config, prompts: Any, key: Any = None, *,
             sampling: SamplingParams | list[SamplingParams] | None = None, tokenizer: Any = None, draft: Any = None,
             num_speculative_tokens: int = 4, hooks: Any = None, **settings: Any) -> GenerateResult:  # fmt: skip
    """Prompts (lists of token ids, ragged) -> GenerateResult(tokens [B, N], lengths [B], logprobs, ...).

    sampling: one gpt2_jax.SamplingParams for every row, or one per prompt (what each row samples with, how
      long and where it stops; see SamplingParams). Keyword settings (temperature=0.8, max_new_tokens=50,
      ...: SamplingParams' field names, each one value or one per row) are sugar that builds the same rows.
    key: one PRNG key (row b uses fold_in(key, b)) or one key per row [B]; a row whose SamplingParams has a
      seed uses fold_in(jax.random.key(seed), b) instead, and with a seed in every row no key is needed.
    tokenizer: decodes tokens for stop strings (default: the gpt2 encoding).
    draft: speculative decoding (gpt2_jax.generation.speculative): "prompt_lookup" or (draft_params,
      draft_config), a smaller model with the same vocabulary; each round checks num_speculative_tokens
      proposals in one forward. The result equals decoding without a draft bit for bit (tokens, lengths,
      logprobs); only the speed differs. proposed/accepted in the result count the proposals per row.
    hooks: {hook name: fn} (or a gpt2_jax.interp.Hooks) editing activations in every forward, prefill and
      each step, as run_with_hooks does (steering while decoding); each fn sees that call's new tokens.
      Build the functions once: a new function compiles a new program.
    Params sharded with gpt2_jax.parallel.sharding run on their mesh and give the same tokens."""
    rows, prep = _prepared(params, config, prompts, key, sampling, hooks, settings)
    B, r = prep.batch.rows, prep.r
    n = int(prep.max_new_tokens.max())
    spec = None if draft is None else _speculator(params, config, prep, draft, num_speculative_tokens, n)
    with on_mesh(prep.mesh):
        out, generated, done, hits = decode_chunks(
            params, config, prep, n, tokenizer, MAX_TOP_LOGPROBS if r else 0, spec
        )
    toks, logprobs = np.asarray(out.token)[:B, :n].copy(), np.asarray(out.logprob)[:B, :n].copy()
    generated, done = np.asarray(generated)[:B], np.asarray(done)[:B]
    eos = np.asarray(prep.rules.stop.eos_id)[:B]
    lengths, reason, stop_string = np.zeros(B, np.int32), [], []
    for b, (hit, limit) in enumerate(zip(hits, prep.max_new_tokens)):
        if hit is not None and hit.token < limit:  # the tokens after the completing one: drawn, dropped
            length, why, stop = hit.token + 1, "stop", hit.stop
        elif generated[b] > limit or (generated[b] == limit and not done[b]):  # its own max_new_tokens
            length, why, stop = limit, "length", None
        else:
            length, why, stop = generated[b], "stop" if done[b] else "length", None
        lengths[b] = length
        toks[b, length:] = eos[b] if eos[b] >= 0 else toks[b, length - 1]
        logprobs[b, length:] = 0.0
        reason.append(why)
        stop_string.append(stop)
    top_ids = top_lp = None
    if r:
        after = np.arange(n)[None, :, None] >= lengths[:, None, None]
        top_ids = np.where(after, -1, np.asarray(out.top_ids)[:B, :n, :r])
        top_lp = np.where(after, 0.0, np.asarray(out.top_logprobs)[:B, :n, :r])
    stats = None if spec is None else jax.tree.map(lambda x: x[:B], spec.stats)
    want_logprobs = any(s.logprobs for s in rows)
    return GenerateResult(toks, lengths, logprobs if want_logprobs else None, reason, stop_string, top_ids, top_lp,
                          None if stats is None else stats.proposed, None if stats is None else stats.accepted)  # fmt: skip


def _speculator(params: Params, config: GPT2Config, prep: Prepared, draft: Any, k: int, n: int) -> Speculator:
    """The checked draft, its cache holding the prompts (generate and generate_stream alike)."""
    batch = prep.batch
    spec = Speculator(params, config, draft, k, int(batch.lengths[: batch.rows].max()) + n, prep.hooks)
    spec.start(batch.tokens, batch.lengths, batch.capacity)
    return spec


def generate_stream(params: Params, config: GPT2Config, prompts: Any, key: Any = None, *,
                    sampling: SamplingParams | list[SamplingParams] | None = None, tokenizer: Any = None,
                    draft: Any = None, num_speculative_tokens: int = 4, hooks: Any = None,
                    **settings: Any) -> Iterator[tuple[Int[np.ndarray, " B"], Bool[np.ndarray, " B"]]]:  # fmt: skip
    """Like generate (the same arguments), one decode_step at a time: yields (tokens [B], live [B]) per step,
    where live marks the rows whose token is newly generated (the others have stopped and repeat their
    EOS). A row whose stop string completes, or that reaches its max_new_tokens, yields that token live
    and then stops."""
    _, prep = _prepared(params, config, prompts, key, sampling, hooks, settings)
    batch, B = prep.batch, prep.batch.rows
    if prep.r:
        raise ConfigError("generate_stream yields tokens only; use generate for top_logprobs")
    rules = prep.rules if prep.mesh else jax.device_put(prep.rules)  # sent once, not at every step
    prep = prep._replace(rules=rules)
    limits = prep.max_new_tokens
    matcher = stop_matcher(prep.stops, tokenizer)
    state = start(params, config, prep)
    if draft is not None:
        spec = _speculator(params, config, prep, draft, num_speculative_tokens, int(limits.max()))
        with on_mesh(prep.mesh):
            yield from stream_rounds(spec, state, rules, limits, matcher, halt)
        return
    live, made = np.ones(B, bool), np.zeros(B, np.int64)
    for _ in range(int(limits.max())):
        with on_mesh(prep.mesh):
            state, step = decode_step(params, state, rules, config, 0, prep.hooks)
        token = np.asarray(step.token)[:B]
        yield token, live
        made += live
        stopped = live & (made >= limits)
        if matcher:
            stopped |= np.array([live[b] and matcher.feed(b, [token[b]]) is not None for b in range(B)])
        if stopped.any():
            with on_mesh(prep.mesh):
                state = halt(state, np.pad(stopped, (0, len(batch.tokens) - B)), rules.stop.eos_id)
        live = ~np.asarray(state.done)[:B]
        if not live.any():
            return
