"""An OpenAI-compatible HTTP API over the serving engine: /v1/completions (plain and streamed),
/v1/models, /health and /metrics.

`create_app(engine, tokenizer, model_name)` returns a FastAPI app; `gpt2-jax serve` runs it with
uvicorn; `warm_up(engine)` compiles what requests will run. The parts: schema.py (the request body
and OpenAI-shaped errors), metrics.py (/metrics) and jobs.py (one request's rows, their events and
their text).

The engine reports on its own thread; each callback hands its event to the request's asyncio queue
with loop.call_soon_threadsafe. Validation, tokenizing and submission run in a worker thread, so a
slow request (a large JSON schema to compile) never holds up the event loop.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import threading
import time
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.generation import bucket
from gpt2_jax.sampling import SamplingParams, constraints
from gpt2_jax.serving.engine import Engine, Request
from gpt2_jax.serving.jobs import MAX_LOGPROBS, Choice, EventStream, Job, Plan, prompt_logprobs, row_key
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.schema import ApiError, CompletionRequest, from_gpt2_jax, from_validation

__all__ = ["create_app", "prompt_logprobs", "row_key", "warm_up"]


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
        return from_validation(list(e.errors())).response()

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
        job: Job | None = None
        try:
            raw = await http.body()
            try:
                req = CompletionRequest.model_validate_json(raw)
            except ValidationError as e:
                raise from_validation(e.errors()) from None
            if req.model != model_name:
                raise ApiError(404, f"the model {req.model!r} does not exist; this server has {model_name!r}",
                               param="model", code="model_not_found")  # fmt: skip
            if app.state.stopping or not engine.running:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            loop = asyncio.get_running_loop()
            plan = await loop.run_in_executor(None, Plan, req, engine, enc)
            job = Job(rid, plan, enc, eos, metrics, t0)
            if plan.echo and plan.top_n is not None:
                job.echo = await loop.run_in_executor(
                    None, lambda: [prompt_logprobs(engine.params, config, p, plan.top_n) for p in plan.prompts]
                )
            if plan.max_tokens > 0:
                await loop.run_in_executor(None, job.submit, engine)
            else:  # echo-only scoring: nothing to generate
                for c in job.choices:
                    c.finish = "length"
        except Exception as e:
            err = from_gpt2_jax(e)
            metrics.requests[err.status] += 1
            say(f"{rid} {err.status} {err.message}")
            return err.response()
        headers = {"x-seed": str(plan.seed), "x-request-id": rid}
        if plan.stream:
            return EventStream(_stream(job, t0), job, media_type="text/event-stream",
                                    headers={**headers, "cache-control": "no-cache"})  # fmt: skip
        return await _collect(job, http, t0, headers)

    def _head(job: Job) -> dict:
        return {"id": job.rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

    def _finished(job: Job, t0: float, status: int, note: str = "") -> None:
        latency = time.perf_counter() - t0
        metrics.requests[status] += 1
        usage = job.usage()
        if status == 200:
            metrics.latency.observe(latency)
            metrics.prompt_tokens += usage["prompt_tokens"]
            metrics.completion_tokens += usage["completion_tokens"]
        reasons = ",".join(str(c.finish) for c in job.choices)
        ttft = "" if job.first_token is None else f" ttft={job.first_token - job.arrived:.3f}s"
        say(
            f"{job.rid} {status} prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
            f" finish={reasons} latency={latency:.3f}s{ttft} seed={job.plan.seed}{note}"
        )

    async def _collect(job: Job, http: HTTPRequest, t0: float, headers: dict) -> Response:
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
            err = from_gpt2_jax(job.error)
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

    async def _stream(job: Job, t0: float):
        """Server-sent events: text deltas per choice, each choice's last chunk with its finish_reason."""
        head = {**_head(job), "seed": job.plan.seed}
        sent = [0] * len(job.choices)  # tokens whose logprobs went out, per choice

        def chunk(c: Choice, text: str, finish: str | None, with_prompt: bool = False) -> str:
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
    runs: list[tuple[int, SamplingParams]] = [
        (min(b, engine.max_seq - 1), SamplingParams(max_new_tokens=1)) for b in lengths
    ]
    runs.append((1, SamplingParams(max_new_tokens=1, logprobs=True, top_logprobs=MAX_LOGPROBS)))
    if constrained and config.eos_id is not None:
        runs.append((1, SamplingParams(max_new_tokens=1, constraint=constraints.choice(["a", "b"]))))
    for n, sampling in runs:
        if n < 1 or n + 1 > engine.max_seq:
            continue
        done = threading.Event()
        result: list = []

        def on_event(kind: str, payload: Any, done=done, result=result) -> None:
            if kind != "token":
                result.append((kind, payload))
                done.set()

        engine.submit(Request([0] * n, sampling, row_key(0, 0), on_event))
        if not done.wait(timeout):
            raise GPT2JaxError(f"warm-up: the engine did not answer within {timeout:.0f} s")
        if result[0][0] == "error":
            raise result[0][1]
    if echo:
        for b in sorted({bucket(n, config.n_positions) for n in range(1, engine.max_seq + 1)}):
            prompt_logprobs(engine.params, config, [0] * min(b, engine.max_seq), 1)
    return time.perf_counter() - t0
