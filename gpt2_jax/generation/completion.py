"""Text in, text out: `complete` encodes prompts, runs `generate`, and cuts each completion as OpenAI does.

The text ends just before a stop string that completed (which may end inside a token), and never
includes the token that stopped the row (EOS or a stop id). Logprobs stay per token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.generation.chunks import encoding
from gpt2_jax.generation.generator import GenerateResult, generate, settings_rows
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.params import SamplingParams


class Completion(NamedTuple):
    text: str  # the generated text, cut before a stop string, without a stopping EOS / stop id
    tokens: list  # the generated token ids, the stopping token included
    finish_reason: str  # "stop" or "length"
    stop: str | None  # the stop string that matched, if any
    logprobs: list | None  # log p(token) per token of `tokens`, under the raw logits
    top_logprobs: list | None  # per token: {token id: logprob} of the most likely ids (raw logits)


def completions(result: GenerateResult, enc: Any, stop_ids: list[set[int]]) -> list[Completion]:
    """A GenerateResult -> one Completion per row (text decoded with enc, a tiktoken Encoding); stop_ids[b]:
    the tokens that end row b (its EOS and stop ids), left out of its text."""
    out = []
    for b in range(len(result.lengths)):
        n = int(result.lengths[b])
        tokens = result.tokens[b, :n].tolist()
        stop = result.stop_string[b] if result.stop_string else None
        shown = tokens
        if (
            result.finish_reason
            and result.finish_reason[b] == "stop"
            and stop is None
            and tokens
            and tokens[-1] in stop_ids[b]
        ):
            shown = tokens[:-1]  # EOS or a stop id: not part of the text
        data = b"".join(enc.decode_single_token_bytes(t) for t in shown)
        if stop is not None:
            data = data[: data.find(stop.encode("utf-8"))]  # the first occurrence is the one that stopped the row
        logprobs = result.logprobs[b, :n].tolist() if result.logprobs is not None else None
        top = None
        if result.top_ids is not None and result.top_logprobs is not None:
            top = [
                dict(zip(ids.tolist(), lp.tolist()))
                for ids, lp in zip(result.top_ids[b, :n], result.top_logprobs[b, :n])
            ]
        reason = result.finish_reason[b] if result.finish_reason else "length"
        out.append(Completion(data.decode("utf-8", errors="replace"), tokens, reason, stop, logprobs, top))
    return out


def complete(params: Params, config: GPT2Config, prompts: str | list[str], key: Any = None, *,
             sampling: SamplingParams | list[SamplingParams] | None = None, tokenizer: Any = None, draft: Any = None,
             num_speculative_tokens: int = 4, hooks: Any = None, **settings: Any) -> list[Completion]:  # fmt: skip
    """Prompt texts (one string or a list) -> one Completion per prompt. sampling and the keyword settings are
    generate's (max_new_tokens=40, stop=["\\n\\n"], constraint=..., top_logprobs=N, ...); in the keyword form
    logprobs are returned unless logprobs=False."""
    enc = encoding(tokenizer)
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not all(isinstance(t, str) for t in texts):
        raise InputError("complete takes prompt text (a str or a list of str); use generate for token ids")
    ids = [enc.encode(t, allowed_special={"<|endoftext|>"}) or [enc.eot_token] for t in texts]
    if sampling is None and "logprobs" not in settings and "return_logprobs" not in settings:
        settings["logprobs"] = True
    rows = settings_rows(sampling, len(ids), settings)
    result = generate(params, config, ids, key, sampling=rows, tokenizer=enc, draft=draft,
                      num_speculative_tokens=num_speculative_tokens, hooks=hooks)  # fmt: skip
    ends = [set(r.stop_ids) | ({eos} if (eos := r.eos(config)) is not None else set()) for r in rows]
    return completions(result, enc, ends)
