"""gpt2_jax.kernels.rowdot, the float32 matmul whose outputs round the same way for any row count.

References: numpy in float64 (the value), the kernel's own full-batch call (the bits of every slice of
rows), its AVX2 path in a fresh process (the same bits as AVX-512), and XLA's own matmul as the
contrast that shows why the kernel exists."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt2_jax import kernels
from gpt2_jax.kernels import rowdot

pytestmark = pytest.mark.skipif(kernels.available() is None, reason="rowdot not built on this machine")

SHAPES = [(768, 2304), (3072, 768), (770, 50), (13, 7)]  # (K, N): GPT-2's, odd widths, a tail of K % 16


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("K,N", SHAPES)
def test_rowdot_equals_a_float64_matmul_and_every_row_count_gives_the_same_bits(K, N):
    rng = np.random.default_rng(K * N)
    x = rng.standard_normal((150, K), np.float32)
    w = rng.standard_normal((N, K), np.float32)
    f = jax.jit(rowdot)
    full = np.asarray(f(x, w))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)  # float32 rounding grows with it
    assert np.all(np.abs(full - ref) <= 1e-6 * scale + 1e-30)
    for M in (1, 2, 3, 7, 8, 9, 17, 64, 65, 129):
        for start in (0, 5):
            rows = slice(start, start + M)
            assert (bits(f(x[rows], w)) == bits(full[rows])).all(), (M, start)


def test_xla_matmul_rounds_one_row_differently_from_many_which_is_why_rowdot_exists():
    """The contrast: XLA's CPU matmul picks its kernel by shape, so a row alone rounds unlike the same
    row among 64 (and a decode step unlike a forward)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 768), np.float32)
    w = rng.standard_normal((3072, 768), np.float32)
    xla = jax.jit(lambda a, b: jnp.einsum("MI,NI->MN", a, b))
    assert (bits(xla(x[:1], w)) != bits(xla(x, w)[:1])).any()
    assert (bits(rowdot(x[:1], w)) == bits(rowdot(x, w)[:1])).all()


def test_leading_dims_and_vmap_over_either_operand_equal_a_loop():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 768), np.float32)
    w = rng.standard_normal((3, 40, 768), np.float32)
    over_x = jax.vmap(rowdot, (0, None))(x, w[0])
    over_w = jax.vmap(rowdot, (None, 0))(x[0], w)
    both = jax.vmap(rowdot)(x, w)
    batched = rowdot(x.reshape(3, 1, 5, 768), w.reshape(3, 1, 40, 768))  # shared leading dims: one call
    for i in range(3):
        assert (bits(batched[i, 0]) == bits(rowdot(x[i], w[i]))).all()
        assert (bits(over_x[i]) == bits(rowdot(x[i], w[0]))).all()
        assert (bits(over_w[i]) == bits(rowdot(x[0], w[i]))).all()
        assert (bits(both[i]) == bits(rowdot(x[i], w[i]))).all()


def test_gradient_is_the_matmul_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 96), np.float32)
    w = rng.standard_normal((40, 96), np.float32)
    g = rng.standard_normal((6, 40), np.float32)
    dx, dw = jax.grad(lambda a, b: (rowdot(a, b) * g).sum(), (0, 1))(x, w)
    np.testing.assert_allclose(dx, g.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, g.T.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


_AVX2_SCRIPT = """
import sys, numpy as np
from gpt2_jax import kernels
assert kernels.available() == "avx2", kernels.available()
rng = np.random.default_rng(3)
x = rng.standard_normal((19, 770), np.float32); w = rng.standard_normal((37, 770), np.float32)
np.save(sys.argv[1], np.asarray(kernels.rowdot(x, w)))
"""


@pytest.mark.skipif(kernels.available() != "avx512", reason="needs an AVX-512 CPU to compare the two paths")
def test_the_avx2_path_rounds_exactly_like_the_avx512_path(tmp_path):
    out = tmp_path / "avx2.npy"
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA="avx2", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(out)], check=True, env=env, timeout=300)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((19, 770), np.float32)
    w = rng.standard_normal((37, 770), np.float32)
    assert (bits(np.load(out)) == bits(rowdot(x, w))).all()


def test_model_matmuls_go_through_rowdot():
    """layers.matmul on float32 operands is the kernel (its bits), for one row as for many."""
    from gpt2_jax.layers import matmul

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 768), np.float32)
    w = rng.standard_normal((3, 4, 768), np.float32)  # c_attn-like [C, E, D]
    y = jax.jit(matmul)(x, w)
    assert y.shape == (2, 3, 3, 4)
    expect = rowdot(x.reshape(6, 768), w.reshape(12, 768)).reshape(2, 3, 3, 4)
    assert (bits(y) == bits(expect)).all()
    assert (bits(jax.jit(matmul)(x[:1, :1], w)) == bits(expect[:1, :1])).all()


def test_without_the_kernel_matmul_is_xla_in_its_row_count_independent_form(monkeypatch):
    """The fallback (no compiler at install, or a CPU without AVX2): XLA's matmul, with a lone row
    computed as two, still gives a row the same bits alone as among others."""
    from gpt2_jax.layers import matmul

    monkeypatch.setattr(kernels, "_REGISTERED", False)
    assert kernels.available() is None
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 768), np.float32)
    w = rng.standard_normal((64, 768), np.float32)
    many = jax.jit(lambda a, b: matmul(a, b))(x, w)
    one = jax.jit(lambda a, b: matmul(a, b))(x[:1], w)
    assert (bits(one) == bits(many[:1])).all()
    np.testing.assert_allclose(many, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)


def test_an_entry_of_a_stacked_array_is_read_in_place_with_the_same_bits_as_its_slice():
    """kernels.Entry (a layer of the KV cache): the same product as on the sliced-out layer, bit for bit,
    for every layer, with an out-of-range index clamped as XLA's slicing clamps it."""
    from gpt2_jax.kernels import Entry

    rng = np.random.default_rng(6)
    stacked = rng.standard_normal((3, 2, 4, 40, 64), np.float32)  # [L, B, H, S, K], like the key cache
    q = rng.standard_normal((2, 4, 5, 64), np.float32)
    f = jax.jit(lambda a, s, i: rowdot(a, Entry(s, i)))
    for layer in (0, 1, 2):
        assert (bits(f(q, stacked, jnp.int32(layer))) == bits(rowdot(q, stacked[layer]))).all()
    assert (bits(f(q, stacked, jnp.int32(7))) == bits(rowdot(q, stacked[2]))).all()
