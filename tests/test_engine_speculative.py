"""Speculative decoding in the serving engine: every request's tokens and logprobs are the bits `generate` gives it
alone without speculation (uint32), in a crowd, with prefix reuse, chunked prefill, constraints and per-request
opt-out, for prompt lookup and a draft model; the per-step choice between a round and a plain step."""

import dataclasses
import threading

import pytest

from gpt2_jax import BUNDLED_MODEL, load, tokenizer
from gpt2_jax.sampling import constraints
from gpt2_jax.serving import Engine
from gpt2_jax.serving.speculation import EXPLORE, Policy, Speculation
from tests.test_engine import assert_same, request

QUOTE = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
         "ROMEO: But soft, what light through yonder window breaks? It is the east, and")  # fmt: skip


@pytest.fixture(scope="module")
def model():
    params, config = load(BUNDLED_MODEL)
    return params, config, tokenizer()


def serve(engine, reqs):
    """Submit every request to the running engine, wait until each has ended."""
    for req, _ in reqs:
        engine.submit(req)
    for _, rec in reqs:
        rec.wait()


def recorded(prompt, n, seed, options, top=0):
    """tests.test_engine's request, its recorder able to wait for the end."""
    req, rec = request(prompt, n, seed, options, top)
    done = threading.Event()
    inner = req.on_event

    def on_event(kind, payload):
        inner(kind, payload)
        if kind != "token":
            done.set()

    req.on_event = on_event
    rec.wait = lambda: done.wait(300)
    return req, rec


def crowd(enc):
    """A crowd of requests over one quoted passage (prompt lookup has matches), two sharing a 130-token prefix
    (one 128-token block reused), prompts longer than a 16-token chunk, sampled, penalised, constrained, top
    logprobs, one opting out."""
    long = enc.encode(QUOTE * 4)[:130]
    assert len(long) == 130
    settings = [
        (enc.encode(QUOTE), dict(temperature=0.0), 0),
        (enc.encode(QUOTE[20:]), dict(temperature=0.8, top_k=40), 2),
        (long + enc.encode(" ROMEO:"), dict(repetition_penalty=1.2), 0),
        (long + enc.encode(" It is"), dict(temperature=0.0, stop=["sun"]), 0),
        (enc.encode(QUOTE[40:]), dict(constraint=constraints.regex(" [a-z ]{1,40}")), 0),
        (enc.encode(QUOTE[5:]), dict(temperature=1.0, min_p=0.05, frequency_penalty=0.4), 0),
    ]
    reqs = []
    for i, (prompt, options, top) in enumerate(settings):
        reqs.append(recorded(prompt, 24, 60 + i, options, top))
    reqs[1][0].speculate = False
    return reqs


@pytest.mark.parametrize("method, when", [("prompt_lookup", "auto"), ("draft", "always")])
def test_speculating_engine_gives_each_request_generate_alone_bits(model, method, when):
    """auto: the per-step choice (it rounds where rounds pay, so the quoted passage gets them); always: a round every
    step."""
    params, config, enc = model
    draft = None
    if method == "draft":  # the target's first layer: a draft that agrees often, sharing the vocabulary
        draft = (dict(params, h=params["h"][:1]), dataclasses.replace(config, n_layer=1))
    engine = Engine(params, config, max_batch=2, max_queue=8, max_seq=200, prefill_chunk=16,
                    speculation=Speculation(k=4, draft=draft, when=when))  # fmt: skip
    engine.programs.compile()
    engine.start()
    try:
        reqs = crowd(enc)
        serve(engine, reqs[:3])  # the first wave computes the shared block
        serve(engine, reqs[3:])
        stats = engine.stats()
    finally:
        engine.stop()
    for req, rec in reqs:
        assert_same(params, config, req, rec)
    assert stats["prefix_hit_tokens"] >= 128
    assert 0 < stats["speculative_accepted"] <= stats["speculative_proposed"]


class Asked:
    def __init__(self, speculate=True):
        self.speculate = speculate


def test_policy_rounds_where_they_pay_and_explores():
    policy = Policy(Speculation(k=4))
    one, crowd8 = [Asked()], [Asked() for _ in range(8)]
    assert not policy.choose(2, one)  # a plain step's time first
    policy.observe(2, False, 0.010, {})
    assert policy.choose(2, one)  # then a round, never timed yet
    policy.observe(2, True, 0.012, {id(one[0]): 4})
    assert policy.choose(2, one)  # 4 tokens in 12 ms beat 1 in 10 ms
    assert not policy.choose(2, [Asked(False)])  # nobody speculates
    policy.observe(8, False, 0.028, {})
    policy.observe(8, True, 0.090, {id(r): 1 for r in crowd8})
    assert not policy.choose(8, crowd8)  # 8 tokens in 90 ms lose to 8 in 28 ms
    for _ in range(EXPLORE):
        policy.observe(8, False, 0.028, {})
    assert policy.choose(8, crowd8)  # tried again after EXPLORE plain steps
    assert Policy(Speculation(k=4, when="always")).choose(2, one)
    lone = Policy(Speculation(k=4))  # a round costs 12 ms against a 10 ms step: it pays from 1.2 tokens a round
    lone.observe(2, False, 0.010, {})
    for _ in range(10):  # requests whose rounds kept only their first token (text that does not repeat)
        lone.observe(2, True, 0.012, {id(Asked()): 1})
    assert not lone.choose(2, [Asked()])  # a new request starts where they left off (~1 token a round), not at 2
    noisy = Policy(Speculation(k=4))  # nothing is ever accepted, and noise once timed a round under a step
    noisy.observe(2, False, 0.010, {})
    for _ in range(20):
        noisy.observe(2, True, 0.0098, {id(Asked()): 1})
    assert not noisy.choose(2, [Asked()])  # a round that keeps one token is a dearer step: not taken (MARGIN)
    stale = Policy(Speculation(k=4))
    stale.observe(2, False, 0.050, {})  # one plain step timed while the machine was busy
    stale.observe(2, True, 0.012, {})
    for _ in range(EXPLORE - 1):
        assert stale.choose(2, one)
        stale.observe(2, True, 0.012, {id(one[0]): 1})
    assert not stale.choose(2, one)  # after EXPLORE rounds, a plain step is timed again


class _Built:
    """chunking.plan's view of the programs: no idle chunk, every batched chunk built."""

    def idle_chunk(self, left):
        return None

    def prefill_built(self, T, P):
        return True


@pytest.mark.parametrize(
    "decoding, per_row, waiting, expect",
    [(8, 1.0, 5, 1), (32, 1.0, 5, 2), (8, 4.9, 5, 4), (8, 4.9, 3, 2), (8, 2.0, 5, 2), (8, 0.5, 5, 1)],
)
def test_prompt_chunks_keep_pace_with_the_tokens_a_round_keeps(decoding, per_row, waiting, expect):
    """serving.chunking.plan: a plain step over fewer than 16 rows takes one prompt chunk, 32 rows two; after a round
    that kept 4.9 tokens a row, about 5 times as many (capped at the 4 prompts compiled, and at those waiting), so
    prompts go in at the pace tokens come out. Never fewer than a plain step's."""
    from gpt2_jax.serving import chunking

    prompts = [(b, list(range(100)), 0) for b in range(waiting)]
    assert chunking.plan(prompts, decoding, 32, _Built(), per_row) == (expect, 32)
