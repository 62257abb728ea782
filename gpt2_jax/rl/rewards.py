"""Rewards on text: a Python callable (prompt, completion) -> float, two built-ins and the CLI's spec strings.

regex:PATTERN          the number of non-overlapping matches of PATTERN in the completion (re.MULTILINE:
                       ^ and $ match at every line), e.g. regex:'^[A-Z][A-Z ]+:$' counts speaker lines
length:N               -|len(completion) - N| / N: 0 at N characters, lower the further away
python:MODULE:FUNC     FUNC(prompt, completion) -> float from an importable module or a .py file
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from gpt2_jax.errors import GPT2JaxError

Reward = Callable[[str, str], float]  # (prompt text, completion text) -> reward
KINDS = ("regex:PATTERN", "length:N", "python:MODULE:FUNCTION")


class RewardError(GPT2JaxError):
    """A reward spec that does not parse, or a reward function that fails or returns no finite number."""


def regex_reward(pattern: str) -> Reward:
    """The number of non-overlapping matches of pattern in the completion (re.MULTILINE)."""
    try:
        compiled = re.compile(pattern, re.MULTILINE)
    except re.error as e:
        raise RewardError(f"regex reward {pattern!r} does not compile: {e}") from None

    def reward(prompt: str, completion: str) -> float:
        return float(sum(1 for _ in compiled.finditer(completion)))

    reward.__name__ = f"regex:{pattern}"
    return reward


def length_reward(target: int) -> Reward:
    """-|len(completion) - target| / target, in characters: 0 at the target length."""
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise RewardError(f"length reward target must be an int >= 1 (characters), got {target!r}")

    def reward(prompt: str, completion: str) -> float:
        return -abs(len(completion) - target) / target

    reward.__name__ = f"length:{target}"
    return reward


def _python_reward(spec: str) -> Reward:
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise RewardError(f"--reward python:{spec}: expected python:MODULE:FUNCTION (or python:FILE.py:FUNCTION)")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise RewardError(f"--reward python:{spec}: {path} is not a file")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or loader.loader is None:
                raise RewardError(f"--reward python:{spec}: {path} cannot be loaded as a module")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardError:
        raise
    except Exception as e:  # the user's module may raise anything while importing
        raise RewardError(f"--reward python:{spec}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"--reward python:{spec}: {where} has no function {name!r}")
    return cast(Reward, fn)  # the user's function, taken at its word: (prompt, completion) -> float


def parse_reward(spec: str) -> Reward:
    """A spec string (see the module docstring) -> the reward function."""
    kind, sep, rest = spec.partition(":")
    if kind == "regex" and sep and rest:
        return regex_reward(rest)
    if kind == "length" and sep:
        try:
            target = int(rest)
        except ValueError:
            raise RewardError(f"--reward {spec}: the length target must be an integer, got {rest!r}") from None
        return length_reward(target)
    if kind == "python" and sep:
        return _python_reward(rest)
    raise RewardError(f"--reward {spec!r} is none of {', '.join(KINDS)}")


def score(reward: Reward, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
    """[B] float64 rewards, one per (prompt, completion); RewardError names the row a failure came from."""
    out = np.empty(len(completions), np.float64)
    name = getattr(reward, "__name__", repr(reward))
    for b, (p, c) in enumerate(zip(prompts, completions)):
        try:
            value = reward(p, c)
        except Exception as e:  # a user's function: report which row, keep the message
            raise RewardError(f"reward {name} raised {type(e).__name__} on completion {b}: {e}") from None
        try:
            out[b] = float(value)
        except (TypeError, ValueError):
            out[b] = math.nan
        if not math.isfinite(out[b]):
            raise RewardError(f"reward {name} returned {value!r} for completion {b}; a reward must be a finite number")
    return out
