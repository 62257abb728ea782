"""Serving: the continuous-batching engine and its OpenAI-compatible HTTP API.

  engine.py             continuous batching over rows of a paged KV cache: admit, prefill by chunks, decode, finish,
                        drain; batch.py: the rows' device state (DeviceBatch); slots.py: a Request, the Slot it
                        holds, their fixed-shape rules
  blocks.py             the KV block pool: block tables, prefix caching by chained block names, LRU eviction
  engine_programs.py    which programs the engine runs, one key type each (Prefill, Decode over 2/8/32/... rows,
                        row start/stop)
  programs.py           those programs, compiled ahead of time off the engine thread
  constraint_worker.py  constraints compiled in a child process, with a time limit
  memory.py             the heap of a long-lived process: jemalloc where installed, else glibc's arenas capped and
                        free pages returned when idle
  warmup.py             start-up: the essential programs first, the rest in the background
  limits.py             what one client may cost: body size, time to send a request, beam-search work
  api.py                the FastAPI app (schema.py, completions.py, metrics.py, openapi.py, static/)
  plan.py               an OpenAI request mapped onto the engine: checked, tokenized, one SamplingParams
  choices.py            a request in flight: each choice's streamed text and logprobs, the Job, the event stream

The HTTP parts need the serve extra (fastapi, uvicorn); they are imported on first use, so the engine alone
needs neither.
"""

from gpt2_jax.serving.engine import Engine

__all__ = ["Engine", "Limits", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from gpt2_jax.serving.api import create_app

        return create_app
    if name == "Limits":  # it needs uvicorn and fastapi, imported on first use
        from gpt2_jax.serving.limits import Limits

        return Limits
    raise AttributeError(f"module 'gpt2_jax.serving' has no attribute {name!r}")
