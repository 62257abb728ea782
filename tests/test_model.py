"""Forward-pass properties: causality, jit == eager, bf16 vs fp32, per-layer parity with transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gpt2_jax
from gpt2_jax.model.gpt2 import _forward, embed
from gpt2_jax.model.layers import block, layer_norm, mlp
from tests.reference import exact_logits, hf_logits, make_hf_model, random_tokens, rel_err, saved_and_loaded

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64)


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=21, **SHAPE), tmp_path_factory)


def test_causality(hf_and_ours):
    _, params, config = hf_and_ours
    tokens = random_tokens(101, (1, 20), seed=1)
    base = np.asarray(gpt2_jax.forward(params, tokens, config))
    for t in (0, 7, 19):
        changed = tokens.copy()
        changed[0, t] = (changed[0, t] + 1) % 101
        out = np.asarray(gpt2_jax.forward(params, changed, config))
        np.testing.assert_array_equal(out[:, :t], base[:, :t])  # earlier positions bit-identical
        assert np.abs(out[:, t:] - base[:, t:]).max() > 1e-3  # position t and later do change


def test_jit_equals_eager(hf_and_ours):
    _, params, config = hf_and_ours
    tokens = jnp.asarray(random_tokens(101, (2, 17), seed=2))
    jitted = _forward(params, tokens, config)
    with jax.disable_jit():
        eager = _forward(params, tokens, config)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_forward_inside_user_jit(hf_and_ours):
    _, params, config = hf_and_ours
    tokens = jnp.asarray(random_tokens(101, (2, 9), seed=3))
    inner = jax.jit(lambda p, t: gpt2_jax.forward(p, t, config))(params, tokens)
    np.testing.assert_array_equal(np.asarray(inner), np.asarray(gpt2_jax.forward(params, tokens, config)))


BF16_TOL = 2e-2  # relative max error of bf16 weights against fp32 (bf16 has an 8-bit mantissa)


def test_bf16_params_close_to_fp32(hf_and_ours):
    model, params, config = hf_and_ours
    tokens = random_tokens(101, (2, 32), seed=4)
    fp32 = gpt2_jax.forward(params, tokens, config)
    bf16 = gpt2_jax.forward(gpt2_jax.cast_params(params, jnp.bfloat16), tokens, config)
    assert bf16.dtype == jnp.float32  # logits stay fp32
    err = rel_err(bf16, fp32)
    assert 0 < err <= BF16_TOL
    exact = exact_logits(model, tokens)
    err, torch_err = rel_err(fp32, exact), rel_err(hf_logits(model, tokens), exact)
    assert err <= 1e-5, f"fp32 logits {err:.2e} from transformers in float64 (transformers' own fp32: {torch_err:.2e})"


def test_per_layer_parity(hf_and_ours):
    """Each piece against its transformers counterpart: embeddings, every block, ln_1, the MLP."""
    model, params, config = hf_and_ours
    tokens = random_tokens(101, (2, 12), seed=5)
    with torch.no_grad():
        out = model.transformer(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    hidden = [h.numpy() for h in out.hidden_states]  # [embeddings, block 0 output, ..., ln_f output]
    x = embed(params, jnp.asarray(tokens), jnp.arange(12))
    assert rel_err(x, hidden[0]) <= 1e-6
    for i in range(config.n_layer):
        p = params["h"][i]
        hf_block = model.transformer.h[i]
        with torch.no_grad():
            ln = hf_block.ln_1(torch.as_tensor(hidden[i])).numpy()
            hf_mlp = hf_block.mlp(torch.as_tensor(ln)).numpy()
        assert rel_err(layer_norm(p["ln_1"], jnp.asarray(hidden[i]), 1e-5), ln) <= 1e-5
        assert rel_err(mlp(p["mlp"], jnp.asarray(ln), config), hf_mlp) <= 1e-5
        x, _ = block(p, jnp.asarray(hidden[i]), config, i)
        if i + 1 < config.n_layer:  # the last hidden state has ln_f applied
            assert rel_err(x, hidden[i + 1]) <= 1e-5


def test_init_params_forward_is_finite_and_near_uniform():
    config = gpt2_jax.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=500, n_positions=32)
    params = gpt2_jax.init_params(jax.random.key(0), config)
    logits = gpt2_jax.forward(params, random_tokens(500, (2, 8)), config)
    assert logits.shape == (2, 8, 500) and logits.dtype == jnp.float32
    loss = -jax.nn.log_softmax(logits).mean()
    assert abs(float(loss) - np.log(500)) < 0.1  # GPT-2 init starts near the uniform distribution
    again = gpt2_jax.init_params(jax.random.key(0), config)
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))
