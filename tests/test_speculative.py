"""Speculative decoding equals plain decoding bit for bit, whatever the proposer; statistics; errors.

The reference for every token and logprob is plain `generate` with the same key and settings (itself
pinned to transformers in test_checkpoints_parity/test_processors), compared as uint32, plus transformers' own
prompt-lookup decoding for greedy and a numpy loop for the proposals.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gpt2_jax import BUNDLED_MODEL, ConfigError, generate, generate_stream, init_params, load, tokenizer
from gpt2_jax.generation.speculative.propose import prompt_lookup
from gpt2_jax.generation.speculative.verify import speculate_chunk
from gpt2_jax.sampling import constraints
from gpt2_jax.sampling.metadata import row_keys
from tests.reference import make_hf_model, saved_and_loaded

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=96)
PROMPTS = [[5, 17, 0, 42, 9, 5, 17, 0], [7], [99, 3, 3, 3, 70, 0, 12, 8, 64, 2, 50, 7, 30, 11, 4]]  # ragged, B=3
N, K = 27, 3  # the last round of k + 1 = 4 tokens is cut by max_new_tokens
ROUNDS = -(-N // (K + 1))  # a perfect draft's rounds: each keeps k + 1 tokens
NEVER = 100  # the always-wrong draft proposes only this id, which every run bans (bad_words_ids)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=13, **SHAPE), tmp_path_factory)


@pytest.fixture(scope="module")
def drafts(target):
    """name -> draft argument: prompt lookup, the target itself (a perfect greedy draft), an unrelated
    random model, and a model whose logits always put NEVER first. The three models share the target's
    shape, so they share one compiled program."""
    _, params, config = target
    wrong = dict(
        params,
        wte=jnp.zeros_like(params["wte"]).at[NEVER].set(1.0),
        ln_f={"weight": jnp.zeros_like(params["ln_f"]["weight"]), "bias": jnp.ones_like(params["ln_f"]["bias"])},
    )
    return {
        "lookup": "prompt_lookup",
        "perfect": (params, config),
        "unrelated": (init_params(jax.random.key(7), config), config),
        "wrong": (wrong, config),
    }


SETTINGS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0),
    "warped": dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.05),
    "processors": dict(
        temperature=0.9,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        no_repeat_ngram_size=3,
        min_new_tokens=5,
        logit_bias={4: 2.0},
    ),
    "per-row": dict(temperature=[0.0, 1.0, 0.5], top_p=[1.0, 0.8, 0.95], repetition_penalty=[1.0, 1.2, 1.5]),
}


def run(target, settings, draft=None, prompts=PROMPTS, eos=None, key=None, **kw):
    _, params, config = target
    extra = {} if draft is None else dict(draft=draft, num_speculative_tokens=K)
    key = jax.random.key(3) if key is None else key
    return generate(params, config, prompts, key, max_new_tokens=N, return_logprobs=True, eos_id=eos,
                    bad_words_ids=[[NEVER]], **settings, **extra, **kw)  # fmt: skip


def assert_same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.logprobs.view(np.uint32), b.logprobs.view(np.uint32))
    assert a.finish_reason == b.finish_reason and a.stop_string == b.stop_string


@pytest.fixture(scope="module")
def plain(target):
    """Plain decoding's results for every setting, and with an EOS id that stops rows at different steps."""
    out = {s: run(target, kw) for s, kw in SETTINGS.items()}
    eos = int(out["greedy"].tokens[0, 6])  # a token greedy row 0 draws mid-way
    out["eos"] = run(target, SETTINGS["greedy"], eos=eos)
    assert out["eos"].lengths.min() < N and "stop" in out["eos"].finish_reason
    return out, eos


@pytest.mark.parametrize("name", ["lookup", "perfect", "unrelated", "wrong"])
def test_every_setting_equals_plain_decoding_bit_for_bit(target, drafts, plain, name):
    plain, eos = plain
    for s, kw in SETTINGS.items():
        spec = run(target, kw, drafts[name])
        assert_same(spec, plain[s])
        if name == "perfect":  # the coupled draw: the target's own draw on the same logits, sampled or not
            assert (spec.accepted == N - ROUNDS).all() and (spec.proposed == K * ROUNDS).all(), s
    spec = run(target, SETTINGS["greedy"], drafts[name], eos=eos)
    assert_same(spec, plain["eos"])
    if name == "perfect":  # row 0's EOS is the second proposal of its second round, accepted mid-round
        assert spec.lengths[0] == 7 and spec.accepted[0] == 7 - 2
    if name == "wrong":  # every proposal rejected: one token per target forward
        assert spec.accepted.sum() == 0 and (spec.proposed == K * spec.lengths).all()


