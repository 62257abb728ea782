"""An OpenAI-compatible HTTP API over the serving engine: /v1/completions (plain and streamed),
/v1/models, /health and /metrics.

`create_app(engine, tokenizer, model_name)` returns a FastAPI app; `gpt2-jax serve` runs it with
uvicorn. Each prompt x choice of a request is one engine row: choice i (= prompt p * n + j) gets
the row key fold_in(key(seed), i), the key `generate` gives row i of [p_0]*n + [p_1]*n + ..., so a
served choice has exactly the tokens and logprobs of that generate call. A request without a seed
draws one and returns it (field "seed", header x-seed).

The engine reports on its own thread; each callback hands its event to the request's asyncio queue
with loop.call_soon_threadsafe. Validation, tokenizing and submission run in a worker thread, so a
slow request (a large JSON schema to compile) never holds up the event loop.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import json
import math
import re
import secrets
import sys
import threading
import time
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2_jax import constraints
from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.model import forward
from gpt2_jax.prompts import bucket
from gpt2_jax.serving.engine import Cancelled, Engine, QueueFull, Request

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW = 10  # seconds over which tokens_per_second is averaged
SEED_LIMIT = 2**32  # JAX (without x64) keys on a seed's low 32 bits: larger seeds would collide


# ---- the request body --------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: Optional[bool] = None


class CompletionRequest(BaseModel):
    """OpenAI's /v1/completions body, plus vLLM's names for the settings OpenAI lacks (top_k, min_p,
    repetition_penalty, min_tokens) and for constrained output (regex, choice, json_schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    json_schema: Optional[dict[str, Any]] = None


# gpt2_jax's names for settings, as the API calls them (errors name the API's field)
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}
_FIELDS = tuple(CompletionRequest.model_fields)


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 404: "invalid_request_error",
                             429: "rate_limit_error", 503: "server_error"}.get(status, "server_error")  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "logit_bias", "stop", "max_tokens", "min_tokens", "logprobs", "prompt", "regex", "choice", "json_schema")


def _guess_param(message: str) -> str | None:
    """The request field a gpt2_jax error message is about: the first setting it names."""
    names = {**{f: f for f in _SETTINGS}, **_PARAM_NAMES, "token id": "prompt", "stop string": "stop"}
    hits = [(m.start(), name) for name in names if (m := re.search(rf"\b{re.escape(name)}\b", message))]
    return names[min(hits)[1]] if hits else None


def _from_gpt2_jax(e: Exception) -> ApiError:
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


