"""Beam search's jitted loop: transformers' vectorised beam search, step for step, over the fixed-size KV cache.

Each prompt owns W rows of the cache (W: its num_beams rounded up to a power of two, the bucket), one row per
beam; a step scores every beam's next tokens, keeps the best candidates, and gathers the cache rows of the
beams they extend (one gather per step), then feeds the chosen tokens back. The arithmetic is transformers'
`_beam_search` (generation/utils.py, 4.5x), op for op in float32, so its sentinels (-1e9 for beams that may not
be chosen) and its early-stopping heuristic decide exactly as they do there:

  1. scores = processors(log_softmax(logits)) (+ warpers when sampling) + each beam's running score
  2. the top C = max(2, 1 + stop ids) * num_beams candidates over num_beams x V (sampled without replacement
     by Gumbel-top-k when sampling, then sorted by score)
  3. running beams: the best num_beams candidates that do not end (EOS, a stop id, max_new_tokens)
  4. finished hypotheses: the best num_beams of the old ones and the candidates that end among the first
     num_beams, scored sum / length ** length_penalty
  5. stop a prompt when its hypotheses can no longer improve (early_stopping), or no candidate continues.

Rows past a prompt's num_beams inside its bucket are never chosen (score -inf), so num_beams and every other
setting is a traced value per prompt: a new value inside a bucket never recompiles. A row's arithmetic never
reads another row's, so a prompt's beams are the same bits alone or in any batch, with any cache capacity.

Shape legend: B prompts, W beams per prompt (bucket), C candidates, N steps, V vocab, S cache slots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax import sampling
from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.decode import DecodeState, Rules, feed, prefill
from gpt2_jax.kernels.invariance import min_rows, pad_rows
from gpt2_jax.model.params import Params
from gpt2_jax.sampling import constraints
from gpt2_jax.sampling.processors import apply_processors, update_state

NEG = -1.0e9  # transformers' score for what may not be chosen


class BeamRules(NamedTuple):
    """The search's settings, one traced value per prompt."""

    beams: jax.Array  # [B] int32 num_beams
    norm: jax.Array  # [B, N + 1] float32: float32(n ** length_penalty), computed in float64 as Python does
    hopeful: jax.Array  # [B] bool: early_stopping "never" with length_penalty > 0 (the heuristic's longest length)
    early: jax.Array  # [B] bool: early_stopping True (stop once num_beams hypotheses are done)
    sample: jax.Array  # [B] bool: beam sampling
    max_new: jax.Array  # [B] int32 max_new_tokens
    kept: jax.Array  # [B] int32: candidates per step, max(2, 1 + stop ids) * num_beams


class Hyps(NamedTuple):
    """W hypotheses per prompt, best first: the running beams, or the finished ones."""

    score: jax.Array  # [B, W] float32: running: sum of scores; finished: sum / length ** length_penalty
    tokens: jax.Array  # [B, W, N] int32
    parents: jax.Array  # [B, W, N] int32: at each step, the beam the token extended (-1: not yet)
    logprobs: jax.Array  # [B, W, N] float32: log p(token) under the raw logits
    length: jax.Array  # [B, W] int32: tokens held
    finished: jax.Array  # [B, W] bool (finished hypotheses: a real one, not a placeholder)


class Trace(NamedTuple):
    """The running beams after each step (for looking at the search), -1 / -inf where there is none."""

    tokens: jax.Array  # [B, N, W] int32
    parents: jax.Array  # [B, N, W] int32
    scores: jax.Array  # [B, N, W] float32


class BeamState(NamedTuple):
    decode: DecodeState  # the cache and processor state, B * W rows (row b * W + j: prompt b's beam j)
    run: Hyps
    fin: Hyps
    open: jax.Array  # [B] bool: the heuristic says the hypotheses may still improve
    done: jax.Array  # [B] bool: the prompt's search has ended (its hypotheses are frozen)
    steps: jax.Array  # [B] int32: steps the prompt's search ran


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...] at idx [B, J] along axis 1 -> [B, J, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def log_probs(logits: jax.Array) -> jax.Array:
    """Raw logits [R, V] -> log_softmax [R, V], rounded alike for any row count (as decode's logprobs)."""
    r, v = logits.shape
    return jax.nn.log_softmax(pad_rows(logits.astype(jnp.float32), min_rows(r, v)), axis=-1)[:r]


def warped(x: jax.Array, settings: sampling.RowSettings, use: jax.Array, n_valid: int) -> jax.Array:
    """Processed log-probs [R, V] -> temperature, top-k, top-p and min-p applied where use [R] (beam sampling,
    as transformers applies its warpers to the log-probs); -inf where filtered. Computed only if some row samples."""
    r, v = x.shape
    rows = min_rows(r, v)

    def warp():
        padded = jax.tree.map(lambda a: pad_rows(a, rows), settings)
        return jnp.where(use[:, None], sampling.filter_logits(pad_rows(x, rows), padded, n_valid)[:r], x)

    return jax.lax.cond(jnp.any(use), warp, lambda: x)


def gumbel(keys: jax.Array, v: int, use: jax.Array) -> jax.Array:
    """[R] row keys -> [R, V] Gumbel noise, each row from its own key only (0 where use [R] is False; nothing
    is drawn when no row samples)."""
    noise = lambda: jnp.where(use[:, None], jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys), 0.0)
    return jax.lax.cond(jnp.any(use), noise, lambda: jnp.zeros((keys.shape[0], v)))


