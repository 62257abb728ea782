"""beam_search: transformers' beam search (and beam sampling) in one jitted loop; prompts in, hypotheses out.

`beam_search` checks the prompts and settings on the host and runs gpt2_jax.generation.beam_loop.search: the
prefill (generate's) and every step of every prompt in one jitted lax.while_loop over the fixed-size KV cache,
the choices made by gpt2_jax.generation.beam_hyps. Greedy beam search equals transformers'
generate(num_beams=..., do_sample=False, length_penalty=..., early_stopping=..., num_return_sequences=...)
token for token, with its sequences_scores.

The beam settings are beam_search's own arguments, not SamplingParams fields: they describe a search over
many cache rows per prompt and change the result's shape (R hypotheses per prompt), which generate, the
engine and the HTTP API's sampling path cannot honour. SamplingParams still carries everything a beam's
next-token scores go through (max_new_tokens, eos_id, stop_ids, the processors, the warpers when sampling,
a constraint, the seed), so the two paths share one checked value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from gpt2_jax.compiling import pow2_bucket, traced
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.batching import as_prompts, prepare
from gpt2_jax.generation.beam_hyps import BeamRules
from gpt2_jax.generation.beam_loop import search
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.checks import MAX_STOP_IDS
from gpt2_jax.sampling.params import SamplingParams, sampling_rows

MAX_BEAMS = 64


class BeamSteps(NamedTuple):
    """The running beams after each step, for looking at the search ([B, N, W]; W: the beams' bucket)."""

    tokens: np.ndarray  # [B, N, W] int32: the token beam j took at step t (-1: no such beam, or the search had ended)
    parents: np.ndarray  # [B, N, W] int32: the beam (of step t - 1) it extended
    scores: np.ndarray  # [B, N, W] float32: its cumulative score (sum of processed log-probs), -inf where none
    count: np.ndarray  # [B] int32: steps each prompt's search ran


class BeamResult(NamedTuple):
    tokens: np.ndarray  # [B, R, N] int32: each prompt's R best hypotheses, best first; past a length: EOS (or the last)
    lengths: np.ndarray  # [B, R] int32: generated tokens, the stopping token included (0: no such hypothesis)
    scores: np.ndarray  # [B, R] float32: transformers' sequences_scores, sum of log-probs / length ** length_penalty
    beam_indices: np.ndarray  # [B, R, N] int32: the beam (of the prompt's) each token extended, -1 past the end
    logprobs: np.ndarray  # [B, R, N] float32: log p(token) under the raw logits (as generate reports), 0 past the end
    finish_reason: list  # [B][R] "stop" (EOS or a stop id) or "length"
    steps: BeamSteps


def _per_row(name: str, value: Any, B: int) -> list:
    """A beam setting: one value for every prompt, or a list / array of one per prompt."""
    if isinstance(value, (list, tuple, np.ndarray)):
        value = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
        if len(value) != B:
            raise ConfigError(f"{name} given per prompt must have one entry per prompt ({B}), got {len(value)}")
        return value
    return [value] * B


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_beam_settings(B: int, num_beams, num_return_sequences, length_penalty, early_stopping, do_sample) -> dict:
    """Each beam setting, per prompt, checked -> {name: list of B values}. ConfigError names the setting (and the
    row, for one given per prompt): "num_beams[1] must be ..."."""
    given = {"num_beams": num_beams, "num_return_sequences": num_return_sequences, "length_penalty": length_penalty,
             "early_stopping": early_stopping, "do_sample": do_sample}  # fmt: skip
    out = {k: _per_row(k, v, B) for k, v in given.items()}
    for b in range(B):
        at = lambda name: f"{name}[{b}]" if isinstance(given[name], (list, tuple, np.ndarray)) else name
        k, r = out["num_beams"][b], out["num_return_sequences"][b]
        lp, es, ds = out["length_penalty"][b], out["early_stopping"][b], out["do_sample"][b]
        if not _is_int(k) or not 1 <= k <= MAX_BEAMS:
            raise ConfigError(f"{at('num_beams')} must be an int in [1, {MAX_BEAMS}], got {k!r}")
        if not _is_int(r) or not 1 <= r <= k:
            raise ConfigError(f"{at('num_return_sequences')} must be an int in [1, num_beams={k}], got {r!r}")
        if isinstance(lp, (bool, np.bool_)) or not isinstance(lp, (int, float, np.number)) or not np.isfinite(lp):
            raise ConfigError(f"{at('length_penalty')} must be a finite number, got {lp!r}")
        if isinstance(es, (bool, np.bool_)):
            out["early_stopping"][b] = bool(es)
        elif not (isinstance(es, str) and es == "never"):
            raise ConfigError(f"{at('early_stopping')} must be False, True or 'never', got {es!r}")
        if not isinstance(ds, (bool, np.bool_)):
            raise ConfigError(f"{at('do_sample')} must be True or False, got {ds!r}")
    return out


def _check_rows(rows: list[SamplingParams], sample: list) -> None:
    """What SamplingParams may set for a beam search: no stop strings (matched on the host, between calls),
    no top logprobs; a sampled search needs a temperature > 0."""
    for b, (s, ds) in enumerate(zip(rows, sample)):
        if s.stop:
            raise ConfigError(f"beam_search takes stop_ids, not stop strings (row {b} has stop={list(s.stop)!r})")
        if s.top_logprobs:
            raise ConfigError(f"beam_search returns each token's logprob, not top_logprobs (row {b} asks for "
                              f"{s.top_logprobs})")  # fmt: skip
        if ds and s.temperature == 0:
            raise ConfigError(f"do_sample=True needs a temperature > 0 (row {b} has temperature 0)")


def width(num_beams: list[int]) -> int:
    """W, the beam rows each prompt takes in the cache: the largest num_beams rounded up to a power of two."""
    return pow2_bucket(max(num_beams))


def beam_rules(beam: dict, rows: list[SamplingParams], config: GPT2Config, steps: int) -> BeamRules:
    """Checked beam settings and SamplingParams per prompt -> BeamRules (host arrays). length ** length_penalty
    is computed in float64 and rounded to float32, as the Python float transformers divides by."""
    lp = np.array(beam["length_penalty"], np.float64)
    n = np.arange(steps + 1, dtype=np.float64)
    norm = np.where(n[None, :] > 0, np.power(np.maximum(n, 1)[None, :], lp[:, None]), 1.0).astype(np.float32)
    es = beam["early_stopping"]
    k = np.array(beam["num_beams"], np.int32)
    n_stops = np.array([(s.eos(config) is not None) + len(s.stop_ids) for s in rows], np.int32)
    return BeamRules(
        beams=traced(k), norm=traced(norm),
        hopeful=traced(np.array([e == "never" for e in es]) & (lp > 0)),
        early=traced(np.array([e is True for e in es]) | (k == 1)),  # 1 beam: greedy search, as transformers
        sample=traced(np.array(beam["do_sample"], bool)),
        max_new=traced(np.array([s.max_new_tokens for s in rows], np.int32)),
        kept=traced(np.maximum(2, 1 + n_stops) * k),
    )  # fmt: skip


def beam_search(
    params: Params,
    config: GPT2Config,
    prompts: Any,
    key: Any = None,
    *,
    num_beams: int | list[int],
    num_return_sequences: int | list[int] = 1,
    length_penalty: float | list[float] = 1.0,
    early_stopping: bool | str | list = False,
    do_sample: bool | list[bool] = False,
    sampling: SamplingParams | list[SamplingParams] | None = None,
    hooks: Any = None,
    **settings: Any,
) -> BeamResult:
    """Prompts (lists of token ids, ragged) -> BeamResult: each prompt's num_return_sequences best hypotheses.

    num_beams: beams per prompt (1 is greedy search, as in transformers). length_penalty: a finished hypothesis
      scores sum(log-probs) / length ** length_penalty (> 0 favours longer ones). early_stopping: True stops a
      prompt once num_beams hypotheses are finished; False once the best running beam, at its current length,
      cannot beat the worst finished one; "never" only once no beam can, at its longest (transformers' rules).
      Each of these, num_return_sequences and do_sample is one value for every prompt or a list of one per prompt.
    do_sample: beam sampling, the candidates sampled without replacement from the scores after the warpers
      (SamplingParams' temperature, top_k, top_p, min_p); keyed like generate: fold_in(key, b) for prompt b,
      or one key per prompt, or each SamplingParams' seed. Without it the warpers are ignored and no key is needed.
    sampling / keyword settings: SamplingParams as in generate (max_new_tokens, eos_id, stop_ids, the
      processors, constraint, seed); the processors run on each beam's log-probs, as transformers' beam search
      applies them. Stop strings and top_logprobs are not taken.
    hooks: as in generate (steering every forward).

    One compiled program per bucket (prompt length, max_new_tokens, the beams' power-of-two bucket): a new
    num_beams inside its bucket, length_penalty, early_stopping or any SamplingParams value does not recompile.
    """
    prompts = as_prompts(prompts)
    B = len(prompts)
    beam = check_beam_settings(B, num_beams, num_return_sequences, length_penalty, early_stopping, do_sample)
    rows = sampling_rows(sampling, B, settings)
    _check_rows(rows, beam["do_sample"])
    sampled = any(beam["do_sample"])
    if sampled and key is None and any(s.seed is None for s in rows):
        raise ConfigError("beam sampling (do_sample=True) needs a key (jax.random.key(...)), or a seed in every row")
    prep = prepare(params, config, prompts, key if sampled else jax.random.key(0), rows, hooks)
    if prep.mesh is not None:
        raise ConfigError("beam_search runs on one device; its params must not be sharded over a mesh")
    batch = prep.batch
    W = width(beam["num_beams"])
    c = W * (2 if max((s.eos(config) is not None) + len(s.stop_ids) for s in rows) <= 1 else 2 + MAX_STOP_IDS)
    b = beam_rules(beam, rows, config, batch.steps)
    fin, trace, count = search(params, batch.tokens, batch.lengths, batch.keys, prep.rules, b, config, batch.capacity,
                               W, c, batch.steps, prep.hooks)  # fmt: skip
    n = int(max(s.max_new_tokens for s in rows))
    return _result(jax.device_get((fin, trace, count)), rows, beam["num_return_sequences"], config, n)


def _result(out, rows: list[SamplingParams], returned: list[int], config: GPT2Config, n: int) -> BeamResult:
    """The search's hypotheses [B, W] (host arrays) -> BeamResult of each prompt's first R."""
    fin, trace, count = out
    B, R = len(rows), max(returned)
    tokens = np.full((B, R, n), -1, np.int32)
    lengths = np.zeros((B, R), np.int32)
    scores = np.full((B, R), -np.inf, np.float32)
    parents, logprobs = np.full((B, R, n), -1, np.int32), np.zeros((B, R, n), np.float32)
    reasons = []
    for b, s in enumerate(rows):
        eos, stops = s.eos(config), set(s.stop_ids) | ({s.eos(config)} - {None})
        why = []
        for r in range(returned[b]):
            m = int(fin.length[b, r]) if fin.finished[b, r] else 0
            scores[b, r] = fin.score[b, r]
            lengths[b, r] = m
            tokens[b, r, :m], parents[b, r, :m] = fin.tokens[b, r, :m], fin.parents[b, r, :m]
            logprobs[b, r, :m] = fin.logprobs[b, r, :m]
            if m:
                tokens[b, r, m:] = eos if eos is not None else tokens[b, r, m - 1]
            why.append("stop" if m and int(tokens[b, r, m - 1]) in stops else "length")
        reasons.append(why)
    took, parent, score = (np.asarray(x)[:, :n] for x in trace)
    steps = BeamSteps(took, parent, score, np.asarray(count))
    return BeamResult(tokens, lengths, scores, parents, logprobs, reasons, steps)
