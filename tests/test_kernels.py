"""gpt2_jax.kernels.ffi.rowdot and chain, the float32 matmuls whose outputs round the same way for any row count.

References: numpy in float64 (the value), a numpy loop of float32 fused multiply-adds (chain's exact
bits), the kernel's own full-batch call (the bits of every slice of rows), its AVX2 path in a fresh
process (the same bits as AVX-512), and XLA's own matmul as the contrast that shows why the kernels exist."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt2_jax import kernels
from gpt2_jax.kernels.ffi import argmax, chain, int8_isa, rowdot, rowdot_int8, softmax

pytestmark = pytest.mark.skipif(kernels.available() is None, reason="rowdot not built on this machine")

SHAPES = [
    (768, 2304),
    (3072, 768),
    (770, 50),
    (13, 7),
    (100, 30),
]  # (K, N): GPT-2's, odd widths, tails of K % 16, K % 64


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
from gpt2_jax.kernels.ffi import chain, rowdot, rowdot_int8
assert kernels.available() == "avx2", kernels.available()
rng = np.random.default_rng(3)
x = rng.standard_normal((19, 770), np.float32); w = rng.standard_normal((37, 770), np.float32)
np.save(sys.argv[1], np.asarray(rowdot(x, w)))
np.save(sys.argv[2], np.asarray(chain(x[:, :70], w[:, :70].T.copy())))
q = rng.integers(-127, 128, (37, 770), dtype=np.int8); s = rng.uniform(1e-3, 1e-1, 37).astype(np.float32)
np.save(sys.argv[3], np.asarray(rowdot_int8(x, q, s)))
"""


@pytest.mark.skipif(kernels.available() != "avx512", reason="needs an AVX-512 CPU to compare the two paths")
def test_the_avx2_path_rounds_exactly_like_the_avx512_path(tmp_path):
    out, out_chain, out_int8 = tmp_path / "avx2.npy", tmp_path / "avx2_chain.npy", tmp_path / "avx2_int8.npy"
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA="avx2", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _AVX2_SCRIPT, str(out), str(out_chain), str(out_int8)], check=True, env=env,
                   timeout=300)  # fmt: skip
    rng = np.random.default_rng(3)
    x = rng.standard_normal((19, 770), np.float32)
    w = rng.standard_normal((37, 770), np.float32)
    assert (bits(np.load(out)) == bits(rowdot(x, w))).all()
    assert (bits(np.load(out_chain)) == bits(chain(x[:, :70], w[:, :70].T.copy()))).all()
    q, s = rng.integers(-127, 128, (37, 770), dtype=np.int8), rng.uniform(1e-3, 1e-1, 37).astype(np.float32)
    assert (bits(np.load(out_int8)) == bits(rowdot_int8(x, q, s))).all()
    assert (bits(rowdot_int8(x, q, s)) == bits(int8_reference(x, q, s))).all()


_ONE_ROW_SCRIPT = """
import sys, numpy as np
from gpt2_jax.kernels.ffi import rowdot, rowdot_int8
rng = np.random.default_rng(6)
x = rng.standard_normal((2, 770), np.float32); w = rng.standard_normal((37, 770), np.float32)
q = rng.integers(-127, 128, (37, 770), dtype=np.int8); s = rng.uniform(1e-3, 1e-1, 37).astype(np.float32)
np.save(sys.argv[1], np.asarray(rowdot(x[:1], w))); np.save(sys.argv[2], np.asarray(rowdot_int8(x[:1], q, s)))
"""


