"""The figure a GRPO run writes beside its history: reward per step, and the sampler-trainer mismatch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def plot_rewards(history: dict[str, Any], path: Path) -> None:
    """Mean reward per step (with its spread over the step's completions), the KL to the reference, and the
    first epoch's largest |sampler - trainer| logprob, as a PNG."""
    from matplotlib.figure import Figure  # a Figure of its own: no pyplot, the caller's backend is untouched

    steps = np.arange(1, len(history["reward_mean"]) + 1)
    mean, std = np.asarray(history["reward_mean"]), np.asarray(history["reward_std"])
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    ax, kl, gap = fig.subplots(1, 3)
    ax.plot(steps, mean, "o-", ms=3, label="mean reward")
    ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="± std over the step's completions")
    ax.set(title="reward", xlabel="GRPO step", ylabel="reward")
    ax.legend(fontsize=8)
    kl.plot(steps, history["kl"], "o-", ms=3, color="tab:green")
    kl.set(title="KL(policy ‖ reference) per token", xlabel="GRPO step", ylabel="nats")
    gap.plot(steps, history["mismatch"], "o-", ms=3, color="tab:red")
    gap.set(title="largest |sampler − trainer| logprob", xlabel="GRPO step", ylabel="nats (first epoch)")
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
