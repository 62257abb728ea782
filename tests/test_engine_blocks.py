"""The engine's KV blocks: prefix reuse, chunked prefill, eviction, and rows bounded by blocks, not by max_seq.

Every served request must give the bits `generate` gives it alone, whatever blocks it got, whatever it shared and
however its prompt was cut into chunks."""

import jax
import numpy as np
import pytest

from gpt2_jax import SamplingParams, generate, load
from gpt2_jax.sampling import constraints
from gpt2_jax.serving import Engine
from gpt2_jax.serving.blocks import BlockPool, block_names
from gpt2_jax.serving.engine import Request
from gpt2_jax.tokenizer import tokenizer
from tests.reference import make_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random GPT-2 with gpt2's vocabulary (so constraints apply), context (8 blocks a row) and head size."""
    path = tmp_path_factory.mktemp("m") / "hf"
    make_hf_model(n_layer=2, n_head=2, n_embd=128, vocab_size=50257, n_positions=1024, seed=3).save_pretrained(path)
    return load(path, dtype="float32")


class Recorder:
    def __init__(self):
        self.tokens, self.logprobs, self.end = [], [], None

    def __call__(self, kind, payload):
        if kind == "token":
            self.tokens.append(payload[0])
            self.logprobs.append(payload[1])
        else:
            self.end = (kind, payload)


def request(prompt, seed, **options):
    rec = Recorder()
    sampling = SamplingParams(**options)
    return Request(list(prompt), sampling, jax.random.fold_in(jax.random.key(seed), 0), rec, seed=seed), rec


def assert_alone(params, config, req, rec):
    g = generate(params, config, [req.prompt], jax.random.key(req.seed), sampling=req.sampling.replace(logprobs=True))
    n = g.lengths[0]
    assert rec.end == ("done", (g.finish_reason[0], g.stop_string[0]))
    assert rec.tokens == g.tokens[0, :n].tolist()
    assert (np.array(rec.logprobs, np.float32).view(np.uint32) == g.logprobs[0, :n].view(np.uint32)).all()


def run(engine, arrivals):
    """Submit (step, request) pairs before the given engine steps; step until idle -> steps taken."""
    arrivals, step = sorted(arrivals, key=lambda a: a[0]), 0
    while True:
        while arrivals and arrivals[0][0] <= step:
            engine.submit(arrivals.pop(0)[1])
        busy = engine.step()
        step += 1
        if not busy and not arrivals:
            return step


