"""Sampling against transformers' logits warpers, plus goodness of fit of the draws themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gpt2_jax import sampling
from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling import next_token_probs, sample
from gpt2_jax.sampling.draw import CANDIDATES, argmax, row_programs, sample_rows
from gpt2_jax.sampling.filters import cumsum
from gpt2_jax.sampling.metadata import row_settings

torch.set_num_threads(1)
LN2 = np.float32(np.log(2.0))


def hf_probs(row, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row [V] through the warpers transformers' generate() would build, then softmax."""
    scores = torch.tensor(np.asarray(row, np.float32))[None]
    if temperature == 0:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1])[0].double().numpy()
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(float(top_p))(None, scores)
    return scores.softmax(-1)[0].double().numpy()


def probs(logits, temperature=1.0, top_k=0, top_p=1.0, n_valid=None) -> np.ndarray:
    out = next_token_probs(
        jnp.asarray(logits, jnp.float32), temperature=temperature, top_k=top_k, top_p=top_p, n_valid=n_valid
    )
    return np.asarray(out, np.float64)


def random_rows_max_err(seed: int = 0) -> float:
    """max |ours - transformers| over ~200 rows whose settings differ row by row within each batch."""
    rng = np.random.default_rng(seed)
    err = 0.0
    for v in (50, 137, 300):
        b = 70
        logits = (rng.standard_normal((b, v)) * rng.uniform(0.5, 4.0, (b, 1))).astype(np.float32)
        t = rng.uniform(0.3, 2.0, b).astype(np.float32)
        k = rng.choice([0, 1, 5, v, v + 10], b)
        p = rng.choice([1.0, 0.9, 0.5, 1e-6], b)
        ours = probs(logits, t, k, p)
        ref = np.stack([hf_probs(logits[i], t[i], k[i], p[i]) for i in range(b)])
        err = max(err, float(np.abs(ours - ref).max()))
    return err


def test_matches_transformers_on_random_rows_with_per_row_settings():
    assert random_rows_max_err() < 1e-6


# 0.75 + 2e-8 rounds to float32 0.75, yet transformers' float64 1 - p rounds to just below 0.25.
@pytest.mark.parametrize(
    "top_p, n_kept", [(0.5, 1), (0.75, 2), (0.875, 3), (0.75 - 1e-7, 2), (0.75 + 1e-7, 3), (0.75 + 2e-8, 3)]
)
def test_cumulative_probability_exactly_p(top_p, n_kept):
    logits = np.array([[0.0, -LN2, -2 * LN2, -2 * LN2]], np.float32)
    plain = probs(logits)
    assert plain[0].tolist() == [0.5, 0.25, 0.125, 0.125]  # exact, or the boundary would not be exact
    ours = probs(logits, top_p=top_p)[0]
    np.testing.assert_array_equal(ours > 0, hf_probs(logits[0], 1.0, 0, top_p) > 0)
    np.testing.assert_allclose(ours, hf_probs(logits[0], 1.0, 0, top_p), atol=1e-7)
    # Mass 0.75 reached exactly keeps {0, 1}; a hair more p admits one (the higher-index) tied 0.125.
    assert (ours > 0).sum() == n_kept


def test_top_p_cumulative_sum_is_torchs_float64_accumulation_rounded():
    # A float32 running sum over 50k tokens drifts by ulps, which would move the top-p boundary.
    p = np.sort(np.random.default_rng(13).dirichlet(np.full(50304, 0.3), 2).astype(np.float32), -1)
    np.testing.assert_array_equal(jax.jit(cumsum)(p), torch.tensor(p).cumsum(-1).numpy())


