"""gpt2_jax: GPT-2 as small pure JAX functions, loading real PyTorch checkpoints."""

from gpt2_jax import constraints, distributed, inspect, precision, sampling, sharding
from gpt2_jax.complete import Completion, complete
from gpt2_jax.config import PRESETS, GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError, GPT2JaxError, InputError
from gpt2_jax.generate import GenerateResult, generate, generate_stream
from gpt2_jax.inspect import run_with_cache, run_with_hooks
from gpt2_jax.loading import load
from gpt2_jax.model import forward
from gpt2_jax.params import cast_params, init_params, stack_layers, unstack_layers
from gpt2_jax.tokenizer import tokenizer
from gpt2_jax.train import Hyper, eval_loss, init_state, loss_fn, make_optimizer, make_train_step

__all__ = [
    "PRESETS",
    "CheckpointError",
    "Completion",
    "ConfigError",
    "GPT2Config",
    "GPT2JaxError",
    "GenerateResult",
    "Hyper",
    "InputError",
    "cast_params",
    "complete",
    "constraints",
    "distributed",
    "eval_loss",
    "forward",
    "generate",
    "generate_stream",
    "init_params",
    "init_state",
    "inspect",
    "load",
    "loss_fn",
    "make_optimizer",
    "make_train_step",
    "precision",
    "run_with_cache",
    "run_with_hooks",
    "sampling",
    "sharding",
    "stack_layers",
    "tokenizer",
    "unstack_layers",
]  # fmt: skip