@pytest.mark.skipif(kernels.available() != "avx512", reason="needs an AVX-512 CPU to compare the two 1-row tiles")
def test_the_one_row_tiles_on_amd_round_like_avx512s(tmp_path):
    """A decode step's single row takes AVX2's 1-row tiles on AMD (rowdot.h's AvxTwoForOneRow) and AVX-512's
    elsewhere, or wherever GPT2_JAX_ROWDOT_ISA names an AVX-512 path (forced here in a fresh process): fp32
    and int8, the same bits as each other, as two rows' first row, and as the int8 reference."""
    outs = tmp_path / "fp32.npy", tmp_path / "int8.npy"
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA="avx512", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", _ONE_ROW_SCRIPT, *map(str, outs)], check=True, env=env, timeout=300)
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((2, 770), np.float32), rng.standard_normal((37, 770), np.float32)
    q, s = rng.integers(-127, 128, (37, 770), dtype=np.int8), rng.uniform(1e-3, 1e-1, 37).astype(np.float32)
    assert (bits(np.load(outs[0])) == bits(rowdot(x[:1], w))).all()
    assert (bits(rowdot(x[:1], w)) == bits(rowdot(x, w)[:1])).all()
    assert (bits(np.load(outs[1])) == bits(rowdot_int8(x[:1], q, s))).all()
    assert (bits(rowdot_int8(x[:1], q, s)) == bits(int8_reference(x[:1], q, s))).all()


