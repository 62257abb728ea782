"""gpt2-jax serve over real HTTP, with the real openai client: every completion must be the bits of
`generate` (choice i of a request with seed s uses generate's row key fold_in(key(s), i)), streamed or
not, alone or among concurrent requests; errors are OpenAI-shaped with the right status; a dropped
stream frees its slot; SIGTERM drains the requests in flight, exits 0 and frees the port.

One server process (bundled model, 4 slots, max_seq 128, speculative decoding by prompt lookup) serves the whole
module; it compiles while
this process compiles its one generate program. Comparisons with generate keep prompts <= 16 tokens,
max_tokens <= 16 and always ask for top logprobs, so this process compiles a single program.
"""

import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from gpt2_jax import (  # noqa: E402
    BUNDLED_MODEL,
    generate,
    load,
    tokenizer,
)
from gpt2_jax.generation.completion import completions  # noqa: E402
from gpt2_jax.generation.generator import GenerateResult  # noqa: E402
from gpt2_jax.generation.stop_strings import StopMatcher  # noqa: E402
from tests.servers import Server  # noqa: E402

MODEL = "shakespeare"
# Prompt lookup on every step (where its round is built): every comparison with generate below is also one of
# speculative serving with plain decoding.
SERVE_ARGS = [
    "--max-batch",
    "4",
    "--max-queue",
    "8",
    "--max-seq",
    "128",
    "--prompt-lookup",
    "--speculate-when",
    "always",
]
TOP = 5  # top logprobs generate computes in every comparison (one compiled program)
NO_EOS = {"50256": -100}  # keeps a long request running until it is cancelled


@pytest.fixture(scope="module")
def _server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("jax-cache"), SERVE_ARGS)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(_server):
    """The same model in this process, and generate's program compiled (while the server compiles its own)."""
    params, config = load(BUNDLED_MODEL, dtype="float32")  # the server computes in float32 on a CPU
    m = params, config, tokenizer()
    expected(m, m[2].encode("ROMEO:"), 0, 0, 4)
    return m


@pytest.fixture
def server(_server, model):
    if _server.proc.poll() is not None:  # a test stopped it
        _server.start()
    _server.wait()
    return _server


def expected(model, ids, seed, index, max_tokens, stop=None, **options):
    """Choice `index` of a request with `seed`: row `index` of generate, via its row key
    fold_in(key(seed), index) (generate gives row b exactly that key). Stop strings cut generate's
    tokens where its stop matcher fires; that is all a stop string changes (rows stop, nothing else)."""
    params, config, enc = model
    key = jax.random.fold_in(jax.random.key(seed), index)[None]
    g = generate(params, config, [ids], key, max_new_tokens=max_tokens, return_logprobs=True, top_logprobs=TOP,
                 **options)  # fmt: skip
    n = int(g.lengths[0])
    finish, hit = g.finish_reason[0], None
    if stop:
        matcher = StopMatcher([[stop] if isinstance(stop, str) else list(stop)], enc.decode_single_token_bytes)
        for k in range(n):
            hit = matcher.feed(0, [int(g.tokens[0, k])])
            if hit is not None:
                n, finish = k + 1, "stop"
                break
    result = GenerateResult(g.tokens[:, :n], np.array([n]), g.logprobs[:, :n], [finish], [hit and hit.stop],
                            g.top_ids[:, :n], g.top_logprobs[:, :n])  # fmt: skip
    return completions(result, enc, [{config.eos_id}])[0]


def bits(values):
    return np.asarray(values, np.float32).view(np.uint32).tolist()


def assert_matches(choice, exp, enc, top=None):
    """An OpenAI choice (plain or joined from a stream) against generate's Completion, logprobs bitwise."""
    assert choice["text"] == exp.text
    assert choice["finish_reason"] == exp.finish_reason
    lp = choice["logprobs"]
    assert lp["tokens"] == [enc.decode([t]) for t in exp.tokens]
    assert bits(lp["token_logprobs"]) == bits(exp.logprobs)
    if top is not None:
        want = [{enc.decode([i]): v for i, v in list(d.items())[:top]} for d in exp.top_logprobs]
        assert [list(d) for d in lp["top_logprobs"]] == [list(d) for d in want]
        assert [bits(list(d.values())) for d in lp["top_logprobs"]] == [bits(list(d.values())) for d in want]