def _from_validation(errors: list[dict]) -> ApiError:
    """pydantic's errors -> one 400 naming the first bad field."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {e['msg']}", code="invalid_json")
    if e["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {'.'.join(loc)!r}; accepted fields: {', '.join(_FIELDS)}",
                        param=loc[0] if loc else None, code="unknown_field")  # fmt: skip
    if e["type"] == "model_type" and not loc:
        return ApiError(400, "the body must be a JSON object")
    if loc and loc[0] == "prompt":
        return ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists", param="prompt")  # fmt: skip
    field = loc[0] if loc else None
    return ApiError(400, f"{'.'.join(loc) or 'body'}: {e['msg']}", param=field)


# ---- metrics ----------------------------------------------------------------------------------------
class _Histogram:
    def __init__(self, buckets: tuple):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


class Metrics:
    """What /metrics reports, besides the engine's own counts (updated on the event loop; the token
    rate from the engine thread, under a lock)."""

    def __init__(self):
        self.ttft, self.latency = _Histogram(TTFT_BUCKETS), _Histogram(LATENCY_BUCKETS)
        self.requests: collections.Counter = collections.Counter()  # by HTTP status
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._per_second: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self.started = time.time()

    def token(self) -> None:
        with self._lock:
            self._per_second[int(time.time())] += 1

    def tokens_per_second(self) -> float:
        now = time.time()
        with self._lock:
            for s in [s for s in self._per_second if s <= now - RATE_WINDOW]:
                del self._per_second[s]
            n = sum(self._per_second.values())
        return n / max(1.0, min(float(RATE_WINDOW), now - self.started))

    def render(self, engine: Engine) -> str:
        stats = engine.stats()
        gauges = [("queue_length", "requests waiting for a slot", stats["queued"]),
                  ("active_slots", "slots generating now", stats["active"]),
                  ("max_batch", "slots", engine.max_batch), ("max_queue", "queue capacity", engine.max_queue),
                  ("tokens_per_second", f"generated tokens per second over the last {RATE_WINDOW} s",
                   self.tokens_per_second())]  # fmt: skip
        counters = [("generated_tokens", "tokens generated by the engine", stats["generated_tokens"]),
                    ("prompt_tokens", "prompt tokens of completed requests", self.prompt_tokens),
                    ("completion_tokens", "completion tokens of completed requests", self.completion_tokens)]
        out = []
        for name, help_, v in gauges:
            out += [f"# HELP gpt2_jax_{name} {help_}", f"# TYPE gpt2_jax_{name} gauge", f"gpt2_jax_{name} {v}"]
        for name, help_, v in counters:
            out += [f"# HELP gpt2_jax_{name} {help_}", f"# TYPE gpt2_jax_{name} counter", f"gpt2_jax_{name}_total {v}"]
        out += ["# HELP gpt2_jax_requests completion requests answered, by HTTP status",
                "# TYPE gpt2_jax_requests counter"]  # fmt: skip
        out += [f'gpt2_jax_requests_total{{status="{s}"}} {c}' for s, c in sorted(self.requests.items())]
        out += self.ttft.lines("gpt2_jax_time_to_first_token_seconds", "request arrival to its first token")
        out += self.latency.lines("gpt2_jax_request_latency_seconds", "request arrival to its last token")
        return "\n".join(out) + "\n"


# ---- one choice's text ----------------------------------------------------------------------------------
class _Choice:
    """One row of a request: its tokens and logprobs as they arrive, and its text, streamed without
    ever taking back a character: text that might still become a stop string, an incomplete UTF-8
    character and a trailing EOS are held back until the row ends."""

    def __init__(self, index: int, prompt_index: int, enc: Any, stops: list[str], eos: int | None):
        self.index, self.prompt_index, self.enc, self.eos = index, prompt_index, enc, eos
        self.patterns = [s.encode("utf-8") for s in stops]
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[list, list]] = []
        self.data = bytearray()  # the bytes of the tokens so far, a trailing EOS excluded
        self.shown = ""  # the text streamed so far
        self.finish: str | None = None
        self.stop: str | None = None
        self.request: Request | None = None

    def add(self, token: int, logprob: float, top_ids: list, top_lps: list) -> None:
        if self.tokens and self.tokens[-1] == self.eos:  # an EOS that did not end the row (no EOS rule)
            self.data += self.enc.decode_single_token_bytes(self.eos)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top.append((top_ids, top_lps))
        if token != self.eos:
            self.data += self.enc.decode_single_token_bytes(token)

    def _held(self) -> int:
        """Bytes at the end of the text that are the start of some stop string."""
        data, held = self.data, 0
        for p in self.patterns:
            for k in range(min(len(p) - 1, len(data)), held, -1):
                if data.endswith(p[:k]):
                    held = k
                    break
        return held

    def safe_text(self) -> str:
        """The text that no later token can change: up to a stop string that completed (its "done" event
        comes after its token), else without the tail that could still begin one."""
        found = [i for i in (self.data.find(p) for p in self.patterns) if i >= 0]
        end = min(found) if found else len(self.data) - self._held()
        safe = bytes(self.data[:end])
        return codecs.getincrementaldecoder("utf-8")("replace").decode(safe, final=False)

    def final_text(self) -> str:
        """gpt2_jax.complete's text: without a stopping EOS, cut before the stop string that matched."""
        shown = self.tokens
        if self.finish == "stop" and self.stop is None and shown and shown[-1] == self.eos:
            shown = shown[:-1]
        data = b"".join(self.enc.decode_single_token_bytes(t) for t in shown)
        if self.stop is not None:
            cut = data.find(self.stop.encode("utf-8"))
            data = data[: cut if cut >= 0 else len(data)]
        return data.decode("utf-8", errors="replace")

    def delta(self, final: bool) -> str:
        text = self.final_text() if final else self.safe_text()
        if not text.startswith(self.shown):  # cannot happen (see safe_text); never resend text
            return ""
        out, self.shown = text[len(self.shown):], text
        return out


