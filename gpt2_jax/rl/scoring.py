"""The trainer's logprobs: each completion token's log-probability, bit for bit the sampler's, and differentiable.

`generate(..., logprobs=True)` reports log_softmax(raw logits)[token] from its cached decode steps; a full
forward over the same sequence gives every position those logits bit for bit (the model's prefill/decode
invariance), whatever the batch, its order, padding or bucket. So scoring a sampled completion with the
forward reproduces the sampler's logprobs exactly: the trainer is exactly on-policy.

One thing breaks that under jax.grad, and it is handled here. Differentiated, XLA compiles the forward
together with the residuals its backward keeps, fuses it differently and rounds differently: on the bundled
model, autodiff's forward gives logprobs a few 1e-6 away from the sampler's (bench/RESULTS.md, RL). `completion_logprobs` therefore has a custom VJP: its forward is the plain inference forward
(the sampler's bits, and nothing kept but its inputs), and its backward differentiates the same function
written as the training step writes its loss (training's attention, its unrolled layer scan, its chunked
fused head), which equals the inference forward to float32 rounding and which autodiff differentiates faster.
The gradient is therefore the gradient at activations a rounding error away from the forward's (it matches
PyTorch's to 1e-4, tests/test_rl_scoring.py); the price is one more forward per backward.

Shape legend: B rows, T positions (bucketed), N completion tokens, D width, V vocab.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.generation.batching import as_prompts
from gpt2_jax.generation.scoring import check_rows, padded_rows
from gpt2_jax.model import stack_layers
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.gpt2 import trunk, unembed
from gpt2_jax.model.layers import layer_norm
from gpt2_jax.model.params import Params
from gpt2_jax.sampling.draw import token_logprobs
from gpt2_jax.training.loss_head import weighted_head_loss
from gpt2_jax.training.step import TRAIN_UNROLL


class CompletionBatch(NamedTuple):
    """Prompts and completions as the trainer's arrays."""

    tokens: np.ndarray  # [B, T] int32: prompt then completion, right-padded with the row's last token
    index: np.ndarray  # [B, N] int32: the position whose logits predict completion token n (clamped past the end)
    mask: np.ndarray  # [B, N] bool: completion token n is real (not past the row's end)


def pack_completions(
    prompts: Any, completions: Any, config: GPT2Config, *, length: int = 0, steps: int = 0
) -> CompletionBatch:
    """Host lists -> CompletionBatch arrays. T is the bucket of the longest row (at least `length`), N the longest
    completion (at least `steps`): a loop that passes the same length and steps every time compiles once."""
    prompts, completions = as_prompts(prompts), [[int(t) for t in c] for c in completions]
    if len(prompts) != len(completions):
        raise InputError(f"{len(prompts)} prompts but {len(completions)} completions")
    rows = [p + c for p, c in zip(prompts, completions)]
    check_rows(rows, config)
    tokens = padded_rows(rows, config, length)
    N = max(max(map(len, completions), default=0), steps)
    start = np.array([len(p) - 1 for p in prompts])  # the position that predicts each completion's first token
    index = np.minimum(start[:, None] + np.arange(N)[None, :], tokens.shape[1] - 2).astype(np.int32)
    mask = np.arange(N)[None, :] < np.array([len(c) for c in completions])[:, None]
    return CompletionBatch(tokens, index, mask)


def _forward(params: Params, tokens: jax.Array, index: jax.Array, config: GPT2Config) -> jax.Array:
    """[B, T] tokens, [B, N] positions -> [B, N] log p(tokens[b, index + 1] | tokens[b, :index + 1]): the model's
    trunk, then the head at the scored positions only (a token's logits are the same bits computed alone or
    among all T, see gpt2_jax.model.layers.matmul), then decode's own token_logprobs."""
    h = trunk(params, tokens, config)  # [B, T, D]
    logits = unembed(params, jnp.take_along_axis(h, index[..., None], axis=1), config)  # [B, N, V]
    B, N, V = logits.shape
    targets = jnp.take_along_axis(tokens, index + 1, axis=1)
    return token_logprobs(logits.reshape(B * N, V), targets.reshape(-1)).reshape(B, N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def completion_logprobs(params: Params, tokens: jax.Array, index: jax.Array, config: GPT2Config) -> jax.Array:
    """[B, T] tokens, [B, N] positions (CompletionBatch's) -> [B, N] float32 logprobs, the sampler's bits whether or not
    they are differentiated (see the module docstring). Unjitted, for a caller's jit or grad; past a row's end
    the values are those of a clamped position (mask them)."""
    return _forward(params, tokens, index, config)


def _fwd(params, tokens, index, config):
    return _forward(params, tokens, index, config), (params, tokens, index)


def _training_objective(params: Params, tokens: jax.Array, index: jax.Array, g: jax.Array, config: GPT2Config):
    """sum(g x logprobs) as the training step computes a loss: the same function as _forward's to float32
    rounding, in the form autodiff differentiates fastest (training's attention and unrolled layer scan on
    stacked layers, see gpt2_jax.training.loss_fn, and its fused head, chunked, its gradient made in one pass)."""
    config = config.replace(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)  # a key selects training's path only
    stacked = stack_layers(params)
    x = trunk(stacked, tokens, config, jax.random.key(0), unroll=min(TRAIN_UNROLL, config.n_layer))
    h = layer_norm(stacked["ln_f"], jnp.take_along_axis(x, index[..., None], axis=1), config.layer_norm_epsilon)
    targets = jnp.take_along_axis(tokens, index + 1, axis=1)
    return -weighted_head_loss(h, stacked["wte"], targets, g)  # logprob = -cross-entropy


def _bwd(config, res, g):
    # The barrier keeps XLA from merging the backward's forward with the forward above (were they the same ops
    # on the same inputs, the forward would get autodiff's fusion, and its rounding, again).
    params, tokens, index = jax.lax.optimization_barrier(res)
    return jax.grad(_training_objective)(params, tokens, index, g, config), None, None


completion_logprobs.defvjp(_fwd, _bwd)


@functools.partial(jax.jit, static_argnames="config")
def _masked_logprobs(params: Params, tokens: jax.Array, index: jax.Array, mask: jax.Array, config: GPT2Config):
    return jnp.where(mask, completion_logprobs(params, tokens, index, config), 0.0)


def sequence_logprobs(params: Params, config: GPT2Config, prompts: Any, completions: Any) -> jax.Array:
    """The log-probability of each completion token after its prompt -> [B, N] float32 (N: the longest
    completion; 0 past a row's end): bit for bit the logprobs generate returned when it sampled them, whatever
    the batch, its order, padding or bucket, and still those bits when differentiated (jax.grad flows through
    it, in params)."""
    batch = pack_completions(prompts, completions, config)
    if batch.mask.shape[1] == 0:
        return jnp.zeros((len(batch.tokens), 0), jnp.float32)
    with on_mesh(mesh_of(params)):
        return _masked_logprobs(params, *map(jnp.asarray, batch), config)
