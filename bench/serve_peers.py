"""gpt2_jax's server against llama.cpp's llama-server, both on the same random gpt2-small checkpoint, the same
threads and the same streamed load.

    pip install -e '.[peers]' && python bench/serve_peers.py [--concurrency 1,8,32] [--requests 2]
        [--engines gpt2_jax,llama-server] [--precisions float32,int8] [--threads 2] [--json out.json] [--quick]

Pairings: float32 = gpt2_jax `--dtype float32` against llama-server on an f32 GGUF; int8 = gpt2_jax `--dtype w8a8`
against llama-server on a q8_0 GGUF (its KV cache f16, its default). The checkpoint and GGUFs come from
bench/peers_convert.py into a temp dir, removed at the end. llama-server is built once from the pinned
llama-cpp-python sdist's llama.cpp (bench/llama_server.py, cached under ~/.cache/gpt2_jax/llama-server/).

One server at a time, pinned to the first --threads cores (llama-server with -t/-tb --threads, or --llama-threads,
-np 32 slots of 512 positions; gpt2_jax with --max-batch 32 and KV blocks for 32 requests of 384 tokens), warmed
up, then per concurrency C: C client threads (http.client, on the remaining cores if there are any) each send
their next request when the last finished, --requests x C requests in all (at least 8): a prompt of 256 random
token ids, 128 new tokens, greedy, EOS forbidden, streamed. Per level: output tok/s (every streamed token over the
level's wall time), TTFT and inter-token gap p50/p99 (bench/serve_peers_client.py says how tokens are counted per
chunk). "distinct of 16": 16 identical greedy requests at concurrency 8, how many different completions came
back (1 is batch invariance). Servers are stopped on exit, Ctrl-C and errors included.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from llama_server import BuildError
from serve_peers_client import Client, distinct_greedy, prompts, run_level, summary
from serve_peers_servers import Setup, start_gpt2_jax, start_llama

PAIRS = {
    "float32": {"gpt2_jax": "float32", "llama-server": "f32"},
    "int8": {"gpt2_jax": "w8a8", "llama-server": "q8_0"},
}
PROMPT, NEW = 256, 128
MIN_REQUESTS = 8  # a level's fewest requests (but --quick's): concurrency 1's TTFT percentiles need a few


def one_engine(engine: str, precision: str, setup: Setup, args) -> list[dict]:
    """Start one server, warm it up, run every concurrency level and the distinct-greedy check -> its rows."""
    label = PAIRS[precision][engine]
    t = time.perf_counter()
    start = start_gpt2_jax if engine == "gpt2_jax" else start_llama
    with start(setup, label) as server:
        return _measure(engine, label, server, args, time.perf_counter() - t)


def _measure(engine: str, label: str, server, args, ready_s: float) -> list[dict]:
    print(f"{engine} {label}: ready in {ready_s:.0f} s: {server.describe}", flush=True)
    client = Client(engine, server.url, server.model, server.eos_field)
    _, seconds = run_level(client, prompts(8, PROMPT, seed=99), 4, NEW)  # warm-up: first-touch, connections
    print(f"  warm-up: 8 requests at concurrency 4 in {seconds:.1f} s", flush=True)
    rows = []
    for c in args.concurrency:
        n = args.requests * c if args.quick else max(MIN_REQUESTS, args.requests * c)
        results, seconds = run_level(client, prompts(n, PROMPT, seed=c), c, NEW)
        row = {"engine": engine, "precision": label, "concurrency": c, **summary(results, seconds)}
        rows.append(row)
        err = f", {row['errors']} errors (first: {row['first_error']})" if row["errors"] else ""
        print(f"  c={c:2d}: {row['tok_s']:7.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 "
              f"{row['itl_p50_ms']:.1f} ms, {row['tokens_per_chunk']:.2f} tokens a chunk{err}", flush=True)  # fmt: skip
    distinct = distinct_greedy(client, prompts(1, PROMPT, seed=7)[0], NEW)
    for row in rows:
        row["distinct_of_16"] = distinct
    print(f"  distinct completions of 16 identical greedy requests at concurrency 8: {distinct}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("engine", "precision", "conc.", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "distinct of 16", "errors")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r["engine"], r["precision"], r["concurrency"], f"{r['tok_s']:.1f}", f"{r['ttft_p50_ms']:.0f}",
                 f"{r['ttft_p99_ms']:.0f}", f"{r['itl_p50_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                 r.get("distinct_of_16", "-"), r["errors"])  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=2,
                    help=f"requests per concurrent stream at each level, at least {MIN_REQUESTS} a level in all")  # fmt: skip
    ap.add_argument("--engines", default="gpt2_jax,llama-server")
    ap.add_argument("--precisions", default="float32,int8", help="float32 (f32 GGUF) and/or int8 (w8a8 vs q8_0)")
    ap.add_argument("--threads", type=int, default=2, help="cores each server is pinned to (and its threads)")
    ap.add_argument("--llama-threads", type=int, default=None,
                    help="llama-server's -t/-tb (default: --threads; its threads spin at every barrier, so one "
                    "descheduled by the client or a neighbour stalls the step)")  # fmt: skip
    ap.add_argument("--llama-server", default=None, help="a llama-server binary to use instead of building one")
    ap.add_argument("--json", default=None, help="also write the machine, builds and rows here")
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 and 8, 1 request per stream")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests = "1,8", 1
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.engines, args.precisions = args.engines.split(","), args.precisions.split(",")
    bad = [e for e in args.engines if e not in ("gpt2_jax", "llama-server")] + [
        p for p in args.precisions if p not in PAIRS
    ]
    if bad or max(args.concurrency) > 32 or min(args.concurrency) < 1 or args.requests < 1:
        ap.error(f"--engines: gpt2_jax, llama-server; --precisions: {', '.join(PAIRS)}; --concurrency 1..32; "
                 f"--requests >= 1 (got {bad or args.concurrency})")  # fmt: skip
    return args


def main() -> None:
    args = parse()
    cores = sorted(os.sched_getaffinity(0))
    if args.threads > len(cores) or not 1 <= (args.llama_threads or args.threads) <= args.threads:
        raise SystemExit(f"--threads {args.threads} must be <= the {len(cores)} cores available, --llama-threads "
                         f"{args.llama_threads} between 1 and --threads")  # fmt: skip
    server_cores = cores[: args.threads]
    client_cores = cores[args.threads :] or server_cores
    os.sched_setaffinity(0, server_cores)  # the machine line measures what the servers get
    import jax
    import jax.numpy as jnp
    from machine import describe

    when = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}
    print(f"date {when['date']}, load average {', '.join(f'{x:.2f}' for x in when['load_average'])}")
    machine = describe(jax, jnp, args.threads)
    shared = "" if cores[args.threads :] else " (no core left over: the client shares the servers' cores)"
    print(f"servers on cores {server_cores}, client on cores {client_cores}{shared}", flush=True)
    os.sched_setaffinity(0, client_cores)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its servers
    work = Path(tempfile.mkdtemp(prefix="gpt2_jax_serve_peers_"))
    rows, builds, failed = [], {}, {}
    try:
        setup = Setup.prepare(work, args, server_cores, client_cores, [PAIRS[p] for p in args.precisions])
        builds = setup.builds
        for name, line in builds.items():
            print(f"{name}: {line}", flush=True)
        for precision in args.precisions:
            for engine in args.engines:
                try:
                    rows += one_engine(engine, precision, setup, args)
                except (RuntimeError, OSError, http.client.HTTPException) as e:  # the next server still runs
                    failed[f"{engine} {PAIRS[precision][engine]}"] = str(e)
                    print(f"{engine} {PAIRS[precision][engine]}: FAILED: {e}", flush=True)
    except BuildError as e:
        raise SystemExit(str(e)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if rows:
            print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({**when, "machine": machine, "builds": builds, "rows": rows,
                                                   "failed": failed,
                                                   "args": {k: v for k, v in vars(args).items()}}, indent=1))  # fmt: skip
    print(f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
