"""Soak: thousands of mixed requests against one `gpt2-jax serve` process, then each again alone.

    python bench/soak.py [--requests 2000] [--concurrency 16] [--seed 0] [--model PATH]

The requests mix every SamplingParams the API takes (temperature, top-p/k, min-p, penalties, logit bias), constraints
of several table sizes (regex, choice, JSON schema), top logprobs, stop strings, n > 1, echo, prompts that share long
preambles (prefix-cache hits and evictions), cancellations (a client that stops waiting) and dropped streams (a
client that closes the stream after a few tokens). Pass criteria, each printed PASS or MISS (exit 1 on a MISS):

  alive     the server is still running at the end and no request got a 5xx
  bits      every answer equals the same request sent alone afterwards: text, finish reason and every token's
            logprob bit for bit (a dropped stream's tokens are the start of the answer alone)
  memory    the server's RSS after the soak is < 1.10x its RSS after the warm-up
  compiles  the server compiled no program after the warm-up (gpt2_jax_xla_compiles_total unchanged)

tests/test_soak.py runs it with --requests 200.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\nYou are "
    "all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\nFirst Citizen:\nFirst, you know Caius "
    "Marcius is chief enemy to the people.\n\nAll:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and "
    "we'll have corn at our own price. Is't a verdict?\n\n",
    "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. Arise, fair "
    "sun, and kill the envious moon, who is already sick and pale with grief, that thou her maid art far more fair "
    "than she: be not her maid, since she is envious; her vestal livery is but sick and green and none but fools do "
    "wear it; cast it off.\n\n",
]  # fmt: skip


def _preambles(n: int = 8, n_tokens: int = 160) -> list[str]:
    """n preambles of n_tokens tokens (windows into the texts): each more than one full 128-token KV block, which
    later requests share; more distinct blocks than the soak's pool keeps, so cached blocks are also evicted."""
    from gpt2_jax.tokenizer import tokenizer

    tok = tokenizer()
    ids = tok.encode("".join(_TEXTS * 2))
    return [tok.decode(ids[i * 24 : i * 24 + n_tokens]) for i in range(n)]


PREAMBLES = _preambles()
SHORT = ["ROMEO:", "JULIET:\n", "HAMLET: To be", "KING HENRY:", "O", "MACBETH:\nIs this a dagger", "Speak:"]
CONSTRAINTS = [{"regex": " [0-9]{1,3}"}, {"regex": " (yes|no|maybe)"}, {"choice": [" aye", " nay", " perchance"]},
               {"json_schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                                "required": ["name", "age"]}}]  # fmt: skip


def make_request(rng: random.Random, i: int) -> dict:
    """Request i: its body and how the client treats it ("full", "drop" after k tokens, or "cancel")."""
    prompt = rng.choice(PREAMBLES) + rng.choice(SHORT) if rng.random() < 0.5 else rng.choice(SHORT)
    body: dict = {"prompt": prompt, "max_tokens": rng.randint(1, 40), "seed": 10_000 + i}
    body["temperature"] = rng.choice([0.0, 0.7, 1.0, 1.3])
    for name, values, p in (("top_p", [0.8, 0.95], 0.3), ("top_k", [5, 40], 0.3), ("min_p", [0.05], 0.15),
                            ("presence_penalty", [0.5, 1.0], 0.2), ("frequency_penalty", [0.5], 0.2),
                            ("repetition_penalty", [1.2], 0.2), ("min_tokens", [2], 0.1),
                            ("stop", [["\n\n"], [".", "!"]], 0.3), ("logit_bias", [{"13": 3.0, "198": -2.0}], 0.1)):  # fmt: skip
        if rng.random() < p and not (name == "min_tokens" and body["max_tokens"] < 2):
            body[name] = rng.choice(values)
    if rng.random() < 0.15:
        body.update(rng.choice(CONSTRAINTS))
        body.pop("stop", None)
    body["logprobs"] = rng.choice([None, 0, 0, 1, 3, 5])
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.1 and "regex" not in body and "choice" not in body and "json_schema" not in body:
        body["echo"] = True
        body["logprobs"] = rng.choice([0, 2])
    body["stream"] = rng.random() < 0.6
    fate = rng.random()
    mode = "drop" if body["stream"] and fate < 0.08 else "cancel" if not body["stream"] and fate < 0.05 else "full"
    return {"body": body, "mode": mode, "drop_after": rng.randint(1, 4)}


def send(url: str, req: dict, timeout: float = 600) -> dict:
    """POST one request -> {status, choices: {index: {text, tokens, logprobs, finish}}} (streamed or not)."""
    body = req["body"]
    data = json.dumps({"model": "soak", **body}).encode()
    http = urllib.request.Request(url + "/v1/completions", data=data, headers={"content-type": "application/json"})
    choices: dict = {}
    try:
        with urllib.request.urlopen(http, timeout=0.3 if req["mode"] == "cancel" else timeout) as r:
            if not body["stream"]:
                return {"status": r.status, "choices": _choices(json.loads(r.read())["choices"], choices)}
            tokens = 0
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"status": 500, "error": chunk["error"]}
                _choices(chunk["choices"], choices)
                tokens += sum(len((c.get("logprobs") or {}).get("tokens", [])) or 1 for c in chunk["choices"])
                if req["mode"] == "drop" and tokens >= req["drop_after"]:
                    return {"status": 200, "choices": choices, "dropped": True}  # closes the connection
            return {"status": r.status, "choices": choices}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()}
    except TimeoutError:
        return {"status": 0, "cancelled": True}
    except OSError as e:
        return {"status": -1, "error": repr(e)}