def plain(resp):
    """A Completion -> {index: choice dict}."""
    return {c.index: c.model_dump() for c in resp.choices}


def joined(stream):
    """A completion stream -> {index: choice dict} with the deltas joined, as a plain response has them."""
    out = {}
    for chunk in stream:
        for c in chunk.choices:
            d = out.setdefault(c.index, {"text": "", "finish_reason": None, "logprobs": None})
            d["text"] += c.text
            if c.finish_reason is not None:
                assert d["finish_reason"] is None, "one finish_reason per choice"
                d["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                lp = d["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for k in lp:
                    lp[k] += getattr(c.logprobs, k)
                d["logprobs"] = lp
    return out


# ---- the endpoints ------------------------------------------------------------------------------------
def test_health_models_and_metrics(server):
    status, _, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    server.client().completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, seed=1)
    status, headers, text = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("queue_length", "active_slots", "tokens_per_second", "time_to_first_token_seconds",
                 "request_latency_seconds", "generated_tokens"):  # fmt: skip
        assert f"# TYPE gpt2_jax_{name} " in text
    m = server.metrics()
    assert m["gpt2_jax_generated_tokens_total"] >= 5  # the warm-up's tokens count too
    assert m["gpt2_jax_tokens_per_second"] > 0
    assert m["gpt2_jax_queue_length"] == 0 and m["gpt2_jax_max_batch"] == 4
    assert m['gpt2_jax_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1
    assert m["gpt2_jax_request_latency_seconds_count"] >= 1
    assert m['gpt2_jax_requests_total{status="200"}'] >= 1
    # the collector ran (a request allocates far past its threshold), and its longest pause is in the histogram
    longest, pauses = m["gpt2_jax_gc_longest_pause_seconds"], m["gpt2_jax_gc_pause_seconds_count"]
    assert pauses >= 1 and 0 < longest <= m["gpt2_jax_gc_pause_seconds_sum"]
    assert m['gpt2_jax_gc_pause_seconds_bucket{le="+Inf"}'] == pauses
    assert server.logged(r"cmpl-\w+ 200 prompt_tokens=3 completion_tokens=5 finish=length latency="), server.log()


# ---- determinism: the bits of generate ---------------------------------------------------------------------
def test_completion_equals_generate_bitwise(server, model):
    enc = model[2]
    raw = server.client().completions.with_raw_response.create(
        model=MODEL, prompt="JULIET: O Romeo, Romeo", max_tokens=16, seed=7, temperature=0.9, logprobs=3,
        extra_body={"top_k": 40})  # fmt: skip
    resp = raw.parse()
    assert raw.headers["x-seed"] == "7" and resp.model_extra["seed"] == 7
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    exp = expected(model, enc.encode("JULIET: O Romeo, Romeo"), 7, 0, 16, temperature=0.9, top_k=40)
    assert_matches(plain(resp)[0], exp, enc, top=3)
    n_prompt = len(enc.encode("JULIET: O Romeo, Romeo"))
    assert resp.usage.prompt_tokens == n_prompt and resp.usage.completion_tokens == len(exp.tokens)
    assert resp.usage.total_tokens == n_prompt + len(exp.tokens)
    offsets = plain(resp)[0]["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_stream_equals_plain(server, model):
    enc = model[2]
    kw = dict(model=MODEL, prompt="ROMEO:", max_tokens=16, seed=11, logprobs=2, extra_body={"min_p": 0.02})
    client = server.client()
    whole = plain(client.completions.create(**kw))
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens == len(whole[0]["logprobs"]["tokens"]) and not chunks[-1].choices
    streamed = joined(iter(chunks))
    assert streamed[0]["text"] == whole[0]["text"] and streamed[0]["finish_reason"] == whole[0]["finish_reason"]
    for k in ("tokens", "top_logprobs", "text_offset"):
        assert streamed[0]["logprobs"][k] == whole[0]["logprobs"][k]
    assert bits(streamed[0]["logprobs"]["token_logprobs"]) == bits(whole[0]["logprobs"]["token_logprobs"])
    assert_matches(whole[0], expected(model, enc.encode("ROMEO:"), 11, 0, 16, min_p=0.02), enc, top=2)


def test_n_choices_and_several_prompts_are_the_rows_of_generate(server, model):
    enc = model[2]
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt="HAMLET:", n=3, max_tokens=12, seed=5, logprobs=0)
    got = plain(resp)
    assert sorted(got) == [0, 1, 2] and len({c["text"] for c in got.values()}) > 1
    for i in range(3):
        assert_matches(got[i], expected(model, enc.encode("HAMLET:"), 5, i, 12), enc)
    prompts = [enc.encode("To be"), [464, 257, 1110, 286]]  # token ids: choice i = prompt p * n + j
    got = joined(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, seed=9, logprobs=1,
                                           temperature=0.7, stream=True))  # fmt: skip
    assert sorted(got) == [0, 1, 2, 3]
    for i in range(4):
        assert_matches(got[i], expected(model, prompts[i // 2], 9, i, 8, temperature=0.7), enc, top=1)


def test_best_of_returns_the_n_candidates_with_the_highest_mean_logprob(server, model):
    """best_of=5, n=2: the server samples candidates 0..4 (rows of generate, as n=5 would) and returns the two with
    the highest mean logprob per token, best first, bit for bit; usage counts every candidate."""
    enc, client = model[2], server.client()
    ids, seed, settings = enc.encode("KING RICHARD:"), 4, dict(temperature=1.3)
    resp = client.completions.create(model=MODEL, prompt="KING RICHARD:", n=2, best_of=5, max_tokens=10, seed=seed,
                                     logprobs=0, **settings)  # fmt: skip
    candidates = [expected(model, ids, seed, i, 10, **settings) for i in range(5)]
    mean = [sum(float(x) for x in c.logprobs) / len(c.tokens) for c in candidates]  # a plain loop, in float64
    best = sorted(range(5), key=lambda i: (-mean[i], i))[:2]
    assert best != [0, 1], "pick a seed whose best candidates are not the first two rows: the test shows nothing"
    got = plain(resp)
    assert sorted(got) == [0, 1]
    for rank, i in enumerate(best):
        assert_matches(got[rank], candidates[i], enc)
    assert resp.usage.completion_tokens == sum(len(c.tokens) for c in candidates)
    alone = plain(client.completions.create(model=MODEL, prompt="KING RICHARD:", n=2, max_tokens=10, seed=seed,
                                            logprobs=0, **settings))  # fmt: skip
    assert_matches(alone[0], candidates[0], enc)  # without best_of: the first two rows
    assert_matches(alone[1], candidates[1], enc)
    for body, param in (({"n": 3, "best_of": 2}, "best_of"), ({"n": 1, "best_of": 2, "stream": True}, "stream"),
                        ({"length_penalty": 0.5}, "length_penalty")):  # fmt: skip
        status, err = server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "A", **body}).encode())
        assert status == 400 and err["error"]["param"] == param, (body, err)


