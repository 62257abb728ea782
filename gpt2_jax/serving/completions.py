"""POST /v1/completions (and /v1/chat/completions): one request planned, its rows submitted, and the answer
collected or streamed.

The request is validated and planned in a worker thread (a constraint is compiled there, in the constraint
compiler's child process; a chat's template is rendered there), so nothing slow ever runs on the event loop or
the engine thread. Both endpoints take this one path: a chat request becomes a completion request on its rendered
prompt (serving/chat.py); only the request body and the answer's shape differ (a Shape: CompletionShape here).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from gpt2_jax.serving.choices import EventStream, Job
from gpt2_jax.serving.engine import Engine
from gpt2_jax.serving.limits import Budget, Limits
from gpt2_jax.serving.logprobs_json import prompt_logprobs
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.plan import DEFAULT_MAX_TOKENS, RequestPlan
from gpt2_jax.serving.schema import ApiError, CompletionRequest, from_gpt2_jax, from_validation
from gpt2_jax.serving.streamed_text import Choice


class CompletionShape:
    """/v1/completions' body and answer: OpenAI's text_completion objects. A Shape says what the endpoint takes
    (`parse`, then `request`, in a worker thread: the CompletionRequest the plan takes) and how each choice is answered
    (`choice` whole, `chunk` streamed: the text delta, its tokens from `start` on)."""

    prefix, object, chunk_object, opens = "cmpl-", "text_completion", "text_completion", False
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS

    def parse(self, raw: bytes) -> CompletionRequest:
        try:
            return CompletionRequest.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation(e.errors()) from None

    def request(self, body: Any) -> CompletionRequest:
        return body

    def choice(self, job: Job, c: Choice, text: str) -> dict:
        if job.plan.echo:
            text = job.plan.texts[c.prompt_index] + text
        return {"text": text, "index": c.index, "logprobs": job.logprobs(c, 0, len(c.tokens), True),
                "finish_reason": c.finish}  # fmt: skip

    def chunk(self, job: Job, c: Choice, text: str, start: int, finish: str | None, first: bool,
              with_prompt: bool = False) -> dict:  # fmt: skip
        lp = job.logprobs(c, start, len(c.tokens), with_prompt)
        return {"text": text, "index": c.index, "logprobs": lp, "finish_reason": finish}


class Completions:
    """The completions endpoint of one app: its engine, tokenizer, model id, metrics and log."""

    def __init__(self, engine: Engine, enc: Any, model_name: str, metrics: Metrics, compiler: Any, log: Any = None,
                 stopping: Any = lambda: False, limits: Limits | None = None):  # fmt: skip
        self.engine, self.enc, self.model_name, self.metrics, self.compiler = engine, enc, model_name, metrics, compiler
        self.log, self.stopping = log, stopping
        self.limits = limits or Limits.for_context(engine.max_seq)
        self.beams = Budget(2 * self.limits.max_beam_tokens)  # a search of the largest size, and another beside it

    def say(self, line: str) -> None:
        print(f"gpt2-jax serve: {line}", file=self.log or sys.stderr, flush=True)

    async def handle(self, http: HTTPRequest, shape: Any = None) -> Response:
        engine, config, shape = self.engine, self.engine.config, shape or CompletionShape()
        rid = shape.prefix + secrets.token_hex(12)
        t0 = time.perf_counter()
        try:
            req = shape.parse(await http.body())
            if req.model != self.model_name:
                raise ApiError(404, f"the model {req.model!r} does not exist; this server has {self.model_name!r}",
                               param="model", code="model_not_found")  # fmt: skip
            if self.stopping() or not engine.running:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            loop = asyncio.get_running_loop()
            plan = await loop.run_in_executor(None, lambda: RequestPlan(
                shape.request(req), engine, self.enc, self.compiler, self.limits.max_beam_tokens,
                shape.default_max_tokens))  # fmt: skip
            job = Job(rid, plan, self.enc, self.metrics, t0)
            top_n = plan.top_n
            if plan.echo and top_n is not None:
                job.echo = await loop.run_in_executor(
                    None, lambda: [prompt_logprobs(engine.params, config, p, top_n) for p in plan.prompts]
                )
            if plan.beam:
                await loop.run_in_executor(None, job.beam_search, engine, self.beams)
            elif plan.max_tokens > 0:
                await loop.run_in_executor(None, job.submit, engine)
            else:  # echo-only scoring: nothing to generate
                for c in job.choices:
                    c.finish = "length"
        except Exception as e:
            err = from_gpt2_jax(e)
            self.metrics.requests[err.status] += 1
            self.say(f"{rid} {err.status} {err.message}")
            return err.response()
        headers = {"x-seed": str(plan.seed), "x-request-id": rid}
        if plan.stream:
            return EventStream(self._stream(job, t0, shape), job, media_type="text/event-stream",
                               headers={**headers, "cache-control": "no-cache"})  # fmt: skip
        return await self._collect(job, http, t0, headers, shape)

    def _head(self, job: Job, kind: str) -> dict:
        return {"id": job.rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    def _finished(self, job: Job, t0: float, status: int, note: str = "") -> None:
        latency = time.perf_counter() - t0
        self.metrics.requests[status] += 1
        usage = job.usage()
        if status == 200:
            self.metrics.latency.observe(latency)
            self.metrics.prompt_tokens += usage["prompt_tokens"]
            self.metrics.completion_tokens += usage["completion_tokens"]
        reasons = ",".join(str(c.finish) for c in job.choices)
        ttft = "" if job.first_token is None else f" ttft={job.first_token - job.arrived:.3f}s"
        self.say(
            f"{job.rid} {status} prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
            f" finish={reasons} latency={latency:.3f}s{ttft} seed={job.plan.seed}{note}"
        )

    async def _collect(self, job: Job, http: HTTPRequest, t0: float, headers: dict, shape: Any) -> Response:
        """Wait for every row; a client that goes away cancels them."""
        while job.pending() and job.error is None:
            try:
                event = await asyncio.wait_for(job.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    job.cancel()
                    self._finished(job, t0, 499, " (client went away)")
                    return Response(status_code=499)
                continue
            job.handle(*event)
        if job.error is not None:
            job.cancel()
            err = from_gpt2_jax(job.error)
            self._finished(job, t0, err.status, f" error={err.message}")
            return err.response(headers)
        job.select()
        choices = [shape.choice(job, c, c.final_text()) for c in job.choices]
        body = {**self._head(job, shape.object), "choices": choices, "usage": job.usage(), "seed": job.plan.seed}
        self._finished(job, t0, 200)
        return JSONResponse(body, headers=headers)

    async def _stream(self, job: Job, t0: float, shape: Any):
        """Server-sent events: text deltas per choice (a chat's first names the role), each choice's last chunk
        with its finish_reason; with continuous_usage_stats, each carries the request's usage so far."""
        head = {**self._head(job, shape.chunk_object), "seed": job.plan.seed}
        sent = [0] * len(job.choices)  # tokens whose logprobs went out, per choice
        opened: set[int] = set()

        def chunk(c: Choice, text: str, finish: str | None, with_prompt: bool = False) -> str:
            choice = shape.chunk(job, c, text, sent[c.index], finish, c.index not in opened, with_prompt)
            sent[c.index] = len(c.tokens)
            opened.add(c.index)
            usage = {"usage": job.usage()} if job.plan.continuous_usage else {}
            return f"data: {json.dumps({**head, 'choices': [choice], **usage}, ensure_ascii=False)}\n\n"

        status, complete = 200, False
        try:
            for c in job.choices if shape.opens else ():
                yield chunk(c, "", None)
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
                err = from_gpt2_jax(job.error)
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
            self._finished(job, t0, status, " (client went away)" if status == 499 else "")
