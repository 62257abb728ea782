"""Constraint tables against outlines-core's own index, Python's re and json, step by step under jit."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from outlines_core import Index, Vocabulary

from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling import constraints as C
from gpt2_jax.sampling.constraints.automaton import Automaton
from gpt2_jax.sampling.constraints.spec import escape
from gpt2_jax.sampling.constraints.tables import MIN_C, MIN_G, MIN_Q, ConstraintTables, advance, allowed, bucket, pack
from gpt2_jax.tokenizer import tokenizer

V, EOS, PADDED_V = 50257, 50256, 50304
ENC = tokenizer()
TOKEN_BYTES = [ENC.decode_single_token_bytes(i) for i in range(EOS)]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
allowed_jit = jax.jit(allowed, static_argnames="eos_id")
advance_jit = jax.jit(advance)


@pytest.fixture(scope="module")
def vocab():
    """The reference: an outlines Vocabulary built here from tiktoken, independently of the package's."""
    tokens: dict[bytes, list[int]] = {}
    for i, b in enumerate(TOKEN_BYTES):
        tokens.setdefault(b, []).append(i)
    return Vocabulary(EOS, tokens)


def text_of(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def regex_check(pattern: str):
    return lambda data: (s := text_of(data)) is not None and re.fullmatch(pattern, s) is not None


def schema_check(data: bytes) -> bool:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(obj, dict)
        and set(obj) <= {"name", "age"}
        and isinstance(obj.get("name"), str)
        and ("age" not in obj or type(obj["age"]) is int)
    )


def distance_to_accept(tables: ConstraintTables) -> np.ndarray:
    """[Q] fewest tokens from each global state to an accepting one (large if none)."""
    dist = np.where(tables.accept, 0, 10**6)
    ns = tables.next_state
    while True:
        via = np.where(ns >= 0, dist[np.maximum(ns, 0)] + 1, 10**6).min(1)
        new = np.minimum(dist, via)
        if (new == dist).all():
            return dist
        dist = new


def walk(constraint, vocab, check, seeds, steps=40, vocab_size=V, greedy=0.6, stop=0.4):
    """Random walks through packed tables, each step compared with outlines' index and with `check`.

    A row stops (EOS) with probability `stop` when it may, and otherwise takes a token that brings it
    closer to an accepting state with probability `greedy`, else any allowed token. Returns the texts
    of the rows that chose EOS (every one of them passed `check`).
    """
    index = Index(constraint.source, vocab)
    tables = pack([C.compile_constraint(constraint, vocab_size)] * len(seeds), vocab_size)
    dist = distance_to_accept(tables)
    rngs = [np.random.default_rng(s) for s in seeds]
    ref = [index.get_initial_state()] * len(seeds)
    texts, done = [b""] * len(seeds), [False] * len(seeds)
    state = jnp.asarray(tables.start)
    for _ in range(steps):
        mask, st = np.asarray(allowed_jit(tables, state, eos_id=EOS)), np.asarray(state)
        tokens = np.full(len(seeds), EOS, np.int32)
        for b, rng in enumerate(rngs):
            if done[b]:
                continue
            expect = np.zeros(vocab_size, bool)
            expect[index.get_allowed_tokens(ref[b])] = True
            np.testing.assert_array_equal(mask[b], expect, err_msg=f"row {b} after {texts[b]!r}")
            accept = bool(tables.accept[st[b]])
            assert accept == index.is_final_state(ref[b]) == check(texts[b]), texts[b]
            choices = np.flatnonzero(mask[b][:EOS])
            nxt = tables.next_state[st[b], tables.class_of[tables.group[b], choices]]
            if accept and (choices.size == 0 or rng.random() < stop):
                tokens[b], done[b] = EOS, True
                continue
            closer = choices[dist[nxt] < dist[st[b]]]
            if closer.size and rng.random() < greedy:  # head for an accepting state, so walks finish
                choices = closer
            tokens[b] = rng.choice(choices)
            texts[b] += TOKEN_BYTES[tokens[b]]
            ref[b] = index.get_next_state(ref[b], int(tokens[b]))
        state = advance_jit(tables, state, jnp.asarray(tokens))
    return [t for t, d in zip(texts, done) if d]


def test_regex_walks_match_outlines_and_re(vocab):
    pattern = "[0-9]{3}-[A-Z][a-z]+"
    finished = walk(C.regex(pattern), vocab, regex_check(pattern), seeds=range(8), vocab_size=PADDED_V)
    assert len(finished) >= 4
    assert all(re.fullmatch(pattern, t.decode()) for t in finished)


