"""The serving engine without HTTP: random arrivals, slot reuse, cancellation, a full queue, bad requests.
Every request must give the bits `generate` gives it alone."""

import jax
import numpy as np
import pytest

from gpt2_jax import BUNDLED_MODEL, ConfigError, SamplingParams, generate, load, tokenizer
from gpt2_jax.sampling import constraints
from gpt2_jax.serving import Engine
from gpt2_jax.serving.slots import Cancelled, QueueFull, Request


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
    engine.programs.compile()  # every program ahead (else the first requests wait for theirs: fine, but not step-countable)
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
    engine.programs.compile()
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
    engine.programs.compile()
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
    engine.programs.compile()
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


def test_a_stopped_engine_is_freed_with_its_threads(model):
    """A long-lived process that makes engines (a test suite, a notebook, a bench) must get their memory back: once
    stopped and dropped, an engine, its compiled programs and its threads are gone."""
    import gc
    import threading
    import weakref

    params, config, enc = model
    # Thread objects, not idents: a thread that ends (an earlier test's compiler finishing its build) frees its
    # ident for the next thread, which then looked as if it had been there before.
    before = set(threading.enumerate())
    engine = Engine(params, config, max_batch=2, max_queue=2, max_seq=64).start()
    engine.programs.wait(engine.programs.essential())
    alive = weakref.ref(engine)
    assert {t.name for t in threading.enumerate() if t not in before} >= {"gpt2-jax-engine", "gpt2-jax-compiler"}
    engine.stop()
    compiler = engine.programs.compiler.thread
    compiler.join(timeout=600)  # it ends once the program it is building is done: a minute or more on a busy machine
    assert not compiler.is_alive()
    del engine, compiler
    gc.collect()
    assert alive() is None
    assert set(threading.enumerate()) <= before


def test_warm_up_freezes_the_heap_the_idle_engine_refreezes_and_stop_thaws(model):
    """A full garbage collection scans every object the collector tracks while holding the GIL: over the objects
    loading and compiling leave behind, it is a gap in every stream, and a first burst of requests triggers one.
    warm_up freezes them (serving.memory.freeze_heap), and the engine freezes again when it goes idle after more
    programs were built, so a collection scans only what was made since. stop() thaws the heap, so a dropped
    engine can still be collected."""
    import gc
    import time

    from gpt2_jax.serving.warmup import warm_up

    params, config, enc = model
    engine = Engine(params, config, max_batch=2, max_queue=2, max_seq=64).start()
    try:
        warm_up(engine, constrained=False, echo=False)
        assert len(gc.get_objects()) < 10_000 < gc.get_freeze_count()
        built = engine.programs.built()
        engine.programs.want_scoring(priority=0.0)  # echo's programs: warm_up without echo never asked for them
        engine.programs.wait(engine.programs.pending())  # built after warm_up froze the heap, with the rest
        req, rec = request(enc.encode("ROMEO:"), 4, 0, {}, top=2)
        engine.submit(req)
        deadline = time.monotonic() + 120
        while engine.frozen_programs != engine.programs.built() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.programs.built() > built and engine.frozen_programs == engine.programs.built()
        assert rec.end is not None and len(gc.get_objects()) < 10_000
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0