@pytest.mark.parametrize("top_p", [1e-6, 1e-9, 1e-30])  # below ~6e-8, 1 - p rounds to 1: all cum <= it
def test_tiny_top_p_keeps_exactly_the_argmax(top_p):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((16, 100)).astype(np.float32)
    ours = probs(logits, temperature=1.3, top_p=top_p)
    np.testing.assert_array_equal(ours, np.eye(100)[logits.argmax(-1)])
    ref = np.stack([hf_probs(r, 1.3, 0, top_p) for r in logits])
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("extra", [0, 1, 10, 10**12])
def test_top_k_at_or_above_vocab_is_off(extra):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, 30)).astype(np.float32)
    ours = probs(logits, temperature=0.7, top_k=30 + extra)
    np.testing.assert_allclose(ours, probs(logits, temperature=0.7, top_k=0), atol=0)
    assert (ours > 0).all()
    ref = np.stack([hf_probs(r, 0.7, 30 + extra, 1.0) for r in logits])
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((32, 64)).astype(np.float32)
    one_hot = np.eye(64)[logits.argmax(-1)]
    np.testing.assert_array_equal(probs(logits, temperature=1.7, top_k=1, top_p=0.9), one_hot)
    np.testing.assert_array_equal(probs(logits, temperature=0.0), one_hot)
    tokens = sample(jax.random.key(0), logits, temperature=1.7, top_k=1, top_p=1.0)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_ties_at_the_kth_value_are_all_kept_like_transformers():
    logits = np.array([[3.0, 2.0, 2.0, 1.0, 2.0, 0.0], [5.0, 1.0, 5.0, 0.0, 0.0, 0.0]], np.float32)
    ours = probs(logits, temperature=1.0, top_k=[2, 1])
    assert (ours[0] > 0).tolist() == [True, True, True, False, True, False]  # 4 tokens for k=2
    assert (ours[1] > 0).tolist() == [True, False, True, False, False, False]  # both maxima for k=1
    for i, k in enumerate([2, 1]):
        np.testing.assert_allclose(ours[i], hf_probs(logits[i], 1.0, k, 1.0), atol=1e-7)
    # Greedy instead resolves the tie to the lowest index, as argmax does.
    np.testing.assert_array_equal(probs(logits[1:], temperature=0.0)[0], np.eye(6)[0])


def test_ties_at_the_top_p_boundary():
    # V <= 16: torch's CPU sort is stable, so identities match: the higher-index tied tokens survive.
    logits = np.zeros((1, 4), np.float32)
    ours = probs(logits, top_p=0.5)[0]
    np.testing.assert_array_equal(ours, hf_probs(logits[0], 1.0, 0, 0.5))
    assert ours.tolist() == [0.0, 0.0, 0.5, 0.5]
    # Larger V: torch's tie order is unspecified, but the number of survivors (and their mass) agree.
    rng = np.random.default_rng(4)
    logits = rng.integers(0, 4, (8, 64)).astype(np.float32)
    ours = probs(logits, top_p=0.6)
    ref = np.stack([hf_probs(r, 1.0, 0, 0.6) for r in logits])
    np.testing.assert_allclose(np.sort(ours, -1), np.sort(ref, -1), atol=1e-6)


@pytest.mark.parametrize("v", [64, 50257])
def test_tied_survivors_are_those_of_a_stable_ascending_sort(v):
    # A numpy reference with token ids: stable ascending argsort, softmax and cumulative sum in float64
    # (rounded to float32, as torch accumulates), drop the prefix whose mass is <= 1 - top_p. The filter
    # sorts values only (integer keys); the tied tokens it keeps at the boundary must be these same ids.
    rng = np.random.default_rng(7)
    logits = rng.integers(0, 4, (6, v)).astype(np.float32)  # four values: every boundary falls in a tie
    top_p = np.array([0.3, 0.5, 0.6, 0.75, 0.9, 0.97], np.float32)
    ours = probs(logits, top_p=top_p) > 0
    split = 0
    for i in range(len(logits)):
        order = np.argsort(logits[i], kind="stable")
        p = np.exp(logits[i][order].astype(np.float64) - logits[i].max())
        cum = np.cumsum(p / p.sum()).astype(np.float32)
        keep = ~(cum <= np.float32(1 - top_p[i]))
        keep[-1] = True
        expected = np.zeros(v, bool)
        expected[order[keep]] = True
        np.testing.assert_array_equal(ours[i], expected, err_msg=f"row {i}, top_p {top_p[i]}")
        tied = logits[i] == logits[i][order[keep]].min()
        split += 0 < (expected & tied).sum() < tied.sum()
    assert split >= 4, "the boundary must split a tie in most rows for this test to bite"


def test_sort_key_is_the_total_order_of_floats():
    expected = np.array([-np.inf, -1e38, -3.5, -2.0, -1e-45, -0.0, 0.0, 1e-45, 2.0, 3.5, 1e38, np.inf], np.float32)
    x = expected[np.random.default_rng(0).permutation(len(expected))]
    keys = np.asarray(sampling.filters.sort_key(jnp.asarray(x)))
    assert keys.dtype == np.int32 and len(set(keys.tolist())) == len(x)
    np.testing.assert_array_equal(x[np.argsort(keys)].view(np.uint32), expected.view(np.uint32))  # -0.0 < 0.0
    back = np.asarray(sampling.filters.sort_ascending(jnp.asarray(x[None])))[0]
    np.testing.assert_array_equal(back.view(np.uint32), expected.view(np.uint32))


