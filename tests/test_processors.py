"""Logits processors against transformers' generate and a numpy reference loop; per-row invariance; errors."""

import jax
import numpy as np
import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from gpt2_jax import ConfigError, sampling
from gpt2_jax.generation.generator import _generate, generate
from tests.reference import hf_logits, make_hf_model, saved_and_loaded

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64)
PROMPTS = [[5, 17, 0, 42, 9, 33, 1], [7], [99, 3, 3, 3, 70, 0, 0, 12, 8, 64, 2, 50, 7, 7, 30, 11, 4], [23, 45, 67]]
N = 24


@pytest.fixture(scope="module")
def model_and_params(tmp_path_factory):
    # A greedy loop of this model repeats itself (so the penalties have work) but not one token only.
    return saved_and_loaded(make_hf_model(seed=13, **SHAPE), tmp_path_factory)


@pytest.fixture(scope="module")
def plain(model_and_params):
    _, params, config = model_and_params
    return generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=N, temperature=0.0, eos_id=None).tokens


def hf_greedy(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    kw.setdefault("eos_token_id", None)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, **kw)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def ours_greedy(params, config, **kw):
    kw.setdefault("eos_id", None)
    out = generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=N, temperature=0.0, **kw)
    return [out.tokens[b, : out.lengths[b]].tolist() for b in range(len(PROMPTS))]


def bad_words_from(plain):
    """Words the plain greedy output does contain: a one-token word and a two-token sequence of row 0,
    and a three-token sequence of row 2."""
    return [[int(plain[0, 3])], [int(plain[0, 5]), int(plain[0, 6])], plain[2, 2:5].tolist()]


SETTINGS = {
    "repetition_penalty_1.4": dict(repetition_penalty=1.4),
    "repetition_penalty_0.8": dict(repetition_penalty=0.8),
    "no_repeat_ngram_2": dict(no_repeat_ngram_size=2),
    "no_repeat_ngram_3": dict(no_repeat_ngram_size=3),
    "no_repeat_ngram_1": dict(no_repeat_ngram_size=1),
    "bad_words": "bad_words",
    "combined": "combined",
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_with_each_hf_processor_equals_transformers_generate(model_and_params, plain, name):
    model, params, config = model_and_params
    kw = SETTINGS[name]
    if kw == "bad_words":
        kw = dict(bad_words_ids=bad_words_from(plain))
    elif kw == "combined":
        kw = dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=bad_words_from(plain))
    ours = ours_greedy(params, config, **kw)
    for b, prompt in enumerate(PROMPTS):
        assert ours[b] == hf_greedy(model, prompt, N, **kw), f"prompt {b}"
    assert any(ours[b] != plain[b].tolist() for b in range(len(PROMPTS))), "the setting changed nothing"


def test_min_new_tokens_masks_eos_and_stop_ids_like_transformers(model_and_params, plain):
    model, params, config = model_and_params
    first = next(i for i in range(2, N) if plain[0, i] not in plain[0, :i])
    eos = int(plain[0, first])  # row 0 would stop early, at this token
    short = ours_greedy(params, config, eos_id=eos)
    assert len(short[0]) == first + 1 and short[0][-1] == eos
    for k in (first + 2, 12):
        ours = ours_greedy(params, config, eos_id=eos, min_new_tokens=k)
        for b, prompt in enumerate(PROMPTS):
            assert ours[b] == hf_greedy(model, prompt, N, eos_token_id=eos, min_new_tokens=k), f"prompt {b}"
        assert len(ours[0]) > k and eos not in ours[0][:k]
    # stop ids are held back too (transformers has no separate stop ids: compare with eos = that id)
    k = first + 2
    held = ours_greedy(params, config, stop_ids=[eos], min_new_tokens=k)
    assert eos not in held[0][:k] and held[0] == ours_greedy(params, config, eos_id=eos, min_new_tokens=k)[0]


def numpy_reference(model, prompt, n, frequency=0.0, presence=0.0, bias=None):
    """OpenAI's penalties and logit_bias, greedily, one uncached transformers forward per token."""
    out = []
    for _ in range(n):
        logits = hf_logits(model, [prompt + out])[0, -1].astype(np.float32)
        for t, x in (bias or {}).items():
            logits[t] += np.float32(x)
        counts = np.bincount(np.array(out, np.int64), minlength=logits.shape[0]).astype(np.float32)
        logits = logits - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("kw", [dict(frequency=0.8), dict(presence=1.5), dict(frequency=0.5, presence=-0.5),
                                dict(bias={3: 4.0, 10: -100.0, 11: 2.5})])  # fmt: skip
