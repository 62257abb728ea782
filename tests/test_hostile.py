"""gpt2-jax serve against hostile and careless clients, over real HTTP on 127.0.0.1: each bad request gets its
status in OpenAI's error shape naming the right param, costs bounded time and memory, and a cheap request of
the same kind beside it (a /health, a new regex, a 2-beam search) is answered within seconds.

One server (bundled model, 4 slots, max_seq 128, so a body limit of 1 MiB) serves the module; every attack is
bounded in count, size and time.
"""

import argparse
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.servers import Server

IDLE = 2.0  # the server's --idle-timeout
ARGS = ["--max-batch", "4", "--max-queue", "8", "--max-seq", "128", "--idle-timeout", str(IDLE),
        "--max-beam-tokens", "8192", "--constraint-timeout", "60"]  # fmt: skip
LIMIT = 1 << 20  # the body limit the server derives from max_seq 128 (at least 1 MiB)
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}  # megabytes of regex


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("jax-cache"), ARGS)
    s.start()
    s.wait()
    yield s
    s.stop()


def rss_mb(server) -> float:
    for line in open(f"/proc/{server.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def call(server, path, body, timeout=30):
    """POST a JSON body -> (status, parsed answer, seconds)."""
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.perf_counter() - t


def completion(**kw):
    return {"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 4, **kw}


def assert_error(status, body, want_status, param, *words):
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param, body
    for w in words:
        assert w in body["error"]["message"], body


def raw(server, head: bytes, chunks=(), pause=0.0, timeout=10.0) -> bytes:
    """Send `head` then each chunk (with `pause` between), on one socket; what comes back until it closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        try:
            s.sendall(head)
            for c in chunks:
                time.sleep(pause)
                s.sendall(c)
        except (BrokenPipeError, ConnectionResetError):  # refused mid-body: the answer is already there
            pass
        out = b""
        try:
            while data := s.recv(65536):
                out += data
        except (ConnectionResetError, TimeoutError):
            pass
        return out


def answer(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def beside(slow, cheap, delay=0.3):
    """Run slow() in a thread, then cheap() `delay` s later -> (cheap's result, slow's result)."""
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("slow", slow()))
    t.start()
    time.sleep(delay)
    out = cheap()
    t.join(120)
    return out, got.get("slow")


# ---- bodies and prompts ----------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read_and_health_stays_fast(server):
    before = rss_mb(server)
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (20 << 20))  # fmt: skip
    chunk = b"x" * (1 << 20)
    health, (reply, seconds) = beside(
        lambda: timed(raw, server, head, [chunk] * 20), lambda: timed(server.get, "/health")
    )
    assert_error(*answer(reply), 413, None, "--max-body-bytes", str(LIMIT))
    assert seconds < 5
    chunked = (
        b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    reply = raw(server, chunked, [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 12)  # no Content-Length: counted as it comes
    assert_error(*answer(reply), 413, None, "--max-body-bytes")
    assert health[0][0] == 200 and health[1] < 2
    assert rss_mb(server) - before < 200


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing(server):
    text = "The quick brown fox. " * 45000  # 945,000 characters: under the body limit, far over 128 x 128
    status, body, seconds = call(server, "/v1/completions", completion(prompt=text))
    assert_error(status, body, 400, "prompt", "945000 characters", "max_seq=128")
    assert body["error"]["code"] == "context_length_exceeded" and seconds < 2


def test_big_tokenize_calls_at_once_keep_health_fast_and_memory_bounded(server):
    before = rss_mb(server)
    text = "hello world " * 80000  # 960,000 characters each
    results = []
    threads = [threading.Thread(target=lambda: results.append(call(server, "/tokenize", {"prompt": text})[0]))
               for _ in range(6)]  # fmt: skip
    for t in threads:
        t.start()
    worst = max(timed(server.get, "/health")[1] for _ in range(10))
    for t in threads:
        t.join(60)
    assert results == [200] * 6
    assert worst < 1.5
    assert rss_mb(server) - before < 400


# ---- errors name the right param ------------------------------------------------------------------------------
def test_too_many_prompts_or_beams_name_their_param(server):
    status, body, seconds = call(server, "/v1/completions", completion(prompt=["a"] * 10000))
    assert_error(status, body, 400, "prompt", "10000 prompt(s)", "capacity of 12")
    assert seconds < 2
    status, body, _ = call(server, "/v1/completions", completion(prompt="a", n=2, best_of=13))
    assert_error(status, body, 400, "best_of", "best_of=13")
    status, body, _ = call(server, "/v1/completions", completion(use_beam_search=True, best_of=96))
    assert_error(status, body, 400, "best_of", "best_of=96", "at most 64")
    status, body, _ = call(
        server,
        "/v1/completions",
        completion(prompt=["ROMEO:", "JULIET:"], use_beam_search=True, best_of=64, max_tokens=100),
    )
    assert_error(status, body, 400, "best_of", "--max-beam-tokens", "8192")


# ---- a cheap request beside an expensive one of its kind --------------------------------------------------------
def test_a_cheap_constraint_is_answered_while_expensive_ones_compile(server):
    wide = [threading.Thread(target=lambda: call(server, "/v1/completions", completion(json_schema=WIDE_SCHEMA)))
            for _ in range(3)]  # fmt: skip
    for t in wide:
        t.start()
    time.sleep(0.3)
    status, body, seconds = call(server, "/v1/completions", completion(regex="[A-Z]+"))
    assert status == 200 and seconds < 10, (status, seconds)
    for t in wide:
        t.join(60)
    status, body, seconds = call(server, "/v1/completions", completion(json_schema=WIDE_SCHEMA))
    assert_error(status, body, 400, "json_schema", "too large")
    assert seconds < 2
    # an allowed but slow schema takes one compiler worker; a new regex takes the other
    slow = lambda: call(server, "/v1/completions", completion(json_schema={}), timeout=90)
    cheap, slow_result = beside(slow, lambda: call(server, "/v1/completions", completion(regex="[a-z]{2,4}")))
    assert cheap[0] == 200 and cheap[2] < 5, cheap
    assert slow_result[0] == 200 and slow_result[2] > cheap[2], slow_result


def test_a_small_beam_search_runs_beside_a_big_one(server):
    small = lambda: call(server, "/v1/completions", completion(use_beam_search=True, best_of=2))
    assert small()[0] == 200  # compiled before it is timed
    big = completion(use_beam_search=True, best_of=64, max_tokens=100, logit_bias={"50256": -100})
    cheap, slow = beside(lambda: call(server, "/v1/completions", big, timeout=120), small, delay=0.5)
    assert slow[0] == 200 and cheap[0] == 200
    assert cheap[2] < 3 and cheap[2] < slow[2] / 2, (cheap[2], slow[2])


# ---- connections that never finish a request ------------------------------------------------------------------
def test_slowloris_connections_are_closed_after_the_idle_timeout(server):
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\n")
        socks.append(s)
    deadline, closed = time.monotonic() + IDLE + 5, 0
    for s in socks:  # a header line a second: uvicorn's keep-alive timer would restart at each
        while time.monotonic() < deadline:
            try:
                s.sendall(b"x-a: b\r\n")
                s.settimeout(1)
                if s.recv(1) == b"":
                    closed += 1
                    break
            except TimeoutError:
                continue
            except OSError:
                closed += 1
                break
        s.close()
    assert closed == 20
    reply = raw(
        server, b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    )
    assert_error(*answer(reply), 408, None, "--idle-timeout")
    assert server.get("/health")[0] == 200


# ---- the API key without ps -------------------------------------------------------------------------------------
def test_api_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from gpt2_jax.cli.serve import api_keys

    keys = tmp_path / "keys"
    keys.write_text("k1\n\nk2\n")
    monkeypatch.setenv("GPT2_JAX_API_KEY", "from-env")
    assert api_keys(argparse.Namespace(api_key=None, api_key_file=str(keys))) == ["k1", "k2"]
    assert api_keys(argparse.Namespace(api_key=None, api_key_file=None)) == ["from-env"]