def test_use_beam_search_equals_transformers_beam_search(server, model, tmp_path_factory):
    """use_beam_search with best_of=4 beams, n=2, length_penalty and early_stopping: the two best hypotheses of
    transformers' generate(num_beams=4, ...) on the same weights, token for token, best first; their logprobs are
    the ones generate would report for those tokens (prompt_logprobs of prompt + tokens), bit for bit."""
    import torch
    import transformers

    from gpt2_jax import convert
    from gpt2_jax.generation import prompt_logprobs

    params, config, enc = model
    hf_path = convert(BUNDLED_MODEL, tmp_path_factory.mktemp("hf") / "m", dtype="float32", to_hf=True)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_path, torch_dtype=torch.float32).eval()
    ids = enc.encode("MENENIUS:\nWhat work")
    resp = server.client().completions.create(model=MODEL, prompt="MENENIUS:\nWhat work", n=2, best_of=4,
                                              max_tokens=12, logprobs=0, extra_body={"use_beam_search": True,
                                              "length_penalty": 0.5, "early_stopping": True})  # fmt: skip
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), num_beams=4, num_return_sequences=2, max_new_tokens=12,
                           length_penalty=0.5, early_stopping=True, do_sample=False,
                           pad_token_id=config.eos_id)[:, len(ids):].tolist()  # fmt: skip
    got = plain(resp)
    assert sorted(got) == [0, 1]
    greedy = expected(model, ids, 0, 0, 12, temperature=0.0)
    for r in range(2):
        tokens = want[r][: want[r].index(config.eos_id) + 1] if config.eos_id in want[r] else want[r]
        lp = got[r]["logprobs"]
        assert lp["tokens"] == [enc.decode([t]) for t in tokens]
        assert got[r]["text"] == enc.decode([t for t in tokens if t != config.eos_id])
        assert bits(lp["token_logprobs"]) == bits(
            prompt_logprobs(params, config, [ids + tokens]).logprobs[0][len(ids) :]
        )
    assert got[0]["text"] != greedy.text  # the search found what greedy decoding does not
    assert resp.usage.completion_tokens == sum(len(got[r]["logprobs"]["tokens"]) for r in range(2))