def _choices(parts: list, into: dict) -> dict:
    for c in parts:
        d = into.setdefault(c["index"], {"text": "", "tokens": [], "logprobs": [], "finish": None})
        d["text"] += c["text"]
        lp = c.get("logprobs")
        if lp:
            d["tokens"] += lp["tokens"]
            d["logprobs"] += [
                np.float32(x).view(np.uint32).item() if x is not None else None for x in lp["token_logprobs"]
            ]
        d["finish"] = c.get("finish_reason") or d["finish"]
    return into


def same(got: dict, alone: dict, prefix: bool) -> bool:
    """A choice against the same choice of the request alone (the start of it, for a dropped stream)."""
    if not prefix:
        return got == alone
    n = len(got["tokens"])
    return got["tokens"] == alone["tokens"][:n] and got["logprobs"] == alone["logprobs"][:n]


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = [x for x in r.read().decode().splitlines() if x and not x.startswith("#")]
    return {k: float(v) for k, v in (x.rsplit(" ", 1) for x in lines)}


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start(model: str | None, max_batch: int, num_blocks: int) -> tuple[subprocess.Popen, str]:
    from serve import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--port", str(port), "--model-name", "soak", "--max-batch",
           str(max_batch), "--max-queue", "1024", "--max-seq", "256", "--num-blocks", str(num_blocks)] + (["--model", model] if model else [])  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise SystemExit("server exited:\n" + "".join(log[-30:]))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if not json.loads(r.read())["compiling"]:
                    print(f"server ready and every program compiled in {time.time() - t0:.0f} s", flush=True)
                    return proc, url
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not finish compiling in 900 s")


