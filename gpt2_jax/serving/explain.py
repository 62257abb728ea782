"""The explainer over HTTP: GET /explain serves the page (gpt2_jax/interp/static/explain.html) and
POST /v1/explain answers one view of a prompt with gpt2_jax.interp.explain_data's numbers, for the model
this server loaded.

Why a worker thread of its own: a view runs the whole forward (and "steps" runs it once per draw), so it
must never run on the event loop, where every stream's next chunk waits. One view runs at a time, beside the
engine's steps (XLA shares the cores between them; neither waits for the other to finish), and at most
MAX_WAITING more wait their turn; beyond that a request gets 429 at once, as a full queue does for
completions. The answer's JSON (megabytes for a wide layer) is encoded in that thread too.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.interp import explain_data
from gpt2_jax.interp.explain_page import VIEWS as EXPLAIN_VIEWS
from gpt2_jax.interp.explain_page import page_html as explain_page_html
from gpt2_jax.serving import openapi
from gpt2_jax.serving.limits import check_chars
from gpt2_jax.serving.schema import ApiError

MAX_WAITING = 4  # explain requests waiting behind the one running; more get 429


class ExplainRequest(BaseModel):
    """One view of a prompt (gpt2_jax.interp.explain_data's arguments)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int] = Field(description="text, or token ids")
    view: str = Field(description=f"one of {', '.join(EXPLAIN_VIEWS)}")
    layer: int = Field(0, description="the block shown by the layer and dropout views")
    head: int = Field(0, description="the head whose attention stages the layer view sends")
    outputs: list[int] = Field([], description="token ids drawn so far, appended after the prompt")
    settings: dict[str, Any] = Field({}, description="sampling settings, SamplingParams' names")
    seed: int = Field(0, description="the draw's seed (and dropout's key)")
    steps: int = Field(1, description="draws made by the steps view")
    model: str | None = None


def _param(message: str, settings: dict) -> str | None:
    """The request field an InputError/ConfigError message is about."""
    for name in ("layer", "head", "seed", "steps", "view"):
        if message.startswith((f"unknown {name}", f"{name} ")):
            return name
    if any(message.startswith(name) for name in settings):
        return "settings"
    return "prompt" if "prompt" in message or "token id" in message else None


def install(app: FastAPI, engine: Any, enc: Any, check_model: Any) -> None:
    """Add GET /explain and POST /v1/explain to `app` for the engine's params and config."""
    worker = ThreadPoolExecutor(1, thread_name_prefix="gpt2-jax-explain")
    page = explain_page_html()
    waiting = [0]

    @app.get("/explain", include_in_schema=False)
    async def explain_page():
        return HTMLResponse(page)

    def answer(body: ExplainRequest) -> bytes:
        data = explain_data(engine.params, engine.config, body.prompt, body.view, layer=body.layer, head=body.head,
                            outputs=body.outputs, settings=body.settings, seed=body.seed, steps=body.steps)  # fmt: skip
        return json.dumps(data, separators=(",", ":")).encode()

    @app.post("/v1/explain", responses=openapi.errors(400, 401, 404, 408, 413, 429, 503))
    async def explain(body: ExplainRequest):
        """One view of the prompt's real internals: the numbers gpt2_jax.interp.explain_data computes, float
        arrays as base64 little-endian float32 (lossless)."""
        check_model(body.model)
        if app.state.stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down", kind="server_error")
        if isinstance(body.prompt, str):
            check_chars(body.prompt, enc, engine.config.n_positions, "the prompt")
        if waiting[0] > MAX_WAITING:
            raise ApiError(429, f"{MAX_WAITING} explain requests are already waiting; try again shortly",
                           code="queue_full", kind="rate_limit_error")  # fmt: skip
        waiting[0] += 1
        try:
            raw = await asyncio.get_running_loop().run_in_executor(worker, answer, body)
        except GPT2JaxError as e:
            raise ApiError(400, str(e), param=_param(str(e), body.settings)) from None
        finally:
            waiting[0] -= 1
        return Response(raw, media_type="application/json")
