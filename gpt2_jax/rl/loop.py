"""The GRPO loop behind `gpt2-jax rl`: sample groups with generate, score them, several optimisation epochs.

Step s: the prompts s*P .. s*P + P - 1 (cycling through the list), each repeated G times, are sampled with
generate (key fold_in(key, s), logprobs on); the reward scores each completion's text; advantages are
normalised within each prompt's group; the reference model scores the tokens (for the KL); then `epochs`
optimizer updates on that batch, the first at ratio exactly 1 (the trainer's logprobs are the sampler's, bit
for bit: the mismatch recorded each step is measured on that epoch) and the later ones off it.

With out: out/checkpoints (orbax: the TrainState every ckpt_every steps), history.json, model/ (the final
gpt2_jax checkpoint) and reward.png, as gpt2-jax train writes them; resume continues from the latest
checkpoint, and since every step's batch and key are a function of s alone, a resumed run records exactly
the history the uninterrupted one does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.checkpoints import native
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, GPT2JaxError, InputError
from gpt2_jax.generation import generate
from gpt2_jax.generation.batching import bucket
from gpt2_jax.generation.chunks import encoding
from gpt2_jax.model.params import Params, check_trainable, float_dtype, stack_layers, unstack_layers
from gpt2_jax.rl.objective import Objective, group_advantages
from gpt2_jax.rl.plots import plot_rewards
from gpt2_jax.rl.rewards import Reward, score
from gpt2_jax.rl.scoring import pack_completions
from gpt2_jax.rl.step import Rollout, make_grpo_step, reference_logprobs
from gpt2_jax.sampling import SamplingParams
from gpt2_jax.training import Hyper, init_state, make_optimizer
from gpt2_jax.training.run_dir import check_writable, checkpoint_manager, make_dir, progress_bar, write_json

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=48)  # temperature 1, no filters: samples from the policy itself
DEFAULT_OBJECTIVE = Objective()  # clip at 0.2 both ways, no KL term, DeepSeekMath's per-completion mean
DEFAULT_HYPER = Hyper(lr=1e-4, min_lr=1e-4, warmup=0, weight_decay=0.0)  # constant rate; steps is set per run
METRICS = ("reward_mean", "reward_std", "mismatch", "kl", "loss", "clipped", "ratio_min", "ratio_max", "grad_norm",
           "completion_tokens", "sampled_tokens_per_s", "trained_tokens_per_s", "step_s")  # fmt: skip


def prompt_rows(prompts: Any, tokenizer: Any) -> tuple[list[str], list[list[int]]]:
    """Prompts as text or token-id lists -> (texts, ids)."""
    if isinstance(prompts, str) or not prompts:
        raise InputError("prompts must be a non-empty list of strings (or of token-id lists)")
    enc = encoding(tokenizer)
    texts, ids = [], []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            texts.append(p)
            ids.append(enc.encode(p, allowed_special="all"))
        else:
            ids.append([int(t) for t in p])
            texts.append(enc.decode(ids[-1]))
        if not ids[-1]:
            raise InputError(f"prompt {i} is empty; every prompt needs at least one token")
    return texts, ids


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


def _settings(texts, reward, group_size, per_step, sampling, epochs, hyper, objective, key) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (steps may grow)."""
    return json.loads(json.dumps({  # as history.json holds them (tuples as lists)
        "prompts_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
        "reward": getattr(reward, "__name__", repr(reward)), "group_size": group_size, "prompts_per_step": per_step,
        "sampling": repr(sampling), "epochs": epochs, "hyper": hyper._replace(steps=0)._asdict(),
        "objective": objective._asdict(), "key": np.asarray(jax.random.key_data(key)).tolist(),
    }))  # fmt: skip


