"""GRPO (gpt2_jax.rl): the objective and its gradient against numpy and PyTorch, advantages as TRL computes
them, rewards, the CLI's bad input (the loop itself: tests/test_rl_loop.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gpt2_jax import rl
from gpt2_jax.cli import main
from gpt2_jax.errors import ConfigError
from gpt2_jax.model.params import to_flat
from gpt2_jax.rl.rewards import RewardError, score
from gpt2_jax.rl.scoring import pack_completions
from gpt2_jax.rl.step import Rollout, rollout_loss
from tests.reference import make_hf_model, rel_err, saved_and_loaded

OBJECTIVES = {
    "grpo": rl.Objective(epsilon=0.2, epsilon_high=0.28, beta=0.04, loss_type="grpo"),
    "dapo": rl.Objective(epsilon=0.1, beta=0.0, loss_type="dapo"),
}


def test_group_advantages_are_trls():
    """TRL's GRPOTrainer: (r - group mean) / (group std with Bessel's correction + 1e-4); a group whose rewards
    all agree gets 0."""
    rewards = np.array([[1.0, 0.0, 3.0, 2.0], [0.5, 0.5, 0.5, 0.5], [-1.0, 4.0, 0.0, 0.0]])
    r = torch.tensor(rewards)
    trl = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)  # torch.std is Bessel-corrected
    got = rl.group_advantages(rewards)
    assert got.dtype == np.float32 and np.abs(got - trl.numpy()).max() < 1e-6
    assert (got[1] == 0).all()
    with pytest.raises(ConfigError, match="group_size >= 2"):
        rl.group_advantages(rewards[:, :1])


def numpy_objective(lp, old, ref, adv, mask, o: rl.Objective):
    """The loss and d loss / d lp in float64, written out: -min(rho A, clip(rho) A) + beta k3, averaged."""
    rho = np.exp(lp - old)
    a = adv[:, None]
    unclipped, clipped = rho * a, np.clip(rho, 1 - o.epsilon, 1 + o.high) * a
    d = ref - lp
    per_token = -np.minimum(unclipped, clipped) + o.beta * (np.exp(d) - d - 1)
    grad = np.where(unclipped <= clipped, -rho * a, 0.0) + o.beta * (1 - np.exp(d))  # the clipped branch is flat
    if o.loss_type == "grpo":
        weight = mask / mask.sum(1, keepdims=True) / len(mask)
    else:
        weight = mask / mask.sum()
    return (per_token * weight).sum(), grad * weight


@pytest.mark.parametrize("name", OBJECTIVES)
def test_grpo_loss_and_its_gradient_match_numpy(name):
    """Ratios spread over [0.6, 1.5] so that both clips cut somewhere; ragged masks; advantages of both signs."""
    o = OBJECTIVES[name]
    rng = np.random.default_rng(2)
    lp = rng.uniform(-6, -0.1, (6, 9))
    old = lp - rng.uniform(np.log(0.6), np.log(1.5), lp.shape)
    ref = lp + rng.normal(0, 0.3, lp.shape)
    adv = rng.normal(size=6)
    mask = np.arange(9)[None] < np.array([9, 3, 5, 9, 1, 7])[:, None]
    want, want_grad = numpy_objective(lp, old, ref, adv, mask, o)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    (loss, metrics), grad = jax.value_and_grad(rl.grpo_loss, has_aux=True)(
        f32(lp), f32(old), f32(ref), f32(adv), mask, o
    )
    assert abs(float(loss) - want) <= 1e-5 * abs(want)
    assert np.abs(np.asarray(grad) - want_grad).max() <= 1e-5 * np.abs(want_grad).max()
    assert 0 < float(metrics["clipped"]) < 1  # some tokens clipped, not all
    if not o.beta:
        assert (np.asarray(grad)[mask] == 0).any()  # a clipped token's gradient is cut
    assert abs(float(metrics["kl"]) - (np.exp(ref - lp) - (ref - lp) - 1)[mask].mean()) < 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=13), tmp_path_factory)  # 2 layers, 3 heads, 48 wide, vocab 101


@pytest.mark.parametrize("name", OBJECTIVES)
def test_rollout_loss_and_every_gradient_match_pytorch(tiny, name):
    """The whole trainer side on a tiny model: logprobs from the forward, the objective, d/dparams, against
    PyTorch autograd of the same objective (TRL's formula) on transformers' model."""
    model, params, config = tiny
    o = OBJECTIVES[name]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 100, n).tolist() for n in (4, 1, 6, 2)]
    comps = [rng.integers(0, 100, n).tolist() for n in (8, 5, 8, 2)]
    packed = pack_completions(prompts, comps, config, steps=8)
    exact = np.asarray(rl.sequence_logprobs(params, config, prompts, comps))
    old = exact - rng.uniform(np.log(0.7), np.log(1.4), exact.shape)  # as if sampled by a slightly older policy
    ref = exact + rng.normal(0, 0.2, exact.shape)
    adv = rng.normal(size=4)
    rollout = Rollout(*map(jnp.asarray, packed), *(jnp.asarray(a, jnp.float32) for a in (old, ref, adv)))
    (loss, _), grads = jax.value_and_grad(rollout_loss, has_aux=True)(params, rollout, config, o)

    model.zero_grad()
    t = lambda a: torch.tensor(np.asarray(a, np.float32))
    lp = torch.zeros(exact.shape)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1], -1)
        lp = lp.index_put((torch.tensor([b]), torch.arange(len(c))), logp.gather(-1, torch.tensor(c)[:, None])[:, 0])
    rho = torch.exp(lp - t(old))
    a = t(adv)[:, None]
    per_token = -torch.min(rho * a, torch.clamp(rho, 1 - o.epsilon, 1 + o.high) * a)
    d = t(ref) - lp
    per_token = per_token + o.beta * (torch.exp(d) - d - 1)
    m = torch.tensor(packed.mask, dtype=torch.float32)
    if o.loss_type == "grpo":
        total = ((per_token * m).sum(-1) / m.sum(-1)).mean()
    else:
        total = (per_token * m).sum() / m.sum()
    total.backward()
    assert abs(float(loss) - float(total.detach())) <= 1e-5 * abs(float(total.detach()))
    ref_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    for n, g in to_flat(grads, config).items():
        assert rel_err(g, ref_grads["transformer." + n]) <= 1e-4, n


def test_rewards(tmp_path):
    speakers = rl.parse_reward(r"regex:^[A-Z][A-Z ]+:$")
    assert speakers("", "ROMEO:\nHi.\nFIRST CITIZEN:\nNo: no.\nJuliet:") == 2.0  # ^...$ at every line
    length = rl.parse_reward("length:10")
    assert length("p", "x" * 10) == 0.0 and length("p", "x" * 15) == -0.5
    (tmp_path / "my_reward.py").write_text(
        "def fn(prompt, completion):\n    return len(prompt) + completion.count('a')\n"
    )
    assert rl.parse_reward(f"python:{tmp_path / 'my_reward.py'}:fn")("ab", "banana") == 5
    assert rl.parse_reward("python:operator:eq")("a", "a") is True  # an importable module's function
    bad = {"regex:[": "does not compile", "length:ten": "must be an integer", "length:0": "int >= 1",
           "python:no_such_module_xyz:f": "importing no_such_module_xyz failed", "python:json:nope": "no function",
           "python:json": "expected python:MODULE:FUNCTION", "bleu:4": "none of regex:PATTERN"}  # fmt: skip
    for spec, message in bad.items():
        with pytest.raises(RewardError, match=message):
            rl.parse_reward(spec)
    with pytest.raises(RewardError, match="returned 'x' for completion 1"):
        score(lambda p, c: "x" if c == "b" else 1.0, ["", ""], ["a", "b"])
    with pytest.raises(RewardError, match="raised ZeroDivisionError on completion 0"):
        score(lambda p, c: 1 / 0, [""], ["a"])


def run_cli(args, capsys):
    code = main(["rl", "--no-progress", "--no-compile-cache", *args])
    return code, capsys.readouterr().err.strip()


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("ROMEO:\n\nFirst Citizen:\\nBefore we proceed\n")
    return path


def test_cli_reads_prompts(prompts_file):
    from gpt2_jax.cli.rl import read_prompts

    assert read_prompts(str(prompts_file)) == ["ROMEO:", "First Citizen:\nBefore we proceed"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "{tmp}/missing.txt"], "--prompts {tmp}/missing.txt: no such file"),
        (["--prompts", "{tmp}/empty.txt"], "holds no prompts"),
        (["--reward", "bleu:4"], "is none of regex:PATTERN, length:N, python:MODULE:FUNCTION"),
        (["--reward", "regex:("], "does not compile"),
        (["--reward", "python:no_such_module_xyz:f"], "importing no_such_module_xyz failed"),
        (["--group-size", "1"], "group_size must be an int >= 2, got 1"),
        (["--steps", "0"], "steps must be an int >= 1, got 0"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--epsilon", "-0.1"], "epsilon must be a finite number >= 0"),
        (["--max-new-tokens", "300"], "exceed the context n_positions=256"),
        (["--model", "{tmp}/no_model"], "no_model"),
        (["--out", "{tmp}/a_file/run"], "is not writable"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_and_leaves_nothing(args, message, prompts_file, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "a_file").write_text("")
    base = {"--prompts": str(prompts_file), "--reward": "length:40", "--out": str(tmp_path / "run"), "--steps": "1"}
    given = dict(zip(args[::2], (a.format(tmp=tmp_path) for a in args[1::2])))
    argv = [x for k, v in {**base, **given}.items() for x in (k, v)]
    code, err = run_cli(argv, capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "run").exists()