def test_temperature_does_not_change_the_top_k_set():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((16, 80)).astype(np.float32)
    supports = [probs(logits, temperature=t, top_k=7) > 0 for t in (0.3, 1.0, 2.0)]
    assert all((s.sum(-1) == 7).all() and (s == supports[0]).all() for s in supports)


def test_greedy_and_sampled_rows_share_a_batch():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    logits[0, [7, 9]] = 10.0  # tie: greedy takes the lowest index
    t, k, p = [0.0, 0.8, 0.0, 1.2], [3, 0, 0, 5], [0.5, 0.9, 1.0, 1.0]
    ours = probs(logits, t, k, p)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours[0], np.eye(50)[7])
    np.testing.assert_array_equal(ours[2], np.eye(50)[logits[2].argmax()])
    for i in (1, 3):
        np.testing.assert_allclose(ours[i], hf_probs(logits[i], t[i], k[i], p[i]), atol=1e-6)
    tokens = np.asarray(sample(jax.random.key(1), logits, temperature=t, top_k=k, top_p=p))
    assert tokens[0] == 7 and tokens[2] == logits[2].argmax() and (ours[[1, 3], tokens[[1, 3]]] > 0).all()


def test_padded_vocab_columns_are_never_chosen():
    rng = np.random.default_rng(7)
    n_valid, v = 20, 24
    logits = rng.standard_normal((2000, v)).astype(np.float32)
    logits[:, n_valid:] = 50.0  # padding that would otherwise win every draw
    for t, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (1.5, 50, 1.0), (0.9, 5, 0.8)]:
        ours = probs(logits[:50], t, k, p, n_valid=n_valid)
        assert (ours[:, n_valid:] == 0).all()
        ref = np.stack([hf_probs(r[:n_valid], t, k, p) for r in logits[:50]])
        np.testing.assert_allclose(ours[:, :n_valid], ref, atol=1e-6)
        tokens = np.asarray(sample(jax.random.key(2), logits, temperature=t, top_k=k, top_p=p, n_valid=n_valid))
        assert tokens.max() < n_valid


def test_draws_follow_next_token_probs():
    rng = np.random.default_rng(8)
    row = (1.5 * rng.standard_normal(40)).astype(np.float32)
    n, settings = 20000, dict(temperature=0.8, top_k=15, top_p=0.9)
    expected = probs(row[None], **settings)[0]
    support = expected > 0
    assert 3 < support.sum() < 15  # both filters actually cut something
    tokens = np.asarray(sample(jax.random.key(3), np.broadcast_to(row, (n, 40)), **settings))
    counts = np.bincount(tokens, minlength=40)
    assert counts[~support].sum() == 0
    assert scipy.stats.chisquare(counts[support], n * expected[support] / expected.sum()).pvalue > 1e-3


def test_same_key_same_tokens_different_key_different_tokens():
    logits = (0.1 * np.random.default_rng(9).standard_normal((64, 100))).astype(np.float32)
    draw = lambda key: np.asarray(sample(key, logits, temperature=1.0, top_k=0, top_p=1.0))
    np.testing.assert_array_equal(draw(jax.random.key(4)), draw(jax.random.key(4)))
    assert (draw(jax.random.key(4)) != draw(jax.random.key(5))).mean() > 0.8


def test_per_row_keys_are_batch_invariant():
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((6, 100)).astype(np.float32)
    t, k, p = rng.uniform(0.5, 2.0, 6), np.array([0, 3, 10, 0, 50, 1]), np.array([1.0, 0.9, 0.5, 0.95, 1.0, 1.0])
    keys = jax.random.split(jax.random.key(6), 6)
    batch = np.asarray(sample(keys, logits, temperature=t, top_k=k, top_p=p))
    single = np.asarray(sample(jax.random.key(6), logits, temperature=t, top_k=k, top_p=p))
    for i in range(6):
        kw = dict(temperature=t[i], top_k=int(k[i]), top_p=p[i])
        assert sample(keys[i : i + 1], logits[i : i + 1], **kw)[0] == batch[i]
        # One key for the whole batch: row i draws with fold_in(key, i).
        row_key = jax.random.fold_in(jax.random.key(6), i)[None]
        assert sample(row_key, logits[i : i + 1], **kw)[0] == single[i]


