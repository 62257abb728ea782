import dataclasses
import math
import re

import jax
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax import PRESETS, ConfigError, GPT2Config, init_params
from gpt2_jax.model.params import flat_shapes

# Published parameter counts of GPT-2 with the unembedding tied to wte.
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_param_counts(name):
    assert GPT2Config.preset(name).n_params == PUBLISHED[name]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_param_count_matches_tensor_shapes(name):
    config = GPT2Config.preset(name)
    total = 0
    for shape in flat_shapes(config).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    assert total == config.n_params


def test_param_count_matches_transformers():
    import transformers

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=99))
    ours = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=99)
    assert ours.n_params == sum(p.numel() for p in hf.parameters())  # tied lm_head counted once


def test_init_params_count_and_no_bias_variant():
    for config in (
        GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=50, n_positions=16),
        GPT2Config(n_layer=3, n_head=2, n_embd=32, vocab_size=50, n_positions=16, bias=False),
    ):
        params = init_params(jax.random.key(0), config)
        assert sum(a.size for a in jax.tree.leaves(params)) == config.n_params
        assert len(params["h"]) == 3 and params["h"][0]["attn"]["c_attn"]["weight"].shape == (
            3,
            32,
            32,
        )  # q|k|v, out, in
        assert params["h"][0]["mlp"]["c_fc"]["weight"].shape == (128, 32)  # [out, in]
        stacked = init_params(jax.random.key(0), config, stacked=True)
        assert stacked["h"]["attn"]["c_attn"]["weight"].shape == (3, 3, 32, 32)  # [L, q|k|v, out, in]
        for a, b in zip(jax.tree.leaves(gpt2_jax.model.stack_layers(params)), jax.tree.leaves(stacked)):
            assert (np.asarray(a) == np.asarray(b)).all()


def test_unknown_preset_lists_known_names():
    with pytest.raises(ConfigError, match="gpt2-small") as e:
        GPT2Config.preset("gpt2-small")
    for name in PRESETS:
        assert name in str(e.value)


def test_preset_lookup_is_exact():
    with pytest.raises(ConfigError):
        GPT2Config.preset("GPT2")
    with pytest.raises(ConfigError):
        GPT2Config.preset("gpt2-x")


def test_config_is_frozen_and_hashable():
    a = GPT2Config.preset("gpt2")
    with pytest.raises(AttributeError):
        a.n_layer = 3
    assert hash(a) == hash(GPT2Config.preset("gpt2"))
    assert a != a.replace(n_layer=3)
    assert a.replace(n_layer=3).n_layer == 3 and a.n_layer == 12
    assert GPT2Config.from_dict(a.to_dict()) == a


def test_preset_sizes():
    got = {n: (c.n_layer, c.n_head, c.n_embd) for n, c in PRESETS.items()}
    assert got == {
        "gpt2": (12, 12, 768),
        "gpt2-medium": (24, 16, 1024),
        "gpt2-large": (36, 20, 1280),
        "gpt2-xl": (48, 25, 1600),
    }


def test_invalid_config_values():
    with pytest.raises(ConfigError, match="n_embd=100 is not divisible by n_head=3"):
        GPT2Config(n_embd=100, n_head=3)
    with pytest.raises(ConfigError, match="n_layer"):
        GPT2Config(n_layer=0)
    with pytest.raises(ConfigError, match="unknown GPT2Config fields"):
        GPT2Config.from_dict({"n_layers": 3})
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ConfigError, match=r"attn_pdrop must be a dropout rate, in \[0, 1\), got"):
            GPT2Config(attn_pdrop=bad)
    assert GPT2Config(embd_pdrop=0, attn_pdrop=0.0, resid_pdrop=0.999).resid_pdrop == 0.999


SIZE = "an int in [1, 2147483647]"
ALLOWED = {"vocab_size": SIZE, "n_positions": SIZE, "n_embd": SIZE, "n_layer": SIZE, "n_head": SIZE,
           "n_inner": SIZE + " or None", "n_valid_tokens": SIZE + " or None",
           "layer_norm_epsilon": "a finite number in (0, 1)", "eos_token_id": "an int or None",
           "embd_pdrop": "a dropout rate, in [0, 1)", "attn_pdrop": "a dropout rate, in [0, 1)",
           "resid_pdrop": "a dropout rate, in [0, 1)", "gelu_approximate": "true or false", "bias": "true or false",
           "scale_attn_weights": "true or false", "scale_attn_by_inverse_layer_idx": "true or false"}  # fmt: skip


def test_every_field_has_a_check():
    assert set(ALLOWED) == {f.name for f in dataclasses.fields(GPT2Config)}


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 2**31), ("n_positions", 0), ("n_embd", 48.0), ("n_layer", True), ("n_head", None),
    ("n_inner", 0), ("n_inner", 1.5), ("n_valid_tokens", 5.5), ("n_valid_tokens", "7"),
    ("layer_norm_epsilon", math.nan), ("layer_norm_epsilon", math.inf), ("layer_norm_epsilon", -1e-5),
    ("layer_norm_epsilon", 0.0), ("layer_norm_epsilon", 1.0), ("layer_norm_epsilon", "1e-5"),
    ("layer_norm_epsilon", True), ("eos_token_id", 1.0), ("eos_token_id", True), ("eos_token_id", [50256]),
    ("embd_pdrop", math.nan), ("resid_pdrop", -0.1), ("gelu_approximate", 1), ("bias", "yes"),
    ("scale_attn_weights", None), ("scale_attn_by_inverse_layer_idx", 0),
])  # fmt: skip
def test_a_bad_value_is_named_with_its_allowed_range(field, value):
    with pytest.raises(ConfigError, match=re.escape(f"GPT2Config.{field} must be {ALLOWED[field]}, got {value!r}")):
        GPT2Config(**{**dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16), field: value})


def test_good_edge_values_pass_and_huge_ones_are_named_short():
    config = GPT2Config(n_inner=None, n_valid_tokens=None, eos_token_id=None, layer_norm_epsilon=1e-12,
                        vocab_size=2**31 - 1, attn_pdrop=0, n_embd=2**31 - 1, n_head=1)  # fmt: skip
    assert config.eos_id is None and GPT2Config(eos_token_id=-1).eos_id is None
    with pytest.raises(ConfigError, match=r"GPT2Config\.n_layer must be .*, got an int of 33220 bits$"):
        GPT2Config(n_layer=10**10000)
    with pytest.raises(ConfigError, match=r"got 'xxxxx+\.\.\.$"):
        GPT2Config(bias="x" * 10**6)
