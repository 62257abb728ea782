"""SamplingParams, the one value settings travel in: its checks, one per row, the keyword sugar building the
same rows, seeds, per-row max_new_tokens and stop settings, and the server and CLI mapping onto it."""

import jax
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax import BUNDLED_MODEL, ConfigError, SamplingParams
from gpt2_jax.cli.generate import sampling_params
from gpt2_jax.cli.parser import build_parser


@pytest.fixture(scope="module")
def model():
    params, config = gpt2_jax.load(BUNDLED_MODEL, dtype="float32")
    return params, config, gpt2_jax.tokenizer()


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("top_p", 0.0, r"top_p must be a number in \(0, 1\]"),
    ("top_k", 1.5, "top_k must be an integer"),
    ("max_new_tokens", 0, "max_new_tokens must be an int >= 1"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("frequency_penalty", 3.0, r"frequency_penalty must be a number in \[-2, 2\]"),
    ("no_repeat_ngram_size", 17, r"no_repeat_ngram_size must be an integer in \[0, 16\]"),
    ("top_logprobs", 21, r"top_logprobs must be an int in \[0, 20\]"),
    ("logit_bias", {5: 101}, r"logit_bias\[5\] = 101: a bias must be a number in \[-100, 100\]"),
    ("logit_bias", [1, 2], "logit_bias must map token ids to biases"),
    ("bad_words_ids", [[]], "each banned word must be a non-empty list"),
    ("stop", [""], "a stop string must be a non-empty str"),
    ("stop", ["x"] * 17, "at most 16 stop strings"),
    ("stop_ids", list(range(9)), "at most 8 stop_ids"),
    ("eos_id", -3, "eos_id must be 'config', a token id >= 0 or None"),
    ("constraint", "[a-z]+", "constraint must be a gpt2_jax.sampling.constraints object"),
    ("seed", 2**32, r"seed must be an int in \[0, 2\*\*32\)"),
    ("logprobs", 1, "logprobs must be True or False"),
])  # fmt: skip
def test_every_bad_value_is_named_at_construction(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})


def test_token_ids_are_checked_against_the_model_when_prepared(model):
    params, config, _ = model
    with pytest.raises(ConfigError, match=r"stop_ids: token id 50257 must be an int in \[0, 50257\)"):
        gpt2_jax.generate(params, config, [[1, 2]], jax.random.key(0), sampling=SamplingParams(stop_ids=(50257,)))
    with pytest.raises(ConfigError, match="pass either sampling= or keyword settings"):
        gpt2_jax.generate(params, config, [[1, 2]], jax.random.key(0), sampling=SamplingParams(), temperature=0.5)
    with pytest.raises(ConfigError, match=r"one SamplingParams per prompt \(2\), got 3"):
        gpt2_jax.generate(params, config, [[1], [2]], jax.random.key(0), sampling=[SamplingParams()] * 3)
    with pytest.raises(ConfigError, match=r"unknown setting.*tempreature"):
        gpt2_jax.generate(params, config, [[1, 2]], jax.random.key(0), tempreature=0.5)
    with pytest.raises(ConfigError, match="needs a key"):
        gpt2_jax.generate(params, config, [[1, 2]], sampling=SamplingParams())


def test_keyword_sugar_builds_the_same_rows_as_sampling_params(model):
    """Per-row keyword settings and a list of SamplingParams are one path: the same bits."""
    params, config, enc = model
    prompts = [enc.encode("ROMEO:"), enc.encode("JULIET: O Romeo"), enc.encode("To be")]
    kw = dict(max_new_tokens=[6, 12, 9], temperature=[0.0, 0.9, 1.2], top_k=[0, 40, 0], stop=[None, ["\n"], None],
              repetition_penalty=1.2, logprobs=True)  # fmt: skip
    sugar = gpt2_jax.generate(params, config, prompts, jax.random.key(3), **kw)
    rows = [SamplingParams(max_new_tokens=6, temperature=0.0, repetition_penalty=1.2, logprobs=True),
            SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, stop=["\n"], repetition_penalty=1.2,
                           logprobs=True),
            SamplingParams(max_new_tokens=9, temperature=1.2, repetition_penalty=1.2, logprobs=True)]  # fmt: skip
    typed = gpt2_jax.generate(params, config, prompts, jax.random.key(3), sampling=rows)
    assert (sugar.tokens == typed.tokens).all() and (sugar.lengths == typed.lengths).all()
    assert (bits(sugar.logprobs) == bits(typed.logprobs)).all()
    assert sugar.finish_reason == typed.finish_reason


