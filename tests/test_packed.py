"""float32-packed: float32 weights in 3.5 bytes each (gpt2_jax.kernels.packed), compared as uint32 bits.

Packing is lossless (every float, escapes included, comes back bit for bit), rowdot_packed gives rowdot's bits
over the unpacked weight at every row count and on both instruction sets, and a packed model's logits equal
float32's. The batch-invariance of generation over packed params is in test_invariance.py.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax import kernels
from gpt2_jax.cli import main
from gpt2_jax.errors import ConfigError
from gpt2_jax.kernels.ffi import rowdot
from gpt2_jax.kernels.packed import Packed, pack, packed_rows, rowdot_packed, unpack
from gpt2_jax.model import precision
from tests.reference import hf_logits, make_hf_model

needs_kernels = pytest.mark.skipif(kernels.available() is None, reason="the C++ kernels are not built here")


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def weights(shape, seed=0) -> np.ndarray:
    """N(0, 0.02) weights (a checkpoint's init) with every kind of escape planted: zeros of both signs, a
    denormal, infinities, a NaN, a large value, and one escape per group in a whole row (a group boundary each)."""
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)
    flat = w.reshape(-1, shape[-1])
    flat[0, :8] = [0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan, 3.5, -1e30]
    flat[-1, 15::16] = 2.0 ** -np.arange(100, 100 + shape[-1] // 16)  # the last lane of each group of the last row
    return w


def test_packing_is_lossless_and_takes_seven_eighths_of_the_bytes():
    w = weights((3, 40, 64))
    p = pack(w)
    assert p.shape == w.shape and p.escapes >= 4  # the planted exponents seen once each at least
    assert p.data.nbytes == w.nbytes * 7 // 8  # 3.5 bytes a weight
    np.testing.assert_array_equal(bits(unpack(p)), bits(w))
    gaussian = (np.random.default_rng(1).standard_normal((768, 768)) * 0.02).astype(np.float32)
    assert pack(gaussian).escapes < 1e-3 * gaussian.size  # 15 exponents cover nearly all of N(0, 0.02)


@needs_kernels
@pytest.mark.parametrize("M", [1, 2, 3, 8, 9, 70])
def test_rowdot_packed_gives_rowdots_bits_at_every_row_count(M):
    w = weights((2304, 768))
    x = np.random.default_rng(M).standard_normal((M, 768)).astype(np.float32)
    p = pack(w)
    assert p.escapes >= 48  # one in every group of the last row
    got, want = bits(rowdot_packed(x, p)), bits(rowdot(x, w))
    nan = np.isnan(np.asarray(rowdot(x, w)))  # row 0 holds a NaN and infinities
    assert nan[:, 0].all() and not nan[:, 1:].any()
    np.testing.assert_array_equal(got[:, 1:], want[:, 1:])
    exact = np.asarray(x, np.float64) @ np.asarray(w[1:], np.float64).T  # and the values themselves
    np.testing.assert_allclose(np.asarray(rowdot_packed(x, p))[:, 1:], exact, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_packed_rows_are_the_weights_rows_and_nan_for_a_bad_id():
    w = weights((50, 32))
    rows = np.asarray(packed_rows(pack(w), np.array([[3, 0], [49, 50]])))
    np.testing.assert_array_equal(bits(rows[0, 0]), bits(w[3]))
    np.testing.assert_array_equal(bits(rows[0, 1]), bits(w[0]))
    np.testing.assert_array_equal(bits(rows[1, 0]), bits(w[49]))
    assert np.isnan(rows[1, 1]).all()


_ISA_SCRIPT = """
import sys, numpy as np
from gpt2_jax import kernels
from gpt2_jax.kernels.packed import pack, rowdot_packed
from tests.test_packed import weights
assert kernels.available() == sys.argv[2][:6], kernels.available()
w = weights((300, 256)); p = pack(w)
for M in (1, 5):
    x = np.random.default_rng(M).standard_normal((M, 256)).astype(np.float32)
    np.save(sys.argv[1] + f"{M}.npy", np.asarray(rowdot_packed(x, p)))
"""


@pytest.mark.skipif(kernels.available() != "avx512", reason="needs an AVX-512 CPU to compare the paths")
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_decoder_gives_the_same_bits(tmp_path, isa):
    """AVX2's decoders, and AVX-512's for one row, which AMD runs only when forced (its 1-row tiles are AVX2's,
    packed.h's Block), give the bits of this process's."""
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA=isa, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(tmp_path / "y"), isa], check=True, env=env, timeout=300)
    w = weights((300, 256))
    for M in (1, 5):
        x = np.random.default_rng(M).standard_normal((M, 256)).astype(np.float32)
        np.testing.assert_array_equal(bits(np.load(tmp_path / f"y{M}.npy")), bits(rowdot_packed(x, pack(w))))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random transformers GPT-2 saved with save_pretrained -> (its directory, float32 params, config, the model)."""
    hf = make_hf_model(seed=3, n_layer=2, n_head=4, n_embd=64, vocab_size=500)
    path = tmp_path_factory.mktemp("m") / "hf"
    hf.save_pretrained(path)
    return path, *gpt2_jax.load(path, dtype="float32"), hf


def test_a_packed_model_gives_float32s_logits_bit_for_bit(model):
    path, params, config, hf = model
    packed, _ = gpt2_jax.load(path, dtype="float32-packed")
    assert gpt2_jax.model.params.is_packed(packed) and isinstance(packed["h"][1]["mlp"]["c_fc"]["weight"], Packed)
    assert gpt2_jax.model.params.param_bytes(packed) < 0.9 * gpt2_jax.model.params.param_bytes(params)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (3, 11))
    logits = gpt2_jax.forward(packed, ids, config)
    np.testing.assert_array_equal(bits(logits), bits(gpt2_jax.forward(params, ids, config)))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), rtol=1e-5, atol=1e-5)  # transformers' too
    back = precision.with_precision(packed, "float32")  # unpacked: the very params loaded
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    int8 = precision.with_precision(packed, "int8")  # other modes start from the unpacked values
    np.testing.assert_array_equal(np.asarray(int8["wte"]), np.asarray(precision.with_precision(params, "int8")["wte"]))


