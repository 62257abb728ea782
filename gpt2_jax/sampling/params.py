"""SamplingParams: everything one request sets, checked in one place, the one value settings travel in.

`generate`, `complete`, the serving engine, the HTTP API's request body and the CLI's flags all map onto it
(vLLM's SamplingParams, transformers' GenerationConfig). A batch takes one for every row or one per row;
a setting's off value (temperature 1, top_k 0, top_p 1, penalties 0 or 1, no words, no constraint) leaves
that row's logits exactly as they were, so rows with different settings share one compiled program.

Checked here, at construction: every type and range that does not depend on the model. Token ids are
checked against the vocabulary when a batch is packed (`check(config)`), since only then is it known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpt2_jax.errors import ConfigError

MAX_NGRAM = 16  # the longest n-gram no_repeat_ngram_size may ban (a static window of the decode loop)
MAX_TOP_LOGPROBS = 20  # R: top logprobs are computed this wide whenever asked for, then cut on the host
MAX_STOP_IDS = 8  # stop ids are padded to this count, so their number never changes a shape
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries per row, as OpenAI's API allows
MAX_BAD_WORDS = 256  # sequences per row


def _finite(v):
    return np.isfinite(v)


# name -> (dtype, what is allowed, the rule): the one table every scalar setting is checked against.
RULES: dict[str, tuple[Any, str, Any]] = {
    "max_new_tokens": (np.int32, "an int >= 1", lambda v: v >= 1),
    "temperature": (np.float32, "a finite number >= 0 (0 means greedy)", lambda v: _finite(v) & (v >= 0)),
    "top_k": (np.int32, "an integer >= 0 (0 means off)", lambda v: v >= 0),
    "top_p": (np.float32, "a number in (0, 1] (1 means off)", lambda v: (v > 0) & (v <= 1)),
    "min_p": (np.float32, "a number in [0, 1] (0 means off)", lambda v: (v >= 0) & (v <= 1)),
    "repetition_penalty": (np.float32, "a finite number > 0 (1 means off)", lambda v: _finite(v) & (v > 0)),
    "frequency_penalty": (np.float32, "a number in [-2, 2] (0 means off)", lambda v: (v >= -2) & (v <= 2)),
    "presence_penalty": (np.float32, "a number in [-2, 2] (0 means off)", lambda v: (v >= -2) & (v <= 2)),
    "no_repeat_ngram_size": (np.int32, f"an integer in [0, {MAX_NGRAM}] (0 means off)", lambda v: (v >= 0) & (v <= MAX_NGRAM)),
    "min_new_tokens": (np.int32, "an integer >= 0 (0 means off)", lambda v: v >= 0),
    "top_logprobs": (np.int32, f"an int in [0, {MAX_TOP_LOGPROBS}]", lambda v: (v >= 0) & (v <= MAX_TOP_LOGPROBS)),
}  # fmt: skip


# The same ranges as JSON-schema bounds, for the documents that describe these settings (the server's OpenAPI).
BOUNDS: dict[str, dict] = {
    "max_new_tokens": {"minimum": 1},
    "temperature": {"minimum": 0},
    "top_k": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "no_repeat_ngram_size": {"minimum": 0, "maximum": MAX_NGRAM},
    "min_new_tokens": {"minimum": 0},
    "top_logprobs": {"minimum": 0, "maximum": MAX_TOP_LOGPROBS},
}


def check_values(name: str, value: Any, batch_size: int | None = None) -> np.ndarray:
    """Check one setting against RULES -> it as an array. A scalar, or (batch_size given) one value per row
    [B]; the dtype must be an integer (or a float, for the float settings), and NaN fails every rule.
    ConfigError names the setting, and the row: "temperature[1] must be ..."."""
    dtype, allowed, ok = RULES[name]
    v = np.asarray(value)
    if v.ndim > 1 or (v.ndim == 1 and (batch_size is None or v.shape[0] != batch_size)):
        want = "a scalar" if batch_size is None else f"a scalar or one value per row (shape ({batch_size},))"
        raise ConfigError(f"{name} must be {want}, got shape {v.shape}")
    floats = dtype == np.float32
    integral = np.issubdtype(v.dtype, np.integer)
    if v.dtype == bool or not (integral or (floats and np.issubdtype(v.dtype, np.floating))):
        raise ConfigError(f"{name} must be {allowed}, got {value!r} of dtype {v.dtype}")
    bad = np.flatnonzero(~np.atleast_1d(ok(v.astype(np.float64))))
    if bad.size:
        where = f"{name}[{bad[0]}]" if v.ndim else name
        raise ConfigError(f"{where} must be {allowed}, got {np.atleast_1d(v)[bad[0]].item()!r}")
    return v


def _token_ids(name: str, ids: Any) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray):
        raise ConfigError(f"{name} must be a list of token ids, got {ids!r}")
    out = tuple(ids)
    for t in out:
        if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"{name}: token id {t!r} must be an int >= 0")
    return tuple(int(t) for t in out)


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
            if not isinstance(self.logit_bias, Mapping):
                raise ConfigError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ConfigError(
                    f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported"
                )
            bias = {}
            for t, x in self.logit_bias.items():
                t = int(t) if isinstance(t, str) and t.isdigit() else t  # JSON keys are strings
                if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 0:
                    raise ConfigError(f"logit_bias: token id {t!r} must be an int >= 0")
                if not isinstance(x, int | float | np.number) or isinstance(x, bool) or not -100 <= float(x) <= 100:
                    raise ConfigError(f"logit_bias[{t}] = {x!r}: a bias must be a number in [-100, 100]")
                bias[int(t)] = float(x)
            set_(self, "logit_bias", bias or None)
        words = self.bad_words_ids or ()
        if isinstance(words, (str, bytes)) or not isinstance(words, Sequence | np.ndarray):
            raise ConfigError(f"bad_words_ids must be a list of token-id sequences, got {words!r}")
        words = tuple(_token_ids("bad_words_ids", w) for w in words)
        if any(not w for w in words):
            raise ConfigError("bad_words_ids: each banned word must be a non-empty list of token ids")
        if len(words) > MAX_BAD_WORDS:
            raise ConfigError(f"bad_words_ids has {len(words)} sequences; at most {MAX_BAD_WORDS} are supported")
        set_(self, "bad_words_ids", words)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > MAX_STOP_STRINGS:
            raise ConfigError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError(
                f"a stop string must be a non-empty str, got {next(s for s in stop if not isinstance(s, str) or not s)!r}"
            )
        set_(self, "stop", stop)
        ids = _token_ids("stop_ids", self.stop_ids or ())
        if len(ids) > MAX_STOP_IDS:
            raise ConfigError(f"at most {MAX_STOP_IDS} stop_ids are supported, got {len(ids)}")
        set_(self, "stop_ids", ids)
        eos = self.eos_id
        if not (
            eos is None
            or eos == "config"
            or (isinstance(eos, int | np.integer) and not isinstance(eos, bool) and eos >= 0)
        ):
            raise ConfigError(f"eos_id must be 'config', a token id >= 0 or None, got {eos!r}")
        if self.constraint is not None:
            from gpt2_jax.sampling.constraints import Constraint

            if not isinstance(self.constraint, Constraint):
                raise ConfigError(
                    f"constraint must be a gpt2_jax.sampling.constraints object (regex, choice, json_schema), got {self.constraint!r}"
                )
        if not isinstance(self.logprobs, bool | np.bool_):
            raise ConfigError(f"logprobs must be True or False, got {self.logprobs!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int | np.integer) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32
        ):
            raise ConfigError(f"seed must be an int in [0, 2**32) or None, got {self.seed!r}")
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
        return config.eos_id if self.eos_id == "config" else self.eos_id

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