def test_stop_strings_cut_the_text(server, model):
    enc = model[2]
    client = server.client()
    ids = enc.encode("ROMEO:")
    full = expected(model, ids, 3, 0, 16)
    assert len(full.text) > 8
    stop = full.text[3:6]  # from the middle, across tokens or inside one
    for stops in ([stop, "zzzz"], stop):
        exp = expected(model, ids, 3, 0, 16, stop=stops)
        assert exp.finish_reason == "stop" and exp.text == full.text[: full.text.find(stop)]
        kw = dict(model=MODEL, prompt="ROMEO:", max_tokens=16, seed=3, stop=stops, logprobs=0)
        assert_matches(plain(client.completions.create(**kw))[0], exp, enc)
        streamed = joined(client.completions.create(stream=True, **kw))[0]
        assert_matches(streamed, exp, enc)


def test_seeds_replay(server, model):
    client = server.client()
    kw = dict(model=MODEL, prompt="O", max_tokens=16, logprobs=0)
    a, b = (plain(client.completions.create(seed=1234, **kw))[0] for _ in range(2))
    assert a["text"] == b["text"] and bits(a["logprobs"]["token_logprobs"]) == bits(b["logprobs"]["token_logprobs"])
    raw = client.completions.with_raw_response.create(**kw)
    drawn = raw.parse()
    seed = drawn.model_extra["seed"]
    assert isinstance(seed, int) and raw.headers["x-seed"] == str(seed)
    again = plain(client.completions.create(seed=seed, **kw))[0]
    assert again["text"] == plain(drawn)[0]["text"]
    assert bits(again["logprobs"]["token_logprobs"]) == bits(plain(drawn)[0]["logprobs"]["token_logprobs"])
    assert_matches(again, expected(model, model[2].encode("O"), seed, 0, 16), model[2])


def test_one_seed_one_text_from_the_cli_and_the_server(server, model, capsys):
    """`gpt2-jax generate --seed 7` and a request with seed 7 and the same settings give the same text: both
    default to float32 on a CPU, whatever the bundled model stores (bfloat16)."""
    from gpt2_jax.cli import main

    prompt, settings = "JULIET:", dict(max_tokens=16, seed=7, temperature=0.9)
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "16", "--seed", "7", "--temperature", "0.9",
                 "--no-compile-cache"]) == 0  # fmt: skip
    cli_text = capsys.readouterr().out
    served = plain(server.client().completions.create(model=MODEL, prompt=prompt, **settings))[0]["text"]
    assert cli_text == prompt + served + "\n"
    assert served == expected(model, model[2].encode(prompt), 7, 0, 16, temperature=0.9).text


