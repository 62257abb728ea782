"""POST /v1/chat/completions: messages -> a prompt through the server's chat template (serving/chat_template.py),
then the completions path (serving/completions.py) on that prompt, answered in chat's shape.

A chat request is a completion request whose prompt is the rendered text, tokenized as a completion prompt is
(<|endoftext|> written by the template is the special token): the same rows, keys and checks, so a chat
completion has exactly the tokens and logprobs of /v1/completions on its rendered prompt with the same seed.
What differs: the body (messages; logprobs a flag and top_logprobs a count), max_tokens' default (the rest of the
context, as OpenAI's chat has), and the answer (an assistant message, streamed as deltas, the role first;
logprobs as `content`: per token its string, logprob, bytes and top alternatives).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from gpt2_jax.sampling.checks import MAX_TOP_LOGPROBS
from gpt2_jax.serving.chat_schema import ChatRequest
from gpt2_jax.serving.chat_template import ChatTemplate, ChatTemplateError, TooLong
from gpt2_jax.serving.choices import Job
from gpt2_jax.serving.limits import max_token_bytes
from gpt2_jax.serving.schema import ApiError, CompletionRequest, SamplingFields, from_validation
from gpt2_jax.serving.streamed_text import Choice

UNLIKELY = -9999.0  # OpenAI's chat logprob for a token of probability 0 (JSON has no -Infinity)
NO_TEMPLATE = ("this server has no chat template: start it with --chat-template FILE (a Jinja template in "
               "HuggingFace's chat_template convention), or serve a model whose tokenizer_config.json has a "
               "chat_template")  # fmt: skip


def _messages(req: ChatRequest) -> list[dict]:
    """The messages as the template sees them: plain dicts, content parts joined into one string (vLLM's
    "string" content format), unset keys left out (as transformers' apply_chat_template leaves them)."""
    out = []
    for m in req.messages:
        content = m.content if not isinstance(m.content, list) else "".join(part.text for part in m.content)
        out.append({k: v for k, v in (("role", m.role), ("content", content), ("name", m.name)) if v is not None})
    return out


def _top_n(req: ChatRequest) -> int | None:
    """Chat's logprobs (a flag) and top_logprobs (a count) as the completions plan's top_n."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                       param="top_logprobs")  # fmt: skip
    return (req.top_logprobs or 0) if req.logprobs else None


def _token(enc: Any, t: int, logprob: float) -> dict:
    return {"token": enc.decode([t]), "logprob": logprob if math.isfinite(logprob) else UNLIKELY,
            "bytes": list(enc.decode_single_token_bytes(t))}  # fmt: skip


def content_logprobs(enc: Any, tokens: list[int], logprobs: list[float], tops: list[tuple[list, list]]) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = [{**_token(enc, t, lp), "top_logprobs": [_token(enc, i, v) for i, v in zip(*top)]}
               for t, lp, top in zip(tokens, logprobs, tops)]  # fmt: skip
    return {"content": content}


class ChatShape:
    """/v1/chat/completions' body and answer (the Shape serving/completions.py's CompletionShape describes)."""

    prefix, object, chunk_object, opens = "chatcmpl-", "chat.completion", "chat.completion.chunk", True
    default_max_tokens: int | None = None  # the rest of the context

    def __init__(self, template: ChatTemplate | None, enc: Any, max_seq: int):
        self.template, self.enc, self.max_seq = template, enc, max_seq

    def parse(self, raw: bytes) -> ChatRequest:
        try:
            return ChatRequest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = [str(x) for x in first.get("loc", ())]
            if loc[:1] == ["messages"] and "content" in loc and first["type"] != "extra_forbidden":
                where = f"messages[{loc[1]}].content" if len(loc) > 1 else "messages"
                raise ApiError(400, f"{where} must be a string or a list of text parts "
                                    '({"type": "text", "text": "..."}); this model reads text only',
                               param="messages") from None  # fmt: skip
            raise from_validation(e.errors(), ChatRequest) from None

    def request(self, req: ChatRequest) -> CompletionRequest:
        """The completion request on the rendered prompt (a worker thread: the template is code)."""
        if self.template is None:
            raise ApiError(400, NO_TEMPLATE, param="messages", code="no_chat_template")
        if not req.messages:
            raise ApiError(400, "messages is empty: give at least one message", param="messages")
        top_n = _top_n(req)
        limit = self.max_seq * max_token_bytes(self.enc)  # as a completion prompt's text is bounded
        try:
            text = self.template.render(_messages(req), req.add_generation_prompt is not False, limit)
        except TooLong:
            raise ApiError(400, f"the rendered chat prompt is over {limit} characters: more than fit in this "
                                f"server's max_seq={self.max_seq} tokens", param="messages",
                           code="context_length_exceeded") from None  # fmt: skip
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages", code="chat_template_error") from None
        shared = {name: getattr(req, name) for name in SamplingFields.model_fields}
        return CompletionRequest.model_construct(**shared, prompt=text, logprobs=top_n)

    def choice(self, job: Job, c: Choice, text: str) -> dict:
        lp = None if job.plan.top_n is None else content_logprobs(c.enc, c.tokens, c.logprobs, c.top)
        return {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                "finish_reason": c.finish}  # fmt: skip

    def chunk(self, job: Job, c: Choice, text: str, start: int, finish: str | None, first: bool,
              with_prompt: bool = False) -> dict:  # fmt: skip
        """A choice's delta: the role (and empty content) first, then content; logprobs of the new tokens."""
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        end = len(c.tokens)
        new = job.plan.top_n is not None and end > start
        lp = content_logprobs(c.enc, c.tokens[start:end], c.logprobs[start:end], c.top[start:end]) if new else None
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