def test_statistics_follow_the_draft(target, drafts):
    perfect = run(target, SETTINGS["greedy"], drafts["perfect"])
    assert (perfect.proposed == K * ROUNDS).all() and (perfect.accepted == N - ROUNDS).all()
    wrong = run(target, SETTINGS["greedy"], drafts["wrong"])
    assert (wrong.accepted == 0).all()
    copy = [list(range(10, 30)) * 2]  # the model continues copying? lookup proposes the copy either way
    lookup = run(target, SETTINGS["greedy"], "prompt_lookup", prompts=copy)
    assert lookup.accepted[0] > 0 and lookup.proposed[0] == K * (N - lookup.accepted[0])


def test_a_near_copy_draft_is_accepted_under_sampling(target, plain):
    """The target with 0.3% noise on every weight (total variation ~0.2% per token) as the draft, at
    temperature 1: its coupled draws share the target's exponential clocks, so they differ about as
    often as the total variation. This random model's most likely token has p < 0.07, so argmax proposals would be
    kept about 7% of the time."""
    _, params, config = target
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = jax.tree.unflatten(tree, [x * (1 + 3e-3 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])
    spec = run(target, SETTINGS["sampled"], (noisy, config))
    assert_same(spec, plain[0]["sampled"])
    assert spec.accepted.sum() >= 0.9 * (N - ROUNDS) * len(PROMPTS), (spec.accepted, spec.proposed)


def test_a_row_is_the_same_alone_and_in_any_batch(target, drafts):
    keys = row_keys(jax.random.key(3), len(PROMPTS))  # what generate gives row b: fold_in(key, b)
    batch = run(target, SETTINGS["per-row"], "prompt_lookup")
    assert len(set(batch.accepted.tolist())) > 1  # rows accepted different counts in the same rounds
    for b in (0, 2):
        alone = run(target, {k: v[b] for k, v in SETTINGS["per-row"].items()}, "prompt_lookup", prompts=[PROMPTS[b]],
                    key=keys[b : b + 1])  # fmt: skip
        np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b])
        np.testing.assert_array_equal(alone.logprobs[0].view(np.uint32), batch.logprobs[b].view(np.uint32))


def test_stop_strings_top_logprobs_and_stream(target):
    _, params, config = target
    tok = _digits_tokenizer()
    kw = dict(temperature=0.8, stop=["3"], tokenizer=tok, top_logprobs=4)
    plain, spec = run(target, kw), run(target, kw, "prompt_lookup")
    assert_same(spec, plain)
    np.testing.assert_array_equal(spec.top_ids, plain.top_ids)
    np.testing.assert_array_equal(spec.top_logprobs.view(np.uint32), plain.top_logprobs.view(np.uint32))
    assert "stop" in plain.finish_reason
    args = dict(max_new_tokens=N, temperature=0.0, eos_id=int(plain.tokens[1, 4]), stop=["3"], tokenizer=tok)
    a = list(generate_stream(params, config, PROMPTS, jax.random.key(3), **args))
    b = list(
        generate_stream(
            params, config, PROMPTS, jax.random.key(3), draft="prompt_lookup", num_speculative_tokens=K, **args
        )
    )
    assert len(a) == len(b) and all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a, b))


def test_constraint_on_the_bundled_model():
    params, config = load(BUNDLED_MODEL)  # constraints need the GPT-2 vocabulary
    prompt = tokenizer().encode("ROMEO:\nHow many ducats? I say ")
    args = dict(max_new_tokens=16, temperature=0.9, constraint=constraints.regex("[0-9]{1,3} ducats"), eos_id=50256,
                return_logprobs=True)  # fmt: skip
    keys = row_keys(jax.random.key(5), 3)
    plain = generate(params, config, [prompt] * 3, keys, **args)
    spec = generate(params, config, [prompt] * 3, keys, draft="prompt_lookup", num_speculative_tokens=K, **args)
    assert_same(spec, plain)
    assert all(re.fullmatch("[0-9]{1,3} ducats", tokenizer().decode(t[: n - 1].tolist()))
               for t, n in zip(spec.tokens, spec.lengths))  # fmt: skip


