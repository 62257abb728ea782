"""Bit-level determinism, compared as uint32 bits (never allclose), on gpt2-small widths.

A row's tokens and logprobs are the same bits whatever its batch neighbours, the batch size, its
padding, the cache capacity and the param layout, and equal to a full forward over the same sequence
(prefill/decode invariance). transformers' own cached decode is not: the last test pins that too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gpt2_jax
from gpt2_jax.generation.generator import generate
from tests.reference import hf_logits, make_hf_model, saved_and_loaded

# gpt2's widths (12 heads of 64, the full vocab), two layers to keep the suite fast.
SHAPE = dict(n_layer=2, n_head=12, n_embd=768, vocab_size=50257, n_positions=256)
PROMPTS = [[464, 3290, 318, 257], [50256], [40, 588, 262, 3797, 11, 290, 314, 588, 262, 3290, 13, 632, 318, 1049,
                                             1110, 284, 307], [1212, 1110, 318, 922, 780, 2187, 11, 523]]  # fmt: skip
SETTINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, top_k=40, top_p=0.95)}
N = 12


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=5, **SHAPE), tmp_path_factory)


@pytest.fixture(scope="module")
def batch_runs(model):
    """Each setting's generation of the 4 prompts as one ragged batch (per-layer params, from load())."""
    _, params, config = model
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    return {name: generate(params, config, PROMPTS, keys, max_new_tokens=N, eos_id=None, return_logprobs=True,
                           **kw) for name, kw in SETTINGS.items()}  # fmt: skip


@pytest.mark.parametrize("name", SETTINGS)
def test_a_row_alone_equals_the_row_in_a_batch_bit_for_bit(model, batch_runs, name):
    _, params, config = model
    batch = batch_runs[name]
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    stacked = gpt2_jax.model.stack_layers(params)
    for b, prompt in enumerate(PROMPTS):
        # alone; alone with a 3x larger cache (max_new_tokens 150: 384 slots, not 128); with the stacked layout;
        # and next to a different neighbour in a batch of 2
        runs = [generate(params, config, [prompt], keys[b][None], max_new_tokens=N, eos_id=None,
                         return_logprobs=True, **SETTINGS[name]),
                generate(params, config, [prompt], keys[b][None], max_new_tokens=150, eos_id=None,
                         return_logprobs=True, **SETTINGS[name]),
                generate(stacked, config, [prompt], keys[b][None], max_new_tokens=N, eos_id=None,
                         return_logprobs=True, **SETTINGS[name]),
                generate(params, config, [prompt, PROMPTS[2]], keys[jnp.array([b, 2])], max_new_tokens=N,
                         eos_id=None, return_logprobs=True, **SETTINGS[name])]  # fmt: skip
        for run in runs:
            np.testing.assert_array_equal(run.tokens[0, :N], batch.tokens[b])
            np.testing.assert_array_equal(bits(run.logprobs[0, :N]), bits(batch.logprobs[b]))
    if name == "sampled":
        assert len({tuple(t) for t in batch.tokens.tolist()}) == len(PROMPTS)  # really sampled


@pytest.mark.parametrize("rows", [3, 6])
def test_odd_batch_sizes_give_the_same_bits(model, batch_runs, rows):
    # XLA's fused log_softmax over [R, 50257] rounded row 0 differently for R = 3, 5, 6, 7 (numerics.min_rows)
    _, params, config = model
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    order = [b % len(PROMPTS) for b in range(rows)]
    out = generate(params, config, [PROMPTS[b] for b in order], keys[jnp.array(order)], max_new_tokens=N,
                   eos_id=None, return_logprobs=True, **SETTINGS["sampled"])  # fmt: skip
    ref = batch_runs["sampled"]
    for i, b in enumerate(order):
        assert (out.tokens[i] == ref.tokens[b]).all()
        assert (bits(out.logprobs[i]) == bits(ref.logprobs[b])).all()


@pytest.mark.parametrize("name", SETTINGS)
def test_decode_logprobs_equal_a_full_forward_bit_for_bit(model, batch_runs, name):
    _, params, config = model
    out = batch_runs[name]
    for b, prompt in enumerate(PROMPTS):
        seq = np.array([prompt + out.tokens[b].tolist()])
        logp = jax.nn.log_softmax(gpt2_jax.forward(params, seq, config))[0]
        expected = np.asarray(logp)[np.arange(len(prompt) - 1, len(prompt) - 1 + N), out.tokens[b]]
        np.testing.assert_array_equal(bits(out.logprobs[b]), bits(expected))


