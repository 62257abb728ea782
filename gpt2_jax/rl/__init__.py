"""Reinforcement learning on the model's own samples: GRPO, exactly on-policy.

The sampler (generate) and the trainer (a forward over the sampled sequences) compute every logprob with the
same bits, so the trainer sees exactly the policy that sampled: the first epoch's ratio is 1 exactly, and
the mismatch each step records is 0.0, measured.

scoring.py    sequence_logprobs and completion_logprobs: the sampler's logprobs from a forward, differentiable
objective.py  group advantages, the clipped ratio objective, the KL to a reference (pure functions)
rewards.py    rewards on text: regex, length, a Python function; the CLI's spec strings
step.py       one jitted optimisation epoch (training's TrainState and optimizer)
loop.py       grpo(): sample, score, several epochs per batch; checkpoints, history, bit-exact resume
runner.py     a run's steps: sample_groups, one batch's rollouts and epochs
plots.py      the run's reward / KL / mismatch figure
"""

from gpt2_jax.rl.loop import grpo
from gpt2_jax.rl.objective import Objective, group_advantages, grpo_loss
from gpt2_jax.rl.rewards import Reward, length_reward, parse_reward, regex_reward
from gpt2_jax.rl.runner import sample_groups
from gpt2_jax.rl.scoring import sequence_logprobs
from gpt2_jax.rl.step import make_grpo_step

__all__ = [
    "Objective",
    "Reward",
    "group_advantages",
    "grpo",
    "grpo_loss",
    "length_reward",
    "make_grpo_step",
    "parse_reward",
    "regex_reward",
    "sample_groups",
    "sequence_logprobs",
]
