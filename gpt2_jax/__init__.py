"""gpt2_jax: GPT-2 as small pure JAX functions, loading real PyTorch checkpoints."""

from gpt2_jax import distributed, precision, sampling, sharding
from gpt2_jax.config import PRESETS, GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError, GPT2JaxError, InputError
from gpt2_jax.generate import GenerateResult, generate, generate_stream
from gpt2_jax.loading import load
from gpt2_jax.model import forward
from gpt2_jax.params import cast_params, init_params, unstack_layers
from gpt2_jax.tokenizer import tokenizer

__all__ = [
    "PRESETS", "GPT2Config", "CheckpointError", "ConfigError", "GPT2JaxError", "InputError",
    "load", "forward", "cast_params", "init_params", "unstack_layers", "tokenizer",
    "generate", "generate_stream", "GenerateResult", "sampling", "sharding", "precision", "distributed",
]  # fmt: skip