def test_each_row_stops_at_its_own_max_new_tokens_with_the_bits_of_its_run_alone(model):
    params, config, enc = model
    prompts = [enc.encode("ROMEO:"), enc.encode("KING HENRY: Once more")]
    rows = [
        SamplingParams(max_new_tokens=5, temperature=0.8, logprobs=True, eos_id=None),
        SamplingParams(max_new_tokens=20, temperature=0.8, logprobs=True, eos_id=None),
    ]
    both = gpt2_jax.generate(params, config, prompts, jax.random.key(5), sampling=rows)
    assert both.tokens.shape == (2, 20) and both.lengths.tolist() == [5, 20]
    assert both.finish_reason == ["length", "length"]
    assert (both.tokens[0, 5:] == both.tokens[0, 4]).all() and (both.logprobs[0, 5:] == 0).all()  # no EOS: its last
    for b, row in enumerate(rows):
        key = jax.random.fold_in(jax.random.key(5), b)[None]
        alone = gpt2_jax.generate(params, config, [prompts[b]], key, sampling=row)
        n = row.max_new_tokens
        assert (alone.tokens[0] == both.tokens[b, :n]).all()
        assert (bits(alone.logprobs[0]) == bits(both.logprobs[b, :n])).all()
    streamed = list(gpt2_jax.generate_stream(params, config, prompts, jax.random.key(5), sampling=rows))
    tokens = np.array([t for t, _ in streamed])  # [steps, B]
    live = np.array([lv for _, lv in streamed])
    assert live.sum(0).tolist() == [5, 20] and (tokens[:5, 0] == both.tokens[0, :5]).all()


def test_a_seed_replaces_the_key_as_generate_with_that_seed_would(model):
    params, config, enc = model
    prompts = [enc.encode("ROMEO:")] * 3
    seeded = gpt2_jax.generate(params, config, prompts, sampling=SamplingParams(max_new_tokens=8, seed=11))
    keyed = gpt2_jax.generate(params, config, prompts, jax.random.key(11), max_new_tokens=8)
    assert (seeded.tokens == keyed.tokens).all()
    assert len({tuple(t) for t in seeded.tokens.tolist()}) > 1  # rows still differ: fold_in(key(seed), row)
    mixed = gpt2_jax.generate(
        params,
        config,
        prompts[:2],
        jax.random.key(0),
        sampling=[SamplingParams(max_new_tokens=8, seed=11), SamplingParams(max_new_tokens=8)],
    )
    assert (mixed.tokens[0] == keyed.tokens[0]).all()  # row 0 from its seed
    other = gpt2_jax.generate(params, config, prompts[:2], jax.random.key(0), max_new_tokens=8)
    assert (mixed.tokens[1] == other.tokens[1]).all()  # row 1 from the key


def test_per_row_stop_ids_and_eos(model):
    """Stop settings are per row now: one row stopping on a stop id leaves its neighbour running."""
    params, config, enc = model
    prompt = enc.encode("ROMEO:")
    free = gpt2_jax.generate(params, config, [prompt], jax.random.key(2), max_new_tokens=12, temperature=0.0,
                             eos_id=None)  # fmt: skip
    stop_at = int(free.tokens[0, 3])
    out = gpt2_jax.generate(params, config, [prompt, prompt], jax.random.key(2), temperature=0.0, eos_id=None,
                            max_new_tokens=12, stop_ids=[[stop_at], []])  # fmt: skip
    first = free.tokens[0].tolist().index(stop_at)
    assert out.lengths.tolist() == [first + 1, 12] and out.finish_reason == ["stop", "length"]
    assert (out.tokens[1] == free.tokens[0]).all()


def test_the_cli_flags_and_the_server_body_map_onto_it(model):
    args = build_parser().parse_args(["generate", "--temperature", "0.7", "--top-k", "5", "--stop", "\n",
                                      "--min-new-tokens", "2", "--max-new-tokens", "9"])  # fmt: skip
    sp = sampling_params(args)
    assert (sp.temperature, sp.top_k, sp.stop, sp.min_new_tokens, sp.max_new_tokens) == (0.7, 5, ("\n",), 2, 9)
    from gpt2_jax.serving.plan import RequestPlan
    from gpt2_jax.serving.schema import CompletionRequest

    req = CompletionRequest(model="m", prompt="hi", max_tokens=7, temperature=0.5, top_k=-1, logprobs=3,
                            stop="\n", logit_bias={"13": 2.0}, min_tokens=1)  # fmt: skip
    sp = RequestPlan._sampling(req, 7, 3)
    assert sp == SamplingParams(max_new_tokens=7, temperature=0.5, top_k=0, logprobs=True, top_logprobs=3,
                                stop=("\n",), logit_bias={13: 2.0}, min_new_tokens=1)  # fmt: skip
