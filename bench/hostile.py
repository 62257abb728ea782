"""What each hostile or careless request costs `gpt2-jax serve`: its time to an answer, the server's peak RSS,
the largest token gap it causes in 4 running streams, and the slowest /health while it runs.

    python bench/hostile.py [--src TREE] [--model PATH] [--rss-cap-gb 4]

--src runs the server from another checkout (PYTHONPATH=TREE), so the same attacks measure the code before a
change. Sizes are bounded so that even a server without limits cannot exhaust the machine: bodies of 10-20 MB
(the issue's 50 MB ones peaked at 7.6 GB), and a server whose RSS passes --rss-cap-gb is killed ("killed at").
The server runs the bundled model with --max-batch 8 --max-seq 256 --constraint-timeout 10 (bench/stalls.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from machine import describe
from stalls import gaps_between, start, stop, stream

STREAMS = ["ROMEO:", "JULIET:", "HAMLET:", "MACBETH:"]
WIDE_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(500)}}


def rss_gb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def post(url: str, path: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict | None, float]:
    if isinstance(body, bytes):
        return post_raw(url, path, body, timeout)
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"content-type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), time.perf_counter() - t
    except OSError:  # refused mid-body (a 413 before the body is read), or the server killed
        return 0, None, time.perf_counter() - t


def post_raw(url: str, path: str, data: bytes, timeout: float) -> tuple[int, dict | None, float]:
    """A big body on a plain socket, so that an answer sent before the body is all read still comes back."""
    port, t = int(url.rsplit(":", 1)[1]), time.perf_counter()
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head.encode() + b"connection: close\r\n\r\n")
            for i in range(0, len(data), 1 << 20):
                s.sendall(data[i : i + (1 << 20)])
        except OSError:
            pass
        reply = b""
        try:
            while chunk := s.recv(1 << 16):
                reply += chunk
        except OSError:
            pass
    head_, _, body = reply.partition(b"\r\n\r\n")
    try:
        return int(head_.split()[1]), json.loads(body), time.perf_counter() - t
    except (IndexError, ValueError):
        return 0, None, time.perf_counter() - t


class Watch:
    """While an attack runs: 4 streams (restarted as they end), /health polled, the server's RSS sampled (and
    the server killed above the cap)."""

    def __init__(self, proc, url: str, cap_gb: float):
        self.proc, self.url, self.cap = proc, url, cap_gb
        self.stop, self.killed, self.peak, self.health = threading.Event(), None, 0.0, 0.0
        self.stamps: list[list[float]] = []
        self.threads = [threading.Thread(target=self._stream, args=(p, i), daemon=True) for i, p in enumerate(STREAMS)]
        self.threads += [threading.Thread(target=f, daemon=True) for f in (self._rss, self._health)]

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        time.sleep(1.0)  # the streams are flowing
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *_) -> None:
        self.t1 = time.perf_counter()
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _stream(self, prompt: str, seed: int) -> None:
        while not self.stop.is_set() and self.killed is None:
            stamps: list[float] = []
            self.stamps.append(stamps)
            try:
                stream(self.url, prompt, seed, stamps)
            except Exception:
                time.sleep(0.2)

    def _rss(self) -> None:
        while not self.stop.is_set():
            gb = rss_gb(self.proc.pid)
            self.peak = max(self.peak, gb)
            if gb > self.cap and self.killed is None:
                self.killed = gb
                self.proc.kill()
            time.sleep(0.05)

    def _health(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                urllib.request.urlopen(self.url + "/health", timeout=60).read()
            except Exception:
                pass
            self.health = max(self.health, time.perf_counter() - t)
            time.sleep(0.2)

    def gap(self) -> float:
        return max(gaps_between(self.stamps, self.t0, self.t1), default=0.0)


def at_once(fn, k: int) -> list:
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(fn())) for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def slowloris(url: str, conns: int = 200, seconds: float = 30.0) -> tuple[int, None, float]:
    """conns connections each sending a header byte every 2 s for `seconds`: how many are still open at the end."""
    port, t = int(url.rsplit(":", 1)[1]), time.perf_counter()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(conns)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\n")
    while time.perf_counter() - t < seconds:
        for s in socks:
            try:
                s.sendall(b"x")
            except OSError:
                pass
        time.sleep(2)
    open_ = 0
    for s in socks:
        try:
            s.sendall(b"x")
            s.setblocking(False)
            open_ += s.recv(1) != b""
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
        s.close()
    return open_, None, time.perf_counter() - t


def attacks(url: str) -> list:
    """(name, fn -> (status or count, body, seconds))."""
    c = {"model": "shakespeare", "max_tokens": 4}
    big = json.dumps({**c, "prompt": "hello world " * ((20 << 20) // 12)}).encode()
    ten = json.dumps({**c, "prompt": "hello world " * ((10 << 20) // 12)}).encode()
    tok = json.dumps({"prompt": "hello world " * ((10 << 20) // 12)}).encode()

    def cheap_behind(slow, cheap, k, warm=False):
        """cheap()'s answer and time while k slow() run (the first slow one's answer noted); warm: cheap() once
        first, so that its time is not a program compiling."""
        if warm:
            cheap()
        slow_out: list = []
        threads = [threading.Thread(target=lambda: slow_out.append(slow())) for _ in range(k)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        status, body, seconds = cheap()
        for t in threads:
            t.join(300)
        return status, body, seconds, outcome(slow_out[0]) if slow_out else "?"

    def beams(k, max_tokens):
        return {**c, "prompt": "ROMEO:", "max_tokens": max_tokens, "use_beam_search": True, "best_of": k,
                "logit_bias": {"50256": -100}}  # fmt: skip

    return [
        ("20 MB prompt", lambda: post(url, "/v1/completions", big)),
        ("six 10 MB prompts at once", lambda: max(at_once(lambda: post(url, "/v1/completions", ten), 6), key=lambda r: r[2])),
        ("10 MB /tokenize", lambda: post(url, "/tokenize", tok)),
        ("10,000 prompts (param)", lambda: post(url, "/v1/completions", {**c, "prompt": ["a"] * 10000})),
        ("beam best_of 96 (param)", lambda: post(url, "/v1/completions", {**c, "prompt": "a", "use_beam_search": True, "best_of": 96})),
        ("regex [A-Z]+ behind 3 wide schemas", lambda: cheap_behind(
            lambda: post(url, "/v1/completions", {**c, "prompt": "x", "json_schema": WIDE_SCHEMA}),
            lambda: post(url, "/v1/completions", {**c, "prompt": "x", "regex": "[A-Z]+"}), 3)),
        ("2 beams behind 64 beams x 200 tokens", lambda: cheap_behind(
            lambda: post(url, "/v1/completions", beams(64, 200)), lambda: post(url, "/v1/completions", beams(2, 4)), 1,
            warm=True)),
        ("2 beams behind 8 beams x 200 tokens", lambda: cheap_behind(
            lambda: post(url, "/v1/completions", beams(8, 200)), lambda: post(url, "/v1/completions", beams(2, 4)), 1,
            warm=True)),
        ("200 slowloris connections, 30 s", lambda: slowloris(url)),
    ]  # fmt: skip


def outcome(result: tuple) -> str:
    status, body = result[:2]
    if body is None:
        return str(status)
    err = body.get("error") if isinstance(body, dict) else None
    return f"{status} param={err['param']}" if err else str(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=None, help="run the server from this checkout (default: the installed gpt2_jax)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rss-cap-gb", type=float, default=4.0)
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp

    describe(jax, jnp, len(os.sched_getaffinity(0)))
    if args.src:  # `python -m` puts the working directory first on sys.path: run the server from there
        os.environ["PYTHONPATH"] = os.path.abspath(args.src)
        os.chdir(args.src)
    cache, proc = tempfile.mkdtemp(prefix="gpt2-jax-cache-"), None
    print(f"server from {args.src or 'the installed gpt2_jax'}")
    print("| attack | answer | time s | peak RSS GB | RSS after GB | largest stream gap s | slowest /health s |")
    print("|---|---|---|---|---|---|---|")
    names = [name for name, _ in attacks("http://127.0.0.1:1")]
    for i, name in enumerate(names):
        if proc is None or proc.poll() is not None:
            port: list = []
            proc, _, _ = start(cache, args.model, port, ["--constraint-timeout", "10"])
            url = f"http://127.0.0.1:{port[0]}"
        with Watch(proc, url, args.rss_cap_gb) as w:
            result = attacks(url)[i][1]()
        time.sleep(1.0)
        after = rss_gb(proc.pid) if proc.poll() is None else 0.0
        answer = f"killed at {w.killed:.1f} GB" if w.killed else outcome(result)
        if name.startswith("200 slowloris"):
            answer = f"{result[0]} still open"
        elif len(result) > 3:
            answer += f" (behind: {result[3]})"
        print(f"| {name} | {answer} | {result[2]:.1f} | {w.peak:.2f} | {after:.2f} | {w.gap():.2f} | {w.health:.2f} |",
              flush=True)  # fmt: skip
    stop(proc)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
