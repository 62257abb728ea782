"""Stop strings and constrained decoding on the bundled Shakespeare model (the GPT-2 vocabulary)."""

import json
import re

import jax
import numpy as np
import pytest

from gpt2_jax import BUNDLED_MODEL, ConfigError, complete, generate, generate_stream, load, tokenizer
from gpt2_jax.generation.generator import _generate
from gpt2_jax.sampling import constraints

N = 40


@pytest.fixture(scope="module")
def bundled():
    params, config = load(BUNDLED_MODEL)
    enc = tokenizer()
    prompt = enc.encode("ROMEO:\nWhat say you, my lord?\n\nJULIET:\n")
    plain = generate(params, config, [prompt], jax.random.key(0), max_new_tokens=N, temperature=0.0, eos_id=None)
    return params, config, enc, prompt, plain.tokens[0].tolist()


def byte_spans(enc, tokens):
    """[(start, end)] byte offsets of each token in the concatenated text, and the bytes."""
    spans, data = [], b""
    for t in tokens:
        b = enc.decode_single_token_bytes(t)
        spans.append((len(data), len(data) + len(b)))
        data += b
    return spans, data


def greedy(bundled, **kw):
    params, config, _, prompt, _ = bundled
    kw.setdefault("eos_id", None)
    return generate(params, config, [prompt], jax.random.key(0), max_new_tokens=N, temperature=0.0, **kw)


def pick(bundled, inside: bool):
    """A stop string whose first occurrence in the greedy text completes inside token i (inside=True: it
    is the first 2 bytes of a longer token) or across tokens i-1 and i -> (stop, i)."""
    _, _, enc, _, plain = bundled
    spans, data = byte_spans(enc, plain)
    for i in range(3, N):
        (s0, e0), (s1, e1) = spans[i - 1], spans[i]
        if inside and e1 - s1 >= 3:
            stop = data[s1 : s1 + 2]
        elif not inside and e0 - s0 >= 2 and e1 - s1 >= 2:
            stop = data[e0 - 2 : s1 + 2]
        else:
            continue
        try:
            text = stop.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data.find(stop) == (s1 if inside else e0 - 2):
            return text, i
    raise AssertionError("no suitable stop string in the greedy text")


@pytest.mark.parametrize("inside", [True, False], ids=["mid-token", "across-tokens"])
def test_a_stop_string_stops_at_the_token_that_completes_it(bundled, inside):
    params, config, enc, prompt, plain = bundled
    stop, i = pick(bundled, inside)
    out = greedy(bundled, stop=[stop])
    assert out.lengths[0] == i + 1 and out.finish_reason == ["stop"] and out.stop_string == [stop]
    assert out.tokens[0, : i + 1].tolist() == plain[: i + 1]  # the same tokens up to there
    text = complete(params, config, enc.decode(prompt), jax.random.key(0), max_new_tokens=N, temperature=0.0,
                    eos_id=None, stop=[stop])[0]  # fmt: skip
    full = enc.decode(plain)
    assert text.text == full[: full.index(stop)] and text.finish_reason == "stop" and text.stop == stop
    assert len(text.tokens) == i + 1


def test_the_first_stop_string_to_complete_wins_and_the_prompt_never_counts(bundled):
    _, _, enc, _, plain = bundled
    a, i = pick(bundled, inside=False)
    b, j = pick(bundled, inside=True)
    # the stop string completed by the earlier token wins; completed by the same token, the one starting first
    _, data = byte_spans(enc, plain)
    first = min((i, data.find(a.encode()), a), (j, data.find(b.encode()), b))
    out = greedy(bundled, stop=[b, "no such text \u2603", a])
    assert out.lengths[0] == first[0] + 1 and out.stop_string == [first[2]]
    # "ROMEO:" is in the prompt, and not in the greedy text: it never stops the row
    assert "ROMEO:" not in enc.decode(plain)
    free = greedy(bundled, stop=["ROMEO:"])
    assert free.finish_reason == ["length"] and free.stop_string == [None] and free.lengths[0] == N
    assert free.tokens[0].tolist() == plain


def test_stop_strings_in_a_batch_and_in_a_stream(bundled):
    params, config, enc, prompt, plain = bundled
    stop, i = pick(bundled, inside=True)
    other = enc.encode("A plague o' both your houses!")
    out = generate(params, config, [prompt, other], jax.random.key(0), max_new_tokens=N, temperature=0.0,
                   eos_id=None, stop=[stop])  # fmt: skip
    alone = generate(params, config, [other], jax.random.key(0), max_new_tokens=N, temperature=0.0, eos_id=None,
                     stop=[stop])  # fmt: skip
    assert out.lengths[0] == i + 1 and out.lengths[1] == alone.lengths[0]
    assert (out.tokens[1] == alone.tokens[0]).all()
    streamed = [int(t[0]) for t, live in generate_stream(params, config, [prompt], jax.random.key(0),
                                                         max_new_tokens=N, temperature=0.0, eos_id=None,
                                                         stop=[stop]) if live[0]]  # fmt: skip
    assert streamed == plain[: i + 1]