def test_forward_rows_and_prefixes_are_bit_identical(model):
    _, params, config = model
    rng = np.random.default_rng(3)
    seqs = rng.integers(0, config.vocab_size, (3, 40))
    together = np.asarray(gpt2_jax.forward(params, seqs, config))
    for b in range(3):
        alone = np.asarray(gpt2_jax.forward(params, seqs[b : b + 1], config))[0]
        np.testing.assert_array_equal(bits(alone), bits(together[b]))
        for T in (1, 2, 17):  # a prefix: its logits are those of the longer sequence's first T positions
            prefix = np.asarray(gpt2_jax.forward(params, seqs[b : b + 1, :T], config))[0]
            np.testing.assert_array_equal(bits(prefix), bits(together[b, :T]))


def test_transformers_cached_decode_is_not_bit_identical_to_its_forward(model):
    """The reference we improve on: transformers' KV-cached steps round differently from its full pass."""
    hf, _, _ = model
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        past, step_logits, tokens = out.past_key_values, [], prompt[0].tolist()
        for _ in range(N):
            token = torch.tensor([[int(out.logits[0, -1].argmax())]])
            tokens.append(int(token))
            out = hf(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_logits.append(out.logits[0, -1].numpy())
    full = hf_logits(hf, np.array([tokens]))[0, len(PROMPTS[2]) :]
    differ = np.abs(np.stack(step_logits) - full)
    assert (bits(np.stack(step_logits)) != bits(full)).any()  # not the same bits ...
    assert differ.max() < 1e-4  # ... though numerically close


@pytest.mark.parametrize("name", SETTINGS)
def test_without_the_kernels_decode_still_equals_a_full_forward(model, batch_runs, monkeypatch, name):
    """Where the C++ kernels do not run (no compiler at install, a GPU), XLA computes every product and
    the prefix sums, in forms that keep the same property; its tokens agree with the kernels' run."""
    from gpt2_jax import kernels

    _, params, config = model
    monkeypatch.setattr(kernels.registry, "_REGISTERED", False)
    jax.clear_caches()  # programs traced with the kernels must not be reused (nor these, after)
    try:
        assert kernels.available() is None
        keys = jax.random.split(jax.random.key(11), len(PROMPTS))
        out = generate(params, config, PROMPTS[2:3], keys[2:3], max_new_tokens=N, eos_id=None,
                       return_logprobs=True, **SETTINGS[name])  # fmt: skip
        seq = np.array([PROMPTS[2] + out.tokens[0].tolist()])
        logp = np.asarray(jax.nn.log_softmax(gpt2_jax.forward(params, seq, config))[0])
        expected = logp[np.arange(len(PROMPTS[2]) - 1, len(PROMPTS[2]) - 1 + N), out.tokens[0]]
        np.testing.assert_array_equal(bits(out.logprobs[0]), bits(expected))
        np.testing.assert_array_equal(out.tokens[0], batch_runs[name].tokens[2])  # the same text as with the kernels
        np.testing.assert_allclose(out.logprobs[0], batch_runs[name].logprobs[2], rtol=1e-5, atol=1e-5)
        assert (bits(out.logprobs[0]) != bits(batch_runs[name].logprobs[2])).any()  # XLA's arithmetic did run
    finally:
        jax.clear_caches()


def test_log_softmax_rows_keep_their_bits_for_every_row_count():
    """XLA reduces rows 8 at a time and rounds a last group of 3, 5, 6 or 7 rows differently; min_rows pads to
    whole groups and a last group of 1, 2 or 4. Checked on a trained model's logits (random rows rarely show
    it): each row's logprob, computed with R - 1 neighbours for R = 1 .. 24, equals it computed among 64."""
    from gpt2_jax.generation.decode import most_likely
    from gpt2_jax.sampling.draw import token_logprobs

    params, config = gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")
    text = (
        "HAMLET.\nTo be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings "
        "and arrows of outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. To "
        "die: to sleep; no more; and by a sleep to say we end the heart-ache and the thousand natural shocks"
    )
    ids = gpt2_jax.tokenizer().encode(text)[:72]
    logits = np.asarray(gpt2_jax.forward(params, np.array([ids]), config))[0]  # [T, V]
    tokens = np.array(ids[1:] + ids[:1], np.int32)
    f = jax.jit(lambda x, t: (token_logprobs(x, t), most_likely(x, 20)[1]))  # the logprob, and the top logprobs
    ref = [bits(a) for a in f(logits, tokens)]
    for start in range(0, 48, 3):  # row 41 onwards showed it, with 13 to 15 rows, before the fix
        for R in range(1, 25):
            got = [bits(a) for a in f(logits[start : start + R], tokens[start : start + R])]
            assert all((g == r[start : start + R]).all() for g, r in zip(got, ref)), (start, R)


@pytest.fixture(scope="module", params=["int8", "w8a8"])
def int8_runs(model, request):
    """int8 weight-only params (gpt2_jax.model.precision), or w8a8's (the same weights, 8-bit matmul inputs), and
    their sampled run of the 4 prompts as one batch."""
    from gpt2_jax.model.precision import with_precision

    _, params, config = model
    q = with_precision(params, request.param)
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    batch = generate(q, config, PROMPTS, keys, max_new_tokens=N, eos_id=None, return_logprobs=True,
                     **SETTINGS["sampled"])  # fmt: skip
    return q, batch


def test_int8_rows_keep_their_bits_in_any_batch_and_equal_a_full_forward(model, batch_runs, int8_runs):
    """The int8 path (rowdot_int8 for every matmul and the tied head) keeps every property above: a row alone,
    in an odd batch of 3 and in the stacked layout has the batch's bits, and its decode logprobs are a full
    int8 forward's. Its numbers are int8's, not float32's. The same for w8a8, whose 3 and 4 rows take a8.h's
    byte tiles on VNNI and 1 row the int16 tiles."""
    _, params, config = model
    q, batch = int8_runs
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    kw = dict(max_new_tokens=N, eos_id=None, return_logprobs=True, **SETTINGS["sampled"])
    order = [2, 0, 2]
    runs = {b: generate(q, config, [PROMPTS[b]], keys[b][None], **kw) for b in (0, 1)}
    odd = generate(q, config, [PROMPTS[b] for b in order], keys[jnp.array(order)], **kw)
    stacked = generate(gpt2_jax.model.stack_layers(q), config, [PROMPTS[3]], keys[3][None], **kw)
    for rows, got in [((0,), runs[0]), ((1,), runs[1]), (order, odd), ((3,), stacked)]:
        for i, b in enumerate(rows):
            np.testing.assert_array_equal(got.tokens[i], batch.tokens[b])
            np.testing.assert_array_equal(bits(got.logprobs[i]), bits(batch.logprobs[b]))
    for b, prompt in enumerate(PROMPTS):
        seq = np.array([prompt + batch.tokens[b].tolist()])
        logp = np.asarray(jax.nn.log_softmax(gpt2_jax.forward(q, seq, config))[0])
        expected = logp[np.arange(len(prompt) - 1, len(prompt) - 1 + N), batch.tokens[b]]
        np.testing.assert_array_equal(bits(batch.logprobs[b]), bits(expected))
    fp32 = batch_runs["sampled"]
    assert (bits(batch.logprobs) != bits(fp32.logprobs)).any()  # int8's arithmetic, not float32's
    assert q["h"][0]["mlp"]["c_fc"]["weight"].dtype == jnp.int8 and q["wte"].dtype == jnp.int8


def test_packed_float32_generates_float32s_bits_at_any_batch(model, batch_runs):
    """float32-packed params (gpt2_jax.model.precision: float32 weights in 3.5 bytes each) generate float32's very
    tokens and logprobs: the batch of 4 (its weights decoded into rowdot's tiles) and a row alone (B=1: decoded in
    registers) both equal the float32 batch's bits, and so a full float32 forward's (the tests above)."""
    from gpt2_jax.model.precision import with_precision

    _, params, config = model
    packed = with_precision(params, "float32-packed")
    assert gpt2_jax.model.params.param_bytes(packed) < 0.9 * gpt2_jax.model.params.param_bytes(params)
    keys = jax.random.split(jax.random.key(11), len(PROMPTS))
    kw = dict(max_new_tokens=N, eos_id=None, return_logprobs=True, **SETTINGS["sampled"])
    fp32 = batch_runs["sampled"]
    batch = generate(packed, config, PROMPTS, keys, **kw)
    np.testing.assert_array_equal(batch.tokens, fp32.tokens)
    np.testing.assert_array_equal(bits(batch.logprobs), bits(fp32.logprobs))
    for b in (0, 2):
        alone = generate(packed, config, [PROMPTS[b]], keys[b][None], **kw)
        np.testing.assert_array_equal(alone.tokens[0], fp32.tokens[b])
        np.testing.assert_array_equal(bits(alone.logprobs[0]), bits(fp32.logprobs[b]))
