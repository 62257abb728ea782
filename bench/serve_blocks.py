"""The engine's rows of bench/serve.py (issue 25), on a random model of gpt2-small's widths (12 x 768, 1024 context):

  TTFT, cold vs prefix hit   a 900-token prefix + 20-token suffix; cold: a prefix never seen; hit: the same prefix
                             with a new suffix (target: hit <= 0.2x cold)
  gaps while prompts arrive  4 streams run while three 900-token prompts arrive one after another; the streams'
                             inter-token gaps p50 / p99 / max, per --prefill-chunk (target: max <= 3x median)
  blocks vs slots            64 requests (prompt + output <= 256 tokens) at concurrency 32: rows bounded by blocks
                             (--max-batch 32, the default pool) against slots (--max-batch 8, the 8 rows of
                             max_seq the same KV memory held before the pool), or the slot engine itself from a
                             checkout given with --slots-tree

Each server is `python -m gpt2_jax serve` on a free 127.0.0.1 port; times are the client's (the openai client,
streamed, one chunk per token). Run through bench/serve.py (--blocks-only runs just these rows).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

NO_EOS = {"50256": -100}


def small_model(tmp: Path) -> Path:
    """A random model of gpt2-small's widths, saved as a gpt2_jax checkpoint."""
    import jax

    from gpt2_jax import GPT2Config, init_params
    from gpt2_jax.checkpoints import native

    return native.save(tmp / "gpt2-small-random", init_params(jax.random.key(0), GPT2Config()), GPT2Config())


def serve(model: Path, args: list[str], tree: str | None = None) -> tuple[subprocess.Popen, str, float]:
    """Start a server and wait until every program is compiled -> (process, url, seconds)."""
    from serve import free_port

    port = free_port()
    env = {**os.environ, **({"PYTHONPATH": tree} if tree else {})}
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--port", str(port), "--model", str(model), "--max-queue",
           "256", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=tree or None)
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    import json

    while time.time() - t0 < 1800:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({' '.join(cmd)})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200 and not json.loads(r.read()).get("compiling"):
                    return proc, url, time.time() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit("server did not finish compiling in 1800 s")


def stream(client, model: str, prompt, max_tokens: int, stamps: list | None = None, **kw) -> float:
    """One streamed completion; token arrival times go into stamps -> time to the first token."""
    t0, first = time.perf_counter(), None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           logprobs=0, **kw):  # fmt: skip
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].logprobs is not None:
            first = first or now - t0
            if stamps is not None:
                stamps += [now] * len(chunk.choices[0].logprobs.tokens)
    return first if first is not None else time.perf_counter() - t0


def ttft_rows(client, model: str, rng) -> tuple[float, float]:
    prefix = rng.integers(0, 50000, 900).tolist()
    cold = [stream(client, model, rng.integers(0, 50000, 920).tolist(), 1) for _ in range(3)]
    stream(client, model, prefix + rng.integers(0, 50000, 20).tolist(), 1)  # the prefix's blocks go in the cache
    hit = [stream(client, model, prefix + rng.integers(0, 50000, 20).tolist(), 1) for _ in range(3)]
    return statistics.median(cold), statistics.median(hit)


def gap_rows(client, model: str, rng) -> dict:
    """4 streams; three 900-token prompts arrive one after another once they run -> gap statistics (ms)."""
    stamps = [[] for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(stream, client, model, f"Stream {i}:", 200, stamps[i], logit_bias=NO_EOS)
                for i in range(4)]  # fmt: skip
        while min(map(len, stamps)) < 10:
            time.sleep(0.01)
        start = time.perf_counter()
        arrivals = [stream(client, model, rng.integers(0, 50000, 900).tolist(), 1) for _ in range(3)]
        end = time.perf_counter()
        for r in runs:
            r.result()
    gaps = np.concatenate([np.diff(s) for s in stamps]) * 1e3
    during = np.concatenate([np.diff([t for t in s if start <= t <= end]) for s in stamps]) * 1e3
    return {"p50": float(np.median(gaps)), "p99": float(np.percentile(gaps, 99)), "max": float(during.max()),
            "arrival_ttft": statistics.median(arrivals)}  # fmt: skip


def throughput(client, model: str, rng, concurrency: int = 32, n: int = 64) -> float:
    reqs = [rng.integers(0, 50000, int(rng.integers(40, 100))).tolist() for _ in range(n)]
    counts = [[] for _ in range(n)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: stream(client, model, reqs[i], 150, counts[i], logit_bias=NO_EOS, seed=i), range(n)))
    return sum(map(len, counts)) / (time.perf_counter() - t0)


def main(info: dict, chunks: list[int], slots_tree: str | None) -> None:
    import openai

    from gpt2_jax import GPT2Config

    config = GPT2Config()
    weight_bytes = 4 * (config.vocab_size * 768 + 1024 * 768 + 12 * 12 * 768 * 768)  # float32, about 124M params
    bound = info["bandwidth"] / weight_bytes  # decode steps/s if each step only streamed the weights once
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = small_model(Path(tmp))
        print(f"engine rows: a random model of gpt2-small's widths ({weight_bytes / 1e6:.0f} MB of float32 weights; "
              f"bandwidth bound {bound:.1f} decode steps/s)", flush=True)  # fmt: skip
        for i, chunk in enumerate(chunks):
            proc, url, took = serve(model, ["--prefill-chunk", str(chunk)])
            try:
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
                name = client.models.list().data[0].id
                if i == 0:
                    cold, hit = ttft_rows(client, name, rng)
                    print(f"TTFT, 900-token prefix + 20-token suffix (--prefill-chunk {chunk}): cold {cold:.2f} s, "
                          f"prefix hit {hit:.3f} s = {hit / cold:.3f}x cold (target <= 0.2x: "
                          f"{'PASS' if hit <= 0.2 * cold else 'MISS'})", flush=True)  # fmt: skip
                g = gap_rows(client, name, rng)
                print(f"gaps of 4 streams while 900-token prompts arrive (--prefill-chunk {chunk}): p50 "
                      f"{g['p50']:.0f} ms, p99 {g['p99']:.0f} ms, max {g['max']:.0f} ms = {g['max'] / g['p50']:.2f}x "
                      f"p50 (target <= 3x: {'PASS' if g['max'] <= 3 * g['p50'] else 'MISS'}); the arriving prompts' "
                      f"TTFT {g['arrival_ttft']:.2f} s; server compiled in {took:.0f} s", flush=True)  # fmt: skip
                if i == 0:
                    blocks = throughput(client, name, rng)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        peer = "the slot engine at " + slots_tree if slots_tree else "--max-batch 8 (the 8 slots the same KV held)"
        proc, url, _ = serve(model, ["--max-batch", "8"], slots_tree)
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            slots = throughput(client, client.models.list().data[0].id, rng)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"throughput at concurrency 32, 64 requests of <= 256 tokens: blocks (--max-batch 32) {blocks:.0f} tokens/s "
          f"({blocks / (32 * bound):.2f} of the bandwidth bound at 32 rows), slots ({peer}) {slots:.0f} tokens/s "
          f"({slots / (8 * bound):.2f} of the bound at 8 rows): blocks / slots {blocks / slots:.2f}x", flush=True)  # fmt: skip