def _number(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no -Infinity


def _logprobs_object(enc: Any, tokens: list, logprobs: list, tops: list, offset: int) -> dict:
    """OpenAI's legacy logprobs: token strings, their logprobs, the top alternatives and character offsets
    (into the choice's text). A None logprob (an echoed first prompt token) stays None."""
    strings = [enc.decode([t]) for t in tokens]
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    top = [None if t is None else {enc.decode([i]): _number(v) for i, v in zip(*t)} for t in tops]
    return {"tokens": strings, "token_logprobs": [None if v is None else _number(v) for v in logprobs],
            "top_logprobs": top, "text_offset": offsets}  # fmt: skip


@jax.jit
def _score_prompt(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [1, P, V] of tokens [1, P] -> log p(token t | tokens < t) for t >= 1, and the MAX_LOGPROBS most
    likely ids and logprobs after each position."""
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    values, ids = jax.lax.top_k(logp, MAX_LOGPROBS)
    return picked, ids, values


def prompt_logprobs(params: Any, config: Any, ids: list[int], top_n: int) -> tuple[list, list]:
    """One gpt2_jax.forward pass over a prompt -> (logprobs, top) per prompt token, the first None. The
    prompt is padded to its length bucket, so a new length rarely compiles."""
    P = bucket(len(ids), config.n_positions)
    tokens = np.zeros((1, P), np.int32)
    tokens[0, : len(ids)] = ids
    logits = forward(params, tokens, config)[..., : config.valid_vocab]
    picked, top_ids, top_lps = jax.device_get(_score_prompt(logits, jnp.asarray(tokens)))
    n = len(ids)
    lps = [None] + picked[: n - 1].tolist()
    tops = [None] + [(i[:top_n].tolist(), v[:top_n].tolist()) for i, v in zip(top_ids[: n - 1], top_lps[: n - 1])]
    return lps, tops


def row_key(seed: int, index: int) -> jax.Array:
    """Choice `index`'s key: generate's key for row `index` of a batch sampled with jax.random.key(seed)."""
    return jax.random.fold_in(jax.random.key(seed), index)


# ---- the app ---------------------------------------------------------------------------------------------
class _Plan:
    """A validated request: its prompts as token ids and text, and the engine's per-row settings."""

    def __init__(self, req: CompletionRequest, engine: Engine, enc: Any):
        config = engine.config
        self.n = 1 if req.n is None else req.n
        if self.n < 1:
            raise ApiError(400, f"n must be >= 1, got {self.n}", param="n")
        if req.best_of is not None and req.best_of != self.n:
            raise ApiError(400, "best_of is not supported (only best_of = n)", param="best_of")
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix")
        self.max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if self.max_tokens < 0:
            raise ApiError(400, f"max_tokens must be >= 0, got {self.max_tokens}", param="max_tokens")
        self.echo = bool(req.echo)
        self.top_n = req.logprobs
        if self.top_n is not None and not 0 <= self.top_n <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.top_n}", param="logprobs")
        if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
            raise ApiError(400, f"seed must be an int in [0, 2**32), got {req.seed}", param="seed")
        self.seed = secrets.randbelow(2**31) if req.seed is None else req.seed
        self.stream = bool(req.stream)
        if req.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.prompts, self.texts = self._prompts(req.prompt, enc, config)
        rows = len(self.prompts) * self.n
        if rows > engine.max_batch + engine.max_queue:
            raise ApiError(400, f"{len(self.prompts)} prompt(s) x n={self.n} = {rows} completions exceed this "
                                f"server's capacity of {engine.max_batch + engine.max_queue} "
                                f"(max_batch + max_queue)", param="n")  # fmt: skip
        for p, ids in enumerate(self.prompts):
            if len(ids) + self.max_tokens > engine.max_seq:
                raise ApiError(400, f"prompt {p}: {len(ids)} prompt tokens + max_tokens={self.max_tokens} exceed "
                                    f"this server's max_seq={engine.max_seq}", param="max_tokens",
                               code="context_length_exceeded")  # fmt: skip
        self.options = self._options(req)
        if self.options.get("min_new_tokens", 0) > self.max_tokens:
            raise ApiError(400, f"min_tokens={req.min_tokens} must be <= max_tokens={self.max_tokens}",
                           param="min_tokens")  # fmt: skip
        self.stops = list(self.options.get("stop") or ())

    @staticmethod
    def _prompts(prompt: Any, enc: Any, config: Any) -> tuple[list[list[int]], list[str]]:
        """A string, a list of strings, a list of token ids or a list of token-id lists -> (ids, text) per prompt."""
        if prompt is None:
            prompt = ""  # OpenAI: as if from the start of a new document
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is an empty list", param="prompt")
        ids, texts = [], []
        for p, x in enumerate(prompt):
            if isinstance(x, str):
                ids.append(enc.encode(x, allowed_special={"<|endoftext|>"}) or [enc.eot_token])
                texts.append(x)
                continue
            if not x:
                raise ApiError(400, f"prompt {p} is an empty list of token ids", param="prompt")
            bad = [t for t in x if not 0 <= t < config.valid_vocab]
            if bad:
                raise ApiError(400, f"prompt {p}: token id {bad[0]} is outside the vocab [0, {config.valid_vocab})",
                               param="prompt")  # fmt: skip
            ids.append(list(x))
            texts.append(enc.decode(list(x)))
        return ids, texts

    @staticmethod
    def _options(req: CompletionRequest) -> dict:
        """The request's settings as generate's keyword arguments (only those given)."""
        o: dict[str, Any] = {}
        for api, ours in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                          ("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                          ("frequency_penalty", "frequency_penalty"), ("min_tokens", "min_new_tokens")):  # fmt: skip
            v = getattr(req, api)
            if v is not None:
                o[ours] = v
        if req.top_k is not None:
            if req.top_k < -1:
                raise ApiError(400, f"top_k must be -1 or 0 (off) or a positive int, got {req.top_k}", param="top_k")
            o["top_k"] = max(req.top_k, 0)
        if req.stop is not None and req.stop != []:
            o["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.logit_bias:
            bias = {}
            for k, v in req.logit_bias.items():
                if not re.fullmatch(r"[0-9]+", k):
                    raise ApiError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
                t = int(k)
                if not -100 <= v <= 100:
                    raise ApiError(400, f"logit_bias[{k}] must be in [-100, 100], got {v}", param="logit_bias")
                bias[t] = v
            o["logit_bias"] = bias
        given = [f for f in ("regex", "choice", "json_schema") if getattr(req, f) is not None]
        if len(given) > 1:
            raise ApiError(400, f"give at most one of regex, choice and json_schema, got {', '.join(given)}",
                           param=given[1])  # fmt: skip
        try:
            if req.regex is not None:
                o["constraint"] = constraints.regex(req.regex)
            elif req.choice is not None:
                o["constraint"] = constraints.choice(req.choice)
            elif req.json_schema is not None:
                o["constraint"] = constraints.json_schema(req.json_schema)
        except GPT2JaxError as e:
            raise ApiError(400, str(e), param=given[0]) from None
        return o


class _Job:
    """One HTTP request in flight: its choices, the engine rows, and the queue their events arrive on."""

    def __init__(self, rid: str, plan: _Plan, enc: Any, eos: int | None, metrics: Metrics, arrived: float):
        self.rid, self.plan, self.metrics = rid, plan, metrics
        self.arrived = arrived  # perf_counter() when the request came in
        self.first_token: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.choices = [_Choice(p * plan.n + j, p, enc, plan.stops, eos)
                        for p in range(len(plan.prompts)) for j in range(plan.n)]  # fmt: skip
        self.echo: list[tuple[list, list]] = []  # per prompt: its logprobs and top alternatives
        self.error: BaseException | None = None

    def _callback(self, index: int):
        put, metrics = self.queue.put_nowait, self.metrics

        def on_event(kind: str, payload: Any) -> None:  # the engine thread
            if kind == "token":
                metrics.token()
            self.loop.call_soon_threadsafe(put, (index, kind, payload))

        return on_event

    def submit(self, engine: Engine) -> None:
        """Make and queue every row (a worker thread). All or none: a refusal cancels the rows queued."""
        plan = self.plan
        try:
            for c in self.choices:
                c.request = Request(plan.prompts[c.prompt_index], plan.max_tokens, row_key(plan.seed, c.index),
                                    plan.options, self._callback(c.index), top_logprobs=plan.top_n or 0,
                                    seed=plan.seed)  # fmt: skip
                if c.index % plan.n == 0:
                    engine.check(c.request)  # validate each prompt before queueing any row
            for c in self.choices:
                engine.submit(c.request)
            if not engine.running:  # stopped while we queued: nobody will answer
                raise Cancelled("the server is shutting down")
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for c in self.choices:
            if c.request is not None:
                c.request.cancel()

    def handle(self, index: int, kind: str, payload: Any) -> _Choice | None:
        """Apply one engine event -> the choice it finished (else None)."""
        c = self.choices[index]
        if c.finish is not None:
            return None
        if kind == "token":
            if self.first_token is None:
                self.first_token = time.perf_counter()
                self.metrics.ttft.observe(self.first_token - self.arrived)
            c.add(*payload)
            return None
        if kind == "done":
            c.finish, c.stop = payload
        else:
            c.finish, self.error = "error", self.error or payload
        return c

    def pending(self) -> int:
        return sum(c.finish is None for c in self.choices)

    def logprobs(self, c: _Choice, start: int, end: int, with_prompt: bool) -> dict | None:
        """Choice c's logprobs object for its tokens [start, end), the echoed prompt's first."""
        if self.plan.top_n is None:
            return None
        tokens, lps, tops = c.tokens[start:end], c.logprobs[start:end], c.top[start:end]
        offset = sum(len(c.enc.decode([t])) for t in c.tokens[:start])
        if self.plan.echo:
            prompt = self.plan.prompts[c.prompt_index]
            if with_prompt:
                plp, ptop = self.echo[c.prompt_index]
                tokens, lps, tops = prompt + tokens, plp + lps, ptop + tops
            else:
                offset += len(self.plan.texts[c.prompt_index])
        return _logprobs_object(c.enc, tokens, lps, tops, offset)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.plan.prompts)
        done = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


class _EventStream(StreamingResponse):
    """A StreamingResponse that cleans up as soon as the response ends, the client gone or not: it cancels
    the job's engine rows (a no-op for finished ones) and closes the generator, whose own cleanup then
    runs now rather than at garbage collection (and the rows are cancelled even if it never started)."""

    def __init__(self, content, job: "_Job", **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            await self.body_iterator.aclose()


def create_app(engine: Engine, tokenizer: Any, model_name: str, *, log: Any = None) -> FastAPI:
    """The OpenAI-compatible app over a started Engine. tokenizer: a tiktoken Encoding (gpt2_jax.tokenizer());
    model_name: the id clients pass as "model". log: where the one line per request goes (default stderr)."""
    app = FastAPI(title="gpt2-jax", description="OpenAI-compatible completions over gpt2_jax's serving engine")
    app.state.engine, app.state.model_name, app.state.stopping = engine, model_name, False
    app.state.metrics = metrics = Metrics()
    enc, config = tokenizer, engine.config
    eos = config.eos_id
    created = int(time.time())

    def say(line: str) -> None:
        print(f"gpt2-jax serve: {line}", file=log or sys.stderr, flush=True)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return _from_validation(list(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, str(e.detail), code=code, kind="invalid_request_error").response()

    @app.get("/health")
    async def health():
        if app.state.stopping or not engine.running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok", "model": model_name}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "gpt2-jax",
                "max_model_len": engine.max_seq}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return model_card()

    @app.get("/metrics")
    async def metrics_page():
        return PlainTextResponse(metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    schema = CompletionRequest.model_json_schema()
    body_doc = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    @app.post("/v1/completions", openapi_extra=body_doc)
    async def completions(http: HTTPRequest):
        rid = "cmpl-" + secrets.token_hex(12)
        t0 = time.perf_counter()
        job: _Job | None = None
        try:
            raw = await http.body()
            try:
                req = CompletionRequest.model_validate_json(raw)
            except ValidationError as e:
                raise _from_validation(e.errors()) from None
            if req.model != model_name:
                raise ApiError(404, f"the model {req.model!r} does not exist; this server has {model_name!r}",
                               param="model", code="model_not_found")  # fmt: skip
            if app.state.stopping or not engine.running:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            loop = asyncio.get_running_loop()
            plan = await loop.run_in_executor(None, _Plan, req, engine, enc)
            job = _Job(rid, plan, enc, eos, metrics, t0)
            if plan.echo and plan.top_n is not None:
                job.echo = await loop.run_in_executor(
                    None, lambda: [prompt_logprobs(engine.params, config, p, plan.top_n) for p in plan.prompts])
            if plan.max_tokens > 0:
                await loop.run_in_executor(None, job.submit, engine)
            else:  # echo-only scoring: nothing to generate
                for c in job.choices:
                    c.finish = "length"
        except Exception as e:  # noqa: BLE001
            err = _from_gpt2_jax(e)
            metrics.requests[err.status] += 1
            say(f"{rid} {err.status} {err.message}")
            return err.response()
        headers = {"x-seed": str(plan.seed), "x-request-id": rid}
        if plan.stream:
            return _EventStream(_stream(job, t0), job, media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache"})  # fmt: skip
        return await _collect(job, http, t0, headers)

    def _head(job: _Job) -> dict:
        return {"id": job.rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

    def _finished(job: _Job, t0: float, status: int, note: str = "") -> None:
        latency = time.perf_counter() - t0
        metrics.requests[status] += 1
        usage = job.usage()
        if status == 200:
            metrics.latency.observe(latency)
            metrics.prompt_tokens += usage["prompt_tokens"]
            metrics.completion_tokens += usage["completion_tokens"]
        reasons = ",".join(str(c.finish) for c in job.choices)
        ttft = "" if job.first_token is None else f" ttft={job.first_token - job.arrived:.3f}s"
        say(f"{job.rid} {status} prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
            f" finish={reasons} latency={latency:.3f}s{ttft} seed={job.plan.seed}{note}")

    async def _collect(job: _Job, http: HTTPRequest, t0: float, headers: dict) -> Response:
        """Wait for every row; a client that goes away cancels them."""
        while job.pending() and job.error is None:
            try:
                event = await asyncio.wait_for(job.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    job.cancel()
                    _finished(job, t0, 499, " (client went away)")
                    return Response(status_code=499)
                continue
            job.handle(*event)
        if job.error is not None:
            job.cancel()
            err = _from_gpt2_jax(job.error)
            _finished(job, t0, err.status, f" error={err.message}")
            return err.response(headers)
        choices = []
        for c in job.choices:
            text = c.final_text()
            if job.plan.echo:
                text = job.plan.texts[c.prompt_index] + text
            choices.append({"text": text, "index": c.index, "logprobs": job.logprobs(c, 0, len(c.tokens), True),
                            "finish_reason": c.finish})  # fmt: skip
        body = {**_head(job), "choices": choices, "usage": job.usage(), "seed": job.plan.seed}
        _finished(job, t0, 200)
        return JSONResponse(body, headers=headers)

    async def _stream(job: _Job, t0: float):
        """Server-sent events: text deltas per choice, each choice's last chunk with its finish_reason."""
        head = {**_head(job), "seed": job.plan.seed}
        sent = [0] * len(job.choices)  # tokens whose logprobs went out, per choice

        def chunk(c: _Choice, text: str, finish: str | None, with_prompt: bool = False) -> str:
            lp = job.logprobs(c, sent[c.index], len(c.tokens), with_prompt)
            sent[c.index] = len(c.tokens)
            choice = {"text": text, "index": c.index, "logprobs": lp, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [choice]}, ensure_ascii=False)}\n\n"

        status, complete = 200, False
        try:
            if job.plan.echo:
                for c in job.choices:
                    yield chunk(c, job.plan.texts[c.prompt_index], None, with_prompt=True)
            for c in job.choices:
                if c.finish is not None:  # max_tokens 0
                    yield chunk(c, "", c.finish)
            while job.pending() and job.error is None:
                index, kind, payload = await job.queue.get()
                c = job.choices[index]
                ended = job.handle(index, kind, payload)
                if job.error is not None:
                    break
                if ended is not None:
                    yield chunk(c, c.delta(final=True), c.finish)
                elif kind == "token":
                    text = c.delta(final=False)
                    if text or job.plan.top_n is not None:
                        yield chunk(c, text, None)
            if job.error is not None:
                err = _from_gpt2_jax(job.error)
                status = err.status
                yield f"data: {json.dumps(err.body())}\n\n"
            elif job.plan.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': job.usage()})}\n\n"
            yield "data: [DONE]\n\n"
            complete = True
        finally:  # also when the client went away: cancelled while waiting, or closed at a yield
            job.cancel()  # frees the slots of rows still running (a no-op for finished ones)
            if not complete:
                status = 499
            _finished(job, t0, status, " (client went away)" if status == 499 else "")

    return app


def warm_up(engine: Engine, *, constrained: bool = True, echo: bool = True, timeout: float = 600.0) -> float:
    """Compile what requests will run, before the first one arrives: the one-row prefill of every prompt
    bucket up to max_seq, the decode step with and without top logprobs (and with a small constraint's
    tables), and the echo scoring pass of every bucket. Requests go through the engine one at a time.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    config = engine.config
    lengths = sorted({bucket(n, config.n_positions) for n in range(1, engine.max_seq)})
    runs: list[tuple[int, int, dict]] = [(min(b, engine.max_seq - 1), 0, {}) for b in lengths]
    runs.append((1, MAX_LOGPROBS, {}))
    if constrained and config.eos_id is not None:
        runs.append((1, 0, {"constraint": constraints.choice(["a", "b"])}))
    for n, top, options in runs:
        if n < 1 or n + 1 > engine.max_seq:
            continue
        done = threading.Event()
        result: list = []

        def on_event(kind: str, payload: Any, done=done, result=result) -> None:
            if kind != "token":
                result.append((kind, payload))
                done.set()

        engine.submit(Request([0] * n, 1, row_key(0, 0), options, on_event, top_logprobs=top))
        if not done.wait(timeout):
            raise GPT2JaxError(f"warm-up: the engine did not answer within {timeout:.0f} s")
        if result[0][0] == "error":
            raise result[0][1]
    if echo:
        for b in sorted({bucket(n, config.n_positions) for n in range(1, engine.max_seq + 1)}):
            prompt_logprobs(engine.params, config, [0] * min(b, engine.max_seq), 1)
    return time.perf_counter() - t0