def test_shared_prefixes_chunked_prefill_and_eviction_keep_every_request_equal_to_generate_alone(model):
    """Random arrivals of prompts built from two long preambles (a system prompt, a few-shot header), the same
    prompt several times (n > 1), and unrelated ones, through a pool small enough to evict; prompts go in by
    chunks of 48 tokens. Each answer equals generate's alone, bit for bit; prefix hits skip exactly the tokens they
    cover; eviction happened; and a request served from cached blocks equals itself on a fresh engine."""
    params, config = model
    rng = np.random.default_rng(0)
    V = config.valid_vocab - 1  # no EOS inside prompts
    preambles = [rng.integers(0, V, 300).tolist(), rng.integers(0, V, 520).tolist()]
    prompts = []
    for i in range(14):
        kind = i % 4
        if kind == 3:
            prompts.append(rng.integers(0, V, int(rng.integers(5, 400))).tolist())
        else:
            suffix = rng.integers(0, V, int(rng.integers(1, 60))).tolist()
            prompts.append(preambles[kind % 2] + suffix)
    prompts += [prompts[1]] * 3  # one prompt four times, as n=4 gives
    settings = [dict(temperature=0.8, top_k=40), dict(temperature=0.0), dict(repetition_penalty=1.3, top_p=0.9),
                dict(temperature=1.1, min_p=0.05, frequency_penalty=0.5), dict(top_logprobs=3),
                dict(constraint=constraints.regex("[0-9]{2,4}"), temperature=0.7)]  # fmt: skip
    engine = Engine(params, config, max_batch=4, max_queue=32, max_seq=640, num_blocks=13, prefill_chunk=48)
    engine.programs.compile()
    reqs = []
    for i, p in enumerate(prompts):
        opts = settings[i % len(settings)]
        req, rec = request(p, 100 + i, max_new_tokens=int(rng.integers(3, 40)), **opts)
        reqs.append((int(rng.integers(0, 120)), req, rec))
    run(engine, [(t, r) for t, r, _ in reqs])
    for _, req, rec in reqs:
        assert_alone(params, config, req, rec)
    s = engine.stats()
    assert s["prefix_hit_tokens"] >= 6 * 256, s  # most preamble prompts found their leading blocks cached
    assert s["prefill_tokens"] == sum(map(len, prompts)) - s["prefix_hit_tokens"], s  # hits are not recomputed
    assert s["prefix_evictions"] > 0, s  # 12 blocks cannot keep every preamble and every unrelated prompt
    assert s["blocks_used"] == 0 and s["active"] == 0

    # The last request again, on a fresh engine (no cached blocks, its prompt in one go of 1 chunk per 512).
    _, req, rec = reqs[-1]
    fresh = Engine(params, config, max_batch=1, max_queue=1, max_seq=640, prefill_chunk=512)
    fresh.programs.compile()
    again, rec2 = request(req.prompt, req.seed, **{f: getattr(req.sampling, f) for f in ("max_new_tokens",
                          "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty")})  # fmt: skip
    run(fresh, [(0, again)])
    assert fresh.stats()["prefix_hit_tokens"] == 0
    assert rec2.tokens == rec.tokens
    assert np.array_equal(
        np.array(rec2.logprobs, np.float32).view(np.uint32), np.array(rec.logprobs, np.float32).view(np.uint32)
    )


def test_prompt_chunks_riding_decode_steps_keep_every_request_equal_to_generate_alone(model):
    """While rows decode, a full prompt chunk that ends no prompt goes through the model in the decode step's own
    forward (generation.decode_rows_with_chunk: each chunk token a one-token row of its own). Two long prompts
    arrive while three rows decode: every full chunk but a prompt's last rides (9 of each prompt's 10), and every
    request, the riders and the rows they rode, equals generate alone, bit for bit."""
    params, config = model
    engine = Engine(params, config, max_batch=8, max_queue=8, max_seq=512, prefill_chunk=32)
    engine.programs.wait([engine.programs.want_ride(8, 1), engine.programs.want_decode(8)])  # the rest on demand
    assert engine.programs.ride(3, 1) is not None  # the step over 8 rows with one prompt's chunk in it
    rng = np.random.default_rng(5)
    V = config.valid_vocab - 1
    early = [
        request(rng.integers(0, V, 20).tolist(), 10 + i, max_new_tokens=70, **opts)
        for i, opts in enumerate([dict(temperature=0.0), dict(temperature=0.9, top_k=50), dict(repetition_penalty=1.2)])
    ]
    late = [
        request(rng.integers(0, V, n).tolist(), 20 + n, max_new_tokens=12, **opts)
        for n, opts in [
            (300, dict(temperature=1.1, top_p=0.9)),
            (320, dict(constraint=constraints.regex("[a-z ]{3,30}"))),
        ]
    ]
    run(engine, [(0, r) for r, _ in early] + [(4, r) for r, _ in late])
    for req, rec in early + late:
        assert_alone(params, config, req, rec)
    assert engine.stats()["prefill_rode_tokens"] == 2 * 9 * 32, engine.stats()