def test_settings_are_traced_never_recompiled():
    logits = np.random.default_rng(11).standard_normal((3, 77)).astype(np.float32)
    key = jax.random.key(7)
    before = sampling.draw._sample_jit._cache_size(), sampling.filters._probs_jit._cache_size()
    for t, k, p in [(1.0, 0, 1.0), (0.5, 5, 0.9), (0.0, 1, 0.1), ([0.0, 0.7, 2.0], [0, 76, 100], [1.0, 1e-6, 0.5])]:
        sample(key, logits, temperature=t, top_k=k, top_p=p).block_until_ready()
        next_token_probs(logits, temperature=t, top_k=k, top_p=p).block_until_ready()
    after = sampling.draw._sample_jit._cache_size(), sampling.filters._probs_jit._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_traced_settings_inside_a_users_jit_and_a_scan():
    logits = np.random.default_rng(12).standard_normal((5, 40)).astype(np.float32)
    f = jax.jit(lambda t, k, p: next_token_probs(logits, temperature=t, top_k=k, top_p=p))
    np.testing.assert_allclose(f(0.8, 4, 0.9), probs(logits, 0.8, 4, 0.9), atol=1e-7)
    # The generation loop's entry point: per-row settings and keys inside lax.scan.
    settings = row_settings(0.9, 10, 0.95, 5)
    keys = jax.random.split(jax.random.key(8), (3, 5))
    step = lambda c, ks: (c, sample_rows(ks, logits, settings))
    scanned = jax.lax.scan(step, 0, keys)[1]
    for s in range(3):
        np.testing.assert_array_equal(scanned[s], sample(keys[s], logits, temperature=0.9, top_k=10, top_p=0.95))


@pytest.mark.parametrize(
    "kwargs, name, shown",
    [
        (dict(temperature=-1.0), "temperature", "-1.0"),
        (dict(temperature=float("nan")), "temperature", "nan"),
        (dict(temperature=[1.0, -0.5, 1.0]), "temperature[1]", "-0.5"),
        (dict(top_p=0.0), "top_p", "0.0"),
        (dict(top_p=1.5), "top_p", "1.5"),
        (dict(top_p=float("nan")), "top_p", "nan"),
        (dict(top_k=-1), "top_k", "-1"),
        (dict(top_k=2.5), "top_k", "2.5"),
        (dict(top_k=[1, 2]), "top_k", "(2,)"),
        (dict(top_p=[0.9, 0.9, 0.9, 0.9]), "top_p", "(4,)"),
    ],
)
def test_invalid_settings_raise_before_compiling(kwargs, name, shown):
    logits = jnp.zeros((3, 11))
    settings = dict(temperature=1.0, top_k=0, top_p=1.0) | kwargs
    before = sampling.draw._sample_jit._cache_size()
    for fn in (lambda: sample(jax.random.key(0), logits, **settings), lambda: next_token_probs(logits, **settings)):
        with pytest.raises(ConfigError, match=name.replace("[", r"\[")) as info:
            fn()
        assert shown in str(info.value)
    assert sampling.draw._sample_jit._cache_size() == before


def test_wrong_number_of_keys_raises():
    with pytest.raises(ConfigError, match="key"):
        sample(jax.random.split(jax.random.key(0), 2), jnp.zeros((3, 11)), temperature=1.0, top_k=0, top_p=1.0)


# sample_rows: a program chosen at run time per row (0 greedy, 1 no filter, 2 a window of candidates,
# 3 full sort), one exponential clock per id from the row's key, the race's winner.


def program(t, k, p, b, v, n_valid=None) -> list[int]:
    return np.asarray(row_programs(row_settings(t, k, p, b), v, n_valid)).tolist()