def test_echo_and_prompt_logprobs(server, model):
    enc = model[2]
    client = server.client()
    first = plain(client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=6, seed=2, logprobs=1))[0]
    ids = enc.encode("KING HENRY:")
    resp = plain(client.completions.create(model=MODEL, prompt="KING HENRY:", max_tokens=6, seed=2, logprobs=1,
                                           echo=True))[0]  # fmt: skip
    assert resp["text"] == "KING HENRY:" + first["text"]
    lp = resp["logprobs"]
    assert lp["tokens"] == [enc.decode([t]) for t in ids] + first["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert bits(lp["token_logprobs"][len(ids) :]) == bits(first["logprobs"]["token_logprobs"])
    # scoring the generated text (max_tokens 0, lm-eval's loglikelihood request) gives the logprobs generate
    # reported for those tokens, bit for bit: one forward pass, the decode step's arithmetic
    full = ids + expected(model, ids, 2, 0, 6).tokens
    scored = plain(client.completions.create(model=MODEL, prompt=full, max_tokens=0, echo=True, logprobs=1))[0]
    assert scored["finish_reason"] == "length" and scored["text"] == enc.decode(full)
    assert bits(scored["logprobs"]["token_logprobs"][len(ids) :]) == bits(first["logprobs"]["token_logprobs"])
    assert scored["logprobs"]["top_logprobs"][len(ids) :] == first["logprobs"]["top_logprobs"]


def test_constrained_output(server, model):
    client = server.client()
    got = client.completions.create(model=MODEL, prompt="Age:", max_tokens=8, seed=1,
                                    extra_body={"regex": " [0-9]{1,3}"})  # fmt: skip
    assert re.fullmatch(r" [0-9]{1,3}", got.choices[0].text) and got.choices[0].finish_reason == "stop"
    got = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, seed=2, n=2,
                                    extra_body={"choice": [" aye", " nay"]})  # fmt: skip
    assert all(c.text in (" aye", " nay") and c.finish_reason == "stop" for c in got.choices)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "who": {"enum": ["ROMEO", "JULIET"]}},
              "required": ["ok", "who"]}  # fmt: skip
    got = client.completions.create(model=MODEL, prompt="{", max_tokens=40, seed=3, extra_body={"json_schema": schema})
    value = json.loads(got.choices[0].text)
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(value["ok"], bool) and value["who"] in ("ROMEO", "JULIET")


# ---- concurrency ----------------------------------------------------------------------------------------------
SPECS = [
    dict(prompt="ROMEO:", max_tokens=16, seed=1, temperature=0.8, extra_body={"top_k": 40}),
    dict(prompt="JULIET: O Romeo, Romeo", max_tokens=12, seed=2, top_p=0.9, logprobs=3),
    dict(prompt="To be", max_tokens=16, seed=3, temperature=0, stop=["\n"]),
    dict(prompt=[464, 257, 1110], max_tokens=10, seed=4, frequency_penalty=0.5, presence_penalty=0.3,
         extra_body={"min_p": 0.05}),
    dict(prompt="HAMLET:\n", max_tokens=14, seed=5, logit_bias={"13": 5}, extra_body={"repetition_penalty": 1.3,
                                                                                      "min_tokens": 5}),
    dict(prompt="KING HENRY:", max_tokens=16, seed=6, n=2, stream=True, logprobs=2),
    dict(prompt="Age:", max_tokens=8, seed=7, extra_body={"regex": " [0-9]{1,3}"}),
    dict(prompt="O", max_tokens=40, seed=8, temperature=1.2, stream=True),
]  # fmt: skip


def run_spec(client, spec):
    resp = client.completions.create(model=MODEL, **spec)
    return joined(resp) if spec.get("stream") else plain(resp)