def fullmatch_rows(enc, out, pattern):
    """Rows that stopped on EOS must match the pattern completely; returns how many did."""
    stopped = 0
    for b in range(len(out.lengths)):
        toks = out.tokens[b, : out.lengths[b]].tolist()
        if out.finish_reason[b] == "stop":
            assert toks[-1] == 50256
            text = enc.decode(toks[:-1])
            assert pattern(text), text
            stopped += 1
        else:
            assert out.lengths[b] == out.tokens.shape[1] and 50256 not in toks
    return stopped


def test_regex_choice_and_json_schema_hold_over_many_seeds(bundled):
    params, config, enc, prompt, _ = bundled
    keys = jax.random.split(jax.random.key(11), 24)
    rx = r"(ROMEO|JULIET): [A-Z][a-z]+( [a-z]+){0,3}[.!?]"
    out = generate(params, config, [prompt] * 24, keys, max_new_tokens=32, constraint=constraints.regex(rx))
    assert fullmatch_rows(enc, out, lambda t: re.fullmatch(rx, t)) >= 12

    options = ["yes", "no", "I know not, my lord"]
    out = generate(params, config, [prompt] * 24, keys, max_new_tokens=32, constraint=constraints.choice(options))
    assert fullmatch_rows(enc, out, lambda t: t in options) == 24

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip

    def valid(text):
        obj = json.loads(text)
        return isinstance(obj["name"], str) and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)

    out = generate(params, config, [prompt] * 24, keys, max_new_tokens=32, constraint=constraints.json_schema(schema))
    assert fullmatch_rows(enc, out, valid) >= 12


def test_a_constraint_that_cannot_finish_in_time_ends_with_length(bundled):
    params, config, enc, prompt, _ = bundled
    out = generate(params, config, [prompt] * 4, jax.random.key(3), max_new_tokens=6,
                   constraint=constraints.regex("[a-z]{60}"))  # fmt: skip
    assert out.finish_reason == ["length"] * 4 and (out.lengths == 6).all()
    for b in range(4):
        assert re.fullmatch("[a-z]+", enc.decode(out.tokens[b].tolist()))


def test_a_constraint_wins_over_min_new_tokens(bundled):
    params, config, enc, prompt, _ = bundled
    out = generate(params, config, [prompt] * 4, jax.random.key(5), max_new_tokens=12, min_new_tokens=8,
                   constraint=constraints.choice(["aye", "nay"]))  # fmt: skip
    assert out.finish_reason == ["stop"] * 4
    assert all(enc.decode(out.tokens[b, : out.lengths[b] - 1].tolist()) in ("aye", "nay") for b in range(4))


def test_constrained_and_free_rows_in_one_batch_equal_each_row_alone(bundled):
    params, config, enc, prompt, _ = bundled
    rows = [
        constraints.regex(r"[A-Z][a-z]+, [a-z]+\."),
        None,
        constraints.choice(["aye", "nay"]),
        constraints.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    ]
    keys = jax.random.split(jax.random.key(4), 4)
    batch = generate(params, config, [prompt] * 4, keys, max_new_tokens=20, constraint=rows, return_logprobs=True,
                     repetition_penalty=[1.0, 1.3, 1.0, 1.1])  # fmt: skip
    for b, c in enumerate(rows):
        alone = generate(params, config, [prompt], keys[b:b + 1], max_new_tokens=20, constraint=c,
                         return_logprobs=True, repetition_penalty=[1.0, 1.3, 1.0, 1.1][b])  # fmt: skip
        assert (batch.tokens[b] == alone.tokens[0]).all() and batch.lengths[b] == alone.lengths[0]
        assert (batch.logprobs[b].view(np.uint32) == alone.logprobs[0].view(np.uint32)).all()
    free = generate(params, config, [prompt], keys[1:2], max_new_tokens=20, repetition_penalty=1.3)
    assert (batch.tokens[1] == free.tokens[0]).all()  # a free row next to constrained ones: untouched


def test_a_new_pattern_of_similar_size_does_not_recompile(bundled):
    params, config, _, prompt, _ = bundled
    kw = dict(max_new_tokens=8, temperature=0.0)
    generate(params, config, [prompt], jax.random.key(0), constraint=constraints.regex("[a-z]{3} [0-9]+"), **kw)
    before = _generate._cache_size()
    generate(params, config, [prompt], jax.random.key(0), constraint=constraints.regex("[b-y]{4}, [A-Z]+"), **kw)
    generate(params, config, [prompt], jax.random.key(0), constraint=constraints.choice(["thee", "thou"]), **kw)
    assert _generate._cache_size() == before


def test_constraint_errors_are_named(bundled):
    params, config, _, prompt, _ = bundled
    with pytest.raises(ConfigError, match="outlines-core"):
        constraints.regex("(unclosed")
    with pytest.raises(ConfigError, match="at least one option"):
        constraints.choice([])
    with pytest.raises(ConfigError, match="not valid JSON"):
        constraints.json_schema("{not json")
    with pytest.raises(ConfigError, match="outlines-core"):
        constraints.json_schema({"type": "object", "properties": {"x": {"type": "nonsense"}}})
    with pytest.raises(ConfigError, match="needs an EOS id"):
        generate(params, config, [prompt], jax.random.key(0), max_new_tokens=4, eos_id=None,
                 constraint=constraints.regex("[a-z]+"))  # fmt: skip
    with pytest.raises(ConfigError, match="one entry per prompt"):
        generate(params, config, [prompt], jax.random.key(0), max_new_tokens=4, constraint=[None, None])