def int8_reference(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """rowdot_int8's arithmetic written out in numpy (int8.h): each row of x rounded to int16 by its largest
    |x| (in float64), the dot products exact in int64, then total * row scale * scale in float64, rounded once."""
    amax = np.abs(x).max(axis=1)
    xq = np.rint(x.astype(np.float64) * (32767.0 / np.where(amax > 0, amax, 1.0).astype(np.float64))[:, None])
    row_scale = (amax / np.float32(32767.0)).astype(np.float32)
    return _rounded(xq, row_scale, q, s)


def _rounded(xq: np.ndarray, row_scale: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    total = xq.astype(np.int64) @ q.T.astype(np.int64)
    return (total.astype(np.float64) * row_scale.astype(np.float64)[:, None] * s.astype(np.float64)).astype(np.float32)


def w8a8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8.h's QuantizeRow8 in numpy: each row over its range with 0 in it, in float64, -> (xq, scale float32,
    zero point): 255 steps, z = rint(-lo / s), xq = clip(rint(x / s) + z, 0, 255) - z."""
    lo = np.minimum(x.min(axis=1), 0).astype(np.float64)
    rng = np.maximum(x.max(axis=1), 0).astype(np.float64) - lo
    inv = 255.0 / np.where(rng > 0, rng, 1.0)
    z = np.rint(-lo * inv)
    xq = np.clip(np.rint(x.astype(np.float64) * inv[:, None]) + z[:, None], 0, 255) - z[:, None]
    return xq, (rng / 255.0).astype(np.float32), z


def w8a8_reference(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """rowdot_int8 given qsum (w8a8) in numpy: w8a8_rows, the dot products exact in int64, one rounding."""
    xq, row_scale, _ = w8a8_rows(x)
    return _rounded(xq, row_scale, q, s)


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
@pytest.mark.parametrize("K,N", SHAPES)
def test_rowdot_int8_is_exact_integer_arithmetic_for_any_row_count(K, N, mode):
    """The int8 kernel's bits are a numpy int64 matmul's (over x rounded to int16 per row; w8a8, given the
    weight rows' sums: to bytes with a zero point), rounded once, for every slice of rows and under vmap; its
    value is within that rounding of a float64 matmul's."""
    rng = np.random.default_rng(K + N)
    x = rng.standard_normal((150, K), np.float32) * rng.uniform(0.1, 30, (150, 1)).astype(np.float32)
    x[7] = 0.0  # a zero row (padding): exactly zero out
    q = rng.integers(-127, 128, (N, K), dtype=np.int8)
    s = rng.uniform(1e-3, 1e-1, N).astype(np.float32)
    qsum, reference = (None, int8_reference) if mode == "int8" else (q.sum(1, dtype=np.int32), w8a8_reference)
    f = jax.jit(functools.partial(rowdot_int8, qsum=qsum))
    full = np.asarray(f(x, q, s))
    assert (bits(full) == bits(reference(x, q, s))).all()
    assert not full[7].any()
    exact = (x.astype(np.float64) @ q.T.astype(np.float64)) * s
    step = np.abs(x).max(1) / 32767 if mode == "int8" else (np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0)) / 255
    bound = step[:, None].astype(np.float64) / 2 * (np.abs(q).sum(1) * s)[None]
    assert np.all(np.abs(full - exact) <= bound * (1 + 1e-6) + 1e-6 * np.abs(exact))
    for M in (1, 2, 3, 8, 9, 15, 16, 65):  # int8.h's tiles (w8a8: a8.h's from 3 to 8); from 16, AMX's or vnni_rows.h's
        for start in (0, 5):
            rows = slice(start, start + M)
            assert (bits(f(x[rows], q, s)) == bits(full[rows])).all(), (M, start)
    over_x = jax.vmap(f, (0, None, None))(x[:60].reshape(3, 20, K), q, s)  # vmap: one weight for all
    assert (bits(over_x.reshape(60, N)) == bits(full[:60])).all()


@pytest.mark.skipif(int8_isa() not in ("avx512-vnni", "amx-int8"), reason="a8.h's byte tiles need AVX512-VNNI")
def test_w8a8s_few_rows_take_the_byte_tiles_that_read_the_weight_row_sums():
    """3 to 8 rows of w8a8 run a8.h's vpdpbusd tiles, which take the bytes xq + z (z: the row's zero point) and
    subtract z x each weight row's sum: given sums off by one, exactly those rows' outputs move by z x row
    scale x scale (1 and 2 rows take the int16 tiles, 16 vnni_rows.h's one byte plane, which sums the weights
    itself), so the tiles ran, and with the true sums they give the reference bits. Skewed rows (a GELU's
    output: min -0.17) get nonzero zero points."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((16, 768), np.float32)
    x = np.where(np.arange(16)[:, None] % 2 == 0, x, np.maximum(x, -0.17))  # every other row skewed
    q = rng.integers(-127, 128, (50, 768), dtype=np.int8)
    s = np.full(50, 0.01, np.float32)
    qsum = q.sum(1, dtype=np.int32)
    for M in (1, 2, 5, 8, 16):
        good = np.asarray(rowdot_int8(x[:M], q, s, qsum))
        assert (bits(good) == bits(w8a8_reference(x[:M], q, s))).all(), M
        off = np.asarray(rowdot_int8(x[:M], q, s, qsum + 1))
        _, row_scale, z = w8a8_rows(x[:M])
        assert (z[1::2] < 30).all() and (z[0::2] > 90).all()  # a skewed row's zero point sits low in its byte
        moved = -z[:, None] * row_scale[:, None].astype(np.float64) * s.astype(np.float64)
        if 3 <= M <= 8:
            ulp = np.spacing(np.float32(np.abs(good).max() + np.abs(moved).max()))  # each output rounded once
            np.testing.assert_allclose(off - good, moved, rtol=0, atol=2 * ulp)
        else:
            assert (bits(off) == bits(good)).all(), M


def test_rowdot_int8_gives_a_row_with_a_nan_nan_outputs_and_leaves_the_others():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 64), np.float32)
    x[1, 5], x[2, 0] = np.nan, np.inf
    q, s = rng.integers(-127, 128, (10, 64), dtype=np.int8), np.full(10, 0.01, np.float32)
    y = np.asarray(rowdot_int8(x, q, s))
    assert np.isnan(y[1:]).all() and np.isfinite(y[0]).all()
    assert (bits(y[0]) == bits(int8_reference(x[:1], q, s)[0])).all()


_INT8_SCRIPT = """
import sys, numpy as np
from gpt2_jax.kernels.ffi import int8_isa, rowdot_int8
assert int8_isa() == sys.argv[2], int8_isa()
rng = np.random.default_rng(4)
for K, path in ((3100, sys.argv[1]), (3072, sys.argv[3])):  # a K tail; a K that AMX's tiles take
    x = rng.standard_normal((43, K), np.float32); q = rng.integers(-128, 128, (45, K), dtype=np.int8)
    np.save(path, np.asarray(rowdot_int8(x, q, np.full(45, 0.02, np.float32))))
x = rng.standard_normal((5, 768), np.float32); q = rng.integers(-127, 128, (45, 768), dtype=np.int8)
np.save(sys.argv[4], np.asarray(rowdot_int8(x, q, np.full(45, 0.02, np.float32), q.sum(1, dtype=np.int32))))
"""
INT8_ISAS = ["avx2", "avx512", "avx512-vnni", "amx-int8"]  # each runs everything before it, when forced


@pytest.mark.parametrize("isa", INT8_ISAS[:-1])
def test_every_int8_instruction_set_gives_the_reference_bits(tmp_path, isa):
    """AMX's byte tiles, VNNI's vpdpwssd and (16 rows or more without AMX) vpdpbusd over byte planes,
    AVX-512's and AVX2's vpmaddwd (forced in fresh processes) sum the same integers: the bits of 43 rows
    (AMX's 16-row tiles or vnni_rows.h's groups of 8, and a part-filled one) against 45 weight rows (AMX's
    32-column steps and a tail), at a K with a tail of 64 and one without; and w8a8's 5 rows (a8.h's byte
    tiles on VNNI, the int16 tiles on its 8-bit rows without)."""
    here = int8_isa()
    if here not in INT8_ISAS or INT8_ISAS.index(here) <= INT8_ISAS.index(isa):
        pytest.skip(f"needs a CPU with more than {isa} to force it (this one: {here})")
    outs = tmp_path / "tail.npy", tmp_path / "even.npy", tmp_path / "w8a8.npy"
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA=isa, JAX_PLATFORMS="cpu")
    subprocess.run(
        [sys.executable, "-c", _INT8_SCRIPT, str(outs[0]), isa, str(outs[1]), str(outs[2])],
        check=True, env=env, timeout=300,
    )  # fmt: skip
    rng = np.random.default_rng(4)
    for K, out in zip((3100, 3072), outs):
        x, q = rng.standard_normal((43, K), np.float32), rng.integers(-128, 128, (45, K), dtype=np.int8)
        s = np.full(45, 0.02, np.float32)
        assert (bits(np.load(out)) == bits(int8_reference(x, q, s))).all(), (isa, K)
        assert (bits(np.load(out)) == bits(rowdot_int8(x, q, s))).all(), (isa, K)
    x, q = rng.standard_normal((5, 768), np.float32), rng.integers(-127, 128, (45, 768), dtype=np.int8)
    s, qsum = np.full(45, 0.02, np.float32), q.sum(1, dtype=np.int32)
    assert (bits(np.load(outs[2])) == bits(w8a8_reference(x, q, s))).all(), isa
    assert (bits(np.load(outs[2])) == bits(rowdot_int8(x, q, s, qsum))).all(), isa


def test_model_matmuls_go_through_rowdot():
    """layers.matmul on float32 operands is the kernel (its bits), for one row as for many."""
    from gpt2_jax.model.invariant import matmul

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 768), np.float32)
    w = rng.standard_normal((3, 4, 768), np.float32)  # c_attn-like [C, E, D]
    y = jax.jit(matmul)(x, w)
    assert y.shape == (2, 3, 3, 4)
    expect = rowdot(x.reshape(6, 768), w.reshape(12, 768)).reshape(2, 3, 3, 4)
    assert (bits(y) == bits(expect)).all()
    assert (bits(jax.jit(matmul)(x[:1, :1], w)) == bits(expect[:1, :1])).all()


def test_without_the_kernel_matmul_is_xla_in_its_row_count_independent_form(monkeypatch):
    """The fallback (no compiler at install, or a CPU without AVX2): XLA's matmul, with fewer than
    XLA_MIN_ROWS rows padded, still gives a row the same bits alone as among others."""
    from gpt2_jax.model.invariant import matmul

    monkeypatch.setattr(kernels.registry, "_REGISTERED", False)
    assert kernels.available() is None
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 768), np.float32)
    w = rng.standard_normal((64, 768), np.float32)
    many = jax.jit(lambda a, b: matmul(a, b))(x, w)
    one = jax.jit(lambda a, b: matmul(a, b))(x[:1], w)
    assert (bits(one) == bits(many[:1])).all()
    np.testing.assert_allclose(many, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)


def test_bfloat16_matmul_gives_a_row_the_same_bits_for_any_row_count():
    """bfloat16 weights run on XLA's matmul (not the float32 kernels). On a Xeon with AMX its bfloat16 kernel
    rounds 1 and 2 rows differently from 3 or more (seen 2026-12-02: the served bundled model's logprobs
    then changed with the number of busy slots), so fewer than XLA_MIN_ROWS rows are padded."""
    from gpt2_jax.model.invariant import XLA_MIN_ROWS, matmul

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((384, 128)), jnp.bfloat16)
    f = jax.jit(matmul)
    ref = bits(f(x, w)[:1])
    for rows in (1, 2, 3, 5, 8, 17):
        assert (bits(f(x[:rows], w)[:1]) == ref).all(), rows
    raw = jax.jit(lambda a, b: jnp.einsum("MI,NI->MN", a, b, preferred_element_type=jnp.float32))
    assert XLA_MIN_ROWS >= 3 and (bits(raw(x[:XLA_MIN_ROWS], w)[:1]) == ref).all()


def test_without_the_kernels_on_the_cpu_a_warning_says_so_once(monkeypatch):
    """Every speed figure assumes the kernels: running without them warns once per process, naming why
    and how to build them."""
    import warnings

    from gpt2_jax.model.invariant import matmul

    monkeypatch.setattr(kernels.registry, "_REGISTERED", False)
    monkeypatch.setattr(kernels.ffi, "_WARNED", False)
    x, w = np.ones((2, 32), np.float32), np.ones((8, 32), np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(matmul)(x, w)
        jax.jit(lambda a, b: matmul(a, b) + 1)(x, w)
    mine = [c for c in caught if "without its kernels" in str(c.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert "g++" in str(mine[0].message) and kernels.why_unavailable() is not None


def test_an_entry_of_a_stacked_array_is_read_in_place_with_the_same_bits_as_its_slice():
    """Entry (a layer of the KV cache): the same product as on the sliced-out layer, bit for bit,
    for every layer, with an out-of-range index clamped as XLA's slicing clamps it."""
    from gpt2_jax.kernels.products import Entry

    rng = np.random.default_rng(6)
    stacked = rng.standard_normal((3, 2, 4, 40, 64), np.float32)  # [L, B, H, S, K], like the key cache
    q = rng.standard_normal((2, 4, 5, 64), np.float32)
    f = jax.jit(lambda a, s, i: rowdot(a, Entry(s, i)))
    for layer in (0, 1, 2):
        assert (bits(f(q, stacked, jnp.int32(layer))) == bits(rowdot(q, stacked[layer]))).all()
    assert (bits(f(q, stacked, jnp.int32(7))) == bits(rowdot(q, stacked[2]))).all()