def candidates(acc: jax.Array, noise: jax.Array, c: int, kept: jax.Array, plain: jax.Array):
    """Accumulated scores acc [B, W * V] (+ Gumbel noise [B, W * V], zero for greedy prompts) -> each prompt's
    kept [B] <= c candidates: (scores [B, c], the order they rank in [B, c], descending, flat indices [B, c]),
    -inf past kept. With noise this samples them without replacement from softmax(acc), as transformers'
    torch.multinomial does, then ranks them by score; the cut comes first, so the sample does not depend on c.
    A plain [B] prompt (sampling with one beam, i.e. plain sampling) ranks them in the order drawn, so its
    first candidate is a Gumbel-max draw from softmax(acc)."""
    drawn, idx = jax.lax.top_k(acc + noise, c)
    past = jnp.arange(c) >= kept[:, None]
    vals = jnp.where(past, -jnp.inf, jnp.take_along_axis(acc, idx, axis=1))
    rank = jnp.where(plain[:, None], jnp.where(past, -jnp.inf, drawn), vals)
    neg, vals, idx = jax.lax.sort((-rank, vals, idx), dimension=1, is_stable=True, num_keys=1)  # descending rank
    return vals, -neg, idx


def extend(h: Hyps, parent: jax.Array, token: jax.Array, logprob: jax.Array, t: jax.Array) -> Hyps:
    """Running hypotheses -> the J [B, J] extensions of beams parent [B, J] by token [B, J] at step t (score unset)."""
    at = lambda x, v: jax.lax.dynamic_update_index_in_dim(_take(x, parent), v, t, axis=2)
    return Hyps(jnp.zeros(parent.shape), at(h.tokens, token), at(h.parents, parent), at(h.logprobs, logprob),
                jnp.full(parent.shape, t + 1), jnp.zeros(parent.shape, bool))  # fmt: skip


def _select(h: Hyps, idx: jax.Array) -> Hyps:
    return jax.tree.map(lambda x: _take(x, idx), h)


def finish(fin: Hyps, cand: Hyps, vals: jax.Array, ends: jax.Array, state: BeamState, b: BeamRules, t) -> Hyps:
    """transformers' _update_finished_beams: the candidates [B, C] that end among the first num_beams enter the
    finished hypotheses, scored vals / (t + 1) ** length_penalty; the best W stay (placeholders at -1e9, rows
    past num_beams -inf). A prompt whose search has ended keeps its hypotheses. (transformers also adds -1e9
    when they are all done under early_stopping=True, or can no longer improve: then a prompt of its own has
    ended its loop, as a prompt here has ended its search, so those terms never decide anything.)"""
    W, C = fin.score.shape[1], vals.shape[1]
    slot = jnp.arange(W) < b.beams[:, None]
    did = ends & (jnp.arange(C) < b.beams[:, None])
    s = vals / b.norm[:, t + 1][:, None]  # the same float32 division torch does
    s = s + (~did).astype(jnp.float32) * NEG
    merged = jax.tree.map(lambda a, c: jnp.concatenate([a, c], axis=1), fin, cand._replace(score=s, finished=did))
    _, best = jax.lax.top_k(merged.score, W)
    new = _select(merged, best)
    new = new._replace(score=jnp.where(slot, new.score, -jnp.inf), finished=new.finished & slot)
    return jax.tree.map(lambda old, x: jnp.where(_rows_like(state.done, x), old, x), fin, new)  # done: frozen


def _rows_like(rows: jax.Array, x: jax.Array) -> jax.Array:
    return rows.reshape(rows.shape + (1,) * (x.ndim - 1))


