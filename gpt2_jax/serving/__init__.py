"""Serving: the continuous-batching engine (engine.py) and its OpenAI-compatible HTTP API (api.py and its parts:
schema.py, jobs.py, metrics.py). The API needs the serve extra (fastapi, uvicorn); it is imported on first use,
so the engine alone needs neither."""

from gpt2_jax.serving.engine import Cancelled, Engine, QueueFull, Request

__all__ = ["Cancelled", "Engine", "QueueFull", "Request", "create_app", "warm_up"]


def __getattr__(name: str):
    if name in ("create_app", "warm_up"):
        from gpt2_jax.serving import api

        return getattr(api, name)
    raise AttributeError(f"module 'gpt2_jax.serving' has no attribute {name!r}")
