"""One request's rows, their events and their text: the validated plan, the job in flight, each choice.

Each prompt x choice of a request is one engine row: choice i (= prompt p * n + j) gets the row key
fold_in(key(seed), i), the key `generate` gives row i of [p_0]*n + [p_1]*n + ..., so a served choice
has exactly the tokens and logprobs of that generate call. A request without a seed draws one and
returns it (field "seed", header x-seed).
"""

from __future__ import annotations

import asyncio
import codecs
import math
import re
import secrets
import time
from typing import Any

import jax
from fastapi.responses import StreamingResponse

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.generation import MAX_BEAMS, beam_search
from gpt2_jax.generation import prompt_logprobs as score_prompts
from gpt2_jax.sampling import SamplingParams, constraints
from gpt2_jax.serving.engine import Cancelled, Engine, Request
from gpt2_jax.serving.limits import check_chars
from gpt2_jax.serving.metrics import Metrics
from gpt2_jax.serving.rows import row_key
from gpt2_jax.serving.schema import ApiError, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_LIMIT = 2**32  # JAX (without x64) keys on a seed's low 32 bits: larger seeds would collide


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


# ---- the request ---------------------------------------------------------------------------------------------
class Plan:
    """A validated request: its prompts as token ids and text, and the engine's per-row settings."""

    def __init__(self, req: CompletionRequest, engine: Engine, enc: Any, compiler: Any = None,
                 max_beam_tokens: int | None = None):  # fmt: skip
        config = engine.config
        self.n = 1 if req.n is None else req.n
        if self.n < 1:
            raise ApiError(400, f"n must be >= 1, got {self.n}", param="n")
        self.best_of = self.n if req.best_of is None else req.best_of  # candidates per prompt; the n best returned
        if self.best_of < self.n:
            raise ApiError(400, f"best_of={self.best_of} must be >= n={self.n}", param="best_of")
        self.beam = bool(req.use_beam_search)
        if (self.best_of > self.n or self.beam) and req.stream:
            what = "use_beam_search" if self.beam else f"best_of={self.best_of} > n"
            raise ApiError(400, f"{what} cannot be streamed: the best are known only at the end", param="stream")
        if not self.beam and (req.length_penalty is not None or req.early_stopping is not None):
            name = "length_penalty" if req.length_penalty is not None else "early_stopping"
            raise ApiError(400, f"{name} is a beam-search setting: give use_beam_search: true", param=name)
        if req.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix")
        self.max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        if self.max_tokens < 0:
            raise ApiError(400, f"max_tokens must be >= 0, got {self.max_tokens}", param="max_tokens")
        self.echo = bool(req.echo)
        self.top_n = req.logprobs
        if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
            raise ApiError(400, f"seed must be an int in [0, 2**32), got {req.seed}", param="seed")
        self.seed = secrets.randbelow(2**31) if req.seed is None else req.seed
        self.stream = bool(req.stream)
        if req.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self._check_rows(req, engine)  # before any tokenizing: 10,000 prompts are refused at once
        self.prompts, self.texts = self._prompts(req.prompt, enc, config, engine.max_seq)
        for p, ids in enumerate(self.prompts):
            if len(ids) + self.max_tokens > engine.max_seq:
                raise ApiError(400, f"prompt {p}: {len(ids)} prompt tokens + max_tokens={self.max_tokens} exceed "
                                    f"this server's max_seq={engine.max_seq}", param="max_tokens",
                               code="context_length_exceeded")  # fmt: skip
        self.sampling = self._sampling(req, self.max_tokens, self.top_n, compiler, config)
        if self.sampling.min_new_tokens > self.max_tokens:
            raise ApiError(400, f"min_tokens={req.min_tokens} must be <= max_tokens={self.max_tokens}",
                           param="min_tokens")  # fmt: skip
        self.stops = list(self.sampling.stop)
        if self.beam:
            self._beam_settings(req, max_beam_tokens)

    def _check_rows(self, req: CompletionRequest, engine: Engine) -> None:
        """400 when the request's rows (prompts x best_of) exceed the engine's rows plus its queue; the error names
        prompt when the prompts alone are too many, else the field that asked for the candidates. A beam search
        runs outside the engine's rows: --max-beam-tokens bounds it instead (_beam_settings)."""
        if self.beam:
            return
        prompts = (
            req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) else [0]
        )
        capacity, rows = engine.max_batch + engine.max_queue, len(prompts) * self.best_of
        if rows <= capacity:
            return
        name = "best_of" if req.best_of is not None else "n"
        param = "prompt" if len(prompts) > capacity else name
        raise ApiError(400, f"{len(prompts)} prompt(s) x {name}={self.best_of} = {rows} completions exceed this "
                            f"server's capacity of {capacity} (max_batch + max_queue)", param=param)  # fmt: skip

    def _beam_settings(self, req: CompletionRequest, max_beam_tokens: int | None) -> None:
        """use_beam_search: gpt2_jax.beam_search with best_of beams (greedy at temperature 0 or unset, beam sampling
        above), the n best hypotheses returned best first."""
        if self.stops:
            raise ApiError(400, "stop strings are not supported with use_beam_search (stop token ids are)",
                           param="stop")  # fmt: skip
        if self.top_n:
            raise ApiError(400, "use_beam_search reports the chosen tokens' logprobs only: logprobs must be 0",
                           param="logprobs")  # fmt: skip
        if self.max_tokens == 0:
            raise ApiError(400, "use_beam_search needs max_tokens >= 1", param="max_tokens")
        name = "best_of" if req.best_of is not None else "n"  # the field that set the number of beams
        if self.best_of > MAX_BEAMS:
            raise ApiError(400, f"use_beam_search runs {name}={self.best_of} beams; at most {MAX_BEAMS}", param=name)
        self.beam_tokens = self.best_of * len(self.prompts) * (max(map(len, self.prompts)) + self.max_tokens)
        if max_beam_tokens is not None and self.beam_tokens > max_beam_tokens:
            raise ApiError(400, f"use_beam_search with {name}={self.best_of} beams x {len(self.prompts)} prompt(s) x "
                                f"(prompt + max_tokens={self.max_tokens}) = {self.beam_tokens} tokens is over this "
                                f"server's limit of {max_beam_tokens} (--max-beam-tokens)", param=name)  # fmt: skip
        self.beam_settings = {"num_beams": self.best_of, "num_return_sequences": self.n,
                              "length_penalty": 1.0 if req.length_penalty is None else req.length_penalty,
                              "early_stopping": False if req.early_stopping is None else req.early_stopping,
                              "do_sample": bool(req.temperature)}  # fmt: skip

    @staticmethod
    def _prompts(prompt: Any, enc: Any, config: Any, max_seq: int) -> tuple[list[list[int]], list[str]]:
        """A string, a list of strings, a list of token ids or a list of token-id lists -> (ids, text) per prompt.
        A text too long to fit in max_seq tokens whatever it says is refused before it is tokenized."""
        if prompt is None:
            prompt = ""  # OpenAI: as if from the start of a new document
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is an empty list", param="prompt")
        ids, texts = [], []
        for p, x in enumerate(prompt):
            if isinstance(x, str):
                check_chars(x, enc, max_seq, f"prompt {p}")
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
    def _sampling(req: CompletionRequest, max_tokens: int, top_n: int | None, compiler: Any = None,
                  config: Any = None) -> SamplingParams:  # fmt: skip
        """The request's settings as one SamplingParams (OpenAI's and vLLM's names mapped onto its fields;
        it checks every range, and errors name the API's field). A constraint is compiled by `compiler`
        (serving.constraint_worker, a child process) when given, else here."""
        o: dict[str, Any] = {
            "max_new_tokens": max(max_tokens, 1),
            "logprobs": True,  # the engine always reports them (best_of ranks by them); shown only when asked
            "top_logprobs": top_n or 0,
        }
        for api, ours in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                          ("repetition_penalty", "repetition_penalty"), ("presence_penalty", "presence_penalty"),
                          ("frequency_penalty", "frequency_penalty"), ("min_tokens", "min_new_tokens")):  # fmt: skip
            v = getattr(req, api)
            if v is not None:
                o[ours] = v
        if req.top_k is not None:
            if req.top_k < -1:
                raise ApiError(400, f"top_k must be -1 or 0 (off) or a positive int, got {req.top_k}", param="top_k")
            o["top_k"] = max(req.top_k, 0)  # vLLM's -1 is our 0: off
        if req.stop is not None and req.stop != []:
            o["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.logit_bias:
            bad = [k for k in req.logit_bias if not re.fullmatch(r"[0-9]+", k)]
            if bad:
                raise ApiError(400, f"logit_bias keys must be token ids, got {bad[0]!r}", param="logit_bias")
            o["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        given = [f for f in ("regex", "choice", "json_schema") if getattr(req, f) is not None]
        if len(given) > 1:
            raise ApiError(400, f"give at most one of regex, choice and json_schema, got {', '.join(given)}",
                           param=given[1])  # fmt: skip
        try:
            if given:
                payload = getattr(req, given[0])
                if compiler is None:
                    o["constraint"] = getattr(constraints, given[0])(payload)
                else:
                    o["constraint"] = compiler.compile(given[0], payload, config.vocab_size, config.eos_id)
        except GPT2JaxError as e:
            raise ApiError(400, str(e), param=given[0]) from None
        return SamplingParams(**o)


class Job:
    """One HTTP request in flight: its choices, the engine rows, and the queue their events arrive on."""

    def __init__(self, rid: str, plan: Plan, enc: Any, eos: int | None, metrics: Metrics, arrived: float):
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
