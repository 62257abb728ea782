"""Serving: the continuous-batching engine and its OpenAI-compatible HTTP API.

  engine.py             continuous batching over rows of a paged KV cache: submit, the step loop, drain;
                        engine_rows.py: each step's work (admit, decode, finish); engine_prompts.py: the
                        prompt chunks going in (alone or riding a decode step);
                        engine_checks.py: a request's and the settings' checks; batch.py: the rows' device
                        state (DeviceBatch); slots.py: a Request, the Slot it holds, their fixed-shape rules
  blocks.py             the KV block pool: block tables, prefix caching by chained block names, LRU eviction
  engine_programs.py    the engine's programs by name: prefill(T), decode(rows, top), start_row, stop_rows
  programs.py           those programs, compiled ahead of time off the engine thread
  constraint_worker.py  constraints compiled in a child process, with a time limit
  memory.py             the heap of a long-lived process: jemalloc where installed, else glibc's arenas capped and
                        free pages returned when idle
  warmup.py             start-up: the essential programs first, the rest in the background
  limits.py             what one client may cost: body size, time to send a request, beam-search work
  api.py                the FastAPI app (schema.py, completions.py, metrics.py, openapi.py, static/)
  chat.py               /v1/chat/completions: messages through the chat template (chat_template.py) to a prompt,
                        then the completions path; chat_schema.py: its body and answer
  plan.py               an OpenAI request mapped onto the engine: checked, tokenized, one SamplingParams
  choices.py            a request in flight: the Job and its event stream; streamed_text.py: a choice's text;
                        logprobs_json.py: its logprobs as OpenAI's JSON

The HTTP parts need the serve extra (fastapi, uvicorn, jinja2); they are imported on first use, so the engine alone
needs neither.
"""

import typing

from gpt2_jax.serving.engine import Engine

if typing.TYPE_CHECKING:  # imported on first use (below): they need the serve extra
    from gpt2_jax.serving.api import create_app
    from gpt2_jax.serving.limits import Limits

__all__ = ["Engine", "Limits", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from gpt2_jax.serving.api import create_app

        return create_app
    if name == "Limits":  # it needs uvicorn and fastapi, imported on first use
        from gpt2_jax.serving.limits import Limits

        return Limits
    raise AttributeError(f"module 'gpt2_jax.serving' has no attribute {name!r}")