def _check(group_size: int, per_step: int, epochs: int, steps: int, sampling: Any) -> None:
    for name, v, low in (("group_size", group_size, 2), ("prompts_per_step", per_step, 1), ("epochs", epochs, 1),
                         ("steps", steps, 1)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {v!r}")
    if not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a gpt2_jax.SamplingParams, got {sampling!r}")
    if sampling.seed is not None:
        raise ConfigError("sampling.seed must be None: the loop keys every step itself (fold_in(key, step))")


def _check_params(params: Params, ref_params: Params | None) -> None:
    """float32 params only: the sampler's and the trainer's logprobs are the same bits in float32 (the model's
    prefill/decode invariance), while bfloat16's cached decode and full forward round differently, so a
    bfloat16 run would be off-policy by its rounding from the first step."""
    check_trainable(params)
    for name, p in (("params", params), ("ref_params", ref_params)):
        if p is not None and float_dtype(p) != jnp.float32:
            raise ConfigError(f"rl.grpo needs float32 {name}, got {float_dtype(p)}: exactly on-policy scoring holds "
                              "in float32; load with gpt2_jax.load(path, dtype='float32') or cast with "
                              "gpt2_jax.precision.with_precision(params, 'float32')")  # fmt: skip


def grpo(
    params: Params,
    config: GPT2Config,
    prompts: Any,
    reward: Reward,
    key: jax.Array,
    *,
    steps: int,
    group_size: int = 8,
    prompts_per_step: int | None = None,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    epochs: int = 2,
    hyper: Hyper = DEFAULT_HYPER,
    objective: Objective = DEFAULT_OBJECTIVE,
    ref_params: Params | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    ckpt_every: int = 10,
    progress: bool = False,
    callback: Callable[[int, Params, dict], None] | None = None,
    tokenizer: Any = None,
) -> tuple[Params, dict[str, Any]]:
    """GRPO fine-tuning -> (params, history). prompts: strings (or token-id lists); reward(prompt, completion)
    -> float (gpt2_jax.rl.rewards); key: drives every step's sampling. Each step samples group_size completions
    of prompts_per_step prompts (default: up to 4) with `sampling` (any SamplingParams without a seed; its
    max_new_tokens bounds the completions), then runs `epochs` optimizer updates (AdamW from
    gpt2_jax.training.make_optimizer with `hyper`, whose steps is set to steps x epochs) on `objective`.
    ref_params: the KL's frozen reference (default: the params given). history: one entry per step in each
    of METRICS (mismatch: the largest |sampler - trainer| logprob of the first epoch) and "settings".
    out / resume / ckpt_every: a run directory as gpt2-jax train writes (see the module docstring).
    callback(step, params, record): after each step, with the params the next step samples from."""
    per_step = min(len(prompts), 4) if prompts_per_step is None else prompts_per_step
    _check(group_size, per_step, epochs, steps, sampling)
    _check_params(params, ref_params)
    objective = objective.check()
    texts, ids = prompt_rows(prompts, tokenizer)
    if not callable(reward):
        raise ConfigError(f"reward must be a callable (prompt, completion) -> float, got {reward!r}")
    n_new = sampling.max_new_tokens
    length = max(map(len, ids)) + n_new
    if length > config.n_positions:
        raise InputError(f"the longest prompt ({length - n_new} tokens) + max_new_tokens={n_new} exceed the context "
                         f"n_positions={config.n_positions}")  # fmt: skip
    hyper = hyper._replace(steps=steps * epochs)
    settings = _settings(texts, reward, group_size, per_step, sampling, epochs, hyper, objective, key)
    run = _Run(config, texts, ids, reward, key, group_size, per_step, sampling, epochs, hyper, objective,
               bucket(length, config.n_positions), tokenizer)  # fmt: skip
    layered = isinstance(params["h"], (list, tuple))
    state = init_state(stack_layers(params), make_optimizer(hyper))
    ref = stack_layers(params if ref_params is None else ref_params)
    history: dict[str, Any] = {"settings": settings, **{m: [] for m in METRICS}}
    if out is None:
        state, history = run.steps(state, ref, history, 0, steps, progress, callback, None, ckpt_every)
    else:
        state, history = _in_dir(Path(out), run, state, ref, history, steps, resume, progress, callback, ckpt_every)
    return (unstack_layers(state.params) if layered else state.params), history


def _in_dir(out: Path, run, state, ref, history, steps, resume, progress, callback, ckpt_every):
    """The loop with a run directory: resume from it or start it; a failed start leaves nothing behind."""
    import orbax.checkpoint as ocp

    check_writable(out)
    created = not out.exists()
    make_dir(out)
    try:
        manager = checkpoint_manager(out)
        done = 0
        if manager.latest_step() is not None:
            if not resume:
                raise GPT2JaxError(f"{out} already holds checkpoints; pass --resume to continue, or use a new --out")
            saved = json.loads((out / "history.json").read_text())
            diff = sorted(k for k in history["settings"] if saved["settings"].get(k) != history["settings"][k])
            if diff:
                raise ConfigError(f"--resume with settings that differ from the run in {out}: {', '.join(diff)}")
            done = manager.latest_step()
            state = manager.restore(done, args=ocp.args.StandardRestore(state))
            history = {**saved, **{m: saved[m][:done] for m in METRICS}}
        state, history = run.steps(state, ref, history, done, steps, progress, callback, (manager, out), ckpt_every)
        native.save(out / "model", state.params, run.config, force=True)
        write_json(out / "history.json", history)
        if jax.process_index() == 0:
            plot_rewards(history, out / "reward.png")
        return state, history
    except BaseException:
        if created and not any((out / "checkpoints").glob("[0-9]*")):
            shutil.rmtree(out, ignore_errors=True)  # nothing worth keeping (no checkpoint to resume from)
        raise


@functools.lru_cache(maxsize=8)
def _grpo_step(config: GPT2Config, hyper: Hyper, objective: Objective):
    """One jitted step per setting, shared by the runs that use it (a second run, or a resumed one, in the same
    process compiles nothing new)."""
    return make_grpo_step(config, make_optimizer(hyper), objective)


class _Run:
    """One run's fixed settings, and its steps."""

    def __init__(self, config, texts, ids, reward, key, group_size, per_step, sampling, epochs, hyper, objective,
                 length, tokenizer):  # fmt: skip
        self.config, self.texts, self.ids, self.reward, self.key = config, texts, ids, reward, key
        self.G, self.P, self.sampling, self.epochs, self.length = group_size, per_step, sampling, epochs, length
        self.tokenizer, self.step_fn = tokenizer, _grpo_step(config, hyper, objective)
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
