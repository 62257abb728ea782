"""An OpenAI completions request mapped onto the engine: checked field by field (errors name the API's field),
its prompts tokenized, its settings one SamplingParams, and its rows counted against the engine's capacity.

Each prompt x choice of a request is one engine row: choice i (= prompt p * n + j) gets the row key
fold_in(key(seed), i), the key `generate` gives row i of [p_0]*n + [p_1]*n + ..., so a served choice
has exactly the tokens and logprobs of that generate call. A request without a seed draws one and
returns it (field "seed", header x-seed).
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.generation.beam import MAX_BEAMS
from gpt2_jax.sampling import SamplingParams, constraints
from gpt2_jax.sampling.checks import MAX_STOP_IDS
from gpt2_jax.serving.engine import Engine
from gpt2_jax.serving.limits import check_chars
from gpt2_jax.serving.schema import ApiError, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_LIMIT = 2**32  # JAX (without x64) keys on a seed's low 32 bits: larger seeds would collide


class RequestPlan:
    """A validated request: its prompts as token ids and text, and the engine's per-row settings."""

    def __init__(self, req: CompletionRequest, engine: Engine, enc: Any, compiler: Any = None,
                 max_beam_tokens: int | None = None, default_max_tokens: int | None = DEFAULT_MAX_TOKENS):  # fmt: skip
        """default_max_tokens: max_tokens when the request gives none (None: the rest of the context, as chat has)."""
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
        given = _given_max_tokens(req)
        max_tokens = default_max_tokens if given is None else given
        if max_tokens is not None and max_tokens < 0:
            raise ApiError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
        self.echo = bool(req.echo)
        self.top_n = req.logprobs
        if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
            raise ApiError(400, f"seed must be an int in [0, 2**32), got {req.seed}", param="seed")
        self.seed = secrets.randbelow(2**31) if req.seed is None else req.seed
        self.stream = bool(req.stream)
        options = req.stream_options
        if options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)  # usage so far in every chunk
        self._check_rows(req, engine)  # before any tokenizing: 10,000 prompts are refused at once
        self.prompts, self.texts = self._prompts(req.prompt, enc, config, engine.max_seq)
        # none given and no default: as much as the longest prompt leaves (at least 1, else the 400 below)
        self.max_tokens = max(engine.max_seq - max(map(len, self.prompts)), 1) if max_tokens is None else max_tokens
        for p, ids in enumerate(self.prompts):
            if len(ids) + self.max_tokens > engine.max_seq:
                raise ApiError(400, f"prompt {p}: {len(ids)} prompt tokens + max_tokens={self.max_tokens} exceed "
                                    f"this server's max_seq={engine.max_seq}", param="max_tokens",
                               code="context_length_exceeded")  # fmt: skip
        stop_ids = _stop_ids(req.stop_token_ids or [], config.valid_vocab)
        self.sampling = self._sampling(req, self.max_tokens, self.top_n, compiler, config)
        if self.sampling.min_new_tokens > self.max_tokens:
            raise ApiError(400, f"min_tokens={req.min_tokens} must be <= max_tokens={self.max_tokens}",
                           param="min_tokens")  # fmt: skip
        self.stops = list(self.sampling.stop)
        eos = self.sampling.eos(config)
        self.end_ids = frozenset(stop_ids + ([] if eos is None else [eos]))  # the tokens that end a row
        self.skip_special = req.skip_special_tokens is not False  # <|endoftext|> left out of the text
        self.speculate = req.speculative is not False  # takes part in speculative decoding, where the server has it
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
        if req.ignore_eos:
            o["eos_id"] = None  # vLLM's ignore_eos: EOS is a token like any other
        if req.stop_token_ids:
            o["stop_ids"] = tuple(req.stop_token_ids)
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
        if given and req.ignore_eos:
            raise ApiError(400, f"ignore_eos cannot be combined with {given[0]}: a constrained output ends on EOS",
                           param="ignore_eos")  # fmt: skip
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


def _given_max_tokens(req: CompletionRequest) -> int | None:
    """max_tokens or its newer name max_completion_tokens (None: neither given); both given must agree."""
    old, new = req.max_tokens, req.max_completion_tokens
    if old is not None and new is not None and old != new:
        raise ApiError(400, f"max_tokens={old} and max_completion_tokens={new} differ: give one of them "
                            "(max_completion_tokens is OpenAI's newer name for max_tokens)",
                       param="max_completion_tokens")  # fmt: skip
    return new if new is not None else old


def _stop_ids(ids: list[int], vocab: int) -> list[int]:
    """stop_token_ids checked: inside the vocab, and at most MAX_STOP_IDS (the engine's fixed width)."""
    if len(ids) > MAX_STOP_IDS:
        raise ApiError(400, f"stop_token_ids: at most {MAX_STOP_IDS} token ids are supported, got {len(ids)}",
                       param="stop_token_ids")  # fmt: skip
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"stop_token_ids: token id {bad[0]} is outside the vocab [0, {vocab})",
                       param="stop_token_ids")  # fmt: skip
    return list(ids)
