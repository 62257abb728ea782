"""Serving: a continuous-batching engine (engine.py) and an OpenAI-compatible HTTP API (api.py)."""

from gpt2_jax.serving.engine import Cancelled, Engine, QueueFull, Request

__all__ = ["Cancelled", "Engine", "QueueFull", "Request"]
