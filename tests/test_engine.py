"""The serving engine without HTTP: random arrivals, slot reuse, cancellation, a full queue, bad requests.
Every request must give the bits `generate` gives it alone."""

import jax
import numpy as np
import pytest

from gpt2_jax import BUNDLED_MODEL, ConfigError, SamplingParams, constraints, generate, load, tokenizer
from gpt2_jax.serving import Cancelled, Engine, QueueFull, Request


@pytest.fixture(scope="module")
def model():
    params, config = load(BUNDLED_MODEL)
    return params, config, tokenizer()


class Recorder:
    def __init__(self):
        self.tokens, self.logprobs, self.end = [], [], None

    def __call__(self, kind, payload):
        if kind == "token":
            self.tokens.append(payload[0])
            self.logprobs.append(payload[1])
        else:
            self.end = (kind, payload)


def request(prompt, n, seed, options, top=0):
    rec = Recorder()
    sampling = SamplingParams(max_new_tokens=n, top_logprobs=top, **options)
    return Request(prompt, sampling, jax.random.fold_in(jax.random.key(seed), 0), rec, seed=seed), rec


def alone(params, config, req):
    g = generate(params, config, [req.prompt], jax.random.key(req.seed), sampling=req.sampling.replace(logprobs=True))
    n = g.lengths[0]
    return g.tokens[0, :n].tolist(), g.logprobs[0, :n], (g.finish_reason[0], g.stop_string[0])


def assert_same(params, config, req, rec):
    tokens, logprobs, end = alone(params, config, req)
    assert rec.end == ("done", end)
    assert rec.tokens == tokens
    assert (np.array(rec.logprobs, np.float32).view(np.uint32) == logprobs.view(np.uint32)).all()


def test_random_arrivals_share_slots_and_each_request_equals_generate_alone(model):
    params, config, enc = model
    rng = np.random.default_rng(0)
    texts = [
        "ROMEO:",
        "JULIET: O Romeo, Romeo, wherefore",
        "To be",
        "HAMLET:\n",
        "KING HENRY: Once more",
        "Age:",
        "FIRST CITIZEN:\nBefore we proceed",
        "O",
    ]
    settings = [dict(temperature=0.8, top_k=40), dict(repetition_penalty=1.3), dict(temperature=0.0, stop=["\n"]),
                dict(temperature=1.2, min_p=0.05, frequency_penalty=0.5), dict(top_p=0.9, presence_penalty=1.0),
                dict(constraint=constraints.regex(" [0-9]{1,3}")), dict(no_repeat_ngram_size=2, logit_bias={13: 5.0}),
                dict(constraint=constraints.choice(["aye", "nay"]))]  # fmt: skip
    engine = Engine(params, config, max_batch=3, max_queue=8, max_seq=96)
    pending = []
    for i, (text, options) in enumerate(zip(texts, settings)):
        req, rec = request(enc.encode(text), int(rng.integers(4, 17)), 40 + i, options)  # <= 16: one step bucket
        req.seed = 40 + i
        pending.append((int(rng.integers(0, 30)), req, rec))  # arrives before that step
    pending.sort(key=lambda x: x[0])
    step, waiting, late = 0, list(pending), 0
    while True:
        while waiting and waiting[0][0] <= step:
            late += engine.stats()["active"] > 0  # joins a running batch
            engine.submit(waiting.pop(0)[1])
        busy = engine.step()
        step += 1
        if not busy and not waiting:
            break
    assert step > 30 and late >= 3  # requests joined a running engine, and 8 went through 3 slots
    for _, req, rec in pending:
        assert_same(params, config, req, rec)


def test_cancel_frees_the_slot_and_the_next_request_is_unaffected(model):
    params, config, enc = model
    engine = Engine(params, config, max_batch=1, max_queue=2, max_seq=64)
    first, rec1 = request(enc.encode("ROMEO:"), 40, 1, {})
    second, rec2 = request(enc.encode("JULIET:"), 12, 2, dict(temperature=0.7))
    second.seed = 2
    engine.submit(first)
    engine.submit(second)
    for _ in range(3):
        engine.step()
    first.cancel()
    while engine.step():
        pass
    assert rec1.end[0] == "error" and isinstance(rec1.end[1], Cancelled) and len(rec1.tokens) == 3
    assert_same(params, config, second, rec2)


def test_a_full_queue_is_refused_and_bad_requests_fail_alone(model):
    params, config, enc = model
    engine = Engine(params, config, max_batch=1, max_queue=1, max_seq=64)
    a, _ = request(enc.encode("A"), 4, 1, {})
    b, _ = request(enc.encode("B"), 4, 2, {})
    engine.submit(a)
    engine.submit(b)
    c, _ = request(enc.encode("C"), 4, 3, {})
    with pytest.raises(QueueFull, match="server busy"):
        engine.submit(c)
    with pytest.raises(ConfigError, match="temperature"):
        engine.submit(request(enc.encode("D"), 4, 4, dict(temperature=-1.0))[0])
    with pytest.raises(Exception, match="max_seq=64"):
        engine.submit(request(enc.encode("E"), 80, 5, {})[0])

    def explode(kind, payload):
        raise RuntimeError("a client callback failed")

    engine = Engine(params, config, max_batch=2, max_queue=2, max_seq=64)
    bad = Request(enc.encode("F"), SamplingParams(max_new_tokens=8), jax.random.key(0), explode)
    good, rec = request(enc.encode("G"), 8, 6, dict(temperature=0.9))
    good.seed = 6
    engine.submit(bad)
    engine.submit(good)
    while engine.step():
        pass
    assert bad.cancelled
    assert_same(params, config, good, rec)


def test_after_stop_requests_are_refused(model):
    params, config, enc = model
    engine = Engine(params, config, max_batch=1, max_queue=2, max_seq=64).start()
    engine.stop()
    engine.stop()  # twice is fine
    with pytest.raises(Cancelled, match="shutting down"):
        engine.submit(request(enc.encode("A"), 4, 1, {})[0])
