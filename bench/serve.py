"""Load generator for `gpt2-jax serve` over loopback, against transformers serving the same requests one at a time.

    python bench/serve.py [--model PATH] [--requests 32] [--max-batch 8] [--smoke]
                          [--blocks-only | --skip-blocks] [--chunks 32,64] [--slots-tree DIR]

It starts `gpt2-jax serve` on a free 127.0.0.1 port (the bundled model by default), then sends the
same N requests (mixed prompt lengths and settings, each with its own seed, streamed so the time to
the first token is seen) at concurrency 1, 4, 8 and 16 with the `openai` client from threads. Per
level it prints requests/s, generated tokens/s, p50/p99 latency and time to first token, and it
checks every answer against the concurrency-1 answer to the same request: the text and every token
logprob must be the same bits (no request lost or corrupted). The peer is transformers' `generate`
on the same weights, one request at a time (sampling with the same settings; its own RNG). Target:
throughput at concurrency 8 >= 3x concurrency 1.

Then the engine's rows (bench/serve_blocks.py, skipped with --smoke or --skip-blocks): time to first token with a
cold vs a cached 900-token prefix, inter-token gaps while long prompts arrive (per --prefill-chunk in --chunks), and
throughput at concurrency 32 with rows bounded by KV blocks vs by slots.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import describe

PROMPTS = [
    "ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n", "First Citizen:\nBefore we proceed any further, "
    "hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n",
    "HAMLET:\nTo be, or not to be, that is the question:\n", "KING HENRY V:\nOnce more unto the breach, dear friends,",
    "MACBETH:\n", "PORTIA:\nThe quality of mercy is not strain'd,\n", "O",
]  # fmt: skip
SETTINGS = [
    dict(temperature=0.8, top_p=0.95), dict(temperature=0.0), dict(temperature=1.0, frequency_penalty=0.5),
    dict(temperature=0.7, extra_body={"top_k": 40}), dict(temperature=1.0, presence_penalty=0.8),
    dict(temperature=0.9, extra_body={"repetition_penalty": 1.2, "min_p": 0.05}),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, max_batch: int, max_seq: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--port", str(port), "--max-batch", str(max_batch),
           "--max-queue", "256", "--max-seq", str(max_seq)] + (["--model", model] if model else [])  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain its request log
                    print(f"server ready in {time.time() - t0:.1f} s (compiling its shapes)", flush=True)
                    return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("server did not become healthy in 600 s")


def make_requests(n: int, max_tokens: int) -> list[dict]:
    return [dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max(4, max_tokens - max_tokens // 4 * (i % 3)), seed=1000 + i, logprobs=1,
                 **SETTINGS[i % len(SETTINGS)]) for i in range(n)]  # fmt: skip


MODEL = {"id": None}


def one(client, req: dict) -> dict:
    """A streamed completion -> text, token logprobs, latency, time to first token, tokens."""
    t0 = time.perf_counter()
    first, text, logprobs = None, [], []
    for chunk in client.completions.create(model=MODEL["id"], stream=True, **req):
        choice = chunk.choices[0]
        if choice.text and first is None:
            first = time.perf_counter() - t0
        text.append(choice.text)
        if choice.logprobs is not None:
            logprobs += choice.logprobs.token_logprobs
    return dict(text="".join(text), logprobs=logprobs, latency=time.perf_counter() - t0,
                ttft=first if first is not None else time.perf_counter() - t0, tokens=len(logprobs))  # fmt: skip


def level(client, reqs: list[dict], concurrency: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(lambda r: one(client, r), reqs))
    return out, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def transformers_peer(model_dir: str, reqs: list[dict], threads: int) -> tuple[float, int]:
    """transformers generate on the same weights, one request at a time -> (seconds, tokens generated)."""
    import torch
    import transformers

    import gpt2_jax
    from gpt2_jax.checkpoints.conversion import convert

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        hf = convert(model_dir, Path(tmp) / "hf", to_hf=True)
        model = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    enc = gpt2_jax.tokenizer()
    total, t0 = 0, time.perf_counter()
    for r in reqs:
        ids = torch.tensor([enc.encode(r["prompt"])])
        extra = r.get("extra_body", {})
        kw = dict(do_sample=r["temperature"] > 0, max_new_tokens=r["max_tokens"], pad_token_id=50256,
                  repetition_penalty=extra.get("repetition_penalty", 1.0), top_k=extra.get("top_k", 0))  # fmt: skip
        if r["temperature"] > 0:
            kw.update(temperature=r["temperature"], top_p=r.get("top_p", 1.0), min_p=extra.get("min_p"))
        torch.manual_seed(r["seed"])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        total += out.shape[1] - ids.shape[1]
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a gpt2_jax checkpoint directory (default: the bundled model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="8 requests of 12 tokens, concurrency 1 and 4")
    ap.add_argument("--blocks-only", action="store_true", help="only the engine's rows (bench/serve_blocks.py)")
    ap.add_argument("--skip-blocks", action="store_true", help="not the engine's rows")
    ap.add_argument("--chunks", default="32,64", help="--prefill-chunk values the gap row runs (the first: TTFT)")
    ap.add_argument(
        "--slots-tree",
        default=None,
        help="a checkout of the slot engine (e.g. git worktree add DIR "
        "aeb597d, kernels built) as the blocks row's peer; default: this engine at --max-batch 8",
    )
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import openai

    from gpt2_jax import BUNDLED_MODEL

    threads = len(os.sched_getaffinity(0))
    info = describe(jax, jnp, threads)
    if args.blocks_only:
        import serve_blocks

        return serve_blocks.main(info, [int(c) for c in args.chunks.split(",")], args.slots_tree)
    n, max_tokens, levels = (8, 12, [1, 4]) if args.smoke else (args.requests, args.max_tokens, [1, 4, 8, 16])
    model = args.model or str(BUNDLED_MODEL)
    print(f"model: {model}; {n} requests, up to {max_tokens} tokens each, mixed prompts and settings, streamed; "
          f"server --max-batch {args.max_batch}", flush=True)  # fmt: skip
    proc, url = start_server(args.model, args.max_batch, 256)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    reqs = make_requests(n, max_tokens)
    MODEL["id"] = client.models.list().data[0].id
    try:
        level(client, reqs[:2], 2)  # warm the connection and any lazily built state
        results, base = {}, None
        for c in levels:
            out, seconds = level(client, reqs, c)
            tokens = sum(o["tokens"] for o in out)
            results[c] = tokens / seconds
            if base is None:
                base = out
            bad = [
                i for i, (a, b) in enumerate(zip(out, base)) if a["text"] != b["text"] or a["logprobs"] != b["logprobs"]
            ]
            lat, ttft = [o["latency"] for o in out], [o["ttft"] for o in out]
            print(f"concurrency {c:2d}: {n / seconds:6.2f} req/s, {tokens / seconds:8.1f} tokens/s, latency p50 "
                  f"{statistics.median(lat):6.2f} s p99 {pct(lat, 99):6.2f} s, TTFT p50 {statistics.median(ttft):6.3f} s "
                  f"p99 {pct(ttft, 99):6.3f} s; answers equal to concurrency 1 bit for bit: {n - len(bad)}/{n}",
                  flush=True)  # fmt: skip
        top = 8 if 8 in results else max(results)
        ratio = results[top] / results[1]
        verdict = "PASS" if ratio >= 3 else "MISS"
        print(f"throughput at concurrency {top} / concurrency 1: {ratio:.2f}x (target >= 3x: {verdict})")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    seconds, tokens = transformers_peer(model, reqs, threads)
    print(
        f"transformers generate, one request at a time: {tokens / seconds:8.1f} tokens/s ({n} requests in "
        f"{seconds:.1f} s); gpt2-jax serve at concurrency {top}: {results[top] / (tokens / seconds):.2f}x that"
    )
    if not (args.smoke or args.skip_blocks):
        import serve_blocks

        serve_blocks.main(info, [int(c) for c in args.chunks.split(",")], args.slots_tree)


if __name__ == "__main__":
    main()
