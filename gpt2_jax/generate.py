"""Autoregressive generation: prefill the prompts in one pass, then a loop of decode steps, in one jit.

Shapes are bucketed (prompt length P and step count N round up to powers of two), and every
sampling and processor setting, key and stop id is a traced value, so a new value never recompiles.
A row's randomness is fold_in(row_key, absolute position): its tokens depend only on its prompt,
key and settings, never on its batch neighbours, the batch size, the padding or the cache size.

Stop strings are checked on the host between chunks of DECODE_CHUNK steps (the tokens after the
completing token are dropped), so generation without them stays one jitted call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax import constraints, sampling
from gpt2_jax.config import GPT2Config
from gpt2_jax.decode import (  # noqa: F401  (prefill, generate_all: part of this module's API)
    DecodeState,
    Rules,
    StopRule,
    decode_chunk,
    decode_step,
    generate_all,
    halt,
    prefill,
)
from gpt2_jax.errors import ConfigError
from gpt2_jax.inspect.hooks import checked_hooks
from gpt2_jax.numerics import pad_rows
from gpt2_jax.params import Params
from gpt2_jax.prompts import Batch, check_stop_args, make_batch
from gpt2_jax.sampling.options import check_top_logprobs, processor_settings
from gpt2_jax.sharding import data_size, mesh_of, on_mesh
from gpt2_jax.speculative import Speculator
from gpt2_jax.speculative.stream import stream_rounds
from gpt2_jax.stops import StopHit, StopMatcher, check_stop_strings

MAX_STOP_IDS = 8  # stop ids are padded to a fixed count so their number never changes a shape
DECODE_CHUNK = 16  # steps per jitted call when stop strings are checked on the host
_generate = generate_all  # the jitted program (tests count its compiles)


class GenerateResult(NamedTuple):
    tokens: np.ndarray  # [B, max_new_tokens] int32; after a row stops: the EOS id (else its stopping token)
    lengths: np.ndarray  # [B] int32: generated tokens per row, the stopping token included
    logprobs: np.ndarray | None  # [B, max_new_tokens] float32 log p(token) under the raw logits
    finish_reason: list | None = None  # [B] "stop" (EOS, a stop id or a stop string) or "length"
    stop_string: list | None = None  # [B] the stop string that ended the row, else None
    top_ids: np.ndarray | None = None  # [B, max_new_tokens, top_logprobs] the most likely ids (raw logits)
    top_logprobs: np.ndarray | None = None  # [B, max_new_tokens, top_logprobs] their log-probabilities
    proposed: np.ndarray | None = None  # [B] speculative decoding: tokens proposed to the row
    accepted: np.ndarray | None = None  # [B] ... of which kept (each round also keeps one drawn token)


class _Prepared(NamedTuple):
    batch: Batch
    rules: Rules
    mesh: Any
    stops: list[str]
    r: int  # top logprobs asked for
    hooks: Any  # a gpt2_jax.inspect.Hooks editing the forward (steering), or None


def _constraint_rows(constraint: Any, rows: int, config: GPT2Config, eos: int) -> constraints.ConstraintTables:
    """None, one Constraint for every row, or one (or None) per row -> the packed automaton tables."""
    per_row = list(constraint) if isinstance(constraint, (list, tuple)) else [constraint] * rows
    if len(per_row) != rows:
        raise ConfigError(f"constraint given per row must have one entry per prompt ({rows}), got {len(per_row)}")
    for c in per_row:
        if c is not None and not isinstance(c, constraints.Constraint):
            raise ConfigError(
                f"constraint must be a gpt2_jax.constraints object (regex, choice, json_schema), got {c!r}"
            )
    if any(c is not None for c in per_row) and eos < 0:
        raise ConfigError("a constraint needs an EOS id to end on (its accepting states allow only EOS); "
                          "pass eos_id=50256")  # fmt: skip
    automata = [None if c is None else constraints.compile_constraint(c, config.vocab_size, eos) for c in per_row]
    return constraints.pack(automata, config.vocab_size)


def _prepare(
    params: Params,
    config: GPT2Config,
    prompts: Any,
    key: jax.Array,
    max_new_tokens: int,
    *,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
    eos_id: int | str | None = "config",
    stop_ids: Any = (),
    stop: Any = None,
    constraint: Any = None,
    top_logprobs: int = 0,
    hooks: Any = None,
    **processors: Any,
) -> _Prepared:
    """Validate everything on the host, before anything is traced. A mesh's data axis must divide the
    rows: copies of the last row fill up to a multiple of it (rows never affect each other, so the
    caller just drops the copies' results)."""
    mesh = mesh_of(params)
    batch = make_batch(prompts, config, max_new_tokens)
    B = batch.tokens.shape[0]
    settings = sampling.row_settings(temperature, top_k, top_p, B, min_p)
    eos, ids = check_stop_args(config.eos_id if eos_id == "config" else eos_id, stop_ids, config, MAX_STOP_IDS)
    procs = processor_settings(B, config.vocab_size, None if eos < 0 else int(eos), **processors)
    tables = _constraint_rows(constraint, B, config, int(eos))
    rows = -(-B // data_size(mesh)) * data_size(mesh)
    tokens, lengths, keys, settings, procs, group, start = jax.tree.map(
        lambda x: pad_rows(x, rows),
        (batch.tokens, batch.lengths, sampling.row_keys(key, B), settings, procs, tables.group, tables.start),
    )
    rules = Rules(settings, procs, StopRule(eos, ids), tables._replace(group=group, start=start))
    batch = batch._replace(tokens=tokens, lengths=lengths, keys=keys)
    edits = checked_hooks(hooks, config) or None  # None: the plain programs
    return _Prepared(batch, rules, mesh, check_stop_strings(stop), check_top_logprobs(top_logprobs), edits)


def generate(
    params: Params,
    config: GPT2Config,
    prompts: Any,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: Any = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
    repetition_penalty: Any = 1.0,
    frequency_penalty: Any = 0.0,
    presence_penalty: Any = 0.0,
    logit_bias: Any = None,
    no_repeat_ngram_size: Any = 0,
    bad_words_ids: Any = None,
    min_new_tokens: Any = 0,
    constraint: Any = None,
    eos_id: int | str | None = "config",
    stop_ids: Any = (),
    stop: Any = None,
    tokenizer: Any = None,
    top_logprobs: int = 0,
    return_logprobs: bool = False,
    draft: Any = None,
    num_speculative_tokens: int = 4,
    hooks: Any = None,
) -> GenerateResult:
    """Prompts (lists of token ids, ragged) -> GenerateResult(tokens [B, N], lengths [B], logprobs, ...).

    key: one PRNG key (row b uses fold_in(key, b)) or one key per row [B]. Each sampling setting is a
    scalar or one value per row [B]:
      temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off): the warpers;
      repetition_penalty, frequency_penalty, presence_penalty, logit_bias ({token_id: bias}, or one dict
      per row), no_repeat_ngram_size, bad_words_ids (token-id sequences, or one list per row),
      min_new_tokens: the processors, applied in the order gpt2_jax.sampling.processors gives.
    constraint: a gpt2_jax.constraints object (regex, choice, json_schema) for every row, or one (or None)
      per row; a row then only emits tokens its automaton allows, and EOS only once its text matches.
    eos_id: "config" (the default) is the checkpoint's eos_token_id (GPT-2's <|endoftext|>, 50256), or no
      EOS when that id is outside the vocab (a small test model); None never stops on EOS.
    stop_ids: more stop tokens. stop: stop strings (text, decoded with `tokenizer`, by default the gpt2
      encoding); a row stops at the token that completes one, and finish_reason/stop_string say so.
    top_logprobs: N <= 20: per generated token, the N most likely ids and their log-probabilities under
      the raw logits (before any processor, warper or temperature), as `logprobs` is.
    draft: speculative decoding (gpt2_jax.speculative): "prompt_lookup" or (draft_params, draft_config), a
      smaller model with the same vocabulary; each round checks num_speculative_tokens proposals in one
      forward. The result equals decoding without a draft bit for bit (tokens, lengths, logprobs); only
      the speed differs. proposed/accepted in the result count the proposals per row.
    hooks: {hook name: fn} (or a gpt2_jax.inspect.Hooks) editing activations in every forward, prefill
      and each step, as run_with_hooks does (steering while decoding); each fn sees that call's new
      tokens. Build the functions once: a new function compiles a new program.
    Params sharded with gpt2_jax.sharding run on their mesh and give the same tokens."""
    prep = _prepare(params, config, prompts, key, max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, min_p=min_p, eos_id=eos_id, stop_ids=stop_ids, stop=stop, constraint=constraint,
                    top_logprobs=top_logprobs, repetition_penalty=repetition_penalty,
                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, logit_bias=logit_bias,
                    no_repeat_ngram_size=no_repeat_ngram_size, bad_words_ids=bad_words_ids,
                    min_new_tokens=min_new_tokens, hooks=hooks)  # fmt: skip
    batch, B, n, r = prep.batch, prep.batch.rows, max_new_tokens, prep.r
    rr = 20 if r else 0  # one compiled width for every N
    spec = None if draft is None else _speculator(params, config, prep, draft, num_speculative_tokens, n)
    with on_mesh(prep.mesh):
        if prep.stops or spec is not None:
            out, generated, done, hits = _generate_chunks(params, config, prep, n, tokenizer, rr, spec)
        else:
            out, generated, done = generate_all(params, batch.tokens, batch.lengths, batch.keys, prep.rules,
                                                 jnp.int32(n), config, batch.capacity, batch.steps, rr, prep.hooks)  # fmt: skip
            hits = [None] * B
    toks, logprobs = np.asarray(out.token)[:B, :n], np.asarray(out.logprob)[:B, :n]
    lengths, done = np.asarray(generated)[:B].copy(), np.asarray(done)[:B]
    for b, hit in enumerate(hits):
        if hit is not None:  # the tokens after the completing one were drawn in the same chunk: drop them
            lengths[b] = hit.token + 1
            eos = int(prep.rules.stop.eos_id)
            toks[b, lengths[b] :] = eos if eos >= 0 else toks[b, hit.token]
            logprobs[b, lengths[b] :] = 0.0
    reason = ["stop" if d or h is not None else "length" for d, h in zip(done, hits)]
    top_ids = top_lp = None
    if r:
        after = np.arange(n)[None, :, None] >= lengths[:, None, None]
        top_ids = np.where(after, -1, np.asarray(out.top_ids)[:B, :n, :r])
        top_lp = np.where(after, 0.0, np.asarray(out.top_logprobs)[:B, :n, :r])
    stats = None if spec is None else jax.tree.map(lambda x: x[:B], spec.stats)
    return GenerateResult(toks, lengths, logprobs if return_logprobs else None, reason,
                          [None if h is None else h.stop for h in hits], top_ids, top_lp,
                          None if stats is None else stats.proposed, None if stats is None else stats.accepted)  # fmt: skip


def _speculator(params: Params, config: GPT2Config, prep: _Prepared, draft: Any, k: int, n: int) -> Speculator:
    """The checked draft, its cache holding the prompts (generate and generate_stream alike)."""
    batch = prep.batch
    spec = Speculator(params, config, draft, k, int(batch.lengths[: batch.rows].max()) + n, prep.hooks)
    spec.start(batch.tokens, batch.lengths, batch.capacity)
    return spec


def encoding(tokenizer: Any = None) -> Any:
    """The tokenizer stop strings and text are decoded with: the one given, else the gpt2 encoding."""
    if tokenizer is None:
        from gpt2_jax.tokenizer import tokenizer as gpt2

        return gpt2()
    return tokenizer


def _token_bytes(tokenizer: Any):
    return encoding(tokenizer).decode_single_token_bytes


def _generate_chunks(
    params: Params, config: GPT2Config, prep: _Prepared, n: int, tokenizer: Any, r: int, spec: Speculator | None
) -> tuple[Any, Any, Any, list[StopHit | None]]:
    """Decode in chunks: with stop strings, DECODE_CHUNK steps per call, and between calls each row's new
    tokens go to the stop matcher, which halts the rows whose stop string completed. Speculative
    rounds (spec) run the same way, all n steps in one call when there are no stop strings."""
    batch, rules = prep.batch, prep.rules
    B = batch.rows
    matcher = StopMatcher(prep.stops, B, _token_bytes(tokenizer))
    state = prefill(params, batch.tokens, batch.lengths, batch.keys, config, batch.capacity, rules.constraint.start,
                    prep.hooks)  # fmt: skip
    size = DECODE_CHUNK if prep.stops else batch.steps
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


def generate_stream(
    params: Params,
    config: GPT2Config,
    prompts: Any,
    key: jax.Array,
    *,
    max_new_tokens: int,
    tokenizer: Any = None,
    **options: Any,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Like generate (the same options), one decode_step at a time: yields (tokens [B], live [B]) per step,
    where live marks the rows whose token is newly generated (the others have stopped and repeat EOS).
    A row whose stop string completes yields that token live and then stops."""
    options.pop("return_logprobs", None)
    draft, k = options.pop("draft", None), options.pop("num_speculative_tokens", 4)
    prep = _prepare(params, config, prompts, key, max_new_tokens, **options)
    batch, B = prep.batch, prep.batch.rows
    rules = prep.rules if prep.mesh else jax.device_put(prep.rules)  # sent once, not at every step
    matcher = StopMatcher(prep.stops, B, _token_bytes(tokenizer))
    with on_mesh(prep.mesh):
        state = prefill(params, batch.tokens, batch.lengths, batch.keys, config, batch.capacity, rules.constraint.start,
                        prep.hooks)  # fmt: skip
    if draft is not None:
        spec = _speculator(params, config, prep, draft, k, max_new_tokens)
        with on_mesh(prep.mesh):
            yield from stream_rounds(spec, state, rules, max_new_tokens, B, matcher, halt)
        return
    live = np.ones(B, bool)
    for _ in range(max_new_tokens):
        with on_mesh(prep.mesh):
            state, step = decode_step(params, state, rules, config, 0, prep.hooks)
        token = np.asarray(step.token)[:B]
        yield token, live
        if prep.stops:
            hit = np.array([live[b] and matcher.feed(b, [token[b]]) is not None for b in range(B)])
            if hit.any():
                with on_mesh(prep.mesh):
                    state = halt(state, np.pad(hit, (0, len(batch.tokens) - B)), rules.stop.eos_id)
        live = ~np.asarray(state.done)[:B]
        if not live.any():
            return