def test_choice_walks_match_outlines(vocab):
    options = ["yes", "no", "maybe so", "no way"]
    finished = walk(C.choice(options), vocab, lambda d: text_of(d) in options, range(10, 26), greedy=0.3, stop=0.5)
    assert len(finished) >= 8
    assert {t.decode() for t in finished} <= set(options)


def test_json_schema_walks_match_outlines_and_json(vocab):
    finished = walk(C.json_schema(SCHEMA), vocab, schema_check, range(20, 36), steps=80, greedy=0.25, stop=0.3)
    assert len(finished) >= 8
    objs = [json.loads(text) for text in finished]
    assert all(isinstance(o["name"], str) and type(o.get("age", 0)) is int for o in objs)
    assert any("age" in o for o in objs) and any(o["name"] for o in objs)  # the walks reach both fields


def test_empty_pattern_allows_only_eos():
    auto = C.compile_constraint(C.regex(""))
    assert auto.next_state.shape[0] == 1 and auto.accept.tolist() == [True]
    tables = pack([auto], V)
    mask = np.asarray(allowed(tables, jnp.asarray(tables.start), EOS))
    assert np.flatnonzero(mask[0]).tolist() == [EOS]


def test_mixed_pack_equals_each_row_packed_alone():
    cons = [C.regex("[0-9]{3}-[A-Z][a-z]+"), None, C.choice(["yes", "no"]), C.json_schema(SCHEMA), None]
    cons.append(cons[0])
    autos = [None if c is None else C.compile_constraint(c, PADDED_V) for c in cons]
    mixed = pack(autos, PADDED_V)
    alone = [pack([a], PADDED_V) for a in autos]
    assert len(set(mixed.group.tolist())) == 4  # free + three distinct automata (the repeat deduped)
    rng = np.random.default_rng(0)
    state = jnp.asarray(mixed.start)
    single = [jnp.asarray(t.start) for t in alone]
    for _ in range(12):
        mask = np.asarray(allowed_jit(mixed, state, eos_id=EOS))
        tokens = np.zeros(len(cons), np.int32)
        for b, t in enumerate(alone):
            own = np.asarray(allowed_jit(t, single[b], eos_id=EOS))[0]
            np.testing.assert_array_equal(mask[b], own, err_msg=f"row {b}")
            if autos[b] is None:
                assert own.all()
            else:
                assert not own[V:].any()
            tokens[b] = rng.choice(np.flatnonzero(own[:EOS]) if own[:EOS].any() else [EOS])
            single[b] = advance_jit(t, single[b], jnp.asarray(tokens[b : b + 1]))
        state = advance_jit(mixed, state, jnp.asarray(tokens))


def test_same_size_patterns_share_shapes_and_compilation():
    f = jax.jit(lambda tables, state: allowed(tables, state, EOS))
    packs = [pack([C.compile_constraint(C.regex(p)), None], V) for p in ("[a-z]{3}", "[b-y]{4}")]
    assert bucket(packs[0]) == bucket(packs[1]) == (MIN_G, MIN_Q, MIN_C)
    assert [a.shape for a in packs[0]] == [a.shape for a in packs[1]]
    for t in packs:
        f(t, jnp.asarray(t.start))
    assert f._cache_size() == 1
    big = pack([C.compile_constraint(C.regex("[a-z]{100}"))], V)
    assert bucket(big)[1] == 128  # 1 free + 101 states, so the bucket does grow when it must


def test_advance_keeps_state_on_eos_and_disallowed():
    tables = pack([C.compile_constraint(C.regex("ab")), None], V)
    state = jnp.asarray(tables.start)
    b = ENC.encode_ordinary("b")[0]
    assert np.asarray(advance(tables, state, jnp.asarray([b, b]))).tolist() == tables.start.tolist()
    assert np.asarray(advance(tables, state, jnp.asarray([EOS, EOS]))).tolist() == tables.start.tolist()


def accepts(auto: Automaton, text: str) -> bool:
    s = 0
    for t in ENC.encode_ordinary(text):
        s = auto.next_state[s, auto.class_of[t]]
        if s < 0:
            return False
    return bool(auto.accept[s])


