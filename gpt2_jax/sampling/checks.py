"""SamplingParams' checks: the limits, the one table of scalar rules (RULES, and BOUNDS for JSON schemas), and
one function per structured setting, each raising a ConfigError that names the setting (and the row)."""

from __future__ import annotations

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


def checked_logit_bias(logit_bias: Any) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]} (JSON's string keys read as ids) -> the map of ints to floats, or None."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise ConfigError(f"logit_bias must map token ids to biases, got {type(logit_bias).__name__}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ConfigError(f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported")
    bias = {}
    for t, x in logit_bias.items():
        t = int(t) if isinstance(t, str) and t.isdigit() else t  # JSON keys are strings
        if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"logit_bias: token id {t!r} must be an int >= 0")
        if not isinstance(x, int | float | np.number) or isinstance(x, bool) or not -100 <= float(x) <= 100:
            raise ConfigError(f"logit_bias[{t}] = {x!r}: a bias must be a number in [-100, 100]")
        bias[int(t)] = float(x)
    return bias or None


def checked_bad_words(words: Any) -> tuple[tuple[int, ...], ...]:
    """Token sequences never to complete -> a tuple of non-empty tuples of ids."""
    words = words or ()
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence | np.ndarray):
        raise ConfigError(f"bad_words_ids must be a list of token-id sequences, got {words!r}")
    words = tuple(_token_ids("bad_words_ids", w) for w in words)
    if any(not w for w in words):
        raise ConfigError("bad_words_ids: each banned word must be a non-empty list of token ids")
    if len(words) > MAX_BAD_WORDS:
        raise ConfigError(f"bad_words_ids has {len(words)} sequences; at most {MAX_BAD_WORDS} are supported")
    return words


def checked_stop(stop: Any) -> tuple[str, ...]:
    """One stop string or several -> a tuple of non-empty strings."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise ConfigError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError(
            f"a stop string must be a non-empty str, got {next(s for s in stop if not isinstance(s, str) or not s)!r}"
        )
    return stop


def checked_stop_ids(stop_ids: Any) -> tuple[int, ...]:
    ids = _token_ids("stop_ids", stop_ids or ())
    if len(ids) > MAX_STOP_IDS:
        raise ConfigError(f"at most {MAX_STOP_IDS} stop_ids are supported, got {len(ids)}")
    return ids


def check_scalars(eos: Any, constraint: Any, logprobs: Any, seed: Any) -> None:
    """eos_id, constraint, logprobs and seed: each of the type it must be."""
    if not (
        eos is None or eos == "config" or (isinstance(eos, int | np.integer) and not isinstance(eos, bool) and eos >= 0)
    ):
        raise ConfigError(f"eos_id must be 'config', a token id >= 0 or None, got {eos!r}")
    if constraint is not None:
        from gpt2_jax.sampling.constraints import Constraint

        if not isinstance(constraint, Constraint):
            raise ConfigError(
                f"constraint must be a gpt2_jax.sampling.constraints object (regex, choice, json_schema), got {constraint!r}"
            )
    if not isinstance(logprobs, bool | np.bool_):
        raise ConfigError(f"logprobs must be True or False, got {logprobs!r}")
    if seed is not None and (not isinstance(seed, int | np.integer) or isinstance(seed, bool) or not 0 <= seed < 2**32):
        raise ConfigError(f"seed must be an int in [0, 2**32) or None, got {seed!r}")
