"""Reinforcement learning on the model's own samples: GRPO, exactly on-policy.

The sampler (generate) and the trainer (a forward over the sampled sequences) compute every logprob with the
same bits, so the trainer sees exactly the policy that sampled: the first epoch's ratio is 1 exactly, and
the mismatch each step records is 0.0, measured.

scoring.py    sequence_logprobs and completion_logprobs: the sampler's logprobs from a forward, differentiable
objective.py  group advantages, the clipped ratio objective, the KL to a reference (pure functions)
rewards.py    rewards on text: regex, length, a Python function; the CLI's spec strings
step.py       one jitted optimisation epoch (training's TrainState and optimizer)
loop.py       grpo(): sample, score, several epochs per batch; checkpoints, history, bit-exact resume
plots.py      the run's reward / KL / mismatch figure
"""

from gpt2_jax.rl.loop import DEFAULT_HYPER, DEFAULT_SAMPLING, METRICS, grpo, sample_groups
from gpt2_jax.rl.objective import LOSS_TYPES, Objective, group_advantages, grpo_loss, mismatch, token_kl
from gpt2_jax.rl.rewards import Reward, RewardError, length_reward, parse_reward, regex_reward, score
from gpt2_jax.rl.scoring import CompletionBatch, completion_logprobs, pack_completions, sequence_logprobs
from gpt2_jax.rl.step import Rollout, make_grpo_step, reference_logprobs, rollout_loss

__all__ = [
    "DEFAULT_HYPER", "DEFAULT_SAMPLING", "LOSS_TYPES", "METRICS", "CompletionBatch", "Objective", "Reward",
    "RewardError", "Rollout", "completion_logprobs", "group_advantages", "grpo", "grpo_loss", "length_reward",
    "make_grpo_step", "mismatch", "pack_completions", "parse_reward", "reference_logprobs", "regex_reward",
    "rollout_loss", "sample_groups", "score", "sequence_logprobs", "token_kl",
]  # fmt: skip