def _digits_tokenizer():
    class Digits:  # token t decodes to the digit t % 10, so "3" is a frequent stop string
        def decode_single_token_bytes(self, t):
            return str(t % 10).encode()

    return Digits()


def test_greedy_equals_transformers_prompt_lookup(target):
    model, params, config = target
    for prompt in PROMPTS[::2]:
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                            prompt_lookup_num_tokens=K, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        ours = generate(params, config, [prompt], jax.random.key(0), max_new_tokens=N, temperature=0.0, eos_id=None,
                        draft="prompt_lookup", num_speculative_tokens=K)  # fmt: skip
        assert ours.tokens[0].tolist() == hf


def reference_lookup(history, length, k):
    """The proposal as a plain loop: the latest earlier match of the last 3, 2, then 1 tokens."""
    seq = list(history[:length])
    for n in (3, 2, 1):
        if length < n + 1:
            continue
        for e in range(length - 2, n - 2, -1):
            if seq[e - n + 1 : e + 1] == seq[length - n :]:
                known = seq[e + 1 :]
                return [known[i % len(known)] for i in range(k)]
    return [seq[-1]] * k


def test_prompt_lookup_proposals_match_a_reference_loop():
    rng = np.random.default_rng(0)
    history = rng.integers(0, 6, size=(64, 40)).astype(np.int32)  # a small alphabet: many matches, some none
    history[::7] = rng.integers(0, 1000, size=(10, 40))
    lengths = rng.integers(1, 40, size=64).astype(np.int32)
    got = np.asarray(prompt_lookup(jnp.asarray(history), jnp.asarray(lengths), 5))
    for b in range(64):
        assert got[b].tolist() == reference_lookup(history[b], lengths[b], 5), b


def test_new_settings_do_not_recompile(target):
    run(target, dict(temperature=0.5, top_p=0.9), "prompt_lookup")
    before = speculate_chunk._cache_size()
    run(target, dict(temperature=1.3, top_k=7, repetition_penalty=1.1), "prompt_lookup")
    run(target, dict(temperature=[0.0, 0.2, 0.4]), "prompt_lookup")
    assert speculate_chunk._cache_size() == before


@pytest.mark.parametrize("draft, k, message", [
    ("lookup", 3, "draft must be 'prompt_lookup' or (draft_params, draft_config)"),
    ("prompt_lookup", 0, "num_speculative_tokens must be an int in [1, 16], got 0"),
    ("prompt_lookup", 17, "got 17"),
    ("tiny", 8, "num_speculative_tokens=8 is too large for the context: a round feeds k + 1 = 9 tokens in one "
                "forward, more than the model's n_positions=8"),
    ("vocab", 3, "vocabulary (50 ids, 50 real) differs from the target's (101, 101)"),
    ("short", 3, "context n_positions=16 is shorter than the prompt + max_new_tokens = 42"),
    ("params", 3, "draft params do not fit the draft config: wte must be [101, 48]"),
])  # fmt: skip
def test_bad_draft_arguments_name_the_problem(target, draft, k, message):
    _, params, config = target
    prompts, n = PROMPTS, N
    if draft == "tiny":  # a target whose whole context is 8 positions
        config, params, draft = config.replace(n_positions=8), dict(params, wpe=params["wpe"][:8]), "prompt_lookup"
        prompts, n = [[1, 2]], 4
    other = {"vocab": config.replace(vocab_size=50), "short": config.replace(n_positions=16)}
    if draft in other:
        draft = (init_params(jax.random.key(1), other[draft]), other[draft])
    elif draft == "params":
        draft = (init_params(jax.random.key(1), config.replace(n_embd=24, n_head=2)), config)
    with pytest.raises(ConfigError, match=re.escape(message)):
        generate(params, config, prompts, jax.random.key(0), max_new_tokens=n, draft=draft, num_speculative_tokens=k)
