"""Where a busy server's step goes: D decoding rows (each at CONTEXT cached tokens) and one prompt chunk of 32
tokens at slot START, as the engine can run them (issue 49):

    python bench/serve_step.py [--decode-rows 8,16,32] [--starts 0,128,224] [--context 320] [--repeats 7]

  riding     one forward of D + 32 one-token rows (generation.paged.decode_rows_with_chunk's forward)
  separate   a decode forward of D rows, then a prefill forward of the chunk [1, 32] (the peer: the engine's
             path where no riding program is built)
  decode     the D rows alone;  prefill: the chunk alone

forward_cached on a random gpt2-small (float32), a paged cache (serving's 128-slot blocks) donated as the engine
donates it, each program timed interleaved with the others (median of --repeats). Bounds beside them, from the
machine line: the weights' read (498 MB over the measured read bandwidth), the decode rows' K/V read (D x CONTEXT
slots x 12 layers x 2 x 768 float32) and the FLOPs over the measured matmul rate.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np

T, BLOCKS_PER_ROW = 32, 3  # the server's --prefill-chunk; 384 slots a row, as bench/serve_peers.py's --max-seq


def programs(jax, jnp, params, cfg, D: int, context: int, start: int):
    """The four programs over one pool: D decoding rows (blocks 1..) and the chunk's prompt (the last 3 blocks)."""
    from gpt2_jax.model.gpt2 import forward_cached
    from gpt2_jax.model.paged_cache import PagedKVCache

    dtab = jnp.arange(1, D * BLOCKS_PER_ROW + 1, dtype=jnp.int32).reshape(D, BLOCKS_PER_ROW)
    ctab = jnp.arange(D * BLOCKS_PER_ROW + 1, (D + 1) * BLOCKS_PER_ROW + 1, dtype=jnp.int32)[None]
    dlen = jnp.full(D, context, jnp.int32)
    donate = functools.partial(jax.jit, donate_argnums=(0, 1))

    def run(k, v, tokens, table, lengths, **kw):
        logits, c = forward_cached(params, tokens, PagedKVCache(k, v, table, lengths), cfg, **kw)
        return logits, c.k, c.v

    @donate
    def riding(k, v):
        table = jnp.concatenate([dtab, jnp.repeat(ctab, T, axis=0)])
        slots = jnp.concatenate([dlen, start + jnp.arange(T, dtype=jnp.int32)])
        picked = jnp.concatenate([jnp.arange(D), jnp.array([D + T - 1])])  # the decode rows and the chunk's last
        return run(k, v, jnp.ones((D + T, 1), jnp.int32), table, slots, rows=picked)

    @donate
    def decode(k, v):
        return run(k, v, jnp.ones((D, 1), jnp.int32), dtab, dlen)

    @donate
    def prefill(k, v):
        return run(k, v, jnp.ones((1, T), jnp.int32), ctab, jnp.array([start], jnp.int32), last=jnp.array([T - 1]))

    return riding, decode, prefill


def measure(jax, jnp, params, cfg, D: int, context: int, start: int, repeats: int) -> dict[str, float]:
    from gpt2_jax.model.paged_cache import init_pool

    riding, decode, prefill = programs(jax, jnp, params, cfg, D, context, start)
    pool = list(init_pool(cfg, (D + 1) * BLOCKS_PER_ROW + 1))

    def call(f):
        out, pool[0], pool[1] = f(pool[0], pool[1])
        return out

    def separate():
        call(prefill)
        return call(decode)

    runs = {"riding": lambda: call(riding), "separate": separate, "decode": lambda: call(decode),
            "prefill": lambda: call(prefill)}  # fmt: skip
    for f in runs.values():
        jax.block_until_ready(f())  # compile
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so that the machine's drift touches every program alike
        for name, f in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-rows", default="8,16,32")
    p.add_argument("--starts", default="0,128,224")
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    from machine import describe

    from gpt2_jax.config import GPT2Config
    from gpt2_jax.model.params import init_params, param_bytes

    machine = describe(jax, jnp, len(os.sched_getaffinity(0)))
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768)
    params = init_params(jax.random.key(0), cfg)
    bw, flops, weights = machine["bandwidth"], machine["flops"], param_bytes(params)
    body = 2 * 12 * cfg.n_embd * cfg.n_embd * 12  # a token's FLOPs in the blocks' matmuls
    head = 2 * cfg.vocab_size * cfg.n_embd  # an unembedded row's
    print(f"\nweights {weights / 1e6:.0f} MB: read bound {weights / bw * 1e3:.1f} ms; chunk of {T} tokens")
    print("| decode rows | chunk at slot | riding ms | separate ms | riding vs separate | decode ms | prefill ms |"
          " decode K/V read bound ms | riding FLOP bound ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for D in map(int, args.decode_rows.split(",")):
        for start in map(int, args.starts.split(",")):
            ms = {k: v * 1e3 for k, v in measure(jax, jnp, params, cfg, D, args.context, start, args.repeats).items()}
            kv = D * args.context * cfg.n_layer * 2 * cfg.n_embd * 4 / bw * 1e3
            fl = ((D + T) * body + (D + 1) * head) / flops * 1e3
            print(f"| {D} | {start} | {ms['riding']:.1f} | {ms['separate']:.1f} | {ms['separate'] / ms['riding']:.2f}x |"
                  f" {ms['decode']:.1f} | {ms['prefill']:.1f} | {kv:.1f} | {fl:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
