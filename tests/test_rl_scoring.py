"""gpt2_jax.rl.sequence_logprobs: the trainer's logprobs equal the sampler's as uint32 bits (greedy and sampled,
rows shuffled and re-padded, on gpt2-small widths), also when differentiated, and their gradient is PyTorch's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gpt2_jax import rl
from gpt2_jax.errors import InputError
from gpt2_jax.generation import scoring
from gpt2_jax.generation.generator import generate
from gpt2_jax.model.params import to_flat
from gpt2_jax.rl.scoring import pack_completions
from gpt2_jax.training.loss_head import weighted_head_loss
from tests.reference import make_hf_model, rel_err, saved_and_loaded

# gpt2's widths (12 heads of 64, the full vocab), two layers to keep the suite fast.
SHAPE = dict(n_layer=2, n_head=12, n_embd=768, vocab_size=50257, n_positions=256)
PROMPTS = [[464, 3290, 318, 257], [50256], [40, 588, 262, 3797, 11, 290, 314, 588, 262, 3290, 13, 632, 318, 1049,
                                             1110, 284, 307], [1212, 1110, 318, 922, 780, 2187, 11, 523]]  # fmt: skip
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
                    presence_penalty=0.3),
}  # fmt: skip
N = 12


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=7, **SHAPE), tmp_path_factory)


@pytest.fixture(scope="module")
def sampled(model):
    """Each setting's generation of the 4 prompts as one ragged batch: (its logprobs [4, N], the completions)."""
    _, params, config = model
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    runs = {}
    for name, kw in SETTINGS.items():
        out = generate(params, config, PROMPTS, keys, max_new_tokens=N, eos_id=None, logprobs=True, **kw)
        runs[name] = out.logprobs, [out.tokens[b].tolist() for b in range(len(PROMPTS))]
    return runs


KEEP = [12, 5, 12, 9]  # completion tokens scored per row: ragged, so rows end at different positions


def shuffled_and_repadded(completions):
    """Rows in another order, cut to KEEP tokens, beside a longer row that moves the batch to another bucket
    (T 32 -> 64) -> (order, prompts, completions)."""
    order = [2, 0, 3, 1]
    prompts = [PROMPTS[b] for b in order] + [list(range(1000, 1040))]
    return order, prompts, [completions[b][: KEEP[b]] for b in order] + [[5, 6, 7]]


@pytest.mark.parametrize("name", SETTINGS)
def test_sequence_logprobs_are_generates_bits(model, sampled, name):
    _, params, config = model
    logprobs, completions = sampled[name]
    order, prompts, comps = shuffled_and_repadded(completions)
    assert (
        pack_completions(prompts, comps, config).tokens.shape[1]
        == 64
        != pack_completions(PROMPTS, completions, config).tokens.shape[1]
    )
    got = np.asarray(rl.sequence_logprobs(params, config, prompts, comps))
    assert got.shape == (5, N)
    for row, b in enumerate(order):
        n = KEEP[b]
        assert (bits(got[row, :n]) == bits(logprobs[b, :n])).all(), (name, b)
        assert (got[row, n:] == 0).all()


_score = jax.jit(scoring.score_tokens, static_argnames=("config", "r"))


def plain_logprobs(params, config, prompts, completions):
    """The same forward (generation's scoring) without the custom VJP: what plain autodiff differentiates."""
    batch = pack_completions(prompts, completions, config)
    picked = _score(params, jnp.asarray(batch.tokens), config, 0)[0]  # [B, T-1]
    return jnp.where(batch.mask, jnp.take_along_axis(picked, jnp.asarray(batch.index), axis=1), 0.0)