def test_packed_params_refuse_what_they_cannot_do_with_a_clear_error(model):
    path, params, config, _ = model
    packed = precision.pack_params(params)
    with pytest.raises(ConfigError, match="inference only"):
        gpt2_jax.model.stack_layers(packed)  # training and saving stack the layers
    with pytest.raises(ConfigError, match="unpacks first"):
        gpt2_jax.cast_params(packed, np.float32)
    with pytest.raises(ConfigError, match="per-layer"):
        precision.pack_params(gpt2_jax.model.stack_layers(params))
    with pytest.raises(ConfigError, match="mesh"):
        gpt2_jax.load(path, dtype="float32-packed", mesh=object())
    with pytest.raises(ConfigError, match=r"K a multiple of 16.*\(4, 20\)"):
        pack(np.zeros((4, 20), np.float32))


def test_the_cli_samples_float32s_very_text_from_packed_weights(capsys):
    texts = {}
    for dtype in ("float32", "float32-packed"):
        assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "12", "--dtype", dtype, "--seed", "5"]) == 0
        texts[dtype] = capsys.readouterr().out
    assert texts["float32"].startswith("ROMEO:") and len(texts["float32"]) > len("ROMEO:\n")
    assert texts["float32-packed"] == texts["float32"]  # sampled, not greedy: the same logits, bit for bit


def test_without_the_kernels_packed_weights_are_unpacked_for_xlas_matmul(monkeypatch):
    """Where the kernels do not run (a GPU, no compiler), rowdot_packed and packed_rows unpack the weight in jnp and
    hand it to XLA: the values of x @ w.T and of w's rows (exact for the rows, close for the product)."""
    monkeypatch.setattr(kernels.registry, "_REGISTERED", False)
    jax.clear_caches()
    try:
        assert kernels.available() is None
        w = weights((40, 64))
        x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
        y = np.asarray(jax.jit(rowdot_packed)(x, pack(w)))
        np.testing.assert_allclose(y[:, 1:], x.astype(np.float64) @ w[1:].T.astype(np.float64), rtol=1e-5, atol=1e-6)
        rows = np.asarray(packed_rows(pack(w), np.array([7, -1])))
        np.testing.assert_array_equal(bits(rows[0]), bits(w[7]))
        assert np.isnan(rows[1]).all()
    finally:
        jax.clear_caches()
