"""A request in flight, streamed: each choice's tokens and text as they arrive, its logprobs as OpenAI's JSON,
the prompt's echo, the Job that queues the rows and gathers their events, and the event stream.

The rows, their keys and settings come from a RequestPlan (serving.plan); each choice's text is streamed
without ever taking back a character.
"""

from __future__ import annotations

import asyncio
import codecs
import math
import time
from typing import Any

import jax
from fastapi.responses import StreamingResponse

from gpt2_jax.generation import beam_search
from gpt2_jax.generation import prompt_logprobs as score_prompts
from gpt2_jax.serving.engine import Cancelled, Engine, Request
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.plan import RequestPlan
from gpt2_jax.serving.slots import row_key


# ---- one choice's text ----------------------------------------------------------------------------------
class Choice:
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
        out, self.shown = text[len(self.shown) :], text
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


def prompt_logprobs(params: Any, config: Any, ids: list[int], top_n: int) -> tuple[list, list]:
    """A prompt's echo: (logprobs, top) per prompt token, the first None, from gpt2_jax's scoring, so each is the
    logprob generate would report had it sampled that token there (lm-eval's loglikelihood), bit for bit."""
    scores = score_prompts(params, config, [ids], max(top_n, 1))
    tops = [None] + [(i[:top_n], v[:top_n]) for i, v in zip(scores.top_ids[0][1:], scores.top_logprobs[0][1:])]
    return scores.logprobs[0], tops


class Job:
    """One HTTP request in flight: its choices, the engine rows, and the queue their events arrive on."""

    def __init__(self, rid: str, plan: RequestPlan, enc: Any, eos: int | None, metrics: Metrics, arrived: float):
        self.rid, self.plan, self.metrics = rid, plan, metrics
        self.arrived = arrived  # perf_counter() when the request came in
        self.first_token: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        k = plan.n if plan.beam else plan.best_of  # rows per prompt: best_of candidates (beam search returns n)
        self.choices = [Choice(p * k + j, p, enc, plan.stops, eos) for p in range(len(plan.prompts)) for j in range(k)]
        self.candidates = self.choices  # every candidate row (usage counts them all); choices: the ones returned
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
                c.request = Request(plan.prompts[c.prompt_index], plan.sampling, row_key(plan.seed, c.index),
                                    self._callback(c.index), seed=plan.seed)  # fmt: skip
                c.request.prepared = engine.check(c.request)  # every row validated before any is queued
            for c in self.choices:
                engine.submit(c.request)
            if not engine.running:  # stopped while we queued: nobody will answer
                raise Cancelled("the server is shutting down")
        except BaseException:
            self.cancel()
            raise

    def beam_search(self, engine: Engine, budget: Any) -> None:
        """use_beam_search (a worker thread): gpt2_jax.beam_search over every prompt (its own KV cache, outside the
        engine's rows, whose streams keep running) once its tokens fit the budget (serving.limits.Budget: searches
        run side by side up to a bound on their KV cache), its hypotheses as the choices."""
        plan = self.plan
        with budget.take(plan.beam_tokens):
            out = beam_search(engine.params, engine.config, plan.prompts, jax.random.key(plan.seed),
                              sampling=plan.sampling, **plan.beam_settings)  # fmt: skip
        for c in self.choices:
            p, r = divmod(c.index, plan.n)
            for t in range(int(out.lengths[p, r])):
                c.add(int(out.tokens[p, r, t]), float(out.logprobs[p, r, t]), [], [])
            c.finish = out.finish_reason[p][r]
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def cancel(self) -> None:
        for c in self.choices:
            if c.request is not None:
                c.request.cancel()

    def handle(self, index: int, kind: str, payload: Any) -> Choice | None:
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

    def logprobs(self, c: Choice, start: int, end: int, with_prompt: bool) -> dict | None:
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

    def select(self) -> None:
        """best_of > n: keep each prompt's n candidates with the highest mean logprob per token (OpenAI's "highest
        log probability per token"; ties: the lower row), renumbered p * n + rank."""
        plan = self.plan
        if plan.beam or plan.best_of == plan.n:
            return
        chosen = []
        for p in range(len(plan.prompts)):
            group = self.candidates[p * plan.best_of : (p + 1) * plan.best_of]
            best = sorted(group, key=lambda c: (-sum(c.logprobs) / max(len(c.tokens), 1), c.index))[: plan.n]
            for rank, c in enumerate(best):
                c.index = p * plan.n + rank
            chosen += best
        self.choices = chosen

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.plan.prompts)
        done = sum(len(c.tokens) for c in self.candidates)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


class EventStream(StreamingResponse):
    """A StreamingResponse that cleans up as soon as the response ends, the client gone or not: it cancels
    the job's engine rows (a no-op for finished ones) and closes the generator, whose own cleanup then
    runs now rather than at garbage collection (and the rows are cancelled even if it never started)."""

    def __init__(self, content, job: Job, **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            await self.body_iterator.aclose()
