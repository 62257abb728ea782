"""One GRPO run's steps: each step's prompts, their sampled groups (generate), the rewards and the rollout, the
optimisation epochs, the step's history entry and its checkpoint (gpt2_jax.rl.loop's grpo drives them)."""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.generation import generate
from gpt2_jax.generation.chunks import encoding
from gpt2_jax.model.params import Params
from gpt2_jax.rl.objective import Objective, group_advantages
from gpt2_jax.rl.rewards import score
from gpt2_jax.rl.scoring import pack_completions
from gpt2_jax.rl.step import Rollout, make_grpo_step, reference_logprobs
from gpt2_jax.sampling import SamplingParams
from gpt2_jax.training import Hyper, make_optimizer
from gpt2_jax.training.run_dir import progress_bar, write_json

METRICS = ("reward_mean", "reward_std", "mismatch", "kl", "loss", "clipped", "ratio_min", "ratio_max", "grad_norm",
           "completion_tokens", "sampled_tokens_per_s", "trained_tokens_per_s", "step_s")  # fmt: skip


def step_prompts(n: int, per_step: int, s: int) -> list[int]:
    """The prompt indices of step s: the next per_step of the list, cycling."""
    return [(s * per_step + i) % n for i in range(per_step)]


def _completion_text(enc: Any, tokens: list[int], eos: int | None) -> str:
    return enc.decode([t for t in tokens if t != eos])


def sample_groups(params: Params, config: GPT2Config, ids: list[list[int]], group_size: int, sampling: SamplingParams,
                  key: jax.Array, tokenizer: Any = None):  # fmt: skip
    """Each prompt's group: G completions each (rows p*G .. p*G + G - 1) -> (completions [B] token lists,
    their texts, the sampler's logprobs [B, max_new_tokens], seconds)."""
    rows = [p for p in ids for _ in range(group_size)]
    t0 = time.perf_counter()
    out = generate(params, config, rows, key, sampling=sampling.replace(logprobs=True))
    seconds = time.perf_counter() - t0
    completions = [out.tokens[b, : out.lengths[b]].tolist() for b in range(len(rows))]
    enc, eos = encoding(tokenizer), sampling.eos(config)
    return completions, [_completion_text(enc, c, eos) for c in completions], out.logprobs, seconds


@functools.lru_cache(maxsize=8)
def grpo_step(config: GPT2Config, hyper: Hyper, objective: Objective):
    """One jitted step per setting, shared by the runs that use it (a second run, or a resumed one, in the same
    process compiles nothing new)."""
    return make_grpo_step(config, make_optimizer(hyper), objective)


class Run:
    """One run's fixed settings, and its steps."""

    def __init__(self, config, texts, ids, reward, key, group_size, per_step, sampling, epochs, hyper, objective,
                 length, tokenizer):  # fmt: skip
        self.config, self.texts, self.ids, self.reward, self.key = config, texts, ids, reward, key
        self.G, self.P, self.sampling, self.epochs, self.length = group_size, per_step, sampling, epochs, length
        self.tokenizer, self.step_fn = tokenizer, grpo_step(config, hyper, objective)
        self.warned = False

    def rollout(self, params: Params, ref: Params, s: int) -> tuple[Rollout, np.ndarray, float]:
        """Step s's sampled batch -> (rollout, rewards [B], sampling seconds)."""
        chosen = step_prompts(len(self.ids), self.P, s)
        ids = [self.ids[i] for i in chosen]
        completions, comp_texts, sampled, seconds = sample_groups(
            params, self.config, ids, self.G, self.sampling, jax.random.fold_in(self.key, s), self.tokenizer
        )
        rewards = score(self.reward, [self.texts[i] for i in chosen for _ in range(self.G)], comp_texts)
        advantages = group_advantages(rewards.reshape(self.P, self.G)).reshape(-1)
        packed = pack_completions([p for p in ids for _ in range(self.G)], completions, self.config, length=self.length,
                      steps=self.sampling.max_new_tokens)  # fmt: skip
        tokens, index = jnp.asarray(packed.tokens), jnp.asarray(packed.index)
        ref_lp = reference_logprobs(ref, tokens, index, self.config)
        rollout = Rollout(tokens, index, jnp.asarray(packed.mask), jnp.asarray(sampled), ref_lp,
                          jnp.asarray(advantages))  # fmt: skip
        return rollout, rewards, seconds

    def steps(self, state, ref, history, start, steps, progress, callback, directory, ckpt_every):
        bar = progress_bar(start, steps, progress)
        for s in range(start, steps):
            t0 = time.perf_counter()
            rollout, rewards, gen_s = self.rollout(state.params, ref, s)
            t1 = time.perf_counter()
            epochs = []
            for _ in range(self.epochs):
                state, metrics = self.step_fn(state, rollout)
                epochs.append(metrics)
            epochs = jax.device_get(epochs)  # waits for the updates
            t2 = time.perf_counter()
            record = self.record(rewards, rollout, epochs, gen_s, t2 - t1, t2 - t0)
            for m in METRICS:
                history[m].append(record[m])
            done = s + 1
            if directory is not None and (done % ckpt_every == 0 or done == steps):
                import orbax.checkpoint as ocp

                manager, out = directory
                manager.save(done, args=ocp.args.StandardSave(state))
                manager.wait_until_finished()
                write_json(out / "history.json", history)
            if callback is not None:
                callback(s, state.params, record)
            bar.update(1)
            bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}", mismatch=record["mismatch"], kl=f"{record['kl']:.4f}"
            )
        bar.close()
        return state, history

    def record(self, rewards, rollout, epochs, gen_s, train_s, step_s) -> dict[str, float]:
        """One step's history entry: the first epoch's mismatch, KL and clipping; the last epoch's ratios."""
        first, last = epochs[0], epochs[-1]
        tokens = int(np.asarray(rollout.mask).sum())
        mismatch = float(first["mismatch"])
        if mismatch != 0.0 and not self.warned:
            warnings.warn(f"sampler and trainer logprobs differ by up to {mismatch:.3g} (expected exactly 0.0)",
                          stacklevel=3)  # fmt: skip
            self.warned = True
        return {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()), "mismatch": mismatch,
            "kl": float(first["kl"]), "loss": float(first["loss"]), "clipped": float(last["clipped"]),
            "ratio_min": float(last["ratio_min"]), "ratio_max": float(last["ratio_max"]),
            "grad_norm": float(first["grad_norm"]), "completion_tokens": tokens,
            "sampled_tokens_per_s": tokens / gen_s, "trained_tokens_per_s": tokens * self.epochs / train_s,
            "step_s": step_s,
        }  # fmt: skip