def test_rows_are_bounded_by_blocks_not_by_max_seq(model):
    """With the default pool (the KV of 8 rows of max_seq, as the old slots reserved), 32 short requests (prompt +
    output <= 256 tokens: 2 blocks each) run at once, 4x the old 8 slots; a request that needs more blocks than are
    free waits in the queue until some come back, then runs."""
    params, config = model
    engine = Engine(params, config, max_batch=32, max_queue=64)
    assert engine.num_blocks == 8 * 8 + 1
    engine.programs.compile()
    rng = np.random.default_rng(1)
    reqs = [request(rng.integers(0, 50000, 100).tolist(), i, max_new_tokens=150, temperature=0.9) for i in range(32)]
    big, big_rec = request(rng.integers(0, 50000, 900).tolist(), 99, max_new_tokens=100)  # 8 blocks
    for r, _ in reqs:
        engine.submit(r)
    engine.submit(big)
    most = 0
    for _ in range(300):  # the prompts go in by chunks (4 steps each at the default 32): all decode by step ~128
        engine.step()
        most = max(most, engine.stats()["active"] - engine.stats()["prefilling"])
        if most == 32:
            break
    assert most == 32  # every short request decoding at once
    assert engine.stats()["queued"] == 1 and engine.stats()["blocks_free"] == 0  # the long one waits for blocks
    run(engine, [])
    assert all(rec.end is not None for _, rec in [*reqs, (big, big_rec)])
    # every 8th row of the 32 that decoded together, and the long one that waited, each against generate alone
    # (the first test checks every request; this one is about how many rows fit)
    for r, rec in [*reqs[::8], (big, big_rec)]:
        assert_alone(params, config, r, rec)


def test_block_pool_names_reuse_and_evicts_least_recently_used():
    C = 4
    pool = BlockPool(9, C)  # blocks 1..8
    a = list(range(13))  # 3 full blocks (+1 token)
    assert block_names(a, C)[:2] == block_names(a[:8], C)  # a name fixes its whole prefix...
    assert block_names([9, *a[1:]], C)[1] != block_names(a, C)[1]  # ...so a different first block renames the rest
    plan = pool.plan(a, 16)
    assert plan.reused == [] and plan.fresh == 4
    blocks = pool.take(plan, len(a))
    assert pool.waits_for(pool.plan(a, 16), len(a))  # the same prompt waits while its blocks are computed
    pool.register(blocks, plan.names, 3)
    pool.release(blocks, plan.names)
    assert pool.stats()["blocks_cached"] == 3 and pool.stats()["blocks_free"] == 5
    again = pool.plan(a, 16)
    assert again.reused == blocks[:3] and again.fresh == 1  # the 13th token is computed, into a block of its own
    exact = pool.plan(a[:12], 12)
    assert exact.reused == blocks[:2]  # 12 tokens: the last full block is recomputed (its last token's logits)
    other = pool.take(pool.plan(list(range(100, 132)), 32), 32)  # 8 blocks: the 5 free, then the 3 cached, LRU first
    assert pool.stats()["prefix_evictions"] == 3 and pool.plan(a, 16) is None  # the pool is full now
    pool.release(other, [])
    assert pool.plan(a, 16).reused == []  # evicted names are gone


def test_a_prompt_that_is_in_moves_down_so_the_decoding_rows_stay_packed(model):
    """A decode step runs over rows [0, highest decoding row], so the rows whose prompt is in are kept at the
    bottom: a prompt that becomes whole moves to the lowest row that is not decoding (a free one, or one whose
    prompt is still going in, which moves up in its place). Rows 0 and 1 decode, two constrained long prompts go
    in on rows 2 and 3, row 0's request ends: the first long prompt moves to row 0 (its constraint's tables are
    re-packed while the other's prompt is still going in), the second to row 2, row 3 is left free, and every
    request equals generate alone, bit for bit."""
    params, config = model
    engine = Engine(params, config, max_batch=4, max_queue=4, max_seq=256, prefill_chunk=32)
    engine.programs.compile()
    rng = np.random.default_rng(11)
    V = config.valid_vocab - 1
    short, rec_short = request(rng.integers(0, V, 5).tolist(), 40, max_new_tokens=5, temperature=0.0)
    long_run, rec_long_run = request(rng.integers(0, V, 5).tolist(), 41, max_new_tokens=40, top_logprobs=2,
                                     temperature=0.8)  # fmt: skip
    first, rec_first = request(rng.integers(0, V, 200).tolist(), 42, max_new_tokens=30,
                               constraint=constraints.regex("[a-z ]{40,60}"), temperature=0.9)  # fmt: skip
    second, rec_second = request(rng.integers(0, V, 150).tolist(), 43, max_new_tokens=8,
                                 constraint=constraints.choice(["yes", "no", "maybe"]))  # fmt: skip
    for r in (short, long_run):
        engine.submit(r)
    engine.step()
    engine.step()
    for r in (first, second):
        engine.submit(r)
    names = {id(short): "short", id(long_run): "long_run", id(first): "first", id(second): "second"}
    rows = lambda: [None if s is None else names[id(s.request)] for s in engine.rows.slots]
    assert rows() == ["short", "long_run", None, None]
    seen = []
    while engine.step():
        if rows() not in seen:
            seen.append(rows())
    assert ["short", "long_run", "first", "second"] in seen, seen  # the long prompts went in on rows 2 and 3
    assert ["first", "long_run", None, "second"] in seen, seen  # the first moved down to the row short left
    assert ["first", "long_run", "second", None] in seen, seen  # and the second to the lowest row not decoding
    engine.stop()
    for req, rec in [(short, rec_short), (long_run, rec_long_run), (first, rec_first), (second, rec_second)]:
        assert_alone(params, config, req, rec)


