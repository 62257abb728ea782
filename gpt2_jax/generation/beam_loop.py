"""Beam search's jitted loop over the fixed-size KV cache: prefill, then one lax.while_loop of steps.

Each prompt owns W rows of the cache (W: its num_beams rounded up to a power of two, the bucket), one row per
beam. A step scores every beam's next tokens (the processors on its log-probs, as transformers' beam search
applies them, the warpers when sampling, plus its running score), lets gpt2_jax.generation.beam_hyps choose the
candidates, running beams and finished hypotheses in transformers' arithmetic, gathers the cache rows (and
processor and constraint state) of the beams they extend, one gather per step, and feeds the chosen tokens.

Rows past a prompt's num_beams inside its bucket are never chosen (score -inf), so num_beams and every other
setting is a traced value per prompt: a new value inside a bucket never recompiles. A row's arithmetic never
reads another row's, so a prompt's beams are the same bits alone or in any batch, with any cache capacity.

Shape legend: B prompts, W beams per prompt (bucket), C candidates, N steps, V vocab, S cache slots.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax import sampling
from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.beam_hyps import BeamRules, Hyps, candidates, choose, start
from gpt2_jax.generation.decode import DecodeState, Rules, feed, prefill
from gpt2_jax.kernels.invariance import min_rows, pad_rows
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.constraints import tables as automata
from gpt2_jax.sampling.draw import log_probs
from gpt2_jax.sampling.metadata import RowSettings
from gpt2_jax.sampling.processors import apply_processors, update_state

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int, Key


class Trace(NamedTuple):
    """The running beams after each step (for looking at the search), -1 / -inf where there is none."""

    tokens: jax.Array  # [B, N, W] int32
    parents: jax.Array  # [B, N, W] int32
    scores: jax.Array  # [B, N, W] float32: cumulative scores (without the -1e9 a beam that ends gets)


class BeamState(NamedTuple):
    decode: DecodeState  # the cache and processor state, B * W rows (row b * W + j: prompt b's beam j)
    run: Hyps
    fin: Hyps
    open: jax.Array  # [B] bool: the heuristic says the hypotheses may still improve
    done: jax.Array  # [B] bool: the prompt's search has ended (its hypotheses are frozen)
    steps: jax.Array  # [B] int32: steps the prompt's search ran


def warped(x: Float[Array, "R V"], settings: RowSettings, use: Bool[Array, " R"], n_valid: int) -> Float[Array, "R V"]:
    """Processed log-probs [R, V] -> temperature, top-k, top-p and min-p applied where use [R] (beam sampling,
    as transformers applies its warpers to the log-probs); -inf where filtered. Computed only if some row samples."""
    r, v = x.shape
    rows = min_rows(r, v)

    def warp():
        padded = jax.tree.map(lambda a: pad_rows(a, rows), settings)
        return jnp.where(use[:, None], sampling.filter_logits(pad_rows(x, rows), padded, n_valid)[:r], x)

    return jax.lax.cond(jnp.any(use), warp, lambda: x)


def gumbel(keys: Key[Array, " R"], v: int, use: Bool[Array, " R"]) -> Float[Array, "R V"]:
    """[R] row keys -> [R, V] Gumbel noise, each row from its own key only (0 where use [R] is False; nothing
    is drawn when no row samples)."""
    noise = lambda: jnp.where(use[:, None], jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys), 0.0)
    return jax.lax.cond(jnp.any(use), noise, lambda: jnp.zeros((keys.shape[0], v)))


def scores(
    d: DecodeState, rules: Rules, b: BeamRules, t, config: GPT2Config, W: int
) -> tuple[Float[Array, "B*W V"], Float[Array, "B*W V"]]:
    """Each beam row's raw log-probs [B * W, V] and its next-token scores: the processors on the log-probs (as
    transformers' beam search applies them), the warpers for a sampling prompt, -inf in padding vocab columns."""
    rows = lambda x: jnp.repeat(x, W, axis=0)  # a prompt's setting for each of its beam rows
    logp = log_probs(d.logits)
    stop, v = rules.stop, logp.shape[-1]
    tables = rules.constraint._replace(group=rows(rules.constraint.group))
    allowed = jax.lax.cond(jnp.any(d.automaton > 0),
                           lambda: automata.allowed(tables, d.automaton, rows(stop.eos_id)),
                           lambda: jnp.ones(logp.shape, bool))  # fmt: skip
    x = apply_processors(logp, jax.tree.map(rows, rules.processors), d.history, d.cache.lengths,
                         jnp.full(logp.shape[0], t, jnp.int32), rows(stop_ids(rules)), allowed)  # fmt: skip
    x = warped(x, jax.tree.map(rows, rules.settings), rows(b.sample), config.valid_vocab)
    return logp, jnp.where(jnp.arange(v) < config.valid_vocab, x, -jnp.inf)