def same(a, b):
    assert sorted(a) == sorted(b)
    for i in a:
        assert (a[i]["text"], a[i]["finish_reason"]) == (b[i]["text"], b[i]["finish_reason"])
        if a[i]["logprobs"] is not None:
            assert a[i]["logprobs"]["tokens"] == b[i]["logprobs"]["tokens"]
            assert bits(a[i]["logprobs"]["token_logprobs"]) == bits(b[i]["logprobs"]["token_logprobs"])
            assert a[i]["logprobs"]["top_logprobs"] == b[i]["logprobs"]["top_logprobs"]


def test_concurrent_requests_equal_the_same_requests_alone(server, model):
    client = server.client()
    rng = np.random.default_rng(0)
    delays = rng.uniform(0, 0.6, len(SPECS) + 1)
    results, errors = {}, {}

    def send(k):
        time.sleep(delays[k])
        try:
            if k == len(SPECS):  # a bad request among them fails alone
                client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "("})
            else:
                results[k] = run_spec(client, SPECS[k])
        except Exception as e:
            errors[k] = e

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(SPECS) + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    bad = errors.pop(len(SPECS), None)
    assert isinstance(bad, openai.BadRequestError) and bad.status_code == 400 and "regex" in str(bad)
    assert not errors, errors
    for k, spec in enumerate(SPECS):
        same(results[k], run_spec(client, spec))
    assert "\n" not in results[2][0]["text"]
    assert results[0][0]["text"] == expected(model, model[2].encode("ROMEO:"), 1, 0, 16, temperature=0.8, top_k=40).text


# ---- errors -------------------------------------------------------------------------------------------------
def test_speculative_rounds_keep_the_bits_and_a_request_opts_out(server, model):
    """With its speculative programs built, a repetitive greedy prompt's proposals are checked and kept (the
    /metrics counters move), and its tokens and logprobs are still generate's; "speculative": false runs plain
    steps (no proposal counted) with the same bits."""
    enc = model[2]
    deadline = time.time() + 600
    while server.metrics()["gpt2_jax_compiling_programs"] and time.time() < deadline:
        time.sleep(0.5)
    prompt = "ROMEO: the sun, the sun, the sun, the sun, the sun, the sun, the sun"
    exp = expected(model, enc.encode(prompt), 3, 0, 16, temperature=0.0)
    for speculative in (True, False):
        before = server.metrics()
        resp = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=3, temperature=0.0,
                                                  logprobs=TOP, extra_body={"speculative": speculative})  # fmt: skip
        assert_matches(plain(resp)[0], exp, enc, top=TOP)
        after = server.metrics()
        moved = {k: after[k] - before[k] for k in ("gpt2_jax_speculative_proposed_tokens_total",
                                                  "gpt2_jax_speculative_accepted_tokens_total")}  # fmt: skip
        if speculative:
            assert (
                0
                < moved["gpt2_jax_speculative_accepted_tokens_total"]
                <= moved["gpt2_jax_speculative_proposed_tokens_total"]
            )
        else:
            assert moved == {
                "gpt2_jax_speculative_proposed_tokens_total": 0,
                "gpt2_jax_speculative_accepted_tokens_total": 0,
            }


def test_errors_are_openai_shaped_with_their_status(server):
    client = server.client()

    def bad(param, **kw):
        kw = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == 400
        body = e.value.body
        assert set(body) >= {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
        assert body["param"] == param, body
        return body["message"]

    assert "temperature" in bad("temperature", temperature=-0.5)
    assert "top_p" in bad("top_p", top_p=0.0)
    assert "top_p" in bad("top_p", top_p=1.5)
    assert "logprobs" in bad("logprobs", logprobs=21)
    assert "frequency_penalty" in bad("frequency_penalty", frequency_penalty=3.0)
    assert "unknown field 'foo'" in bad("foo", extra_body={"foo": 1})
    assert bad("top_k", extra_body={"top_k": "40"})  # mistyped
    assert bad("n", n=0)
    assert "50257" in bad("prompt", prompt=[1, 50257])
    assert "max_seq=128" in bad("max_tokens", prompt=[1] * 120, max_tokens=16)
    assert "max_seq=128" in bad("max_tokens", prompt=[1] * 130, max_tokens=1)
    assert "regex" in bad("regex", extra_body={"regex": "("})
    assert bad("logit_bias", logit_bias={"the": 1})
    assert bad("stop", stop=[""])
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    status, body = server.post("/v1/completions", b'{"model": "shakespeare", "prompt": ')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = server.post("/v1/completions", b'["not an object"]')
    assert status == 400 and "error" in body
    assert plain(client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, seed=1))[0]["text"]


