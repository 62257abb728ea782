"""The OpenAPI document clients and fuzzers read: every status the API answers, documented with its body.

FastAPI documents what it can see. The completions body is parsed by hand (so errors are OpenAI's shape
and name the field), so its schema is added here, its nested models moved under components/schemas (a
`#/$defs/...` reference cannot resolve inside an OpenAPI document); the 422 FastAPI assumes for a bad body
is replaced by the 400 this API answers; and 404/405 keep their headers (405 says which methods are
Allowed), in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpt2_jax.sampling.checks import BOUNDS, MAX_STOP_IDS, MAX_STOP_STRINGS
from gpt2_jax.serving.chat_schema import ChatRequest, ChatResponse
from gpt2_jax.serving.schema import ApiError, CompletionRequest, CompletionResponse, ErrorResponse

# API field -> the SamplingParams field whose range it has (the ranges live there: sampling.params.BOUNDS)
_SAME_RANGE = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
               "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
               "frequency_penalty": "frequency_penalty", "min_tokens": "min_new_tokens"}  # fmt: skip

MEANING = {
    400: "invalid request: a bad or unknown field, malformed JSON, a prompt too long for the server",
    401: "no valid API key (when the server has keys)",
    404: "no such model",
    408: "the request body stopped arriving (the server's --idle-timeout)",
    413: "the request body is over the server's --max-body-bytes",
    429: "every slot is busy and the queue is full",
    503: "the server is starting or shutting down",
}


def errors(*codes: int) -> dict:
    """FastAPI `responses=` documenting these error statuses with OpenAI's error body."""
    return {code: {"model": ErrorResponse, "description": MEANING[code]} for code in codes}


def completion_body() -> dict:
    ref = {"$ref": "#/components/schemas/CompletionRequest"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def chat_body() -> dict:
    ref = {"$ref": "#/components/schemas/ChatRequest"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _rehome(node: Any) -> Any:
    """Pydantic's `#/$defs/X` references -> `#/components/schemas/X`."""
    if isinstance(node, dict):
        return {k: (v.replace("#/$defs/", "#/components/schemas/") if k == "$ref" else _rehome(v))
                for k, v in node.items()}  # fmt: skip
    if isinstance(node, list):
        return [_rehome(v) for v in node]
    return node


def _bound(prop: dict, bounds: dict) -> None:
    """Add bounds to a property's non-null alternative (pydantic writes `anyOf: [{type}, {type: null}]`)."""
    for alt in prop.get("anyOf", [prop]):
        if alt.get("type") in ("integer", "number"):
            alt.update(bounds)


def _shared_schema(body: type, model_name: str, max_seq: int, vocab: int) -> dict:
    """A body's schema (SamplingFields' fields) as this server takes it: its model id, its ranges, token ids in
    its vocabulary."""
    schema = _rehome(body.model_json_schema(ref_template="#/components/schemas/{model}"))
    props = schema["properties"]
    props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
    for api, ours in _SAME_RANGE.items():
        _bound(props[api], BOUNDS[ours])
    _bound(props["max_tokens"], {"minimum": 0, "maximum": max_seq})
    _bound(props["max_completion_tokens"], {"minimum": 0, "maximum": max_seq})
    _bound(props["top_k"], {"minimum": -1})
    _bound(props["n"], {"minimum": 1})
    _bound(props["seed"], {"minimum": 0, "maximum": 2**32 - 1})
    for alt in props["stop_token_ids"]["anyOf"]:
        if alt.get("type") == "array":
            alt.update(maxItems=MAX_STOP_IDS, items={"type": "integer", "minimum": 0, "maximum": vocab - 1})
    for alt in props["choice"]["anyOf"]:
        if alt.get("type") == "array":
            alt["minItems"] = 1
    for alt in props["stop"]["anyOf"]:
        if alt.get("type") == "array":
            alt.update(maxItems=MAX_STOP_STRINGS, items={"type": "string", "minLength": 1})
        elif alt.get("type") == "string":
            alt["minLength"] = 1
    return schema


def _completion_schema(model_name: str, max_seq: int, vocab: int) -> dict:
    body = _shared_schema(CompletionRequest, model_name, max_seq, vocab)
    props = body["properties"]
    props["suffix"] = {
        "type": "null",
        "title": "Suffix",
        "description": "not supported: insertion needs a model trained for it",
    }
    _bound(props["logprobs"], BOUNDS["top_logprobs"])
    _bound(props["best_of"], {"minimum": 1})
    ids = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    for alt in props["prompt"]["anyOf"]:  # token ids in the vocabulary; lists never empty
        if alt.get("type") == "array":
            alt["minItems"] = 1
            inner = alt["items"]
            if inner.get("type") == "integer":
                alt["items"] = ids
            elif inner.get("type") == "array":
                alt["items"] = {"type": "array", "items": ids, "minItems": 1}
    return body


def _chat_schema(model_name: str, max_seq: int, vocab: int) -> dict:
    body = _shared_schema(ChatRequest, model_name, max_seq, vocab)
    _bound(body["properties"]["top_logprobs"], BOUNDS["top_logprobs"])
    body["properties"]["messages"]["minItems"] = 1
    return body


def _stream_response(schema: str, what: str) -> dict:
    """A 200 that is JSON, or with stream: true server-sent events each holding a `schema` object."""
    return {
        "description": f"the {what}; with stream: true, server-sent events each holding a {schema} "
                       "(choices with deltas), then data: [DONE]",
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}},
                    "text/event-stream": {"schema": {  # one server-sent event
                        "type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string", "description": f"a {schema} as JSON, "
                                                "an error object, or [DONE]"}, "event": {"type": "string"}}}}},
    }  # fmt: skip


def install(app: FastAPI, model_name: str, max_seq: int, vocab: int) -> None:
    """Make app.openapi() the corrected document (built once)."""
    plain = app.openapi

    def document() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = plain()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in (("CompletionRequest", _completion_schema(model_name, max_seq, vocab)),
                             ("ChatRequest", _chat_schema(model_name, max_seq, vocab)),
                             ("CompletionResponse", _rehome(CompletionResponse.model_json_schema(
                                 ref_template="#/components/schemas/{model}"))),
                             ("ChatResponse", _rehome(ChatResponse.model_json_schema(
                                 ref_template="#/components/schemas/{model}")))):  # fmt: skip
            for sub_name, sub in schema.pop("$defs", {}).items():
                schemas[sub_name] = sub
            schemas[name] = schema
        paths = doc["paths"]
        paths["/v1/completions"]["post"]["responses"]["200"] = _stream_response("CompletionResponse", "completion")
        paths["/v1/chat/completions"]["post"]["responses"]["200"] = _stream_response("ChatResponse", "chat completion")
        tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
        tokens["items"] = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
        for path in doc.get("paths", {}).values():
            for op in path.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {"description": MEANING[400],
                                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}  # fmt: skip
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = document


def install_error_pages(app: FastAPI) -> None:
    """404 and 405 (and any other HTTP error Starlette raises) in OpenAI's shape, their headers kept."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        err = ApiError(e.status_code, str(e.detail), code=code, kind="invalid_request_error")
        return err.response(getattr(e, "headers", None))