# ---- chain: x [M, K] @ w [K, N], one fused multiply-add chain per output --------------------------------------


def fma_chain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """acc = fma(x[m, k], w[k, n], acc) for k in order, in float32, as numpy: the product of two float32s
    is exact in 80-bit long double, and so (almost always) is the sum, rounded once to float32."""
    acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for k in range(x.shape[1]):
        exact = np.longdouble(x[:, k, None]) * np.longdouble(w[None, k, :]) + np.longdouble(acc)
        acc = exact.astype(np.float32)
    return acc


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs 80-bit long double for the exact reference")
@pytest.mark.parametrize("K,N", [(64, 130), (640, 64), (5, 3)])  # attention's scores, its weighted sum, tiny
def test_chain_is_one_fused_multiply_add_chain_per_output_for_any_row_count(K, N):
    rng = np.random.default_rng(K + N)
    x = rng.standard_normal((40, K), np.float32)
    w = rng.standard_normal((K, N), np.float32)
    f = jax.jit(chain)
    full = np.asarray(f(x, w))
    assert (bits(full) == bits(fma_chain(x, w))).all()
    assert (bits(full) != bits(rowdot(x, w.T.copy()))).any()  # a different arithmetic from rowdot's
    for M in (1, 2, 5, 6, 7, 13):
        for start in (0, 3):
            assert (bits(f(x[start : start + M], w)) == bits(full[start : start + M])).all(), (M, start)


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs 80-bit long double for the exact reference")
def test_a_decode_querys_scores_with_ends_are_the_same_chains():
    """One query row (a decode step) against its keys with out_ends takes chain.h's wide 1-row tile on
    AVX-512: every needed score is still the one multiply-add chain, and every score past the end is 0, for
    ends at and around each vector (16), tile (64) and pass (256) boundary."""
    rng = np.random.default_rng(5)
    K, S = 64, 600
    ends = np.array([0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 300, 511, 512, 513, 599, 600], np.int32)
    q = rng.standard_normal((len(ends), 1, K), np.float32)
    kt = rng.standard_normal((len(ends), K, S), np.float32)
    got = np.asarray(jax.jit(lambda a, b, e: chain(a, b, out_ends=e))(q, kt, ends[:, None]))
    needed = np.arange(S) < ends[:, None, None]
    ref = np.stack([fma_chain(q[i], kt[i]) for i in range(len(ends))])
    assert (bits(got[needed]) == bits(ref[needed])).all() and (got[~needed] == 0).all()
    assert (bits(got) == bits(np.where(needed, np.asarray(chain(q, kt)), 0))).all()