def test_chat_without_a_template_is_a_400_naming_the_flag(server):
    """The bundled model has no tokenizer_config.json chat_template and this server no --chat-template."""
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert "--chat-template" in e.value.body["message"] and e.value.body["code"] == "no_chat_template"
    assert server.logged(r"no chat template: /v1/chat/completions answers 400"), server.log()


def test_a_huge_or_bad_constraint_is_a_400_naming_the_limit(server):
    """a{100000} would take outlines-core minutes (and, in the server's process, hold the GIL all that time):
    its size is estimated first, and the 400 names the limit."""
    client = server.client()
    t = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "a{100000}"})
    seconds = time.perf_counter() - t
    body = e.value.body
    assert body["param"] == "regex" and "over the limit of 4096 states" in body["message"], body
    print(f"a{{100000}} refused in {seconds * 1e3:.0f} ms")
    with pytest.raises(openai.BadRequestError) as e:  # a pattern outlines-core rejects, from the child process
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "(?<=a)b"})
    assert e.value.body["param"] == "regex" and "outlines-core" in e.value.body["message"]
    ok = plain(client.completions.create(model=MODEL, prompt="Age:", max_tokens=6, seed=3,
                                         extra_body={"regex": " [0-9]{1,3}"}))[0]  # fmt: skip
    assert re.fullmatch(r" [0-9]{1,3}", ok["text"]), ok


