"""Beam search's bookkeeping in transformers' float32 arithmetic: candidates, running beams, finished hypotheses.

Pure functions over each prompt's W beams (W: its num_beams rounded up to a power of two; rows past num_beams
score -inf and are never chosen). They follow transformers' vectorised `_beam_search` (generation/utils.py,
4.5x) op for op, so its sentinels (-1e9 for what may not be chosen) and its early-stopping heuristic decide
exactly as they do there:

  1. the top C = max(2, 1 + stop ids) * num_beams candidates over num_beams x V of the accumulated scores
     (sampled without replacement by Gumbel-top-k when sampling, then ranked by score)
  2. running beams: the best num_beams candidates that do not end (EOS, a stop id, max_new_tokens)
  3. finished hypotheses: the best num_beams of the old ones and the candidates that end among the first
     num_beams, scored sum / length ** length_penalty
  4. a prompt's search ends when its hypotheses can no longer improve (early_stopping), or nothing continues.

Shape legend: B prompts, W beams per prompt, C candidates, N steps, V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int, Shaped

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


class Chosen(NamedTuple):
    """What one step decides for every prompt."""

    run: Hyps  # the running beams
    fin: Hyps  # the finished hypotheses
    open: jax.Array  # [B] bool: the hypotheses may still improve (transformers' heuristic)
    done: jax.Array  # [B] bool: the prompt's search has ended
    parent: jax.Array  # [B, W] int32: the beam each running beam extends
    scores: jax.Array  # [B, W] float32: the running beams' cumulative scores (without the -1e9 of ending)


def divide(x: Float[Array, "*N"], d: Float[Array, "*D"]) -> Float[Array, "*N"]:
    """x / d rounded as one float32 division, d broadcast to x's shape. XLA rewrites x / broadcast(d) as
    x * broadcast(1 / d), which rounds differently (by 1 ulp, in about 1 element in 10); the barrier keeps the
    division a division."""
    return x / jax.lax.optimization_barrier(jnp.broadcast_to(d, x.shape))


def take(x: Shaped[Array, "B M *R"], idx: Int[Array, "B J"]) -> Shaped[Array, "B J *R"]:
    """x [B, M, ...] at idx [B, J] along axis 1 -> [B, J, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def select(h: Hyps, idx: Int[Array, "B J"]) -> Hyps:
    return jax.tree.map(lambda x: take(x, idx), h)


def start(b: BeamRules, W: int, N: int) -> tuple[Hyps, Hyps]:
    """(running, finished) before the first step: beam 0 at score 0, the prompt's other beams at -1e9
    (transformers' start, so the first step extends beam 0 only), rows past num_beams at -inf; W placeholder
    hypotheses at -1e9."""
    B = b.beams.shape[0]
    j = jnp.arange(W)[None, :]
    slot = j < b.beams[:, None]
    none = jnp.full((B, W, N), -1, jnp.int32)  # not a token: the host fills a hypothesis' end
    empty = Hyps(jnp.zeros((B, W)), none, none, jnp.zeros((B, W, N)),
                 jnp.zeros((B, W), jnp.int32), jnp.zeros((B, W), bool))  # fmt: skip
    run = empty._replace(score=jnp.where(j == 0, 0.0, jnp.where(slot, NEG, -jnp.inf)))
    return run, empty._replace(score=jnp.where(slot, NEG, -jnp.inf))


def candidates(
    acc: Float[Array, "B W*V"], noise: Float[Array, "B W*V"], c: int, kept: Int[Array, " B"], plain: Bool[Array, " B"]
) -> tuple[Float[Array, "B C"], Float[Array, "B C"], Int[Array, "B C"]]:
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


def extend(
    h: Hyps, parent: Int[Array, "B J"], token: Int[Array, "B J"], logprob: Float[Array, "B J"], t: Int[Array, ""]
) -> Hyps:
    """Running hypotheses -> the J [B, J] extensions of beams parent [B, J] by token [B, J] at step t (score unset)."""
    at = lambda x, v: jax.lax.dynamic_update_index_in_dim(take(x, parent), v, t, axis=2)
    return Hyps(jnp.zeros(parent.shape), at(h.tokens, token), at(h.parents, parent), at(h.logprobs, logprob),
                jnp.full(parent.shape, t + 1), jnp.zeros(parent.shape, bool))  # fmt: skip


def finish(
    fin: Hyps, cand: Hyps, vals: Float[Array, "B C"], ends: Bool[Array, "B C"], b: BeamRules, t, done: Bool[Array, " B"]
) -> Hyps:
    """transformers' _update_finished_beams: the candidates [B, C] that end among the first num_beams enter the
    finished hypotheses, scored vals / (t + 1) ** length_penalty; the best W stay (placeholders at -1e9, rows
    past num_beams -inf). A prompt whose search has ended (done [B]) keeps its hypotheses. (transformers also
    adds -1e9 when they are all done under early_stopping=True, or can no longer improve: then a prompt of its
    own has left its loop, as a prompt here has ended its search, so those terms never decide anything.)"""
    W, C = fin.score.shape[1], vals.shape[1]
    slot = jnp.arange(W) < b.beams[:, None]
    did = ends & (jnp.arange(C) < b.beams[:, None])
    s = divide(vals, b.norm[:, t + 1][:, None])  # the same float32 division torch does
    s = s + (~did).astype(jnp.float32) * NEG
    merged = jax.tree.map(lambda a, c: jnp.concatenate([a, c], axis=1), fin, cand._replace(score=s, finished=did))
    _, best = jax.lax.top_k(merged.score, W)
    new = select(merged, best)
    new = new._replace(score=jnp.where(slot, new.score, -jnp.inf), finished=new.finished & slot)
    return jax.tree.map(lambda old, x: jnp.where(done.reshape((-1,) + (1,) * (x.ndim - 1)), old, x), fin, new)


def still_open(is_open: Bool[Array, " B"], run: Hyps, fin: Hyps, b: BeamRules, t) -> Bool[Array, " B"]:
    """transformers' _check_early_stop_heuristic after step t: can the best running beam still beat the worst
    finished hypothesis? [B] bool (once False, it stays False)."""
    slot = jnp.arange(fin.score.shape[1]) < b.beams[:, None]
    longest = jnp.where(b.hopeful, b.max_new, t + 1)
    best = run.score[:, :1] / jnp.take_along_axis(b.norm, longest[:, None], axis=1)
    worst = jnp.where(fin.finished, jnp.min(jnp.where(slot, fin.score, jnp.inf), axis=1, keepdims=True), NEG)
    return is_open & jnp.any(slot & (best > worst), axis=1)


def choose(run: Hyps, fin: Hyps, is_open: Bool[Array, " B"], done: Bool[Array, " B"], b: BeamRules, t,
           vals: Float[Array, "B C"], rank: Float[Array, "B C"], idx: Int[Array, "B C"], logprob: Float[Array, "B C"],
           stops: Int[Array, "B M"], V: int) -> Chosen:  # fmt: skip
    """One step's decisions from its candidates (candidates' vals, rank, flat idx [B, C]; their raw logprobs
    [B, C]; each prompt's stop tokens [B, M]): the running beams, the finished hypotheses, whether each
    prompt's search goes on."""
    W, C = run.score.shape[1], vals.shape[1]
    valid = jnp.arange(C) < b.kept[:, None]
    beam, token = idx // V, idx % V
    ends = (token[:, :, None] == stops[:, None, :]).any(-1) | (t + 1 >= b.max_new)[:, None]
    cand = extend(run, beam, token, logprob, t)
    going = jnp.where(valid, rank + ends.astype(jnp.float32) * NEG, -jnp.inf)  # the best that go on
    _, pick = jax.lax.top_k(going, W)
    slot = jnp.arange(W) < b.beams[:, None]
    score = take(vals + ends.astype(jnp.float32) * NEG, pick)  # = going but for a plain prompt's draw order
    new_run = select(cand, pick)._replace(score=jnp.where(slot, score, -jnp.inf))
    new_fin = finish(fin, cand, vals, ends, b, t, done)
    new_open = jnp.where(done, is_open, still_open(is_open, new_run, new_fin, b, t))
    all_done = jnp.all(new_fin.finished | ~slot, axis=1)
    ended = ~new_open | (all_done & b.early) | jnp.all(ends | ~valid, axis=1)
    return Chosen(new_run, new_fin, new_open, done | ended, take(beam, pick), take(vals, pick))
