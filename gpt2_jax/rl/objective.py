"""GRPO's objective as pure functions: group-relative advantages, the clipped ratio, the KL to a reference.

As DeepSeekMath's GRPO and TRL's GRPOTrainer write it. For prompt p's G completions with rewards r:
  advantage    A = (r - mean_G(r)) / (std_G(r) + 1e-4)     (std with Bessel's correction, as TRL)
  ratio        rho = exp(logp - logp_old)                    (per token; logp_old: the policy that sampled)
  token loss   -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta KL
  KL           exp(ref - logp) - (ref - logp) - 1            (k3, Schulman's unbiased, non-negative estimator)
averaged per completion and then over completions ("grpo", DeepSeekMath's), or over every token of the batch
("dapo", TRL's default). On the first epoch over a batch logp == logp_old bit for bit here (the trainer
scores exactly what the sampler drew), so rho is exactly 1; later epochs move it.

Shape legend: P prompts, G completions per prompt, B = P x G rows, N completion tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.errors import ConfigError

LOSS_TYPES = ("grpo", "dapo")
STD_EPS = 1e-4  # TRL's: a group whose rewards all agree gets advantage 0, not 0/0


class Objective(NamedTuple):
    """The clipped objective's settings (static: part of the compiled step)."""

    epsilon: float = 0.2  # clip below: rho >= 1 - epsilon
    epsilon_high: float | None = None  # clip above: rho <= 1 + epsilon_high (None: epsilon; DAPO raises it)
    beta: float = 0.0  # weight of the KL to the reference
    loss_type: str = "grpo"

    def check(self) -> Objective:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        for name in ("epsilon", "epsilon_high", "beta"):
            v = getattr(self, name)
            if v is not None and not (np.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        return self

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: np.ndarray) -> np.ndarray:
    """rewards [P, G] -> advantages [P, G] float32: each reward against its own prompt's group."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ConfigError(f"rewards must be [prompts, group_size] with group_size >= 2, got shape {r.shape}")
    std = r.std(axis=1, ddof=1, keepdims=True)
    return ((r - r.mean(axis=1, keepdims=True)) / (std + STD_EPS)).astype(np.float32)


def token_kl(logprobs: jax.Array, ref: jax.Array) -> jax.Array:
    """[B, N] -> [B, N]: the k3 estimate of KL(policy || reference) at each sampled token."""
    d = ref - logprobs
    return jnp.exp(d) - d - 1.0


def _mean(x: jax.Array, mask: jax.Array, loss_type: str) -> jax.Array:
    """[B, N] -> []: per completion then over completions ("grpo"), or over all tokens ("dapo")."""
    x = jnp.where(mask, x, 0.0)
    if loss_type == "grpo":
        return jnp.mean(x.sum(-1) / jnp.maximum(mask.sum(-1), 1))
    return x.sum() / jnp.maximum(mask.sum(), 1)


def grpo_loss(
    logprobs: jax.Array,
    old: jax.Array,
    ref: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    objective: Objective,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """logprobs, old, ref [B, N], advantages [B], mask [B, N] -> (loss [], metrics): the objective above.
    metrics: kl (mean per token; 0 without ref), clipped (the share of tokens whose clipped term is the
    smaller, where the gradient is cut), ratio_min, ratio_max."""
    ratio = jnp.exp(logprobs - old)
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1.0 - objective.epsilon, 1.0 + objective.high)
    per_token = -jnp.minimum(ratio * a, clipped * a)
    kl = jnp.zeros_like(ratio) if ref is None else token_kl(logprobs, ref)
    if objective.beta:
        per_token = per_token + objective.beta * kl
    cut = ((ratio < 1.0 - objective.epsilon) & (a < 0)) | ((ratio > 1.0 + objective.high) & (a > 0))
    count = jnp.maximum(mask.sum(), 1)
    metrics = {
        "kl": jnp.where(mask, kl, 0.0).sum() / count,
        "clipped": (cut & mask).sum() / count,
        "ratio_min": jnp.min(jnp.where(mask, ratio, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
    }
    return _mean(per_token, mask, objective.loss_type), metrics


def mismatch(logprobs: jax.Array, sampled: jax.Array, mask: jax.Array) -> jax.Array:
    """The largest |trainer - sampler| logprob over the real tokens -> [] (exactly 0.0 on a first epoch)."""
    return jnp.max(jnp.where(mask, jnp.abs(logprobs - sampled), 0.0))
