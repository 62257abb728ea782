"""A request in flight: the Job that queues its rows and gathers their events, and the event stream. Each
choice's streamed text is serving.streamed_text's Choice; its logprobs as OpenAI's JSON and the prompt's echo,
serving.logprobs_json's.

The rows, their keys and settings come from a RequestPlan (serving.plan); each choice's text is streamed
without ever taking back a character.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

import jax
from fastapi.responses import StreamingResponse

from gpt2_jax.generation import beam_search
from gpt2_jax.serving.engine import Cancelled, Engine, Request
from gpt2_jax.serving.logprobs_json import logprobs_object
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.plan import RequestPlan
from gpt2_jax.serving.slots import row_key
from gpt2_jax.serving.streamed_text import Choice


class Job:
    """One HTTP request in flight: its choices, the engine rows, and the queue their events arrive on."""

    def __init__(self, rid: str, plan: RequestPlan, enc: Any, metrics: Metrics, arrived: float):
        self.rid, self.plan, self.metrics = rid, plan, metrics
        self.arrived = arrived  # perf_counter() when the request came in
        self.first_token: float | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        k = plan.n if plan.beam else plan.best_of  # rows per prompt: best_of candidates (beam search returns n)
        self.choices = [Choice(p * k + j, p, enc, plan.stops, plan.end_ids, plan.skip_special)
                        for p in range(len(plan.prompts)) for j in range(k)]  # fmt: skip
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
            requests = []
            for c in self.choices:
                c.request = Request(plan.prompts[c.prompt_index], plan.sampling, row_key(plan.seed, c.index),
                                    self._callback(c.index), seed=plan.seed, speculate=plan.speculate)  # fmt: skip
                c.request.prepared = engine.check(c.request)  # every row validated before any is queued
                requests.append(c.request)
            for request in requests:
                engine.submit(request)
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
        return logprobs_object(c.enc, tokens, lps, tops, offset)

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
            await cast(AsyncGenerator, self.body_iterator).aclose()  # the job's event generator
