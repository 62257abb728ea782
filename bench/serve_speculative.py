"""Speculative decoding in the server: tokens/s of `gpt2-jax serve` with --prompt-lookup and with --draft-model
against the same server without speculation, at concurrency 1 and 8, in one run.

    python bench/serve_speculative.py [--new 128] [--requests 8] [--k 4] [--damp 0.02]

The models are bench/speculative.py's: a random gpt2-small whose layers 1..11 barely change the residual stream,
and a 1-layer draft holding its embeddings, layer 0 and final LayerNorm (the draft agrees with it often). Each
server (plain, --prompt-lookup, --draft-model) starts on a free 127.0.0.1 port with float32 weights and waits
until every program is compiled; then the same requests go at concurrency 1 and 8 from threads, each sending
its next request when its previous one is answered.

Workloads (--new tokens forced each, eos off):
  repeating  greedy, a prompt that repeats itself: 32 random ids followed by the target's own 96-token greedy
             continuation (a random model's greedy text loops, so going on means copying): prompt lookup's case.
  sampled    temperature 1 from a 32-token random prompt: the coupled draft's case.
Output tokens/s per server and level, the ratio to the plain server, and the proposals /metrics counted. Every
answer's tokens must equal the plain server's (the text, compared here; the tests compare the bits).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from machine import describe
from speculative import build  # bench/speculative.py, beside this script

PROMPT, LOOP = 32, 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def start(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A server with every program compiled (polls /metrics until nothing compiles)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--model", model, "--port", str(port), "--max-batch", "8",
           "--max-seq", "512", "--dtype", "float32", "--no-playground", "--model-name", "m", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}")
        try:
            if metric(url, "gpt2_jax_compiling_programs") == 0:
                print(f"  {' '.join(extra) or 'plain'}: ready in {time.time() - t0:.0f} s", flush=True)
                return proc, url
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit("the server did not compile its programs in 900 s")


def complete(url: str, body: dict) -> list[int]:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"]


def level(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list]:
    """-> (output tokens/s, the answers in request order)."""
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(lambda b: complete(url, b), bodies))
    seconds = time.perf_counter() - t
    return sum(b["max_tokens"] for b in bodies) / seconds, texts


def workloads(target: str, n: int, new: int) -> dict[str, list[dict]]:
    import jax
    import numpy as np

    import gpt2_jax

    params, config = gpt2_jax.load(target)
    rng = np.random.default_rng(0)
    base = dict(model="m", max_tokens=new, logit_bias={str(config.eos_id): -100})
    prompts = rng.integers(0, config.vocab_size - 1, (n, PROMPT)).tolist()
    loops = gpt2_jax.generate(params, config, prompts, jax.random.key(0), max_new_tokens=LOOP, temperature=0.0)
    repeating = [p + loops.tokens[i, :LOOP].tolist() for i, p in enumerate(prompts)]
    return {
        "repeating": [dict(base, prompt=p, temperature=0.0) for p in repeating],
        "sampled": [dict(base, prompt=p, temperature=1.0, seed=i) for i, p in enumerate(prompts)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--damp", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    import jax
    import torch
    import transformers

    describe(jax, jax.numpy, args.threads)
    target, draft = build(transformers, torch, args.damp)
    loads = workloads(target, args.requests, args.new)
    servers = {"plain": [], "prompt lookup": ["--prompt-lookup"], "draft model": ["--draft-model", draft]}
    results, answers = {}, {}
    for name, extra in servers.items():
        proc, url = start(target, [*extra, "--num-speculative-tokens", str(args.k)] if extra else [])
        try:
            for work, bodies in loads.items():
                for c in (1, 8):
                    before = (metric(url, "gpt2_jax_speculative_proposed_tokens_total"),
                              metric(url, "gpt2_jax_speculative_accepted_tokens_total"))  # fmt: skip
                    rate, texts = level(url, bodies, c)
                    proposed = metric(url, "gpt2_jax_speculative_proposed_tokens_total") - before[0]
                    accepted = metric(url, "gpt2_jax_speculative_accepted_tokens_total") - before[1]
                    results[name, work, c] = (rate, proposed, accepted)
                    same = answers.setdefault((work, c), texts) == texts
                    print(f"  {name:13s} {work:9s} c={c}: {rate:6.1f} tok/s, proposed {proposed:5.0f}, accepted "
                          f"{accepted:5.0f}, same text as plain: {same}", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\nserver, gpt2-small widths float32, {args.requests} requests x {args.new} tokens, k = {args.k}")
    print("| server | workload | concurrency | output tok/s | vs plain | accepted / proposed |")
    print("|---|---|---|---|---|---|")
    for (name, work, c), (rate, proposed, accepted) in results.items():
        ratio = rate / results["plain", work, c][0]
        share = f"{accepted / proposed:.2f}" if proposed else "-"
        print(f"| {name} | {work} | {c} | {rate:.1f} | {ratio:.2f}x | {share} |")


if __name__ == "__main__":
    main()
