"""An OpenAI-compatible HTTP API over the serving engine: /v1/completions and /v1/chat/completions (plain and
streamed), /v1/models,
/tokenize and /detokenize (vLLM's), /health, /metrics, a playground page at /, and the explainer (its page at
/explain, its numbers from POST /v1/explain: explain.py).

`create_app(engine, tokenizer, model_name)` returns a FastAPI app; `gpt2-jax serve` runs it with uvicorn;
`serving.warmup` compiles what requests will run. The parts: schema.py (request bodies, OpenAI-shaped
errors), completions.py (the completions endpoint), chat.py (the chat endpoint: messages through
chat_template.py's template to a prompt, then the completions path), plan.py (the request mapped onto the engine's rows),
choices.py (each choice's streamed text and logprobs, the job in flight),
metrics.py (/metrics), openapi.py (the schema clients and fuzzers read), static/ (the playground).

The engine reports on its own thread; each callback hands its event to the request's asyncio queue with
loop.call_soon_threadsafe. Validation, tokenizing, constraint compiling and submission run in a worker
thread, so a slow request never holds up the event loop.

API keys: with keys set, every request but GET /health and GET / (the page, which then asks for a key)
must carry `Authorization: Bearer KEY`, compared in constant time; others get a 401 in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from gpt2_jax.serving import explain, openapi
from gpt2_jax.serving.chat import ChatShape
from gpt2_jax.serving.chat_template import ChatTemplate
from gpt2_jax.serving.completions import Completions
from gpt2_jax.serving.engine import Engine
from gpt2_jax.serving.limits import BodyLimit, Limits
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.schema import (
    ApiError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    from_validation,
)

TOKENIZING = 2  # /tokenize and /detokenize calls tokenizing at once; more wait their turn
OPEN_PATHS = {"/health", "/", "/explain", "/openapi.json", "/docs", "/docs/oauth2-redirect"}  # no key needed


def _authorized(header: str | None, keys: tuple[bytes, ...]) -> bool:
    """Whether an Authorization header carries one of the keys; every key is compared, in constant time."""
    scheme, _, given = (header or "").partition(" ")
    given_b = given.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given_b, key)
    return ok


def create_app(engine: Engine, tokenizer: Any, model_name: str, *, log: Any = None, api_keys: Any = (),
               compiler: Any = None, ready: Any = lambda: True, playground: bool = True,
               limits: Limits | None = None, chat_template: ChatTemplate | None = None) -> FastAPI:  # fmt: skip
    """The OpenAI-compatible app over a started Engine. tokenizer: a tiktoken Encoding (gpt2_jax.tokenizer());
    model_name: the id clients pass as "model"; log: where the one line per request goes (default stderr);
    api_keys: the accepted keys (none: no key needed); compiler: a serving.constraint_worker.ConstraintCompiler
    (None: constraints compile in this process); ready(): whether the essential programs are compiled;
    playground: serve the page at /; limits: the per-request bounds (default: Limits.for_context(max_seq));
    chat_template: what renders /v1/chat/completions' messages (serving.chat_template; None: chat answers 400)."""
    app = FastAPI(title="gpt2-jax", description="OpenAI-compatible completions over gpt2_jax's serving engine")
    app.state.engine, app.state.model_name, app.state.stopping = engine, model_name, False
    app.state.metrics = metrics = Metrics()
    keys = tuple(k.encode() for k in api_keys)
    enc, created = tokenizer, int(time.time())
    limits = limits or Limits.for_context(engine.max_seq)
    completions = Completions(engine, enc, model_name, metrics, compiler, log, lambda: app.state.stopping, limits)
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, idle=limits.idle_timeout)
    tokenizing = asyncio.Semaphore(TOKENIZING)

    @app.middleware("http")
    async def _keys(http: HTTPRequest, call_next):
        if keys and http.url.path not in OPEN_PATHS and not _authorized(http.headers.get("authorization"), keys):
            return ApiError(401, "a valid API key is required: send Authorization: Bearer KEY",
                            code="invalid_api_key").response({"www-authenticate": "Bearer"})  # fmt: skip
        return await call_next(http)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        return from_validation(list(e.errors())).response()

    openapi.install_error_pages(app)

    if playground:
        page = resources.files("gpt2_jax.serving").joinpath("static/playground.html").read_text()

        @app.get("/", include_in_schema=False)
        async def playground_page():
            return HTMLResponse(page.replace("{{MODEL}}", model_name).replace("{{KEYS}}", "true" if keys else "false"))

    @app.get("/health", responses=openapi.errors(503))
    async def health():
        """200 once the engine can serve; "compiling" lists the programs still being built in the background."""
        compiling = [f"{kind} {n}" for kind, n in engine.programs.pending()]
        if app.state.stopping or not engine.running:
            return JSONResponse({"status": "unavailable", "compiling": compiling}, status_code=503)
        if not ready():
            return JSONResponse({"status": "starting", "compiling": compiling}, status_code=503)
        return {"status": "ok", "model": model_name, "compiling": compiling}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "gpt2-jax",
                "max_model_len": engine.max_seq}  # fmt: skip

    @app.get("/v1/models", responses=openapi.errors(401))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=openapi.errors(401, 404))
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return model_card()

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.errors(401))
    async def metrics_page():
        """Prometheus text: queue, slots, tokens, compile state, latency histograms."""
        return PlainTextResponse(metrics.render(engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    async def off_loop(work: Any, *args: Any) -> Any:
        """Tokenizer work in a worker thread, TOKENIZING at a time, so a long text neither freezes the event loop
        (and every stream with it) nor, sent many times at once, holds many copies of itself."""
        async with tokenizing:
            return await asyncio.get_running_loop().run_in_executor(None, work, *args)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=openapi.errors(400, 401, 404, 408, 413))
    async def tokenize(body: TokenizeRequest):
        """Text -> its token ids and count (vLLM's /tokenize); <|endoftext|> in the text is the special token."""
        check_model(body.model)
        tokens = await off_loop(lambda: enc.encode(body.prompt, allowed_special={"<|endoftext|>"}))
        return {"count": len(tokens), "max_model_len": engine.max_seq, "tokens": tokens}

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=openapi.errors(400, 401, 404, 408, 413))
    async def detokenize(body: DetokenizeRequest):
        """Token ids -> their text (vLLM's /detokenize)."""
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < enc.n_vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocab [0, {enc.n_vocab})", param="tokens")
        return {"prompt": await off_loop(enc.decode, body.tokens)}

    @app.post(
        "/v1/completions",
        openapi_extra=openapi.completion_body(),
        responses=openapi.errors(400, 401, 404, 408, 413, 429, 503),
    )
    async def completions_endpoint(http: HTTPRequest):
        return await completions.handle(http)

    chat = ChatShape(chat_template, enc, engine.max_seq)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=openapi.chat_body(),
        responses=openapi.errors(400, 401, 404, 408, 413, 429, 503),
    )
    async def chat_endpoint(http: HTTPRequest):
        """Messages rendered by the chat template, then a completion on that prompt, answered as a chat."""
        return await completions.handle(http, chat)

    explain.install(app, engine, enc, check_model)
    openapi.install(app, model_name, engine.max_seq, engine.config.valid_vocab)
    return app
