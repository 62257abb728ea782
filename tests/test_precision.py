"""Precision modes: int8 weight-only quantisation (exact rounding bounds), bf16, int8 and w8a8 logits vs
transformers' float32, int8 and w8a8 through generate, a mesh, load, save and the CLI."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax.checkpoints import native
from gpt2_jax.cli import main
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.generator import generate
from gpt2_jax.model.params import is_w8a8
from gpt2_jax.model.precision import quantize, quantize_int8, with_precision
from gpt2_jax.parallel.sharding import make_mesh, shard_params
from tests.reference import hf_logits, make_hf_model, random_tokens, rel_err, saved_and_loaded


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=81, n_layer=2, n_head=4, n_embd=64, vocab_size=211), tmp_path_factory)


def test_quantize_rounds_each_output_to_its_nearest_step():
    w = jax.random.normal(jax.random.key(0), (2, 3, 16, 48)) * jnp.arange(1, 17)[:, None]  # outputs of other scales
    w = w.at[0, 1, 5, :].set(0.0)  # an all-zero output (row of the [out, in] weight)
    q, scale = quantize(w)
    assert q.dtype == jnp.int8 and scale.shape == (2, 3, 16)
    assert int(jnp.abs(q.astype(jnp.int32)).max()) == 127  # every non-zero output uses the full range
    err = jnp.abs(q * scale[..., None] - w)
    assert bool(jnp.all(err <= scale[..., None] / 2 * (1 + 1e-6)))  # round to nearest: half a step at most
    np.testing.assert_allclose(scale, jnp.abs(w).max(axis=-1) / 127 + (jnp.abs(w).max(axis=-1) == 0), rtol=1e-7)
    assert not np.asarray(q[0, 1, 5, :]).any()


def test_reduced_precision_logits_stay_close_to_transformers(model):
    hf, params, config = model
    tokens = random_tokens(config.vocab_size, (2, 32), seed=8)
    ref = hf_logits(hf, tokens)
    errors = {mode: rel_err(gpt2_jax.forward(with_precision(params, mode), tokens, config), ref)
              for mode in ("float32", "bfloat16", "int8", "w8a8")}  # fmt: skip
    assert errors["float32"] <= 1e-5
    assert 1e-4 < errors["bfloat16"] <= 2e-2  # reduced, measurably, but close
    assert errors["bfloat16"] < errors["int8"] <= 3e-2
    assert errors["int8"] < errors["w8a8"] <= 5e-2  # the 8-bit inputs' rounding on top of the weights'
    w8a8 = with_precision(params, "w8a8")
    assert is_w8a8(w8a8) and not is_w8a8(quantize_int8(params))
    c_fc = w8a8["h"][1]["mlp"]["c_fc"]  # int8's very weights, with each row's sum
    assert (np.asarray(c_fc["weight"]) == np.asarray(quantize_int8(params)["h"][1]["mlp"]["c_fc"]["weight"])).all()
    assert (np.asarray(c_fc["qsum"]) == np.asarray(c_fc["weight"], np.int64).sum(1)).all()
    assert "qsum" in w8a8["h"][0]["attn"]["c_proj"] and "qsum" not in w8a8["h"][0]["attn"]["c_attn"]  # int16 rows there
    # c_attn with byte inputs too (its row sums given): the queries' and keys' rounding moves the logits further
    every = {**w8a8, "h": [{**h, "attn": {**h["attn"], "c_attn": {**h["attn"]["c_attn"], "qsum": h["attn"]["c_attn"]["weight"].astype(jnp.int32).sum(-1)}}} for h in w8a8["h"]]}  # fmt: skip
    assert errors["w8a8"] < rel_err(gpt2_jax.forward(every, tokens, config), ref)
    assert not is_w8a8(with_precision(w8a8, "int8")) and with_precision(w8a8, "float32")["wte"].dtype == jnp.float32
    q = quantize_int8(params)["h"][1]["mlp"]["c_fc"]
    assert q["weight"].dtype == jnp.int8 and q["scale"].shape == (config.mlp_dim,)
    with pytest.raises(
        ConfigError, match="precision 'fp8' is not one of float32, float32-packed, bfloat16, int8, w8a8"
    ):
        with_precision(params, "fp8")


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_int8_generates_alike_on_one_device_and_a_mesh(model, mode):
    _, params, config = model
    q = with_precision(params, mode)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    one = generate(q, config, prompts, jax.random.key(1), max_new_tokens=10, temperature=0.0, eos_id=None)
    sharded = shard_params(q, config, make_mesh(2, 4))
    assert {s.data.shape for s in sharded["h"][0]["attn"]["c_attn"]["scale"].addressable_shards} == {
        (3, config.n_embd // 4)
    }  # the scales split with their outputs
    many = generate(sharded, config, prompts, jax.random.key(1), max_new_tokens=10, temperature=0.0, eos_id=None)
    np.testing.assert_array_equal(many.tokens, one.tokens)
    fp32 = generate(params, config, prompts, jax.random.key(1), max_new_tokens=10, temperature=0.0, eos_id=None)
    assert (one.tokens[:, :3] == fp32.tokens[:, :3]).all()  # greedy: the first tokens match float32's


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_cli_int8(capsys, mode):
    assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "8", "--dtype", mode, "--seed", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:\n") and "tokens/s" in err


def test_convert_stores_int8_and_load_keeps_or_dequantizes_it(model, tmp_path):
    """`convert --dtype int8` writes the quantized weights (a quarter of the bytes), load() gives them back as
    int8 with the bits of quantizing on loading, dtype="float32" dequantizes them, and --to-hf refuses int8."""
    from gpt2_jax.model.params import is_int8, param_bytes

    hf, params, config = model
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    assert main(["convert", str(src), str(tmp_path / "q"), "--dtype", "int8"]) == 0
    stored, _ = gpt2_jax.load(tmp_path / "q")
    assert is_int8(stored) and stored["h"][0]["attn"]["c_attn"]["weight"].dtype == jnp.int8
    assert stored["wte"].dtype == jnp.int8 and stored["wte_scale"].shape == (config.vocab_size,)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "q").rglob("*") if f.is_file())
    assert on_disk < 0.45 * param_bytes(params)  # int8 matrices; float32 scales, biases, wpe and LayerNorms
    tokens = random_tokens(config.vocab_size, (2, 16), seed=3)
    bits = lambda p: np.asarray(gpt2_jax.forward(p, tokens, config)).view(np.uint32)
    assert (bits(stored) == bits(quantize_int8(params))).all()
    assert (bits(gpt2_jax.load(src, dtype="int8")[0]) == bits(stored)).all()  # quantized on loading: the same
    back, _ = gpt2_jax.load(tmp_path / "q", dtype="float32")
    assert not is_int8(back) and back["wte"].dtype == jnp.float32
    assert (bits(back) == bits(with_precision(stored, "float32"))).all()
    assert rel_err(gpt2_jax.forward(back, tokens, config), hf_logits(hf, tokens)) < 3e-2
    assert main(["convert", str(src), str(tmp_path / "h"), "--dtype", "int8", "--to-hf"]) != 0
    assert not (tmp_path / "h").exists()
    with pytest.raises(ConfigError, match="int8"):
        gpt2_jax.cast_params(stored, jnp.float32)
    # w8a8: the stored int8 weights with their row sums added on loading; saved, it is int8's checkpoint again
    w8a8, _ = gpt2_jax.load(tmp_path / "q", dtype="w8a8")
    assert is_w8a8(w8a8) and (bits(w8a8) == bits(with_precision(params, "w8a8"))).all()
    assert (bits(w8a8) != bits(stored)).any()  # 8-bit inputs: other numbers than int8's
    native.save(tmp_path / "again", w8a8, config)
    again, _ = gpt2_jax.load(tmp_path / "again")
    assert is_int8(again) and not is_w8a8(again) and (bits(again) == bits(stored)).all()
    with pytest.raises(ConfigError, match="chosen when loading"):
        gpt2_jax.convert(src, tmp_path / "w", dtype="w8a8")
    assert not (tmp_path / "w").exists()


def test_int8_embedding_keeps_a_second_byte(model, tmp_path):
    """int8's tied wte rounds each row to a byte for the head, but a token's embedding (only B rows a step, never
    streamed) also reads a second byte, 256x finer: against transformers' float32 rows it is within 1/256 of a
    step where the first byte alone is off by up to half a step. An int8 checkpoint written without it still loads."""
    from gpt2_jax.model.gpt2 import embed

    hf, params, config = model
    q = quantize_int8(params)
    assert q["wte_residual"].dtype == jnp.int8 and q["wte_residual"].shape == q["wte"].shape
    ids = jnp.arange(config.vocab_size)[None]
    wpe0 = np.asarray(params["wpe"][0], np.float64)
    ref = hf.transformer.wte.weight.detach().numpy().astype(np.float64)
    step = np.asarray(q["wte_scale"], np.float64)[:, None]
    at = lambda p: np.asarray(embed(p, ids, jnp.zeros_like(ids)), np.float64)[0] - wpe0
    fine = np.abs(at(q) - ref)
    assert (fine <= step / 256 + 1e-6).all()  # half a fine step, or one where the byte clips at 127
    coarse = np.abs(at({k: v for k, v in q.items() if k != "wte_residual"}) - ref)
    assert (coarse <= step / 2 + 1e-6).all() and coarse.max() > 50 * fine.max()
    # the head reads the first byte only: the float32 model of these params is q * scale, as before
    assert (np.asarray(with_precision(q, "float32")["wte"]) == np.asarray(q["wte"], np.float32) * q["wte_scale"][:, None]).all()  # fmt: skip
    old = {k: v for k, v in q.items() if k != "wte_residual"}
    native.save(tmp_path / "old", old, config)
    loaded, _ = gpt2_jax.load(tmp_path / "old")
    assert "wte_residual" not in loaded
    tokens = random_tokens(config.vocab_size, (2, 8), seed=4)
    bits = lambda p: np.asarray(gpt2_jax.forward(p, tokens, config)).view(np.uint32)
    assert (bits(loaded) == bits(old)).all() and (bits(loaded) != bits(q)).any()
