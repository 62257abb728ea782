"""SamplingParams: everything one request sets, checked in one place, the one value settings travel in.

`generate`, `complete`, the serving engine, the HTTP API's request body and the CLI's flags all map onto it
(vLLM's SamplingParams, transformers' GenerationConfig). A batch takes one for every row or one per row;
a setting's off value (temperature 1, top_k 0, top_p 1, penalties 0 or 1, no words, no constraint) leaves
that row's logits exactly as they were, so rows with different settings share one compiled program.

Checked at construction (the checks are sampling.checks'): every type and range that does not depend on the
model. Token ids are checked against the vocabulary when a batch is packed (`check(config)`), since only then
is it known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling.checks import (
    RULES,
    check_scalars,
    check_values,
    checked_bad_words,
    checked_logit_bias,
    checked_stop,
    checked_stop_ids,
)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request sets; every field's off value changes nothing.

    max_new_tokens                 tokens to generate at most (the stopping token included)
    temperature, top_k, top_p, min_p   the warpers, in transformers' order (temperature 0: greedy)
    repetition_penalty             transformers' (prompt + output; 1 = off)
    frequency_penalty, presence_penalty   OpenAI's (output only; 0 = off)
    logit_bias                     {token id: bias in [-100, 100]} added to the logits first
    bad_words_ids                  token sequences never to complete
    no_repeat_ngram_size           never repeat an n-gram of prompt + output (0 = off)
    min_new_tokens                 hold back EOS and the stop ids until this many tokens
    stop                           stop strings: the row ends at the token completing one, the text is cut before it
    stop_ids                       more token ids that end the row
    eos_id                         "config" (the checkpoint's eos_token_id), an id, or None (never stop on EOS)
    constraint                     a gpt2_jax.sampling.constraints object: only text it matches
    logprobs                       return log p(token) per generated token (under the raw logits)
    top_logprobs                   and the N <= 20 most likely alternatives at each step
    seed                           the row's PRNG key is fold_in(jax.random.key(seed), row) (a key given to
                                   generate applies to rows without a seed)
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    eos_id: int | str | None = "config"
    constraint: Any = None
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None

    def __post_init__(self):
        for name in RULES:
            check_values(name, getattr(self, name))
        set_ = object.__setattr__  # frozen: normalise once, here
        if self.logit_bias is not None:
            set_(self, "logit_bias", checked_logit_bias(self.logit_bias))
        set_(self, "bad_words_ids", checked_bad_words(self.bad_words_ids))
        set_(self, "stop", checked_stop(self.stop))
        set_(self, "stop_ids", checked_stop_ids(self.stop_ids))
        check_scalars(self.eos_id, self.constraint, self.logprobs, self.seed)
        for name in ("max_new_tokens", "top_k", "no_repeat_ngram_size", "min_new_tokens", "top_logprobs"):
            set_(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            set_(self, name, float(getattr(self, name)))

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def eos(self, config: Any) -> int | None:
        """The EOS this row stops on, for this model: eos_id, or the checkpoint's for "config"."""
        return config.eos_id if isinstance(self.eos_id, str) else self.eos_id  # the one str allowed: "config"

    def check(self, vocab: int, eos: int | None) -> None:
        """The checks that need the model: every token id (eos: this row's EOS, see `eos`) inside the vocab."""
        ids = [("logit_bias", t) for t in (self.logit_bias or {})] + [("stop_ids", t) for t in self.stop_ids]
        ids += [("bad_words_ids", t) for w in self.bad_words_ids for t in w]
        ids += [] if eos is None else [("eos_id", eos)]
        for name, t in ids:
            if t >= vocab:
                raise ConfigError(f"{name}: token id {t} must be an int in [0, {vocab})")
        if self.constraint is not None and eos is None:
            raise ConfigError(
                "a constraint needs an EOS id to end on (its accepting states allow only EOS); pass eos_id=50256"
            )


FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
# Settings that take one list per row in the keyword form (a plain list is already one value of theirs).
_LISTS = {"bad_words_ids", "stop", "stop_ids"}


def sampling_rows(sampling: Any, batch_size: int, settings: Mapping[str, Any]) -> list[SamplingParams]:
    """generate's `sampling=` (one SamplingParams, or one per row) or its keyword settings -> one
    SamplingParams per row. Keyword settings are sugar: each is one value for every row, or one per row
    (an array or list of B values; for logit_bias, bad_words_ids, stop, stop_ids and constraint a list of B
    entries), and build the same rows."""
    if sampling is not None:
        if settings:
            raise ConfigError(
                f"pass either sampling= or keyword settings, not both (got {', '.join(sorted(settings))})"
            )
        rows = list(sampling) if isinstance(sampling, Sequence) else [sampling] * batch_size
        if len(rows) != batch_size:
            raise ConfigError(
                f"sampling given per row must have one SamplingParams per prompt ({batch_size}), got {len(rows)}"
            )
        for r in rows:
            if not isinstance(r, SamplingParams):
                raise ConfigError(f"sampling must be a gpt2_jax.SamplingParams (or a list of them), got {r!r}")
        return rows
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)}; the settings are SamplingParams' fields: {', '.join(FIELDS)}"
        )
    shared, per_row = {}, {}
    for name, value in settings.items():
        if name in RULES:
            v = check_values(name, value, batch_size)  # names the row: temperature[1]
            (per_row if v.ndim else shared)[name] = v.tolist() if v.ndim else value
        elif _is_per_row(name, value, batch_size):
            per_row[name] = list(value)
            if len(per_row[name]) != batch_size:
                raise ConfigError(
                    f"{name} given per row must have one entry per prompt ({batch_size}), got {len(per_row[name])}"
                )
        else:
            shared[name] = value
    return [SamplingParams(**shared, **{k: v[b] for k, v in per_row.items()}) for b in range(batch_size)]


def _is_per_row(name: str, value: Any, batch_size: int) -> bool:
    """Whether a structured setting was given one entry per row."""
    if isinstance(value, (str, bytes, Mapping)) or value is None or not isinstance(value, Sequence | np.ndarray):
        return False
    value = list(value)
    if name == "logit_bias" or name == "constraint":
        return True  # a list (not a dict / a Constraint): one per row
    if name == "logprobs" or name == "eos_id" or name == "seed":
        return True
    if name in _LISTS:
        # stop: a list of strings is one row's; a list of lists (or None) is per row. The same for token ids.
        inner = str if name == "stop" else int | np.integer
        if name == "bad_words_ids":
            return any(
                w is None or (isinstance(w, Sequence) and w and not isinstance(w[0], int | np.integer)) for w in value
            )
        return any(x is None or not isinstance(x, inner) for x in value)
    return False
