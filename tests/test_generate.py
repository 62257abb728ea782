"""Generation: the cached decode loop against transformers, keys, batch invariance, EOS, compiles, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gpt2_jax
from gpt2_jax import ConfigError, InputError
from gpt2_jax.generation.generator import _generate, generate, generate_stream
from gpt2_jax.model.kv_cache import cache_bytes, init_cache
from gpt2_jax.model.params import unstack_layers
from tests.reference import hf_logits, make_hf_model, saved_and_loaded

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64)
PROMPTS = [[5, 17, 0, 42, 9, 33, 1], [0], [99, 3, 3, 3, 70, 0, 0, 12, 8, 64, 2, 50, 7, 7, 30, 11, 4], [23, 45, 67]]


@pytest.fixture(scope="module")
def model_and_params(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=13, **SHAPE), tmp_path_factory)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_per_prompt_and_in_a_ragged_batch(model_and_params):
    model, params, config = model_and_params
    n = 20
    batch = generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=n, temperature=0.0, eos_id=None)
    assert batch.tokens.shape == (4, n) and batch.tokens.dtype == np.int32
    np.testing.assert_array_equal(batch.lengths, [n] * 4)
    for b, prompt in enumerate(PROMPTS):
        expected = hf_greedy(model, prompt, n)
        alone = generate(params, config, [prompt], jax.random.key(0), max_new_tokens=n, temperature=0.0, eos_id=None)
        assert alone.tokens[0].tolist() == expected
        assert batch.tokens[b].tolist() == expected


def test_sampled_logprobs_equal_uncached_transformers(model_and_params):
    model, params, config = model_and_params
    n = 25
    out = generate(params, config, PROMPTS, jax.random.key(7), max_new_tokens=n, temperature=1.0, eos_id=None,
                   return_logprobs=True)  # fmt: skip
    assert out.logprobs.shape == (4, n) and out.logprobs.dtype == np.float32
    for b, prompt in enumerate(PROMPTS):
        seq = np.array([prompt + out.tokens[b].tolist()])
        ref = torch.log_softmax(torch.tensor(hf_logits(model, seq)[0]), -1).numpy()
        expected = ref[np.arange(len(prompt) - 1, len(prompt) - 1 + n), out.tokens[b]]
        np.testing.assert_allclose(out.logprobs[b], expected, atol=1e-4, rtol=0)
    assert len({tuple(t) for t in out.tokens.tolist()}) == 4  # really sampled: rows differ


def test_same_key_same_tokens_other_key_other_tokens(model_and_params):
    _, params, config = model_and_params
    kw = dict(max_new_tokens=30, temperature=1.0, eos_id=None)
    a = generate(params, config, PROMPTS, jax.random.key(1), **kw)
    b = generate(params, config, PROMPTS, jax.random.key(1), **kw)
    c = generate(params, config, PROMPTS, jax.random.key(2), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any(axis=1).all()  # every row changes with the key


def test_row_alone_equals_row_in_a_mixed_batch(model_and_params):
    _, params, config = model_and_params
    keys = jax.random.split(jax.random.key(3), 4)
    settings = dict(temperature=np.array([1.0, 0.7, 1.3, 0.0]), top_k=np.array([0, 5, 20, 0]),
                    top_p=np.array([1.0, 0.9, 0.8, 1.0]))  # fmt: skip
    batch = generate(params, config, PROMPTS, keys, max_new_tokens=12, eos_id=None, **settings)
    for b, prompt in enumerate(PROMPTS):
        row = {k: v[b] for k, v in settings.items()}
        # alone, and with a different cache capacity (max_new_tokens 40 -> bucket 64)
        for n in (12, 40):
            alone = generate(params, config, [prompt], keys[b][None], max_new_tokens=n, eos_id=None, **row)
            assert alone.tokens[0, :12].tolist() == batch.tokens[b].tolist()
    # a single key gives row b fold_in(key, b): the same as passing those keys explicitly
    key = jax.random.key(4)
    one = generate(params, config, PROMPTS, key, max_new_tokens=8, eos_id=None)
    per_row = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(4))
    np.testing.assert_array_equal(one.tokens, generate(params, config, PROMPTS, per_row, max_new_tokens=8,
                                                       eos_id=None).tokens)  # fmt: skip


def test_stacked_and_unstacked_params_agree(model_and_params):
    _, params, config = model_and_params
    kw = dict(max_new_tokens=10, temperature=0.9, eos_id=None, return_logprobs=True)
    a = generate(params, config, PROMPTS, jax.random.key(5), **kw)
    b = generate(unstack_layers(params), config, PROMPTS, jax.random.key(5), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_stream_equals_scan(model_and_params):
    _, params, config = model_and_params
    kw = dict(max_new_tokens=15, temperature=1.0, top_k=10, eos_id=None)
    scan = generate(params, config, PROMPTS, jax.random.key(6), **kw)
    steps = list(generate_stream(params, config, PROMPTS, jax.random.key(6), **kw))
    assert len(steps) == 15
    np.testing.assert_array_equal(np.stack([t for t, _ in steps], axis=1), scan.tokens)


def test_eos_and_stop_ids(model_and_params):
    model, params, config = model_and_params
    free = generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=12, temperature=0.0, eos_id=None)
    eos = int(free.tokens[0, 3])  # row 0 emits this at step 3 (maybe earlier too)
    first = int(np.argmax(free.tokens[0] == eos))
    out = generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=12, temperature=0.0, eos_id=eos)
    assert out.lengths[0] == first + 1
    assert out.tokens[0, : first + 1].tolist() == free.tokens[0, : first + 1].tolist()
    assert (out.tokens[0, first + 1 :] == eos).all()
    for b in range(4):  # every row: stops at its own first EOS, or runs to the end
        hits = np.flatnonzero(free.tokens[b] == eos)
        assert out.lengths[b] == (hits[0] + 1 if hits.size else 12)
    # an extra stop id ends a row too; the row is then filled with the EOS id
    stop = int(free.tokens[1, 2])
    first1 = int(np.argmax(free.tokens[1] == stop))
    out = generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=12, temperature=0.0, eos_id=eos,
                   stop_ids=[stop])  # fmt: skip
    assert out.lengths[1] <= first1 + 1
    # with eos_id=None and a stop id, the stop id itself fills the rest
    out = generate(params, config, [PROMPTS[1]], jax.random.key(0), max_new_tokens=12, temperature=0.0,
                   eos_id=None, stop_ids=[stop])  # fmt: skip
    assert out.lengths[0] == first1 + 1 and (out.tokens[0, first1:] == stop).all()


def test_stream_marks_finished_rows(model_and_params):
    _, params, config = model_and_params
    free = generate(params, config, PROMPTS[:1], jax.random.key(0), max_new_tokens=6, temperature=0.0, eos_id=None)
    eos = int(free.tokens[0, 1])
    steps = list(generate_stream(params, config, PROMPTS[:1], jax.random.key(0), max_new_tokens=6,
                                 temperature=0.0, eos_id=eos))  # fmt: skip
    first = int(np.argmax(free.tokens[0] == eos))
    assert len(steps) == first + 1 and steps[-1][0][0] == eos and steps[-1][1][0]


def test_settings_keys_and_lengths_in_a_bucket_never_recompile(model_and_params):
    _, params, config = model_and_params
    before = _generate._cache_size()
    for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.5, 10, 0.9), (0.0, 0, 1.0), (1.7, 3, 0.5)]):
        generate(params, config, [[1, 2, 3], [4, 5]], jax.random.key(i), max_new_tokens=9 + i, temperature=t,
                 top_k=k, top_p=p, eos_id=100, stop_ids=[i])  # fmt: skip
    generate(
        params,
        config,
        [[1, 2, 3, 4, 5, 6, 7], [4]],
        jax.random.key(9),
        max_new_tokens=16,
        temperature=np.array([0.2, 0.9]),
        top_k=np.array([1, 0]),
        top_p=np.array([1.0, 0.3]),
        eos_id=None,
    )
    assert _generate._cache_size() == before + 1  # one compile for the (B=2, P=16, N=16) bucket


def test_padding_vocab_rows_are_never_generated(model_and_params):
    _, params, config = model_and_params
    padded = config.replace(n_valid_tokens=60)
    hot = dict(params, wte=params["wte"].at[60:].multiply(50.0))  # make the padding rows the likeliest
    prompts = [[t % 60 for t in p] for p in PROMPTS]
    out = generate(hot, padded, prompts, jax.random.key(0), max_new_tokens=30, temperature=2.0, eos_id=None)
    assert out.tokens.max() < 60
    greedy = generate(hot, padded, prompts, jax.random.key(0), max_new_tokens=5, temperature=0.0, eos_id=None)
    assert greedy.tokens.max() < 60


def test_cache_size_formula():
    config = gpt2_jax.GPT2Config.preset("gpt2")
    cache = init_cache(config, 3, 40)
    assert cache.k.shape == (12, 3, 12, 64, 40) and cache.v.shape == (12, 3, 12, 40, 64)  # keys transposed
    assert cache.nbytes == 2 * 12 * 3 * 40 * 768 * 4 == cache_bytes(config, 3, 40)
    bf16 = init_cache(config, 3, 40, jnp.bfloat16)
    assert bf16.nbytes == 2 * 12 * 3 * 40 * 768 * 2 == cache_bytes(config, 3, 40, jnp.bfloat16)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(temperature=-1.0), ConfigError, "temperature"),
    (dict(temperature=float("nan")), ConfigError, "temperature"),
    (dict(top_p=0.0), ConfigError, "top_p"),
    (dict(top_p=1.5), ConfigError, "top_p"),
    (dict(top_k=-1), ConfigError, "top_k"),
    (dict(top_k=np.array([1, 2, 3])), ConfigError, "top_k"),
    (dict(max_new_tokens=0), ConfigError, "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=60), InputError, "prompt 0: 7 prompt tokens \\+ max_new_tokens=60 exceed the context n_positions=64"),
    (dict(prompts=[[1, 2], []]), InputError, "prompt 1 is empty"),
    (dict(prompts=[[1, 101]]), InputError, "token id 101 is outside the vocab \\[0, 101\\)"),
    (dict(prompts=[[1, -1]]), InputError, "token id -1 is outside the vocab"),
    (dict(eos_id=101), ConfigError, "eos_id: token id 101 must be an int in \\[0, 101\\)"),
    (dict(stop_ids=[3, 500]), ConfigError, "stop_ids: token id 500 must be an int in \\[0, 101\\)"),
    (dict(key=jax.random.split(jax.random.key(0), 3)), ConfigError, "one PRNG key or one per row"),
])  # fmt: skip
def test_invalid_arguments(model_and_params, kwargs, error, message):
    _, params, config = model_and_params
    args = dict(prompts=PROMPTS, key=jax.random.key(0), max_new_tokens=8, eos_id=None)
    args.update(kwargs)
    before = _generate._cache_size()
    with pytest.raises(error, match=message):
        generate(params, config, args.pop("prompts"), args.pop("key"), **args)
    assert _generate._cache_size() == before  # rejected before anything compiled


def test_steering_hooks_while_decoding_match_a_torch_hook(model_and_params):
    """A steering vector added to block 0's output (hook_resid_post) at every position: greedy tokens equal
    transformers' generate with the same edit as a torch forward hook, plain, streamed and speculative;
    logprobs equal a full run_with_hooks forward over the generated sequence, bit for bit."""
    model, params, config = model_and_params
    steer = np.random.default_rng(0).normal(0, 1.5, config.n_embd).astype(np.float32)
    hooks = gpt2_jax.interp.hooks({"blocks.0.hook_resid_post": lambda x: x + steer})
    prompt, n = [5, 17, 0, 42, 9], 16
    kw = dict(max_new_tokens=n, temperature=0.0, eos_id=None, hooks=hooks, return_logprobs=True)
    ours = generate(params, config, [prompt], jax.random.key(0), **kw)
    add = torch.from_numpy(steer)
    handle = model.transformer.h[0].register_forward_hook(
        lambda m, i, o: (o[0] + add, *o[1:]) if isinstance(o, tuple) else o + add
    )
    try:
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    finally:
        handle.remove()
    plain = generate(params, config, [prompt], jax.random.key(0), max_new_tokens=n, temperature=0.0, eos_id=None)
    assert ours.tokens[0].tolist() == hf and plain.tokens[0].tolist() != hf  # the hook changed the text
    full = gpt2_jax.run_with_hooks(params, np.array([prompt + hf[:-1]]), config, hooks)
    logp = jax.nn.log_softmax(np.asarray(full)[0, len(prompt) - 1 :], axis=-1)
    np.testing.assert_allclose(ours.logprobs[0], np.asarray(logp)[np.arange(n), hf], rtol=1e-5)
    streamed = [int(t[0]) for t, _ in generate_stream(params, config, [prompt], jax.random.key(0), **{
        k: v for k, v in kw.items() if k != "return_logprobs"})]  # fmt: skip
    spec = generate(params, config, [prompt], jax.random.key(0), draft="prompt_lookup", **kw)
    assert streamed == hf and spec.tokens[0].tolist() == hf
    np.testing.assert_array_equal(spec.logprobs.view(np.uint32), ours.logprobs.view(np.uint32))