def test_openai_penalties_and_logit_bias_against_a_numpy_reference_loop(model_and_params, plain, kw):
    model, params, config = model_and_params
    ours = ours_greedy(params, config, frequency_penalty=kw.get("frequency", 0.0),
                       presence_penalty=kw.get("presence", 0.0), logit_bias=kw.get("bias"))  # fmt: skip
    for b, prompt in enumerate(PROMPTS):
        assert ours[b] == numpy_reference(model, prompt, N, **kw), f"prompt {b}"
    assert any(ours[b] != plain[b].tolist() for b in range(len(PROMPTS)))


def test_min_p_distribution_equals_transformers_warpers():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 1000)) * 3).astype(np.float32)
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.1), (0.7, 50, 0.9, 0.05), (1.3, 0, 0.8, 0.3)]:
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        warpers += [MinPLogitsWarper(min_p)]
        ref = torch.softmax(LogitsProcessorList(warpers)(None, torch.tensor(logits)), -1).numpy()
        ours = np.asarray(sampling.next_token_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                    min_p=min_p))  # fmt: skip
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
        assert ((ours > 0) == (ref > 0)).all()
        without = np.asarray(sampling.next_token_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p))
        assert (without > 0).sum() > (ours > 0).sum()  # min_p removed tokens


def test_sampling_with_min_p_draws_only_kept_tokens():
    rng = np.random.default_rng(1)
    logits = np.repeat((rng.standard_normal((1, 500)) * 2).astype(np.float32), 256, axis=0)
    kept = np.asarray(sampling.next_token_probs(logits[:1], temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))[0] > 0
    drawn = np.asarray(sampling.sample(jax.random.key(3), logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert kept[drawn].all() and len(set(drawn.tolist())) > 1
    free = np.asarray(sampling.sample(jax.random.key(3), logits, temperature=1.0, top_k=0, top_p=1.0))
    assert not kept[free].all()  # without min_p some draws land outside


def test_process_logits_is_the_loops_function(model_and_params):
    model, params, config = model_and_params
    out = generate(params, config, PROMPTS[:1], jax.random.key(0), max_new_tokens=6, temperature=0.0, eos_id=None,
                   repetition_penalty=1.5, frequency_penalty=0.3, no_repeat_ngram_size=2)  # fmt: skip
    gen = out.tokens[0].tolist()
    for t in range(6):
        logits = hf_logits(model, [PROMPTS[0] + gen[:t]])[:, -1]
        probs = sampling.next_token_probs(logits, temperature=0.0, top_k=0, top_p=1.0, prompts=PROMPTS[:1],
                                          outputs=[gen[:t]], repetition_penalty=1.5, frequency_penalty=0.3,
                                          no_repeat_ngram_size=2)  # fmt: skip
        assert int(np.argmax(probs[0])) == gen[t]


def test_rows_with_different_processors_equal_each_row_alone_bit_for_bit(model_and_params, plain):
    _, params, config = model_and_params
    words = bad_words_from(plain)
    rows = [
        dict(repetition_penalty=1.3, temperature=0.9, top_k=20, logit_bias={5: 3.0}),
        dict(frequency_penalty=0.7, presence_penalty=0.2, temperature=1.1, min_p=0.05, bad_words_ids=words),
        dict(no_repeat_ngram_size=2, temperature=0.0, min_new_tokens=4),
        dict(temperature=1.0, top_p=0.9),  # no processor at all
    ]
    keys = jax.random.split(jax.random.key(5), 4)
    per_row = {k: [r.get(k, d) for r in rows] for k, d in [
        ("repetition_penalty", 1.0), ("temperature", 1.0), ("top_k", 0), ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0), ("min_p", 0.0), ("no_repeat_ngram_size", 0), ("min_new_tokens", 0),
        ("top_p", 1.0), ("logit_bias", None), ("bad_words_ids", None)]}  # fmt: skip
    per_row = {k: (v if k in ("logit_bias", "bad_words_ids") else np.array(v)) for k, v in per_row.items()}
    eos = int(plain[2, 1])
    batch = generate(params, config, PROMPTS, keys, max_new_tokens=N, eos_id=eos, return_logprobs=True, **per_row)
    for b, r in enumerate(rows):
        alone = generate(params, config, [PROMPTS[b]], keys[b:b + 1], max_new_tokens=N, eos_id=eos,
                         return_logprobs=True, **r)  # fmt: skip
        assert (batch.tokens[b] == alone.tokens[0]).all()
        assert (batch.logprobs[b].view(np.uint32) == alone.logprobs[0].view(np.uint32)).all()
        assert batch.lengths[b] == alone.lengths[0]


def test_new_processor_values_do_not_recompile(model_and_params):
    _, params, config = model_and_params
    kw = dict(max_new_tokens=N, eos_id=None, temperature=0.0)
    generate(params, config, PROMPTS, jax.random.key(0), **kw)
    before = _generate._cache_size()
    for values in [dict(repetition_penalty=1.5, min_p=0.1), dict(frequency_penalty=-1.0, presence_penalty=2.0),
                   dict(no_repeat_ngram_size=4, min_new_tokens=3, logit_bias={1: 5.0, 2: -3.0}),
                   dict(bad_words_ids=[[1], [2, 3]])]:  # fmt: skip
        generate(params, config, PROMPTS, jax.random.key(0), **kw, **values)
    assert _generate._cache_size() == before


def test_top_logprobs_are_the_raw_distributions_most_likely(model_and_params):
    model, params, config = model_and_params
    out = generate(params, config, PROMPTS[:2], jax.random.key(2), max_new_tokens=8, eos_id=None, top_logprobs=5,
                   repetition_penalty=2.0, temperature=0.5, return_logprobs=True)  # fmt: skip
    assert out.top_ids.shape == (2, 8, 5) and out.top_logprobs.shape == (2, 8, 5)
    for b, prompt in enumerate(PROMPTS[:2]):
        seq = [prompt + out.tokens[b].tolist()]
        ref = torch.log_softmax(torch.tensor(hf_logits(model, seq)[0]), -1).numpy()[len(prompt) - 1 :][:8]
        order = np.argsort(-ref, axis=-1, kind="stable")[:, :5]
        np.testing.assert_array_equal(out.top_ids[b], order)
        np.testing.assert_allclose(out.top_logprobs[b], np.take_along_axis(ref, order, -1), atol=1e-5)
        # the sampled token's logprob is consistent with the table when it is among them
        hit = out.top_ids[b] == out.tokens[b][:, None]
        np.testing.assert_array_equal(out.top_logprobs[b][hit], np.repeat(out.logprobs[b][:, None], 5, 1)[hit])


@pytest.mark.parametrize("kw, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be"),
    (dict(frequency_penalty=2.5), "frequency_penalty must be a number in [-2, 2]"),
    (dict(presence_penalty=[0.0, 0.0, 0.0, np.nan]), "presence_penalty[3]"),
    (dict(min_p=1.5), "min_p must be a number in [0, 1]"),
    (dict(no_repeat_ngram_size=17), "no_repeat_ngram_size must be an integer in [0, 16]"),
    (dict(logit_bias={101: 1.0}), "logit_bias: token id 101 must be an int in [0, 101)"),
    (dict(logit_bias={5: 150.0}), "logit_bias[5] = 150.0: a bias must be a number in [-100, 100]"),
    (dict(bad_words_ids=[[1, 200]]), "bad_words_ids: token id 200"),
    (dict(bad_words_ids=[[]]), "non-empty list of token ids"),
    (dict(top_logprobs=21), "top_logprobs must be an int in [0, 20]"),
    (dict(stop=["x"] * 17), "at most 16 stop strings"),
    (dict(stop=[""]), "a stop string must be a non-empty str"),
    (dict(min_new_tokens=-1), "min_new_tokens must be an integer >= 0"),
])  # fmt: skip
def test_bad_processor_settings_are_named(model_and_params, kw, message):
    _, params, config = model_and_params
    before = _generate._cache_size()
    with pytest.raises(ConfigError) as e:
        generate(params, config, PROMPTS, jax.random.key(0), max_new_tokens=4, **kw)
    assert message in str(e.value)
    assert _generate._cache_size() == before


def test_bans_that_leave_no_token_are_lifted_for_that_step(model_and_params, plain):
    _, params, config = model_and_params
    everything = [[t] for t in range(config.vocab_size)]
    ours = ours_greedy(params, config, bad_words_ids=everything)
    assert ours == [plain[b].tolist() for b in range(len(PROMPTS))]
    some = ours_greedy(params, config, bad_words_ids=everything[:50])  # bans that leave tokens do apply
    assert all(t >= 50 for row in some for t in row)