def test_ends_skip_work_without_changing_any_needed_output():
    """out_ends: outputs past a row's end come back 0, the others keep their bits; in_ends: products
    past a row's end (where x is 0) are skipped, and every output keeps its bits. For both kernels."""
    rng = np.random.default_rng(7)
    B, T, K, S = 3, 50, 64, 140
    q = rng.standard_normal((B, T, K), np.float32)
    keys = rng.standard_normal((B, S, K), np.float32)
    ends = rng.integers(0, S + 1, (B, T)).astype(np.int32)
    needed = np.arange(S) < ends[..., None]
    weights = np.where(needed, rng.random((B, T, S), np.float32), 0.0).astype(np.float32)
    values = rng.standard_normal((B, S, K), np.float32)
    for kernel, kt, v in (
        (chain, np.swapaxes(keys, 1, 2).copy(), values),
        (rowdot, keys, np.swapaxes(values, 1, 2).copy()),
    ):
        scores = np.asarray(jax.jit(lambda a, b, e: kernel(a, b, out_ends=e))(q, kt, ends))
        assert (bits(scores[needed]) == bits(np.asarray(kernel(q, kt))[needed])).all()
        assert (scores[~needed] == 0).all() and needed.sum() > 0 and (~needed).sum() > 0
        out = jax.jit(lambda a, b, e: kernel(a, b, in_ends=e))(weights, v, ends)
        assert (bits(out) == bits(kernel(weights, v))).all()
        # The promise matters: with non-zero x past the ends, the skipped products show.
        assert (bits(kernel(weights + 1.0, v, in_ends=ends)) != bits(kernel(weights + 1.0, v))).any()