def chi2_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Goodness of fit of counts [N] to expected counts [N]; cells expecting < 5 draws are pooled."""
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return scipy.stats.chisquare(obs, exp).pvalue


def assert_draws_follow_probs(logits, t, k, p, n=20000, seed=0, n_valid=None) -> np.ndarray:
    """n draws of each row of a batch (tiled n times: the same program) vs next_token_probs."""
    b, v = logits.shape
    expected = probs(logits, t, k, p, n_valid)
    rows = lambda x: np.tile(np.broadcast_to(np.asarray(x), (b,)), n)
    tokens = sample(
        jax.random.key(seed),
        np.tile(logits, (n, 1)),
        temperature=rows(t),
        top_k=rows(k),
        top_p=rows(p),
        n_valid=n_valid,
    )
    tokens = np.asarray(tokens).reshape(n, b)
    for i in range(b):
        counts = np.bincount(tokens[:, i], minlength=v)
        support = expected[i] > 0
        assert counts[~support].sum() == 0, f"row {i} drew a filtered-out token"
        if support.sum() == 1:
            assert counts[support].item() == n
        else:
            assert chi2_pvalue(counts[support], n * expected[i, support] / expected[i].sum()) > 1e-3, f"row {i}"
    return tokens


@pytest.mark.parametrize(
    "t, k, p, n_valid, expected_program",
    [
        ([0.0, 0.0, 0.0], [0, 50, 3], [1.0, 0.9, 0.5], None, [0, 0, 0]),  # greedy rows ignore top-k/top-p
        ([0.8, 1.3], [0, 1000], 1.0, None, [1, 1]),  # top_k >= V is off
        ([0.9, 1.5], [0, 290], 1.0, 280, [1, 1]),  # top_k >= n_valid is off too
        ([1.0, 0.7, 1.5], [50, 127, 5], [0.9, 1.0, 0.5], None, [2, 2, 2]),
        (1.2, 0, 0.9, None, [2]),  # top-p alone: its window holds the whole (small) vocabulary
        ([0.0, 0.9, 1.4], [0, 20, 100], [1.0, 0.95, 1.0], 280, [0, 2, 2]),  # a greedy row among candidates
        ([0.0, 0.7], [5, 0], [0.5, 1.0], None, [0, 1]),  # a greedy row among unfiltered rows
        ([0.0, 0.8, 1.3, 1.0], [0, 50, 0, 0], [1.0, 0.9, 0.8, 1.0], 280, [0, 2, 2, 1]),  # each row its own
    ],
)
def test_draws_of_every_program_follow_next_token_probs(t, k, p, n_valid, expected_program):
    rng = np.random.default_rng(20)
    b = max(np.size(t), np.size(k), np.size(p))
    logits = (1.5 * rng.standard_normal((b, 300))).astype(np.float32)
    logits[0, [11, 42]] = logits[0].max() + 1.0  # a tie at the top: greedy takes the lower id
    logits[:, 280:] = 50.0  # padding columns when n_valid = 280; ordinary (winning) tokens otherwise
    assert program(t, k, p, b, 300, n_valid) == expected_program * (b // len(expected_program))
    tokens = assert_draws_follow_probs(logits, t, k, p, n_valid=n_valid)
    greedy = np.broadcast_to(np.asarray(t) == 0, (b,))
    top = np.where(np.arange(300) < (n_valid or 300), logits, -np.inf).argmax(-1)
    assert (tokens[:, greedy] == top[greedy]).all()
    if greedy[0] and n_valid:
        assert top[0] == 11


C = CANDIDATES


@pytest.mark.parametrize("n_ties, top_p", [(C - 1, 1.0), (C, 1.0), (C + 300, 1.0), (C - 1, 0.9), (C + 300, 0.9)])
def test_ties_at_the_kth_value_beyond_the_candidate_window(n_ties, top_p):
    # Every token tying with the k-th value survives top-k, so C + 300 ties cannot fit C candidates: the
    # window must see its last candidate equal the k-th value and fall back to the full sort.
    # C - 1 ties fit (the C-th candidate is lower); C fit too, but the window cannot tell, so it falls back.
    rng = np.random.default_rng(21)
    logits = (rng.standard_normal((1, 3000)) - 3.0).astype(np.float32)
    tied = rng.permutation(3000)[:n_ties]
    logits[0, tied] = 2.0
    assert program(1.0, 5, top_p, 1, 3000) == [2]
    expected = probs(logits, 1.0, 5, top_p)[0]
    assert set(np.flatnonzero(expected)) <= set(tied)
    assert (expected > 0).sum() == n_ties or top_p < 1
    tokens = assert_draws_follow_probs(logits, 1.0, 5, top_p)
    assert set(np.unique(tokens)) == set(np.flatnonzero(expected))


ROW_PAIRS = [
    # (row's settings, a neighbour's settings), the row's program and the neighbour's
    ((1.0, 50, 0.9), (1.0, 0, 0.9), 2, 2),
    ((0.7, 100, 1.0), (1.0, 0, 1.0), 2, 1),
    ((0.8, 0, 1.0), (1.0, 0, 0.9), 1, 2),
    ((0.8, 0, 1.0), (1.0, 50, 0.9), 1, 2),
    ((0.0, 0, 1.0), (1.0, 50, 0.9), 0, 2),
    ((0.0, 7, 0.5), (1.0, 0, 0.9), 0, 2),
    ((0.0, 0, 1.0), (1.3, 0, 1.0), 0, 1),
    ((1.0, 0, 0.9), (1.0, 1500, 1.0), 2, 3),  # next to a neighbour beyond the window: the full sort runs
    ((1.0, 20, 1.0), (1.0, 1500, 0.8), 2, 3),
]


@jax.jit
def _rows(keys, logits, settings):
    return sample_rows(keys, logits, settings)


@pytest.mark.parametrize("v, n", [(2000, 2000), (50257, 64)])
def test_a_rows_token_does_not_depend_on_its_neighbours_program(v, n):
    # n keys for one row: alone (n + 1 copies, one program) vs next to a neighbour whose settings select
    # another program. Both batches have one shape: one compilation.
    rng = np.random.default_rng(22)
    row = (2.5 * rng.standard_normal(v)).astype(np.float32)
    keys = jax.random.split(jax.random.key(23), n + 1)
    logits = np.tile(row, (n + 1, 1))
    for mine, other, my_program, other_program in ROW_PAIRS:
        alone_rows = [np.full(n + 1, x) for x in mine]
        with_rows = [np.append(x[:n], y) for x, y in zip(alone_rows, other)]
        assert program(*alone_rows, n + 1, v) == [my_program] * (n + 1)
        assert program(*with_rows, n + 1, v) == [my_program] * n + [other_program]
        alone = np.asarray(_rows(keys, logits, row_settings(*alone_rows, n + 1)))[:n]
        with_neighbour = np.asarray(_rows(keys, logits, row_settings(*with_rows, n + 1)))[:n]
        np.testing.assert_array_equal(alone, with_neighbour, err_msg=f"{mine} next to {other}")
        expected = probs(row[None], *mine)[0]
        assert (expected[alone] > 0).all()
        assert (alone == expected.argmax()).all() if mine[0] == 0 else len(np.unique(alone)) > 5


def test_argmax_helper_is_jnp_argmax():
    x = np.random.default_rng(24).integers(-3, 3, (6, 40)).astype(np.float32)
    x[1, 5] = np.inf
    x[2, [3, 9]] = np.nan
    x[3] = -np.inf
    x[4, :20] = -np.inf
    np.testing.assert_array_equal(jax.jit(argmax)(x), jnp.argmax(x, axis=-1))


def test_same_key_draws_of_close_distributions_agree_about_one_minus_total_variation():
    """The draw is a race (argmax w / E, E ~ Exp(1) per id from the row's key): two distributions drawn with the
    same keys agree at least (1 - TV) / (1 + TV) of the time, the Gumbel-max coupling's bound, even when the mass is
    spread over all 50,257 ids. Speculative decoding's coupled draw rests on it. An inverse CDF over ids with one
    uniform per key agrees 19% of the time here (the shared uniform falls between the CDFs at some id)."""
    v, n = 50257, 1000
    rng = np.random.default_rng(0)
    p = rng.standard_normal(v).astype(np.float32)
    q = (p + 0.05 * rng.standard_normal(v)).astype(np.float32)
    sp, sq = (np.exp(x - x.max(), dtype=np.float64) for x in (p, q))
    tv = 0.5 * np.abs(sp / sp.sum() - sq / sq.sum()).sum()
    assert 0.01 < tv < 0.03
    keys = jax.random.split(jax.random.key(1), n)
    a, b = (np.asarray(sample(keys, np.tile(x, (n, 1)), temperature=1.0, top_k=0, top_p=1.0)) for x in (p, q))
    bound = (1 - tv) / (1 + tv)
    assert (a == b).mean() > bound - 4 * np.sqrt(bound * (1 - bound) / n), ((a == b).mean(), tv)
    assert len(set(a.tolist())) > 0.9 * n  # a flat distribution: the agreement is not one token drawn every time
