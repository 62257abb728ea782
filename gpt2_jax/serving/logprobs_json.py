"""Logprobs as OpenAI's legacy completions JSON: token strings, their logprobs, the top alternatives and text
offsets, and the echoed prompt's logprobs from gpt2_jax's scoring."""

from __future__ import annotations

import math
from typing import Any

from gpt2_jax.generation import prompt_logprobs as score_prompts


def number(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no -Infinity


def logprobs_object(enc: Any, tokens: list, logprobs: list, tops: list, offset: int) -> dict:
    """OpenAI's legacy logprobs: token strings, their logprobs, the top alternatives and character offsets
    (into the choice's text). A None logprob (an echoed first prompt token) stays None."""
    strings = [enc.decode([t]) for t in tokens]
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    top = [None if t is None else {enc.decode([i]): number(v) for i, v in zip(*t)} for t in tops]
    return {"tokens": strings, "token_logprobs": [None if v is None else number(v) for v in logprobs],
            "top_logprobs": top, "text_offset": offsets}  # fmt: skip


def prompt_logprobs(params: Any, config: Any, ids: list[int], top_n: int) -> tuple[list, list]:
    """A prompt's echo: (logprobs, top) per prompt token, the first None, from gpt2_jax's scoring, so each is the
    logprob generate would report had it sampled that token there (lm-eval's loglikelihood), bit for bit."""
    scores = score_prompts(params, config, [ids], max(top_n, 1))
    assert scores.top_ids is not None and scores.top_logprobs is not None, "asked for at least one"
    tops = [None] + [(i[:top_n], v[:top_n]) for i, v in zip(scores.top_ids[0][1:], scores.top_logprobs[0][1:])]
    return scores.logprobs[0], tops
