"""Serving: the continuous-batching engine and its OpenAI-compatible HTTP API.

  engine.py             continuous batching over slots; rows.py: a request, a slot, their fixed-shape rows
  programs.py           the engine's programs, compiled ahead of time off the engine thread
  constraint_worker.py  constraints compiled in a child process, with a time limit
  warmup.py             start-up: the essential programs first, the rest in the background
  api.py                the FastAPI app (schema.py, completions.py, jobs.py, metrics.py, openapi.py, static/)

The HTTP parts need the serve extra (fastapi, uvicorn); they are imported on first use, so the engine alone
needs neither.
"""

from gpt2_jax.serving.constraint_worker import ConstraintCompiler
from gpt2_jax.serving.engine import Cancelled, Engine, QueueFull, Request
from gpt2_jax.serving.warmup import warm_up

__all__ = ["Cancelled", "ConstraintCompiler", "Engine", "QueueFull", "Request", "create_app", "warm_up"]


def __getattr__(name: str):
    if name == "create_app":
        from gpt2_jax.serving.api import create_app

        return create_app
    raise AttributeError(f"module 'gpt2_jax.serving' has no attribute {name!r}")