@pytest.mark.parametrize("name", SETTINGS)
def test_the_bits_hold_when_differentiated(model, sampled, name):
    """The primal of value_and_grad is the sampler's bits too. Plain autodiff of the same forward is not:
    differentiated, XLA fuses and rounds the forward differently (which the custom VJP avoids)."""
    _, params, config = model
    logprobs, completions = sampled[name]
    order, prompts, comps = shuffled_and_repadded(completions)
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(len(prompts), N)).astype(np.float32))

    def objective(p, f):
        lp = f(p, config, prompts, comps)
        return (lp * weights[:, : lp.shape[1]]).sum(), lp

    (_, exact), grads = jax.value_and_grad(lambda p: objective(p, rl.sequence_logprobs), has_aux=True)(params)
    (_, plain), _ = jax.value_and_grad(lambda p: objective(p, plain_logprobs), has_aux=True)(params)
    same = []
    for row, b in enumerate(order):
        n = KEEP[b]
        assert (bits(exact[row, :n]) == bits(logprobs[b, :n])).all(), (name, b)
        same.append((bits(plain[row, :n]) == bits(logprobs[b, :n])).all())
    assert not all(same)  # what the custom VJP is for
    assert np.isfinite(np.asarray(grads["wte"])).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=11), tmp_path_factory)  # 2 layers, 3 heads, 48 wide, vocab 101


def test_gradient_matches_pytorch(tiny):
    """d/dparams of sum(w * logprobs) over ragged completions, against PyTorch autograd of the same sum."""
    model, params, config = tiny
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 100, n).tolist() for n in (3, 7, 1)]
    comps = [rng.integers(0, 100, n).tolist() for n in (9, 4, 12)]
    w = rng.normal(size=(3, 12)).astype(np.float32)
    value, grads = jax.value_and_grad(lambda p: (rl.sequence_logprobs(p, config, prompts, comps) * w).sum())(params)
    model.zero_grad()
    total = 0.0
    for b, (p, c) in enumerate(zip(prompts, comps)):
        seq = torch.tensor([p + c])
        logp = torch.log_softmax(model(seq).logits[0, len(p) - 1 : -1], -1)
        total = total + (logp.gather(-1, torch.tensor(c)[:, None])[:, 0] * torch.tensor(w[b, : len(c)])).sum()
    total.backward()
    total = float(total.detach())
    assert abs(float(value) - total) <= 1e-5 * abs(total)
    ref = {n: p.grad.numpy() for n, p in model.named_parameters()}
    ours = to_flat(grads, config)
    assert len(ours) == len(ref)  # every parameter compared (lm_head is wte, tied)
    for name, g in ours.items():
        assert rel_err(g, ref["transformer." + name]) <= 1e-4, name


def test_bad_input_is_named(tiny):
    _, params, config = tiny
    with pytest.raises(InputError, match="2 prompts but 1 completions"):
        rl.sequence_logprobs(params, config, [[1], [2]], [[3]])
    with pytest.raises(InputError, match="token id 101 is outside the vocab"):
        rl.sequence_logprobs(params, config, [[1]], [[101]])
    with pytest.raises(InputError, match="70 tokens exceed the context n_positions=64"):
        rl.sequence_logprobs(params, config, [[1] * 60], [[2] * 10])


@pytest.mark.parametrize("B, T", [(3, 100), (130, 2)])  # 3 chunks, the last padded; 1 position per chunk
def test_weighted_head_loss_matches_numpy(B, T):
    """The backward's head (training's fused head with a weight per token): sum(w x cross-entropy) and its
    gradients d/dh = (w (softmax - onehot)) @ wte, d/dwte = (w (softmax - onehot)).T @ h, in float64."""
    rng = np.random.default_rng(8)
    h, wte = rng.normal(size=(B, T, 48)), 0.3 * rng.normal(size=(101, 48))
    targets, w = rng.integers(0, 101, (B, T)), rng.normal(size=(B, T))
    logits = h.reshape(-1, 48) @ wte.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    rows = np.arange(B * T)
    loss = -(np.log(p[rows, targets.reshape(-1)]) * w.reshape(-1)).sum()
    d = p.copy()
    d[rows, targets.reshape(-1)] -= 1.0
    d *= w.reshape(-1, 1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ours, (dh, dwte) = jax.value_and_grad(weighted_head_loss, argnums=(0, 1))(f32(h), f32(wte), jnp.asarray(targets),
                                                                              f32(w))  # fmt: skip
    assert abs(float(ours) - loss) <= 1e-5 * np.abs(w).sum()
    assert rel_err(dh, (d @ wte).reshape(B, T, 48)) <= 1e-5
    assert rel_err(dwte, d.T @ h.reshape(-1, 48)) <= 1e-5
