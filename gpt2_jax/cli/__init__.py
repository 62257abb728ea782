"""The gpt2-jax command: generate, convert, train, data, serve, explain, rl, info. It imports the folders below
it, never the reverse (checked by import-linter, see pyproject.toml)."""

from gpt2_jax.cli.parser import main

__all__ = ["main"]
