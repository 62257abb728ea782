"""Logits parity with transformers' PyTorch GPT-2 for every checkpoint format, via load() and the convert CLI."""

import json

import numpy as np
import pytest
import safetensors.torch
import torch

import gpt2_jax
from gpt2_jax.cli.convert import main as convert_main
from tests.reference import (
    exact_logits,
    hf_logits,
    hf_state,
    make_hf_model,
    random_tokens,
    rel_err,
    save_bin_dir,
    save_nanogpt,
    save_sharded_bin_dir,
)

TOL = 1e-5

SHAPES = {
    "1-layer-1-head": dict(n_layer=1, n_head=1, n_embd=32, vocab_size=64, n_positions=32),
    "odd-heads-vocab101": dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64),
    "5-heads-vocab257-ninner": dict(n_layer=3, n_head=5, n_embd=80, vocab_size=257, n_positions=40, n_inner=100),
    "inverse-layer-idx-upcast": dict(
        n_layer=3,
        n_head=2,
        n_embd=32,
        vocab_size=77,
        n_positions=24,
        scale_attn_by_inverse_layer_idx=True,
        reorder_and_upcast_attn=True,
        attn_implementation="eager",
    ),
}

WRITERS = {
    "hf-safetensors": lambda m, p: (m.save_pretrained(p), p)[1],
    "hf-sharded-safetensors": lambda m, p: (m.save_pretrained(p, max_shard_size="20KB"), p)[1],
    "hf-bin": lambda m, p: save_bin_dir(m, p, prefix=True, lm_head=True),
    "hub-bin-no-prefix-buffers": lambda m, p: save_bin_dir(m, p, prefix=False, buffers=True),
    "hf-sharded-bin": save_sharded_bin_dir,
}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request):
    return make_hf_model(seed=len(request.param), **SHAPES[request.param])


def check_parity(params, config, model, T=None):
    T = T or min(model.config.n_positions, 24)
    tokens = random_tokens(model.config.vocab_size, (2, T), seed=T)
    exact = exact_logits(model, tokens)
    err = rel_err(gpt2_jax.forward(params, tokens, config), exact)
    assert err <= TOL, (
        f"relative max error {err:.2e} > {TOL} (transformers' fp32: {rel_err(hf_logits(model, tokens), exact):.2e})"
    )
    return err


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_load_parity(model, fmt, tmp_path):
    path = WRITERS[fmt](model, tmp_path / fmt)
    params, config = gpt2_jax.load(path)
    assert config.n_head == model.config.n_head and config.n_layer == model.config.n_layer
    check_parity(params, config, model)


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_convert_cli_parity(model, fmt, tmp_path):
    src = WRITERS[fmt](model, tmp_path / fmt)
    assert convert_main([str(src), str(tmp_path / "out")]) == 0
    params, config = gpt2_jax.load(tmp_path / "out")
    check_parity(params, config, model)


def test_full_context_parity(model, tmp_path):
    params, config = gpt2_jax.load(WRITERS["hf-safetensors"](model, tmp_path / "m"))
    check_parity(params, config, model, T=model.config.n_positions)


# Single files carry no config: the head count is inferred as the preset of that width,
# else D / 64 (GPT-2's head size), so these models use 64-wide heads.
FILE_SHAPE = dict(n_layer=2, n_head=2, n_embd=128, vocab_size=99, n_positions=32)


@pytest.mark.parametrize("kind", ["safetensors-no-prefix", "safetensors-prefixed", "bin", "bin-hub"])
def test_single_file_parity(kind, tmp_path):
    model = make_hf_model(seed=7, **FILE_SHAPE)
    if kind.startswith("safetensors"):
        path = tmp_path / "model.safetensors"
        safetensors.torch.save_file(hf_state(model, prefix=kind.endswith("prefixed")), path)
    else:
        path = tmp_path / "weights.bin"
        torch.save(hf_state(model, prefix=kind == "bin", lm_head=kind == "bin", buffers=kind == "bin-hub"), path)
    params, config = gpt2_jax.load(path)
    assert (config.n_layer, config.n_head, config.n_embd, config.vocab_size) == (2, 2, 128, 99)
    check_parity(params, config, model)
    assert convert_main([str(path), str(tmp_path / "out")]) == 0
    check_parity(*gpt2_jax.load(tmp_path / "out"), model)