def still_open(state: BeamState, run: Hyps, fin: Hyps, b: BeamRules, t) -> jax.Array:
    """transformers' _check_early_stop_heuristic after step t: can the best running beam still beat the worst
    finished hypothesis? [B] bool (once False, it stays False)."""
    slot = jnp.arange(fin.score.shape[1]) < b.beams[:, None]
    longest = jnp.where(b.hopeful, b.max_new, t + 1)
    best = run.score[:, :1] / jnp.take_along_axis(b.norm, longest[:, None], axis=1)
    worst = jnp.where(fin.finished, jnp.min(jnp.where(slot, fin.score, jnp.inf), axis=1, keepdims=True), NEG)
    return state.open & jnp.any(slot & (best > worst), axis=1)


def scores(d: DecodeState, rules: Rules, b: BeamRules, t, config: GPT2Config, W: int) -> tuple[jax.Array, jax.Array]:
    """Each beam row's raw log-probs [B * W, V] and its next-token scores: the processors on the log-probs (as
    transformers' beam search applies them), the warpers for a sampling prompt, -inf in padding vocab columns."""
    rows = lambda x: jnp.repeat(x, W, axis=0)  # a prompt's setting for each of its beam rows
    logp = log_probs(d.logits)
    stop, v = rules.stop, logp.shape[-1]
    tables = rules.constraint._replace(group=rows(rules.constraint.group))
    allowed = jax.lax.cond(jnp.any(d.automaton > 0), lambda: constraints.allowed(tables, d.automaton, rows(stop.eos_id)),
                           lambda: jnp.ones(logp.shape, bool))  # fmt: skip
    x = apply_processors(logp, jax.tree.map(rows, rules.processors), d.history, d.cache.lengths,
                         jnp.full(logp.shape[0], t, jnp.int32), rows(stop_ids(rules)), allowed)  # fmt: skip
    x = warped(x, jax.tree.map(rows, rules.settings), rows(b.sample), config.valid_vocab)
    return logp, jnp.where(jnp.arange(v) < config.valid_vocab, x, -jnp.inf)


def stop_ids(rules: Rules) -> jax.Array:
    """[B, 1 + MAX_STOP_IDS] each prompt's EOS and stop ids (-1: none), the tokens that end a hypothesis."""
    return jnp.concatenate([rules.stop.eos_id[:, None], rules.stop.stop_ids], axis=1)


def noise(d: DecodeState, b: BeamRules, W: int) -> jax.Array:
    """[B, W * V] Gumbel noise for the sampling prompts (0 for the others): beam j of a prompt draws from
    fold_in(fold_in(its key, position), j), its own bits whatever W or the batch."""
    B = b.beams.shape[0]
    keys = jax.vmap(jax.random.fold_in)(d.keys, d.cache.lengths)
    keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.arange(W), B))
    return gumbel(keys, d.logits.shape[-1], jnp.repeat(b.sample, W)).reshape(B, -1)


def follow(params: Params, d: DecodeState, rules: Rules, parent: jax.Array, token: jax.Array, config: GPT2Config,
           hooks=None) -> DecodeState:  # fmt: skip
    """The new beams' rows: each takes its parent's cache row, processor and constraint state (parent [B * W],
    one gather), records its token [B * W] and runs it through the model."""
    W = parent.shape[0] // rules.stop.eos_id.shape[0]
    tables = rules.constraint._replace(group=jnp.repeat(rules.constraint.group, W))
    gather = lambda x: jnp.take(x, parent, axis=0)
    cache = d.cache._replace(k=jnp.take(d.cache.k, parent, axis=1), v=jnp.take(d.cache.v, parent, axis=1))
    history = update_state(jax.tree.map(gather, d.history), token, d.cache.lengths, jnp.ones(parent.shape, bool))
    automaton = constraints.advance(tables, gather(d.automaton), token)
    return feed(params, d._replace(cache=cache, history=history, automaton=automaton), token, config, hooks)


