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

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.checkpoints import native
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, GPT2JaxError, InputError
from gpt2_jax.generation.batching import bucket
from gpt2_jax.generation.chunks import encoding
from gpt2_jax.model.params import Params, check_trainable, float_dtype, stack_layers, unstack_layers
from gpt2_jax.rl.objective import Objective
from gpt2_jax.rl.plots import plot_rewards
from gpt2_jax.rl.rewards import Reward
from gpt2_jax.rl.runner import METRICS, Run
from gpt2_jax.sampling import SamplingParams
from gpt2_jax.training import Hyper, init_state, make_optimizer
from gpt2_jax.training.run_dir import check_writable, checkpoint_manager, make_dir, write_json

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=48)  # temperature 1, no filters: samples from the policy itself
DEFAULT_OBJECTIVE = Objective()  # clip at 0.2 both ways, no KL term, DeepSeekMath's per-completion mean
DEFAULT_HYPER = Hyper(lr=1e-4, min_lr=1e-4, warmup=0, weight_decay=0.0)  # constant rate; steps is set per run


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
                              "gpt2_jax.model.precision.with_precision(params, 'float32')")  # fmt: skip


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
    run = Run(config, texts, ids, reward, key, group_size, per_step, sampling, epochs, hyper, objective,
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
