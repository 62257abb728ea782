"""One GRPO optimisation epoch over a batch of rollouts, jitted: score, objective, gradient, optax update.

The state is gpt2_jax.training's TrainState (step = optimizer updates, params, optax state) and the optimizer
its make_optimizer; only the loss differs from a training step. The trainer's logprobs come from
completion_logprobs, which equals the sampler's bits even differentiated, so the first epoch's mismatch
(max |trainer - sampler|) is measured, not assumed: the step returns it with the other metrics.

Shape legend: B rows (prompts x group size), T positions, N completion tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import optax

from gpt2_jax.config import GPT2Config
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.params import Params
from gpt2_jax.rl.objective import Objective, grpo_loss, mismatch
from gpt2_jax.rl.scoring import completion_logprobs
from gpt2_jax.training import TrainState
from gpt2_jax.training.step import apply_updates


class Rollout(NamedTuple):
    """A batch of sampled completions, ready for the trainer (see gpt2_jax.rl.scoring.CompletionBatch)."""

    tokens: jax.Array  # [B, T] int32
    index: jax.Array  # [B, N] int32
    mask: jax.Array  # [B, N] bool
    sampled: jax.Array  # [B, N] float32: the sampler's logprobs (the old policy's, in the ratio)
    ref: jax.Array | None  # [B, N] float32: the reference model's logprobs (None: no KL measured)
    advantages: jax.Array  # [B] float32


def rollout_loss(params: Params, rollout: Rollout, config: GPT2Config, objective: Objective):
    """-> (loss [], metrics): the GRPO objective of these params on a rollout; metrics add mismatch (the
    largest |trainer - sampler| logprob) to grpo_loss's."""
    # functools.partial(jax.custom_vjp, ...) hides the wrapped function's return type from the checker
    logprobs: jax.Array = completion_logprobs(params, rollout.tokens, rollout.index, config)  # pyright: ignore[reportAssignmentType]
    loss, metrics = grpo_loss(logprobs, rollout.sampled, rollout.ref, rollout.advantages, rollout.mask, objective)
    return loss, {**metrics, "mismatch": mismatch(logprobs, rollout.sampled, rollout.mask)}


def make_grpo_step(config: GPT2Config, optimizer: optax.GradientTransformation, objective: Objective):
    """A jitted (state, rollout) -> (state, metrics {loss, grad_norm, mismatch, kl, clipped, ratio_min,
    ratio_max}); the state is donated (pass the returned one on)."""

    @functools.partial(jax.jit, donate_argnums=0)
    def jitted(state: TrainState, rollout: Rollout):
        grad_fn = jax.value_and_grad(rollout_loss, has_aux=True)
        (loss, metrics), grads = grad_fn(state.params, rollout, config, objective)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def grpo_step(state: TrainState, rollout: Rollout):
        with on_mesh(mesh_of(state.params)):
            return jitted(state, rollout)

    return grpo_step


@functools.partial(jax.jit, static_argnames="config")
def reference_logprobs(params: Params, tokens: jax.Array, index: jax.Array, config: GPT2Config) -> jax.Array:
    """[B, N] logprobs of a frozen model (the KL's reference) on a rollout's tokens; forward only."""
    return completion_logprobs(params, tokens, index, config)