def step(params: Params, state: BeamState, rules: Rules, b: BeamRules, t, config: GPT2Config, c: int, hooks=None):
    """One beam-search step for every prompt -> (state, the running beams' tokens, parents, scores [B, W])."""
    B, W = state.run.score.shape
    V = state.decode.logits.shape[-1]
    logp, x = scores(state.decode, rules, b, t, config, W)
    acc = (x.reshape(B, W, V) + state.run.score[:, :, None]).reshape(B, W * V)
    vals, rank, idx = candidates(acc, noise(state.decode, b, W), c, b.kept, b.sample & (b.beams == 1))
    valid = jnp.arange(c) < b.kept[:, None]
    beam, token = idx // V, idx % V
    ends = (token[:, :, None] == stop_ids(rules)[:, None, :]).any(-1) | (t + 1 >= b.max_new)[:, None]
    cand = extend(state.run, beam, token, jnp.take_along_axis(logp.reshape(B, W * V), idx, axis=1), t)
    # the running beams: the best num_beams candidates that go on
    going = jnp.where(valid, rank + ends.astype(jnp.float32) * NEG, -jnp.inf)
    _, pick = jax.lax.top_k(going, W)
    slot = jnp.arange(W) < b.beams[:, None]
    score = _take(vals + ends.astype(jnp.float32) * NEG, pick)  # = going but for a plain prompt's draw order
    run = _select(cand, pick)._replace(score=jnp.where(slot, score, -jnp.inf))
    fin = finish(state.fin, cand, vals, ends, state, b, t)
    is_open = jnp.where(state.done, state.open, still_open(state, run, fin, b, t))
    all_done = jnp.all(fin.finished | ~slot, axis=1)
    done = state.done | ~is_open | (all_done & b.early) | jnp.all(ends | ~valid, axis=1)
    parent = _take(beam, pick)
    d = follow(params, state.decode, rules, (jnp.arange(B)[:, None] * W + parent).reshape(-1),
               run.tokens[:, :, t].reshape(-1), config, hooks)  # fmt: skip
    live = ~state.done[:, None] & slot
    trace = (jnp.where(live, run.tokens[:, :, t], -1), jnp.where(live, parent, -1),
             jnp.where(live, run.score, -jnp.inf))  # fmt: skip
    return BeamState(d, run, fin, is_open, done, jnp.where(state.done, state.steps, t + 1)), trace


def expand(d: DecodeState, W: int) -> DecodeState:
    """A prefilled state of B prompts -> B * W rows, each prompt's row repeated for its beams (the cache too)."""
    idx = jnp.repeat(jnp.arange(d.logits.shape[0]), W)
    cache = d.cache._replace(k=jnp.take(d.cache.k, idx, axis=1), v=jnp.take(d.cache.v, idx, axis=1),
                             lengths=d.cache.lengths[idx])  # fmt: skip
    return jax.tree.map(lambda x: x[idx], d._replace(cache=None))._replace(cache=cache)


def init(d: DecodeState, b: BeamRules, W: int, N: int) -> BeamState:
    """The state before the first step: beam 0 at score 0, the prompt's other beams at -1e9 (transformers'
    start, so the first step extends beam 0 only), rows past num_beams at -inf; W placeholder hypotheses."""
    B = b.beams.shape[0]
    j = jnp.arange(W)[None, :]
    slot = j < b.beams[:, None]
    none = jnp.full((B, W, N), -1, jnp.int32)  # not a token: the host fills a hypothesis' end
    empty = Hyps(jnp.zeros((B, W)), none, none, jnp.zeros((B, W, N)),
                 jnp.zeros((B, W), jnp.int32), jnp.zeros((B, W), bool))  # fmt: skip
    run = empty._replace(score=jnp.where(j == 0, 0.0, jnp.where(slot, NEG, -jnp.inf)))
    fin = empty._replace(score=jnp.where(slot, NEG, -jnp.inf))
    no = jnp.zeros(B, bool)
    return BeamState(expand(d, W), run, fin, ~no, no, jnp.zeros(B, jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "capacity", "width", "c", "steps", "hooks"))
def search(params: Params, tokens: jax.Array, lengths: jax.Array, keys: jax.Array, rules: Rules, b: BeamRules,
           config: GPT2Config, capacity: int, width: int, c: int, steps: int, hooks=None) -> tuple[Hyps, Trace, jax.Array]:  # fmt: skip
    """Right-padded prompts [B, P] of lengths [B], their keys [B] -> (the finished hypotheses [B, W], best first;
    the trace of the running beams [B, N, W]; steps each prompt ran [B]). One program: the prefill writes each
    prompt once into a cache of `capacity` slots, its rows are repeated for the beams, and one lax.while_loop
    runs the steps until every prompt's search has ended (or `steps`), so a bucket's padding steps never run.
    The cache never crosses the program's boundary: it is made inside and updated in the loop's carry."""
    state = prefill(params, tokens, lengths, keys, config, capacity, rules.constraint.start, hooks)
    s = init(state, b, width, steps)
    B = b.beams.shape[0]
    trace = Trace(jnp.full((B, steps, width), -1, jnp.int32), jnp.full((B, steps, width), -1, jnp.int32),
                  jnp.full((B, steps, width), -jnp.inf))  # fmt: skip

    def body(carry):
        t, s, trace = carry
        s, now = step(params, s, rules, b, t, config, c, hooks)
        trace = Trace(*(jax.lax.dynamic_update_index_in_dim(a, x, t, axis=1) for a, x in zip(trace, now)))
        return t + 1, s, trace

    running = lambda carry: (carry[0] < steps) & ~carry[1].done.all()
    _, s, trace = jax.lax.while_loop(running, body, (jnp.zeros((), jnp.int32), s, trace))
    return s.fin, trace, s.steps