def test_no_request_stalls_the_others_while_its_programs_or_its_constraint_compile(model):
    """A request whose prompt bucket is not compiled yet waits while the compiler thread builds its prefill; a
    request with a JSON-schema constraint (seconds of outlines-core) waits while the constraint compiler's
    child process builds it. The streams already running keep getting tokens all the while, and after the
    warm-up no program is ever compiled on the engine thread."""
    import threading
    import time

    import jax

    from gpt2_jax.serving.constraint_worker import ConstraintCompiler

    params, config, enc = model
    engine = Engine(params, config, max_batch=4, max_queue=4, max_seq=256)
    # The essential programs and every decode-step size (so the three streams start together); the larger prompt
    # chunks are left to compile while the test runs.
    essential = engine.programs.essential()
    engine.programs.wait(
        essential + [engine.programs.want_decode(r, priority=0.0) for r in engine.programs.row_buckets()]
    )
    compiler = ConstraintCompiler(timeout=120).start()
    compiles = []  # (thread, event) of every XLA compile from here on
    listen = lambda event, duration, **_: compiles.append((threading.get_ident(), event))
    engine.start()
    try:
        warm = [request(enc.encode("A"), 2, 1, {})[0], request(enc.encode("B"), 2, 2, dict(
            constraint=compiler.compile("choice", ["a", "b"], config.vocab_size, config.eos_id)))[0]]  # fmt: skip
        for r in warm:  # compiles the small row-moving programs, as the server's warm-up does
            engine.submit(r)
        while engine.stats()["active"] or engine.stats()["queued"]:
            time.sleep(0.05)
        jax.monitoring.register_event_duration_secs_listener(listen)
        stamps = [[] for _ in range(3)]
        running = []
        for i in range(3):
            req, _ = request(
                enc.encode(["ROMEO:", "JULIET:", "HAMLET:"][i]), 200, 10 + i, dict(logit_bias={50256: -100})
            )
            req.on_event = lambda kind, payload, i=i: stamps[i].append(time.perf_counter()) if kind == "token" else None
            running.append(req)
            engine.submit(req)
        while min(map(len, stamps)) < 5:
            time.sleep(0.01)
        submitted = time.perf_counter()
        firsts = {}

        def first_token(name):
            return lambda kind, payload: firsts.setdefault(name, time.perf_counter()) if kind == "token" else None

        long_prompt, _ = request(
            enc.encode("KING HENRY: Once more unto the breach, dear friends, " * 12)[:150], 4, 20, {}
        )
        long_prompt.on_event = first_token("new bucket")
        engine.submit(long_prompt)  # chunks of 32 tokens: their program compiles now, in the compiler thread

        def constrained():
            c = compiler.compile("json_schema", {}, config.vocab_size, config.eos_id)  # any JSON: ~3,000 states
            req, _ = request(enc.encode("JSON:"), 4, 21, dict(constraint=c))
            req.on_event = first_token("json schema")
            engine.submit(req)

        threading.Thread(target=constrained).start()
        while len(firsts) < 2:
            time.sleep(0.02)
        done = max(firsts.values())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        for r in running:
            r.cancel()
        engine.stop()
        compiler.stop()
    during = [[t for t in s if submitted < t < done] for s in stamps]
    gaps = np.concatenate([np.diff(s) for s in stamps])
    print(
        f"waited {done - submitted:.1f} s for the two requests; tokens of the running streams meanwhile: "
        f"{[len(d) for d in during]}; gaps median {np.median(gaps) * 1e3:.1f} ms, max {gaps.max() * 1e3:.1f} ms"
    )
    assert all(len(d) >= 10 for d in during), during
    assert not [e for t, e in compiles if t == engine_thread_ident(engine)], compiles


def engine_thread_ident(engine):
    return engine.ident


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_int8_and_w8a8_requests_in_a_batch_equal_generate_alone(model, mode):
    """The int8 modes through the engine: 4 requests decoding together (w8a8's 3 to 8 rows take a8.h's byte
    tiles on VNNI) each give the bits generate gives it alone (1 row: the int16 tiles)."""
    from gpt2_jax.model.precision import with_precision

    params, config, enc = model
    q = with_precision(params, mode)
    engine = Engine(q, config, max_batch=4, max_queue=4, max_seq=64)
    texts = ["ROMEO:", "JULIET: O Romeo", "To be", "HAMLET:\n"]
    made = [request(enc.encode(t), 12, 70 + i, dict(temperature=0.9, top_k=20)) for i, t in enumerate(texts)]
    for i, (req, _) in enumerate(made):
        req.seed = 70 + i
        engine.submit(req)
    while engine.step():
        pass
    for req, rec in made:
        assert_same(q, config, req, rec)