def warm_up(url: str, concurrency: int, seed: int) -> None:
    """One request of each kind, so that anything built on first use is built, then a burst of 64 requests of the
    mix at full concurrency (another seed), so that the memory a full engine holds (its largest decode step run,
    every block in use, the HTTP server's threads) is in the baseline the soak's RSS is measured against."""
    kinds = [{}, {"logprobs": 5}, {"n": 3}, {"stop": ["\n"]}, {"echo": True, "logprobs": 0}, {"echo": True, "logprobs": 2},
             {"prompt": PREAMBLES[0] + "O"}, *CONSTRAINTS]  # fmt: skip
    for i, extra in enumerate(kinds):
        for stream in (False, True):
            body = {"prompt": "ROMEO:", "max_tokens": 4, "seed": i, "stream": stream, **extra}
            out = send(url, {"body": body, "mode": "full"})
            assert out["status"] == 200, (body, out)
    rng = random.Random(seed + 1)
    burst = [make_request(rng, 100_000 + i) for i in range(64)]
    with ThreadPoolExecutor(concurrency) as pool:
        bad = [g for g in pool.map(lambda r: send(url, r), burst) if not (g["status"] == 200 or g.get("cancelled"))]
    assert not bad, bad[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=24,
                    help="KV blocks in the pool: few enough that cached prefixes get evicted")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a checkpoint (default: the bundled Shakespeare model)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from machine import describe

    describe(jax, jnp, len(os.sched_getaffinity(0)))
    rng = random.Random(args.seed)
    reqs = [make_request(rng, i) for i in range(args.requests)]
    kinds = {k: sum(1 for r in reqs if f(r)) for k, f in (
        ("streamed", lambda r: r["body"]["stream"]), ("n>1", lambda r: r["body"].get("n", 1) > 1),
        ("constrained", lambda r: any(k in r["body"] for k in ("regex", "choice", "json_schema"))),
        ("echo", lambda r: r["body"].get("echo")), ("stop strings", lambda r: "stop" in r["body"]),
        ("top logprobs", lambda r: (r["body"].get("logprobs") or 0) > 0), ("dropped", lambda r: r["mode"] == "drop"),
        ("cancelled", lambda r: r["mode"] == "cancel"), ("shared preamble", lambda r: len(r["body"]["prompt"]) > 100))}  # fmt: skip
    print(
        f"{args.requests} requests at concurrency {args.concurrency}: "
        + ", ".join(f"{v} {k}" for k, v in kinds.items())
    )
    proc, url = start(args.model, args.max_batch, args.num_blocks)
    try:
        warm_up(url, args.concurrency, args.seed)
        time.sleep(1.0)  # both RSS readings with the engine idle (it hands free heap pages back then)
        rss0, m0 = rss(proc.pid), metrics(url)
        t0, trace, done = time.perf_counter(), [], threading.Event()
        threading.Thread(target=lambda: [trace.append(rss(proc.pid)) for _ in iter(lambda: done.wait(10), True)],
                         daemon=True).start()  # fmt: skip
        with ThreadPoolExecutor(args.concurrency) as pool:
            got = list(pool.map(lambda r: send(url, r), reqs))
        seconds = time.perf_counter() - t0
        done.set()
        print("RSS every 10 s (MiB): " + " ".join(f"{x / 2**20:.0f}" for x in [rss0, *trace]), flush=True)
        m1 = metrics(url)
        print(f"soak: {args.requests} requests in {seconds:.0f} s ({args.requests / seconds:.1f} req/s, "
              f"{(m1['gpt2_jax_generated_tokens_total'] - m0['gpt2_jax_generated_tokens_total']) / seconds:.0f} "
              f"tokens/s); prefix-cache hit rate {m1['gpt2_jax_prefix_cache_hit_rate']:.2f}, "
              f"{m1['gpt2_jax_prefix_cache_evictions_total']:.0f} evictions", flush=True)  # fmt: skip
        bad = [(i, g) for i, (r, g) in enumerate(zip(reqs, got)) if not (g["status"] == 200 or g.get("cancelled"))]
        mismatched = []
        for i, (r, g) in enumerate(zip(reqs, got)):
            if g["status"] != 200:
                continue
            alone = send(url, {**r, "mode": "full"})
            if alone["status"] != 200 or set(g["choices"]) - set(alone["choices"]):
                mismatched.append(i)
            elif not all(same(c, alone["choices"][k], g.get("dropped", False)) for k, c in g["choices"].items()):
                mismatched.append(i)
        time.sleep(1.0)
        rss1, m2 = rss(proc.pid), metrics(url)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    compiled = m2["gpt2_jax_xla_compiles_total"] - m0["gpt2_jax_xla_compiles_total"]
    checked = sum(g["status"] == 200 for g in got)
    verdicts = [
        ("alive", alive and not bad, f"server alive: {alive}; requests failed: {len(bad)}"
         + (f" (first: {bad[0]})" if bad else "")),
        ("bits", not mismatched, f"{checked - len(mismatched)}/{checked} answers equal to the request alone, bit for bit"
         + (f"; first mismatch: request {mismatched[0]} {reqs[mismatched[0]]}" if mismatched else "")),
        ("memory", rss1 < 1.10 * rss0, f"RSS {rss0 / 2**20:.0f} MiB after warm-up, {rss1 / 2**20:.0f} MiB after "
         f"(x{rss1 / rss0:.3f}; target < 1.10)"),
        ("compiles", compiled == 0, f"{compiled:.0f} programs compiled after warm-up (target 0)"),
    ]  # fmt: skip
    for name, ok, line in verdicts:
        print(f"{name}: {'PASS' if ok else 'MISS'}: {line}", flush=True)
    return 0 if all(ok for _, ok, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
