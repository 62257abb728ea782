"""The request bodies (/v1/completions, /tokenize, /detokenize) and OpenAI-shaped errors."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import ErrorDetails

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.serving.engine import Cancelled, QueueFull


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 3.0 is one (strict mode would refuse it); 3.5, "3" and true stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share: OpenAI's, and vLLM's (and llama-server's) names
    for the settings OpenAI lacks (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
    skip_special_tokens) and for constrained output (regex, choice, json_schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens
    temperature: float | None = None
    top_p: float | None = None
    n: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_schema: dict[str, Any] | None = None
    # gpt2_jax's: false keeps this request out of speculative decoding (on a server started with it)
    speculative: bool | None = None


class CompletionRequest(SamplingFields):
    """OpenAI's /v1/completions body (SamplingFields, and what only completions have: the prompt, legacy logprobs,
    echo, best_of and vLLM's beam search)."""

    prompt: str | list[str] | list[Int] | list[list[Int]] | None = None
    logprobs: Int | None = None
    echo: bool | None = None
    best_of: Int | None = None
    suffix: str | None = None
    use_beam_search: bool | None = None  # vLLM's (legacy) beam search: best_of beams, the n best returned
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: text -> its token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    model: str | None = None
    add_special_tokens: bool | None = None  # accepted for vLLM's clients; GPT-2 adds none


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body: token ids -> their text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[Int]
    model: str | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Logprobs(BaseModel):
    """OpenAI's legacy logprobs object: per token its string, logprob, top alternatives and text offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A completion (and, streamed, each server-sent event's JSON: choices with text deltas)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    seed: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every error answers, as OpenAI's API does."""

    error: ErrorDetail


# gpt2_jax's names for settings, as the API calls them (errors name the API's field)
_PARAM_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "stop_ids": "stop_token_ids",
}


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                             408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             503: "server_error"}.get(status, "server_error")  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: Any = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_SETTINGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stop",
    "max_tokens",
    "min_tokens",
    "stop_token_ids",
    "logprobs",
    "prompt",
    "regex",
    "choice",
    "json_schema",
)


def _guess_param(message: str) -> str | None:
    """The request field a gpt2_jax error message is about: the first setting it names."""
    names = {**{f: f for f in _SETTINGS}, **_PARAM_NAMES, "token id": "prompt", "stop string": "stop"}
    hits = [(m.start(), name) for name in names if (m := re.search(rf"\b{re.escape(name)}\b", message))]
    return names[min(hits)[1]] if hits else None


def from_gpt2_jax(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), code="queue_full")
    if isinstance(e, Cancelled):
        return ApiError(503, f"request cancelled: {e}", code="cancelled")
    if isinstance(e, GPT2JaxError):
        message = str(e)
        for ours, theirs in _PARAM_NAMES.items():
            message = message.replace(ours, theirs)
        code = "context_length_exceeded" if "max_seq" in message or "n_positions" in message else None
        return ApiError(400, message, param=_guess_param(str(e)), code=code)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}")


def from_validation(errors: Sequence[ErrorDetails], body: type[BaseModel] = CompletionRequest) -> ApiError:
    """pydantic's errors (validating `body`) -> one 400 naming the first bad field."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e['msg']}", code="invalid_json")
    if e["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {'.'.join(loc)!r}; accepted fields: {', '.join(body.model_fields)}",
                        param=loc[0] if loc else None, code="unknown_field")  # fmt: skip
    if e["type"] == "model_type" and not loc:
        return ApiError(400, "the body must be a JSON object")
    if loc and loc[0] == "prompt":
        return ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists", param="prompt")  # fmt: skip
    field = loc[0] if loc else None
    return ApiError(400, f"{'.'.join(loc) or 'body'}: {e['msg']}", param=field)
