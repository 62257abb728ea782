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
    "PRESETS", "GPT2Config", "CheckpointError", "ConfigError", "GPT2JaxError", "InputError",
    "load", "forward", "cast_params", "init_params", "stack_layers", "unstack_layers", "tokenizer",
    "loss_fn", "make_train_step", "make_optimizer", "init_state", "eval_loss", "Hyper",
    "generate", "generate_stream", "GenerateResult", "complete", "Completion", "constraints", "sampling", "sharding", "precision", "distributed",
    "run_with_cache", "run_with_hooks", "inspect",
]  # fmt: skip