def test_chain_gradient_and_entry():
    from gpt2_jax.kernels.products import Entry

    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 64), np.float32)
    w = rng.standard_normal((2, 64, 30), np.float32)
    g = rng.standard_normal((2, 6, 30), np.float32)
    ends = np.array([[30, 5, 0, 12, 29, 30], [1, 2, 3, 4, 5, 6]], np.int32)
    kept = np.where(np.arange(30) < ends[..., None], g, 0.0)
    dx, dw = jax.grad(lambda a, b: (chain(a, b, out_ends=ends) * g).sum(), (0, 1))(x, w)
    np.testing.assert_allclose(dx, np.einsum("bmn,bkn->bmk", kept, w.astype(np.float64)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("bmk,bmn->bkn", x.astype(np.float64), kept), rtol=1e-5, atol=1e-5)
    stacked = np.stack([w, 2 * w, 3 * w])  # [L, B, K, N], like the transposed key cache
    f = jax.jit(lambda a, s, i: chain(a, Entry(s, i), out_ends=ends))
    for layer in (0, 2):
        assert (bits(f(x, stacked, jnp.int32(layer))) == bits(chain(x, stacked[layer], out_ends=ends))).all()


_PAGED_SCRIPT = """
import sys
import numpy as np
import jax, jax.numpy as jnp
from gpt2_jax.kernels.ffi import chain
from gpt2_jax.kernels.products import Paged

rng = np.random.default_rng(11)
L, N, H, K, C, B, M, T = 2, 9, 3, 64, 128, 3, 4, 5
kp = rng.standard_normal((L, N, H, K, C), np.float32)
vp = rng.standard_normal((L, N, H, C, K), np.float32)
table = rng.integers(0, N, (B, M)).astype(np.int32)
table[0, 1] = table[0, 3]  # a block listed twice (a row sharing it with itself: reads are reads)
q = rng.standard_normal((B, H, T, K), np.float32)
ends = rng.integers(0, M * C + 1, (B, H, T)).astype(np.int32)
w = np.where(np.arange(M * C) < ends[..., None], rng.random((B, H, T, M * C), np.float32), 0).astype(np.float32)
out = {}
for layer in (0, 1):
    kt = Paged(jnp.asarray(kp), jnp.int32(layer), jnp.asarray(table), True)
    v = Paged(jnp.asarray(vp), jnp.int32(layer), jnp.asarray(table), False)
    out[f"scores{layer}"] = np.asarray(jax.jit(lambda q, e: chain(q, kt, out_ends=e))(q, ends))
    out[f"values{layer}"] = np.asarray(jax.jit(lambda w, e: chain(w, v, in_ends=e))(w, ends))
    # one query a row, as a decode step asks (chain's wide 1-row pass, block by block)
    out[f"decode{layer}"] = np.asarray(jax.jit(lambda q, e: chain(q, kt, out_ends=e))(q[:, :, 1:2], ends[:, :, 1:2]))
np.savez(sys.argv[1], **out)
"""


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_a_paged_operand_is_read_through_its_block_table_with_the_bits_of_the_gathered_array(tmp_path, isa):
    """Paged (one layer of the paged KV cache, gpt2_jax.model.paged_cache): chain reads each row's blocks
    where they lie in the pool, keys paged along the outputs, values along the chains (carried from block to
    block), and gives the bits chain gives on the row's blocks gathered into one array by numpy; a decode
    step's lone query (the wide 1-row pass, a block at a time) too."""
    if isa == "avx2" and kernels.available() != "avx512":
        pytest.skip("needs an AVX-512 CPU to also run the AVX2 path")
    env = dict(os.environ, JAX_PLATFORMS="cpu", **({"GPT2_JAX_ROWDOT_ISA": "avx2"} if isa == "avx2" else {}))
    subprocess.run([sys.executable, "-c", _PAGED_SCRIPT, str(tmp_path / "p.npz")], check=True, env=env, timeout=300)
    got = np.load(tmp_path / "p.npz")
    rng = np.random.default_rng(11)  # the script's arrays, drawn in the same order
    L, N, H, K, C, B, M, T = 2, 9, 3, 64, 128, 3, 4, 5
    kp = rng.standard_normal((L, N, H, K, C), np.float32)
    vp = rng.standard_normal((L, N, H, C, K), np.float32)
    table = rng.integers(0, N, (B, M)).astype(np.int32)
    table[0, 1] = table[0, 3]
    q = rng.standard_normal((B, H, T, K), np.float32)
    ends = rng.integers(0, M * C + 1, (B, H, T)).astype(np.int32)
    w = np.where(np.arange(M * C) < ends[..., None], rng.random((B, H, T, M * C), np.float32), 0).astype(np.float32)
    for layer in (0, 1):
        keys = np.concatenate([kp[layer][table[:, j]] for j in range(M)], axis=-1)  # [B, H, K, M x C]
        values = np.concatenate([vp[layer][table[:, j]] for j in range(M)], axis=-2)  # [B, H, M x C, K]
        assert (bits(got[f"scores{layer}"]) == bits(chain(q, keys, out_ends=ends))).all()
        assert (bits(got[f"values{layer}"]) == bits(chain(w, values, in_ends=ends))).all()
        # a lone query's scores: the bits of the same query among five over the gathered keys (other tiles)
        assert (bits(got[f"decode{layer}"]) == bits(chain(q, keys, out_ends=ends))[:, :, 1:2]).all()
    assert (got["scores0"] != 0).any() and (got["values1"] != 0).any() and (got["decode1"] != 0).any()


def test_attention_softmax_is_a_softmax_whose_row_bits_ignore_batch_and_capacity():
    """softmax (attention's, over blocked scores [..., N, C]): a float64 softmax's values; masked slots
    (NEG_INF) weigh exactly 0 and a fully masked row is uniform; a row's bits are the same alone or in a batch,
    and with more all-masked blocks after it (a larger cache); its gradient is the softmax's."""
    from gpt2_jax.model.attention import NEG_INF, block_softmax

    rng = np.random.default_rng(4)
    s = (rng.standard_normal((3, 5, 2, 3, 128)) * 4).astype(np.float32)
    s[..., 2, 70:] = NEG_INF
    f = jax.jit(lambda x: softmax(x, block_softmax))
    w = np.asarray(f(s))
    ref = np.exp(s.astype(np.float64) - s.max(axis=(-2, -1), keepdims=True))
    ref /= ref.sum(axis=(-2, -1), keepdims=True)
    big = ref > 1e-30
    assert np.max(np.abs(w[big] - ref[big]) / ref[big]) < 4e-6
    assert (w[..., 2, 70:] == 0).all()
    assert (np.asarray(f(np.full((1, 1, 1, 3, 128), NEG_INF, np.float32))) == np.float32(1 / 384)).all()
    assert (bits(f(s[2:, 4:])) == bits(w[2:, 4:])).all()  # alone
    wider = np.concatenate([s, np.full((3, 5, 2, 2, 128), NEG_INF, np.float32)], axis=-2)
    w_wide = np.asarray(f(wider))
    assert (bits(w_wide[..., :3, :])[big] == bits(w)[big]).all() and (w_wide[..., 3:, :][big[..., :2, :]] == 0).all()
    assert (bits(w) != bits(np.asarray(block_softmax(s)))).any()  # its own arithmetic, not XLA's
    g = rng.standard_normal(s.shape).astype(np.float32)
    got = jax.grad(lambda x: (softmax(x, block_softmax) * g).sum())(s)
    want = jax.grad(lambda x: (jax.nn.softmax(x.reshape(3, 5, 2, -1), axis=-1).reshape(x.shape) * g).sum())(s)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_argmax_is_numpys_first_maximum_and_first_nan():
    """The greedy token's kernel: numpy's argmax (the first maximum, the first NaN where there is one) on
    ties, signed zeros, infinities and NaNs, for row lengths around its 8-lane vectors and the vocabulary's;
    and the kernel, not the fallback, is what ran."""
    rng = np.random.default_rng(2)
    for n in (1, 7, 8, 9, 17, 50257):
        x = rng.standard_normal((7, n)).astype(np.float32)
        x[1, n // 2] = np.nan
        x[1, -1] = np.nan
        x[2] = -np.inf
        x[3] = 0.0
        x[3, ::2] = -0.0
        x[4, -1] = np.inf
        x[5] = np.float32(1.5)  # all tie: the first
        x[6, n // 3 :] = x[6].max() + 1  # a run of ties: its first
        got = np.asarray(jax.jit(lambda a: argmax(a, lambda b: jnp.full(b.shape[:-1], -1, jnp.int32)))(x))
        assert (got == np.argmax(x, axis=-1)).all(), n
    assert np.asarray(argmax(x[:2], lambda b: jnp.argmax(b, axis=-1))).shape == (2,)


def test_cumsum_is_torchs_float64_accumulation_rounded_once_per_prefix():
    """The sampler's prefix sums: numpy's sequential float64 cumsum, rounded to float32, bit for bit, the
    same for a row alone; and a float32 scan (XLA's jnp.cumsum) as the contrast that drifts."""
    from gpt2_jax.sampling.filters import cumsum

    rng = np.random.default_rng(9)
    x = (rng.random((5, 50257)) / 25000).astype(np.float32)
    got = bits(jax.jit(cumsum)(x))
    assert (got == bits(np.cumsum(x.astype(np.float64), -1).astype(np.float32))).all()
    assert (bits(jax.jit(cumsum)(x[2:3])) == got[2:3]).all()
    assert (bits(jax.jit(lambda a: jnp.cumsum(a, -1))(x)) != got).any()
