"""Decode speed of gpt2_jax against transformers (PyTorch), measured in the same run on the same checkpoint.

    python bench/generate.py [--repeats 3] [--threads 2]

One random-weight 124M GPT-2 is saved with save_pretrained and loaded by both libraries. Decode
time per step is (time for 128 new tokens - time for 1 new token) / 127, so the 32-token prefill
cancels out. Prints ratios (gpt2_jax tokens/s over transformers tokens/s; > 1 means faster),
prefill time for 512 tokens, first-call compile time, cache bytes and the bandwidth bound.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from timing import best_of  # bench/timing.py, beside this script

PROMPT, NEW = 32, 128
SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.9)


def measure_bandwidth(jnp, jax) -> float:
    """Bytes/s of a streaming read: jnp.sum over a 512 MiB float32 array (best of 5)."""
    x = jnp.ones((128, 1024, 1024), jnp.float32)
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    return x.nbytes / best_of(lambda: total(x).block_until_ready(), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    import gpt2_jax
    from gpt2_jax.cache import cache_bytes
    from gpt2_jax.generate import generate
    from gpt2_jax.params import param_bytes, stack_layers, unstack_layers

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    params, config = gpt2_jax.load(path)
    fast = unstack_layers(params)
    stacked = stack_layers(fast)
    del params

    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__} with {args.threads} threads")

    def ours(p, B, n, kw):
        prompts = rng.integers(0, 50257, (B, PROMPT)).tolist()
        return lambda: generate(p, config, prompts, jax.random.key(0), max_new_tokens=n, eos_id=None, **kw)

    def theirs(B, n, kw):
        ids = torch.as_tensor(rng.integers(0, 50257, (B, PROMPT)))
        sample = dict(do_sample=True, **kw) if kw else dict(do_sample=False)

        def run():
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=50256, **sample)  # fmt: skip
        return run

    t = time.perf_counter()
    ours(fast, 1, NEW, {})()
    first_call = time.perf_counter() - t

    def per_step(make) -> float:
        make(NEW)()  # warm up (and compile) both lengths
        make(1)()
        return (best_of(make(NEW), args.repeats) - best_of(make(1), args.repeats)) / (NEW - 1)

    rows = []
    for B in (1, 8):
        for name, kw in (("greedy", {}), ("sampled", SAMPLED)):
            jt = per_step(lambda n: ours(fast, B, n, {"temperature": 0.0} if not kw else kw))
            ht = per_step(lambda n: theirs(B, n, kw))
            rows.append((B, name, jt, ht))
            print(f"decode B={B} {name:8s} gpt2_jax {jt * 1e3:7.1f} ms/step {B / jt:7.1f} tok/s | "
                  f"transformers {ht * 1e3:7.1f} ms/step {B / ht:7.1f} tok/s | ratio {ht / jt:5.2f}x", flush=True)
    for B in (1, 8):
        st = per_step(lambda n: ours(stacked, B, n, {"temperature": 0.0}))
        fast_t = next(r[2] for r in rows if r[0] == B and r[1] == "greedy")
        print(f"layout B={B} greedy: stacked [L,B,H,S,K] + layer scan {st * 1e3:.1f} ms/step vs "
              f"per-layer buffers {fast_t * 1e3:.1f} ms/step ({st / fast_t:.2f}x)")
    for B in (1, 8):
        g = next(r[2] for r in rows if r[0] == B and r[1] == "greedy")
        s = next(r[2] for r in rows if r[0] == B and r[1] == "sampled")
        print(f"sampled vs greedy B={B}: {s / g:.2f}x the time per step")

    prompt512 = rng.integers(0, 50257, (1, 512)).tolist()

    def prefill_ours():  # max_new_tokens=1: the prompt pass plus one draw
        generate(fast, config, prompt512, jax.random.key(0), max_new_tokens=1, temperature=0.0, eos_id=None)

    prefill_ours()
    ids = torch.as_tensor(prompt512)
    with torch.no_grad():
        hf(ids)
        pt = best_of(lambda: hf(ids), args.repeats)
    jt = best_of(prefill_ours, args.repeats)
    print(f"prefill 512 tokens: gpt2_jax {jt * 1e3:.0f} ms | transformers forward {pt * 1e3:.0f} ms | ratio {pt / jt:.2f}x")

    bw = measure_bandwidth(jnp, jax)
    weights = param_bytes(fast)
    print(f"first call (compile + run, B=1 greedy, 128 tokens): {first_call:.1f} s")
    print(f"KV cache B=1 S={PROMPT + NEW}: {cache_bytes(config, 1, PROMPT + NEW)} bytes; "
          f"B=8: {cache_bytes(config, 8, PROMPT + NEW)} bytes")
    print(f"bandwidth bound: {weights / 1e6:.0f} MB of weights / {bw / 1e9:.1f} GB/s measured = "
          f"{weights / bw * 1e3:.1f} ms/token at B=1")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