def test_single_file_uses_config_beside_it_or_given(tmp_path):
    model = make_hf_model(seed=3, **SHAPES["odd-heads-vocab101"])
    model.save_pretrained(tmp_path / "hf")
    params, config = gpt2_jax.load(tmp_path / "hf" / "model.safetensors")
    assert config.n_head == 3
    check_parity(params, config, model)
    alone = tmp_path / "alone.safetensors"
    safetensors.torch.save_file(hf_state(model), alone)
    given = gpt2_jax.GPT2Config(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64)
    check_parity(*gpt2_jax.load(alone, config=given), model)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [True, False])
def test_nanogpt_parity(bias, compiled, tmp_path):
    # nanoGPT uses exact GELU, so the reference is transformers with activation_function="gelu".
    model = make_hf_model(seed=11, activation_function="gelu", zero_biases=not bias, **SHAPES["odd-heads-vocab101"])
    ckpt = save_nanogpt(model, tmp_path / "out" / "ckpt.pt", bias=bias, compiled=compiled)
    for path in (ckpt, ckpt.parent):  # the file, or nanoGPT's out_dir
        params, config = gpt2_jax.load(path)
        assert config.gelu_approximate is False and config.bias is bias
        assert ("bias" in params["h"][0]["mlp"]["c_fc"]) is bias
        check_parity(params, config, model)
    assert convert_main([str(ckpt), str(tmp_path / "conv")]) == 0
    check_parity(*gpt2_jax.load(tmp_path / "conv"), model)


def test_nanogpt_padded_vocab(tmp_path):
    model = make_hf_model(
        seed=5, activation_function="gelu", n_layer=1, n_head=2, n_embd=32, vocab_size=50304, n_positions=16
    )
    ckpt = save_nanogpt(model, tmp_path / "ckpt.pt")
    params, config = gpt2_jax.load(ckpt)
    assert config.vocab_size == 50304 and config.valid_vocab == 50257
    check_parity(params, config, model, T=16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_dtype(dtype, tmp_path):
    model = make_hf_model(seed=2, **SHAPES["odd-heads-vocab101"])
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", dtype]) == 0
    params, config = gpt2_jax.load(tmp_path / "out")
    assert {a.dtype.name for a in __import__("jax").tree.leaves(params)} == {dtype}
    tokens = random_tokens(101, (2, 24))
    err = rel_err(gpt2_jax.forward(params, tokens, config), hf_logits(model, tokens))
    assert err <= (TOL if dtype == "float32" else 2e-2)


def test_to_hf_round_trip(tmp_path):
    import transformers

    model = make_hf_model(seed=9, **SHAPES["5-heads-vocab257-ninner"])
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    assert convert_main([str(tmp_path / "jax"), str(tmp_path / "back"), "--to-hf"]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()
    params, config = gpt2_jax.load(tmp_path / "jax")
    tokens = random_tokens(257, (2, 30))
    ours = np.asarray(gpt2_jax.forward(params, tokens, config))
    assert rel_err(hf_logits(back, tokens), ours) <= TOL
    np.testing.assert_array_equal(hf_logits(back, tokens), hf_logits(model, tokens))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["n_inner"] == 100


def test_to_hf_from_nanogpt_without_bias(tmp_path):
    import transformers

    model = make_hf_model(seed=4, activation_function="gelu", zero_biases=True, **SHAPES["1-layer-1-head"])
    ckpt = save_nanogpt(model, tmp_path / "ckpt.pt", bias=False)
    assert convert_main([str(ckpt), str(tmp_path / "back"), "--to-hf"]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    tokens = random_tokens(64, (2, 20))
    assert rel_err(hf_logits(back, tokens), hf_logits(model, tokens)) <= TOL