def stop_ids(rules: Rules) -> Int[Array, "B M"]:
    """[B, 1 + MAX_STOP_IDS] each prompt's EOS and stop ids (-1: none), the tokens that end a hypothesis."""
    return jnp.concatenate([rules.stop.eos_id[:, None], rules.stop.stop_ids], axis=1)


def noise(d: DecodeState, b: BeamRules, W: int) -> Float[Array, "B W*V"]:
    """[B, W * V] Gumbel noise for the sampling prompts (0 for the others): beam j of a prompt draws from
    fold_in(fold_in(its key, position), j), its own bits whatever W or the batch."""
    B = b.beams.shape[0]
    keys = jax.vmap(jax.random.fold_in)(d.keys, d.cache.lengths)
    keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.arange(W), B))
    return gumbel(keys, d.logits.shape[-1], jnp.repeat(b.sample, W)).reshape(B, -1)


def follow(params: Params, d: DecodeState, rules: Rules, parent: Int[Array, " B*W"], token: Int[Array, " B*W"],
           config: GPT2Config, hooks=None) -> DecodeState:  # fmt: skip
    """The new beams' rows: each takes its parent's cache row, processor and constraint state (parent [B * W],
    one gather), records its token [B * W] and runs it through the model."""
    W = parent.shape[0] // rules.stop.eos_id.shape[0]
    tables = rules.constraint._replace(group=jnp.repeat(rules.constraint.group, W))
    gather = lambda x: jnp.take(x, parent, axis=0)
    cache = d.cache._replace(k=jnp.take(d.cache.k, parent, axis=1), v=jnp.take(d.cache.v, parent, axis=1))
    history = update_state(jax.tree.map(gather, d.history), token, d.cache.lengths, jnp.ones(parent.shape, bool))
    automaton = automata.advance(tables, gather(d.automaton), token)
    return feed(params, d._replace(cache=cache, history=history, automaton=automaton), token, config, hooks)


def step(params: Params, state: BeamState, rules: Rules, b: BeamRules, t, config: GPT2Config, c: int, hooks=None):
    """One beam-search step for every prompt -> (state, the running beams' tokens, parents, scores [B, W])."""
    B, W = state.run.score.shape
    V = state.decode.logits.shape[-1]
    logp, x = scores(state.decode, rules, b, t, config, W)
    acc = (x.reshape(B, W, V) + state.run.score[:, :, None]).reshape(B, W * V)
    vals, rank, idx = candidates(acc, noise(state.decode, b, W), c, b.kept, b.sample & (b.beams == 1))
    logprob = jnp.take_along_axis(logp.reshape(B, W * V), idx, axis=1)
    ch = choose(state.run, state.fin, state.open, state.done, b, t, vals, rank, idx, logprob, stop_ids(rules), V)
    d = follow(params, state.decode, rules, (jnp.arange(B)[:, None] * W + ch.parent).reshape(-1),
               ch.run.tokens[:, :, t].reshape(-1), config, hooks)  # fmt: skip
    live = ~state.done[:, None] & (jnp.arange(W) < b.beams[:, None])
    trace = (jnp.where(live, ch.run.tokens[:, :, t], -1), jnp.where(live, ch.parent, -1),
             jnp.where(live, ch.scores, -jnp.inf))  # fmt: skip
    return BeamState(d, ch.run, ch.fin, ch.open, ch.done, jnp.where(state.done, state.steps, t + 1)), trace


def expand(d: DecodeState, W: int) -> DecodeState:
    """A prefilled state of B prompts -> B * W rows, each prompt's row repeated for its beams (the cache too)."""
    idx = jnp.repeat(jnp.arange(d.logits.shape[0]), W)
    cache = d.cache._replace(k=jnp.take(d.cache.k, idx, axis=1), v=jnp.take(d.cache.v, idx, axis=1),
                             lengths=d.cache.lengths[idx])  # fmt: skip
    return jax.tree.map(lambda x: x[idx], d._replace(cache=None))._replace(cache=cache)


def init(d: DecodeState, b: BeamRules, W: int, N: int) -> BeamState:
    """The state before the first step: each prompt's row repeated for its W beams (see beam_hyps.start)."""
    run, fin = start(b, W, N)
    no = jnp.zeros(b.beams.shape[0], bool)
    return BeamState(expand(d, W), run, fin, ~no, no, jnp.zeros(b.beams.shape[0], jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "capacity", "width", "c", "steps", "hooks"))
def search(params: Params, tokens: Int[Array, "B P"], lengths: Int[Array, " B"], keys: Key[Array, " B"], rules: Rules,
           b: BeamRules, config: GPT2Config, capacity: int, width: int, c: int, steps: int,
           hooks=None) -> tuple[Hyps, Trace, Int[Array, " B"]]:  # fmt: skip
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
