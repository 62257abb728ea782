"""The gpt2-jax command: generate, convert, train, data, serve, explain, rl, info. It uses only the public API
(checked by import-linter, see pyproject.toml)."""

from gpt2_jax.checkpoints import BUNDLED_MODEL
from gpt2_jax.cli.parser import main

__all__ = ["BUNDLED_MODEL", "main"]