def test_choice_matches_options_literally():
    options = [
        "a.b", "x*", "1+1=2", "why?", "(paren)", "[br]", "{curly}", "a|b", "^caret", "dollar$",
        "back\\slash", "two words", 'say "hi"', "it's", "line\nbreak", "tab\there", "café", "日本",
        "\\.+*?()|[]{}^$#&-~",
    ]  # fmt: skip
    auto = C.compile_constraint(C.choice(options + ["a.b"]))
    for option in options:
        assert accepts(auto, option), option
    wrong = ["axb", "xx", "x", "11=2", "wh", "paren", "b", "a", "caret", "dollar", "back\\\\slash",
             "twowords", "say hi", "line break", "cafe", "日", "", "a.bc", " two words"]  # fmt: skip
    for text in wrong:
        assert not accepts(auto, text), text
    assert escape("a b\n.é") == "a b\n\\.é"


def test_errors_name_the_problem():
    with pytest.raises(ConfigError, match=r"invalid regex '\(': outlines-core says: .*NFA"):
        C.regex("(")
    with pytest.raises(C.ConstraintError, match=r"invalid regex 'a\{2,1\}': outlines-core says: "):
        C.regex("a{2,1}")
    with pytest.raises(C.ConstraintError, match="Unsupported type: nope"):
        C.json_schema({"type": "nope"})
    with pytest.raises(C.ConstraintError, match="not valid JSON"):
        C.json_schema('{"type": ')
    with pytest.raises(C.ConstraintError, match="rejects"):
        C.json_schema({"type": "string", "pattern": "("})
    with pytest.raises(C.ConstraintError, match="choice needs at least one option"):
        C.choice([])
    with pytest.raises(C.ConstraintError, match="option 1 must be a str"):
        C.choice(["a", 3])
    assert C.choice(["a", "a"]) == C.choice(["a"])
    with pytest.raises(
        C.ConstraintError,
        match=r"constraints need the GPT-2 vocabulary \(50257 tokens\); this model has 50000",
    ):
        C.compile_constraint(C.regex("a"), 50000)
    with pytest.raises(C.ConstraintError, match="compiled for vocab_size 50257, not 50304"):
        pack([C.compile_constraint(C.regex("a"))], PADDED_V)


def test_constraint_is_hashable_and_cached():
    a, b = C.regex("[0-9]+"), C.regex("[0-9]+")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert C.compile_constraint(a) is C.compile_constraint(b) is C.compile_constraint(b, V, EOS)
    assert C.compile_constraint(a, vocab_size=V) is C.compile_constraint(a)
    assert "regex '[0-9]+'" in repr(a)


class FakeIndex:
    """outlines' Index interface over hand-made transitions, to give build() dead and unreachable states."""

    def __init__(self, transitions, initial, finals):
        self.transitions, self.initial, self.finals = transitions, initial, finals

    def get_transitions(self):
        return self.transitions

    def get_initial_state(self):
        return self.initial

    def get_final_states(self):
        return self.finals


def test_build_prunes_dead_and_unreachable_states():
    from gpt2_jax.sampling.constraints.automaton import build

    transitions = {
        10: {5: 20, 6: 30, 7: 40},
        20: {EOS: 20, 5: 20},
        30: {5: 30},  # dead: never reaches a final state
        40: {EOS: 40},
        50: {5: 20},  # unreachable from 10
    }
    class_of, next_state, accept = build(FakeIndex(transitions, 10, {20, 40}), V, EOS)
    assert accept.tolist() == [False, True, True] and next_state.shape == (3, 3)
    assert class_of[6] == class_of[EOS] == class_of[0] == 0 and not (next_state[:, 0] >= 0).any()
    assert next_state[0, class_of[5]] == 1 and next_state[1, class_of[5]] == 1
    assert next_state[0, class_of[7]] == 2 and next_state[1, class_of[7]] == -1
    with pytest.raises(C.ConstraintError, match="no GPT-2 token sequence"):
        build(FakeIndex({10: {5: 10}}, 10, set()), V, EOS)


def test_json_schema_whitespace():
    tight = C.json_schema(SCHEMA, whitespace="")
    loose = C.json_schema(SCHEMA, whitespace="[ \\n]{0,2}")
    assert "[ ]?" in C.json_schema(SCHEMA).source and "[ ]?" not in tight.source
    assert accepts(C.compile_constraint(loose), '{ "name":\n"x" }')
    assert not accepts(C.compile_constraint(tight), '{ "name":"x"}')
    assert accepts(C.compile_constraint(tight), '{"name":"x","age":3}')
    with pytest.raises(C.ConstraintError, match="invalid whitespace regex"):
        C.json_schema(SCHEMA, whitespace="(")