def test_tokenize_and_detokenize_are_the_tokenizer(server, model):
    enc = model[2]
    text = "ROMEO: But soft! What light through yonder window breaks?<|endoftext|> naïve 🤖"
    status, body = server.post("/tokenize", json.dumps({"prompt": text, "model": MODEL}).encode())
    ids = enc.encode(text, allowed_special={"<|endoftext|>"})
    assert status == 200 and body == {"count": len(ids), "max_model_len": 128, "tokens": ids}
    status, body = server.post("/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and body == {"prompt": text}
    status, body = server.post("/detokenize", json.dumps({"tokens": [1, 50257]}).encode())
    assert status == 400 and body["error"]["param"] == "tokens" and "50257" in body["error"]["message"]
    status, body = server.post("/tokenize", json.dumps({"prompt": "x", "model": "gpt-4"}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = server.post("/tokenize", json.dumps({"text": "x"}).encode())
    assert status == 400 and body["error"]["param"] in ("prompt", "text"), body  # OpenAI's shape, not a 422


def test_the_openapi_document_describes_what_the_server_answers(server):
    """Every reference resolves inside the document, every error status the API answers is documented with
    its body, /metrics is text, 405s say which methods are allowed."""
    doc = json.loads(server.get("/openapi.json")[2])
    text = json.dumps(doc)
    assert "#/$defs/" not in text
    for ref in set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', text)):
        assert ref in doc["components"]["schemas"], ref
    op = doc["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "404", "429", "503"} <= set(op["responses"]) and "422" not in op["responses"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert "stream_options" in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatRequest")
    assert {"400", "401", "404", "429", "503"} <= set(chat["responses"]) and "422" not in chat["responses"]
    for body in ("CompletionRequest", "ChatRequest"):  # vLLM's extras, documented on both
        assert {"ignore_eos", "stop_token_ids", "skip_special_tokens", "max_completion_tokens"} <= set(
            doc["components"]["schemas"][body]["properties"])  # fmt: skip
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    req = urllib.request.Request(server.url + "/health", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405 and e.value.headers["allow"] == "GET"
    assert json.loads(e.value.read())["error"]["code"] == "method_not_allowed"


def test_health_lists_what_is_still_compiling(server):
    status, _, body = server.get("/health")
    health = json.loads(body)
    assert status == 200 and isinstance(health["compiling"], list)
    assert server.logged(r"ready after [\d.]+ s of compiling; \d+ programs compiling in the background"), server.log()
    assert server.logged(r"compiled prefill 32 in [\d.]+ s", timeout=300), server.log()  # the background built it
    assert "gpt2_jax_compiling_programs" in server.get("/metrics")[2]


def test_a_full_queue_is_429_and_others_are_unaffected(server):
    client = server.client()
    first = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=120, stream=True, n=4,
                                      logit_bias=NO_EOS)  # fmt: skip
    next(iter(first))  # 4 slots busy
    queued = client.completions.create(model=MODEL, prompt="JULIET:", max_tokens=4, stream=True, n=8, seed=4)
    with pytest.raises(openai.RateLimitError) as e:  # 8 queued: the queue is full
        client.completions.create(model=MODEL, prompt="O", max_tokens=2)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
    first.close()
    got = joined(queued)
    assert sorted(got) == list(range(8)) and all(c["finish_reason"] for c in got.values())
    alone = plain(client.completions.create(model=MODEL, prompt="JULIET:", max_tokens=4, n=8, seed=4))
    assert [got[i]["text"] for i in range(8)] == [alone[i]["text"] for i in range(8)]


def test_a_dropped_stream_frees_its_slot(server, model):
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=120, stream=True, n=4,
                                       logit_bias=NO_EOS)  # fmt: skip
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while server.metrics()["gpt2_jax_active_slots"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()["gpt2_jax_active_slots"] == 0
    resp = plain(client.completions.create(model=MODEL, prompt="To be", max_tokens=10, seed=21, logprobs=0))
    assert_matches(resp[0], expected(model, model[2].encode("To be"), 21, 0, 10), model[2])
    assert server.logged(r"\(client went away\)"), server.log()


# ---- shutdown (last: it stops the module's server) -------------------------------------------------------------
def test_sigterm_drains_the_requests_in_flight_then_exits_0_with_the_port_free(server, model):
    """SIGTERM: new requests get 503 (OpenAI's error shape), a short stream in flight finishes as it would have, a
    long one still running at --shutdown-timeout ends with finish_reason "abort", and the process exits 0."""
    server.stop()  # the module's server; this test's own has a short drain deadline and room for 250 tokens
    drained = Server(server.cache_dir, ["--max-batch", "2", "--max-seq", "256", "--shutdown-timeout", "0.5"])
    drained.start()
    try:
        drained.wait()
        while json.loads(drained.get("/health")[2])["compiling"]:  # both streams then start at once
            time.sleep(0.2)
        client = drained.client()
        short = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, stream=True, seed=5, logprobs=TOP)
        long = client.completions.create(model=MODEL, prompt="JULIET:", max_tokens=250, stream=True, logit_bias=NO_EOS)
        short_chunks, long_chunks = iter(short), iter(long)
        first = [next(short_chunks), next(long_chunks)]
        t0 = time.monotonic()
        drained.proc.send_signal(signal.SIGTERM)
        assert drained.logged("draining: 2 requests running"), drained.log()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="O", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
        got_short = joined(iter([first[0], *short_chunks]))[0]
        assert_matches(got_short, expected(model, model[2].encode("ROMEO:"), 5, 0, 8), model[2], top=TOP)
        got_long = joined(iter([first[1], *long_chunks]))[0]
        assert got_long["finish_reason"] == "abort", got_long  # 250 tokens take longer than the 0.5 s deadline
        assert drained.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert 0.5 <= took < 10, f"took {took:.1f} s to exit"
        assert drained.logged("the requests still running ended with finish_reason 'abort'") and drained.logged(
            "gpt2-jax serve: stopped"
        ), drained.log()
    finally:
        drained.stop()
    with socket.socket() as s:  # nothing listens on the port: a new server can take it (TIME_WAITs may remain)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", drained.port))
        s.listen()
