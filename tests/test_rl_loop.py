"""The GRPO loop (gpt2_jax.rl.grpo): a short run on the bundled model raises the reward with a mismatch of
exactly 0.0 at every step; a resumed run equals the uninterrupted one bit for bit."""

import json

import jax
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax import rl
from gpt2_jax.errors import ConfigError, GPT2JaxError
from gpt2_jax.rl.loop import DEFAULT_HYPER, DEFAULT_SAMPLING, METRICS
from tests.reference import make_hf_model, saved_and_loaded

OBJECTIVE = rl.Objective(epsilon=0.2, epsilon_high=0.28, beta=0.04, loss_type="grpo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=13), tmp_path_factory)  # 2 layers, 3 heads, 48 wide, vocab 101


SPEAKERS = r"^[A-Z][A-Z ]+[.:]$"  # a line that is a speaker's name, as the plays write them
PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING HENRY.\n", "First Citizen:\n"]


def test_a_short_run_raises_the_reward():
    """The bundled model, rewarded for speaker lines, 8 steps of 4 prompts x 8 completions of 32 tokens at lr
    1e-3: the mean reward of the last three steps beats the first three's by about 3 to 4.5 across
    seeds, so a margin of 1.0 leaves room for another CPU's rounding. The mismatch is
    exactly 0.0 at every step."""
    params, config = gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")
    hyper = DEFAULT_HYPER._replace(lr=1e-3, min_lr=1e-3)
    _, history = rl.grpo(params, config, PROMPTS, rl.regex_reward(SPEAKERS), jax.random.key(0), steps=8,
                         group_size=8, sampling=DEFAULT_SAMPLING.replace(max_new_tokens=32), hyper=hyper)  # fmt: skip
    r = history["reward_mean"]
    assert np.mean(r[-3:]) > np.mean(r[:3]) + 1.0, r
    assert history["mismatch"] == [0.0] * 8
    assert history["kl"][0] == 0.0 < history["kl"][-1]
    assert history["ratio_min"][-1] < 1.0 < history["ratio_max"][-1]  # the second epoch is off the first's ratio


def tiny_run(params, config, out, steps, **kw):
    prompts = [[5, 6, 7], [8], [9, 10]]
    return rl.grpo(params, config, prompts, lambda p, c: c.count("e") + 0.1 * len(c), jax.random.key(4), steps=steps,
                   group_size=3, prompts_per_step=2, sampling=DEFAULT_SAMPLING.replace(max_new_tokens=8),
                   objective=OBJECTIVE, out=out, ckpt_every=1, **kw)  # fmt: skip


class Stop(Exception):
    pass


def test_resume_equals_an_uninterrupted_run(tiny, tmp_path):
    _, params, config = tiny
    whole, history = tiny_run(params, config, tmp_path / "whole", 4)

    def interrupt(step, p, record):
        if step == 1:
            raise Stop  # after step 2's checkpoint

    with pytest.raises(Stop):
        tiny_run(params, config, tmp_path / "cut", 4, callback=interrupt)
    assert json.loads((tmp_path / "cut" / "history.json").read_text())["reward_mean"] == history["reward_mean"][:2]
    with pytest.raises(GPT2JaxError, match="already holds checkpoints; pass --resume"):
        tiny_run(params, config, tmp_path / "cut", 4)
    resumed, again = tiny_run(params, config, tmp_path / "cut", 4, resume=True)
    timing = ("sampled_tokens_per_s", "trained_tokens_per_s", "step_s")
    for m in METRICS:
        if m not in timing:
            assert again[m] == history[m], m
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)))
    loaded, _ = gpt2_jax.load(tmp_path / "cut" / "model")
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(whole)))
    assert (tmp_path / "cut" / "reward.png").is_file()
    with pytest.raises(ConfigError, match=r"differ from the run .*group_size"):
        rl.grpo(params, config, [[5, 6, 7], [8], [9, 10]], lambda p, c: 0.0, jax.random.key(4), steps=5, group_size=4,
                prompts_per_step=2, out=tmp_path / "cut", resume=True)  # fmt: skip


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "w8a8", "float32-packed"])
def test_grpo_refuses_params_it_cannot_train_on_policy(tiny, mode):
    """rl.grpo takes float32 params; the bundled model's stored bfloat16 (load's default) and the inference
    forms are refused before any sampling, with the load that works, never an error from inside jax.grad."""
    _, params, config = tiny
    loaded = gpt2_jax.model.precision.with_precision(params, mode)
    match = "needs float32 params, got bfloat16" if mode == "bfloat16" else f"{mode} params are for inference only"
    with pytest.raises(ConfigError, match=match):
        rl.grpo(loaded, config, [[1, 2, 3]], rl.length_reward(4), jax.random.key(0), steps=1, group_size=2)
    with pytest.raises(ConfigError, match="needs float32 ref_params, got bfloat16"):
        rl.grpo(params, config, [[1, 2, 3]], rl.length_reward(4), jax.random.key(0), steps=1, group_size=2,
                ref_params=gpt2_jax.model.precision.with_precision(params, "bfloat16"))  # fmt: skip
