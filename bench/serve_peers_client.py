"""bench/serve_peers.py's client: streamed /v1/completions over http.client, one thread per concurrent stream,
every token's arrival time recorded. Imported from beside it.

Each server says how many tokens a chunk carries in its own way: gpt2_jax with `logprobs: 0` sends a chunk per
token (its text may be empty while a UTF-8 character is incomplete) whose token_logprobs has one entry per
token (its engine computes the logprobs anyway); llama-server holds a token back while its text ends in an
incomplete UTF-8 character and sends it with the next one, and with `timings_per_token` every chunk carries
timings.predicted_n, the tokens generated so far. A chunk of k tokens gives each of them its arrival time, so
the inter-token gaps are one wait and k - 1 zeros: what a reader of the stream sees.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

EOS = 50256


@dataclass
class Result:
    """One request: when it was sent, each token's arrival (perf_counter seconds), or what went wrong."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None


def body(engine: str, model: str, prompt: list[int], tokens: int, stream: bool, eos_field: str) -> dict:
    """The request: greedy, `tokens` new tokens with EOS forbidden, per-chunk token counts asked for."""
    out = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": stream}
    if engine == "llama-server":
        return out | {"ignore_eos": True, "timings_per_token": True, "cache_prompt": True}
    # gpt2_jax: `ignore_eos` once the server has it, else a -100 logit bias on EOS (the same rule llama-server's
    # ignore_eos applies: its end-of-generation tokens get a -inf bias)
    force = {"ignore_eos": True} if eos_field == "ignore_eos" else {"logit_bias": {str(EOS): -100}}
    return out | force | {"logprobs": 0}


def _chunk_tokens(engine: str, event: dict, seen: int) -> int:
    """The number of tokens this chunk's event carries (seen: tokens counted so far)."""
    if engine == "llama-server":
        return max(0, event.get("timings", {}).get("predicted_n", seen) - seen)
    lp = (event.get("choices") or [{}])[0].get("logprobs")
    return len(lp["token_logprobs"]) if lp else 0


class Client:
    """Requests to one server at `url`; `engine` picks how chunks are counted."""

    def __init__(self, engine: str, url: str, model: str, eos_field: str = "logit_bias", timeout: float = 600):
        self.engine, self.model, self.eos_field, self.timeout = engine, model, eos_field, timeout
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def post(self, conn: http.client.HTTPConnection, path: str, payload: dict) -> http.client.HTTPResponse:
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        return conn.getresponse()

    def complete(self, conn: http.client.HTTPConnection, prompt: list[int], tokens: int) -> dict:
        """One non-streamed greedy completion -> its JSON (raises on an HTTP error)."""
        payload = body(self.engine, self.model, prompt, tokens, False, self.eos_field)
        if self.engine == "llama-server":  # its generated ids, under "__verbose"
            payload |= {"return_tokens": True, "verbose": True}
        resp = self.post(conn, "/v1/completions", payload)
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{self.engine}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)

    def stream(self, conn: http.client.HTTPConnection, prompt: list[int], tokens: int) -> Result:
        """One streamed completion, every token's arrival time recorded."""
        r = Result(sent=time.perf_counter())
        resp = self.post(conn, "/v1/completions", body(self.engine, self.model, prompt, tokens, True, self.eos_field))
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return r
        while line := resp.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now, event = time.perf_counter(), json.loads(line[6:])
            if "error" in event:
                r.error = f"stream error: {event['error']}"
                break
            r.arrivals += [now] * _chunk_tokens(self.engine, event, len(r.arrivals))
        resp.read()  # the rest of the chunked body, so the connection can be reused
        if r.error is None and len(r.arrivals) != tokens:
            r.error = f"{len(r.arrivals)} tokens streamed, {tokens} asked for"
        return r


def run_threads(target, n: int) -> None:
    """n daemon threads of target, joined in short waits: the kernel may hand a signal to any thread, and Python
    runs its handler only when the main thread next runs, so a plain join would hold Ctrl-C (and with it the
    servers' shutdown) until the whole level ends."""
    threads = [threading.Thread(target=target, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random token ids (EOS excluded), the same for every engine."""
    return np.random.default_rng(seed).integers(0, EOS, (n, length)).tolist()


def run_level(client: Client, reqs: list[list[int]], concurrency: int, tokens: int) -> tuple[list[Result], float]:
    """`concurrency` threads, each sending its next request as soon as its last finished, until `reqs` are
    done -> (results in request order, wall seconds from the first send to the last token)."""
    results: list[Result | None] = [None] * len(reqs)
    order, lock = iter(range(len(reqs))), threading.Lock()

    def stream_loop() -> None:
        # A fresh connection per request: llama-server closes a streamed response's connection, and a reused
        # one then fails the next request (RemoteDisconnected); a loopback connect costs both servers alike.
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            conn = client.connect()
            try:
                results[i] = client.stream(conn, reqs[i], tokens)
            except (OSError, http.client.HTTPException, ValueError) as e:
                results[i] = Result(sent=time.perf_counter(), error=f"{type(e).__name__}: {e}")
            finally:
                conn.close()

    t0 = time.perf_counter()
    run_threads(stream_loop, concurrency)
    done = [r for r in results if r is not None]
    end = max((r.arrivals[-1] for r in done if r.arrivals), default=time.perf_counter())
    return done, end - t0


def summary(results: list[Result], seconds: float) -> dict:
    """Output tokens/s, TTFT and inter-token gaps (ms, p50 and p99), tokens per chunk, errors."""
    ok = [r for r in results if r.error is None and r.arrivals]
    ttft = [(r.arrivals[0] - r.sent) * 1e3 for r in ok]
    itl = np.concatenate([np.diff(r.arrivals) * 1e3 for r in ok]) if ok else np.array([])
    tokens = sum(len(r.arrivals) for r in results)
    chunks = sum(len(set(r.arrivals)) for r in ok)

    def pct(xs, p: float) -> float:
        return float(np.percentile(xs, p)) if len(xs) else float("nan")

    errors = [r.error for r in results if r.error is not None]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "tokens_per_chunk": sum(len(r.arrivals) for r in ok) / max(chunks, 1)}  # fmt: skip


def distinct_greedy(client: Client, prompt: list[int], tokens: int, n: int = 16, concurrency: int = 8) -> int:
    """How many distinct completions `n` identical greedy requests get at `concurrency`: llama-server's by its
    token ids; gpt2_jax's API returns no ids, so by its per-token strings and text."""
    out: list[tuple | None] = [None] * n
    todo, lock = iter(range(n)), threading.Lock()

    def worker() -> None:
        conn = client.connect()
        try:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                choice = client.complete(conn, prompt, tokens)
                if client.engine == "llama-server":
                    out[i] = tuple(choice["__verbose"]["tokens"])
                else:
                    c = choice["choices"][0]
                    out[i] = (c["text"], tuple(c["logprobs"]["tokens"]))
        finally:
            conn.close()

    run_threads(worker, concurrency)
    if any(o is None for o in out):
        raise RuntimeError(f"{client.engine}: a distinct-greedy request failed (see above)")
    return len(set(out))
