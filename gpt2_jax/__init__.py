"""gpt2_jax: GPT-2 as small pure JAX functions, loading real PyTorch checkpoints.

The public API. Each folder answers one question:
  model/        what GPT-2 computes: params, blocks, attention, the KV cache, forward
  kernels/      the CPU kernels that keep a row's bits independent of its batch
  checkpoints/  weights in and out: load, convert, the hub, gpt2_jax's own format
  generation/   prompts into tokens: prefill, decode steps, generate, complete, speculative decoding
  sampling/     choosing the next token: SamplingParams, processors, filters, the draw, constraints
  training/     learning the weights: loss, train step, the training loop, data
  parallel/     many devices and hosts: meshes, sharding, multi-process runs
  interp/       looking inside: TransformerLens-named hooks, logit lens, patching
  serving/      the continuous-batching engine and its OpenAI-compatible HTTP API
  nnx/          GPT-2 as a Flax NNX module over the same params and functions (imported on first use)
  rl/           reinforcement learning on the model's samples: GRPO, exactly on-policy
  cli/          the gpt2-jax command
"""

from gpt2_jax import interp as interp
from gpt2_jax import kernels as kernels
from gpt2_jax import rl as rl
from gpt2_jax import sampling as sampling
from gpt2_jax.checkpoints import BUNDLED_MODEL, convert, load
from gpt2_jax.config import PRESETS, GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError, GPT2JaxError, InputError
from gpt2_jax.generation import BeamResult, Completion, GenerateResult, beam_search, complete, generate, generate_stream
from gpt2_jax.interp import run_with_cache, run_with_hooks
from gpt2_jax.model import cast_params, forward, init_params
from gpt2_jax.sampling import SamplingParams
from gpt2_jax.sampling import constraints as constraints
from gpt2_jax.tokenizer import tokenizer
from gpt2_jax.training import Hyper, init_state, loss_fn, make_optimizer, make_train_step

inspect = interp  # the folder's name before 0.4 (it shadowed the standard library's inspect module)


def __getattr__(name: str):
    """gpt2_jax.nnx on first use: it imports flax (about 0.6 s), which nothing else needs."""
    if name == "nnx":
        import importlib

        return importlib.import_module("gpt2_jax.nnx")
    raise AttributeError(f"module 'gpt2_jax' has no attribute {name!r}")


# The folders (interp, kernels, rl, sampling, constraints; nnx on first use) are reachable as attributes;
# __all__ names the functions and types a user calls.
__all__ = [
    "BUNDLED_MODEL", "PRESETS", "BeamResult", "CheckpointError", "Completion", "ConfigError", "GPT2Config",
    "GPT2JaxError", "GenerateResult", "Hyper", "InputError", "SamplingParams", "beam_search", "cast_params", "complete",
    "convert", "forward", "generate", "generate_stream", "init_params", "init_state", "load", "loss_fn",
    "make_optimizer", "make_train_step", "run_with_cache", "run_with_hooks", "tokenizer",
]  # fmt: skip