def test_back_to_back_steps_drop_what_a_row_that_ended_made_after_its_end(model):
    """While every row decodes and nothing waits, the engine dispatches a step before it hands out the last one's
    tokens (EngineRows.chain), so a row that ends on the host (a stop string, a cancel) has already run one more
    step. That token is dropped and its K/V write lands in the row's own unnamed block: the request ends exactly
    where generate alone ends, its neighbour is untouched, and a request that arrives later, reusing the first's
    named prompt block from the prefix cache and its freed blocks, equals generate alone, bit for bit."""
    params, config = model
    rng = np.random.default_rng(21)
    V = config.valid_vocab - 1
    prompt = rng.integers(0, V, 150).tolist()  # block 0 named once the prompt is in; decoding writes from slot 150
    alone = generate(params, config, [prompt], jax.random.key(50), sampling=SamplingParams(max_new_tokens=30))
    enc = tokenizer()
    made = alone.tokens[0, : alone.lengths[0]].tolist()
    stop = enc.decode(made[8:10])  # a stop string the row reaches mid-way, found on the host
    assert stop and stop not in enc.decode(made[:8]), stop
    stopping, rec_stopping = request(prompt, 50, max_new_tokens=30, stop=[stop])
    cancelled, rec_cancelled = request(rng.integers(0, V, 20).tolist(), 51, max_new_tokens=60, temperature=0.9)
    plain, rec_plain = request(rng.integers(0, V, 12).tolist(), 52, max_new_tokens=60, top_logprobs=2)
    later, rec_later = request(prompt + rng.integers(0, V, 5).tolist(), 53, max_new_tokens=20, temperature=0.7)

    def cancel_after_6(kind, payload, rec=rec_cancelled):
        rec(kind, payload)
        if kind == "token" and len(rec.tokens) == 6:
            cancelled.cancel()

    cancelled.on_event = cancel_after_6
    engine = Engine(params, config, max_batch=3, max_queue=4, max_seq=256, num_blocks=7, prefill_chunk=32)
    engine.programs.compile()
    chained, chain = [0], engine.rows.chain

    def counting():
        ok = chain()
        chained[0] += ok
        return ok

    engine.rows.chain = counting
    run(engine, [(0, stopping), (0, cancelled), (0, plain), (0, later)])  # later waits in the queue for a row
    engine.stop()
    assert chained[0] >= 40, chained  # most steps ran back to back
    for req, rec in [(stopping, rec_stopping), (plain, rec_plain), (later, rec_later)]:
        assert_alone(params, config, req, rec)
    assert rec_stopping.end == ("done", ("stop", stop)) and len(rec_stopping.tokens) < 30
    assert rec_cancelled.end[0] == "error" and len(rec_cancelled.tokens) == 6
    g = generate(params, config, [cancelled.prompt], jax.random.key(51),
                 sampling=cancelled.sampling.replace(logprobs=True))  # fmt: skip
    assert rec_cancelled.tokens == g.tokens[0, :6].tolist()
    assert engine.stats()["prefix_hit_tokens"] >= 128, engine.stats()  # later found block 0 cached
