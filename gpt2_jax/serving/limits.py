"""What one client may cost the server: request body size, time to send a request, beam-search work.

Each bound answers in OpenAI's error shape (413 for a body over --max-body-bytes, 408 for a body that stops
arriving) or closes the connection (a request whose headers do not arrive within --idle-timeout), so that a
careless or hostile client costs bounded memory and time and never holds up the others.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from gpt2_jax.serving.schema import ApiError


@dataclass(frozen=True)
class Limits:
    """The server's per-request bounds (gpt2-jax serve's flags). None: derived from max_seq (see for_context)."""

    max_body_bytes: int = 4 << 20
    idle_timeout: float = 15.0
    max_beam_tokens: int = 8192  # beams x prompts x (prompt + max_tokens) tokens of one beam search

    @staticmethod
    def for_context(max_seq: int, max_body_bytes: int | None = None, idle_timeout: float = 15.0,
                    max_beam_tokens: int | None = None) -> Limits:  # fmt: skip
        """Defaults that scale with the context: a body of 4 KiB per context token (at least 1 MiB: room for
        many prompts as text or token ids, and a large JSON schema), and beam searches of 8 full-context beams."""
        body = max(1 << 20, 4096 * max_seq) if max_body_bytes is None else max_body_bytes
        beams = 8 * max_seq if max_beam_tokens is None else max_beam_tokens
        return Limits(body, idle_timeout, beams)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
                    code="request_too_large")  # fmt: skip


@functools.lru_cache(maxsize=4)
def max_token_bytes(enc: Any) -> int:
    """The most bytes one token stands for (GPT-2's: 128): a text of more characters than max_seq times this
    cannot fit in max_seq tokens, since every character is at least one byte."""
    return max(len(enc.decode_single_token_bytes(t)) for t in range(enc.n_vocab))


def check_chars(text: str, enc: Any, max_seq: int, what: str) -> None:
    """400 for a text that cannot fit in max_seq tokens, known from its length alone (no tokenizing)."""
    limit = max_seq * max_token_bytes(enc)
    if len(text) > limit:
        raise ApiError(400, f"{what} is {len(text)} characters: more than fit in this server's max_seq={max_seq} "
                            f"tokens (at most {limit} characters)", param="prompt",
                       code="context_length_exceeded")  # fmt: skip


class BodyLimit:
    """ASGI middleware: refuse a body over `limit` bytes, by its Content-Length before reading any of it, else
    while it streams in (a chunked body); refuse a body whose next chunk takes over `idle` seconds to come.
    The refusal replaces whatever the app would answer, however the app handled the failed read."""

    def __init__(self, app: Any, limit: int, idle: float):
        self.app, self.limit, self.idle = app, limit, idle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return await _refuse(ApiError(400, "Content-Length must be a number of bytes"), scope, send)
        if int(length) > self.limit:
            return await _refuse(body_too_large(self.limit), scope, send)
        got = {"bytes": 0, "done": False, "error": None, "started": False}

        async def limited() -> dict:
            if got["done"]:  # the body is in: later receives wait for a disconnect, as long as a stream runs
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle)
            except asyncio.TimeoutError:
                got["error"] = ApiError(408, f"the request body stopped arriving for {self.idle:g} s (--idle-timeout)",
                                        code="request_timeout")  # fmt: skip
                raise got["error"] from None
            got["bytes"] += len(message.get("body", b""))
            got["done"] = not message.get("more_body", False)
            if got["bytes"] > self.limit:
                got["error"] = body_too_large(self.limit)
                raise got["error"]
            return message

        async def answer(message: dict) -> None:
            if got["error"] is None:
                got["started"] = True
                await send(message)

        try:
            await self.app(scope, limited, answer)
        except Exception:
            if got["error"] is None or got["started"]:
                raise
        if got["error"] is not None and not got["started"]:
            await _refuse(got["error"], scope, send)


async def _refuse(error: ApiError, scope: dict, send: Any) -> None:
    """Answer `error` and close the connection: the rest of the body is never read."""
    await error.response({"connection": "close"})(scope, _unread, send)


async def _unread() -> dict[str, Any]:
    """The receive a refusal answers with: its body is never read, and the connection closes."""
    return {"type": "http.disconnect"}


class HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers have not all arrived `idle` seconds
    after it opened or after its last response (uvicorn's keep-alive timer restarts on every byte, so a client
    sending a byte now and then would hold the connection for ever)."""

    idle = 15.0
    _deadline: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.idle, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers came in: its body has BodyLimit's timeout
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before the next request's headers, which a pipelined request has already sent
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def header_timeout(idle: float) -> type:
    """The protocol class for uvicorn.Config(http=...) with this header timeout."""
    return type("HeaderTimeout", (HeaderTimeout,), {"idle": idle})


class Budget:
    """Work admitted at once, in units of cost (beam-search tokens): a request waits until its cost fits beside
    the ones running, so small requests run beside a large one instead of queueing behind it."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.cond = threading.Condition()

    @contextmanager
    def take(self, cost: int) -> Iterator[None]:
        cost = min(cost, self.capacity)
        with self.cond:
            self.cond.wait_for(lambda: self.used + cost <= self.capacity)
            self.used += cost
        try:
            yield
        finally:
            with self.cond:
                self.used -= cost
                self.cond.notify_all()
