"""Decode and prefill speed of gpt2_jax against transformers (PyTorch) and against the machine's bound,
measured in the same run on the same checkpoint.

    python bench/generate.py [--repeats 3] [--threads N] [--skip-xl]

One random-weight 124M GPT-2 is saved with save_pretrained and loaded by both libraries (gpt2_jax.load
gives the params every user gets). Decode time per step is (time for 128 new tokens - time for 1) / 127,
so the 32-token prefill cancels out. Prefill is 512 prompt tokens and one new token in both libraries.

The two libraries take turns within each repeat (best of each kept), so a slow spell of a shared
machine falls on both. The bound of a row is the larger of its bytes over the measured read bandwidth (decode reads every
weight and the KV cache once per step) and its FLOPs over the measured matmul FLOP/s; "of bound" is
measured time / bound (1.00 would be at the bound). First-call times (compile included) are measured
in fresh processes for gpt2 and gpt2-xl widths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from machine import describe
from timing import best_of, best_of_each  # bench/timing.py, beside this script

PROMPT, NEW, PREFILL = 32, 128, 512
SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.9)

FIRST_CALL = """
import json, sys, time, jax, gpt2_jax
from gpt2_jax.compiling import CompileTimer
config = gpt2_jax.GPT2Config.preset(sys.argv[1])
params = gpt2_jax.init_params(jax.random.key(0), config)
jax.block_until_ready(params)
with CompileTimer() as c:
    t = time.perf_counter()
    gpt2_jax.generate(params, config, [[1] * 32], jax.random.key(0), max_new_tokens=int(sys.argv[2]), eos_id=None)
    wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "compile": c.seconds}))
"""


def first_call(preset: str, new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, preset, str(new)], capture_output=True, text=True,
                         env={**os.environ, "GPT2_JAX_COMPILATION_CACHE": "off"}, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def sampler_top_p(jax, jnp, np, gpt2_jax, repeats: int) -> None:
    """top-p 0.9 alone at B=8 on a trained model's logits (the bundled Shakespeare model: real, narrow
    nuclei; a random model's are ~90% of the vocab and take the full sort): the draw through its
    candidate window against the full sort of V, the sampler alone."""
    from pathlib import Path

    from gpt2_jax import sampling
    from gpt2_jax.sampling.draw import exponential_clocks, race, sample_rows
    from gpt2_jax.sampling.filters import filter_scaled
    from gpt2_jax.sampling.metadata import row_settings

    params, config = gpt2_jax.load(Path(gpt2_jax.__file__).parent / "assets" / "shakespeare")
    enc = gpt2_jax.tokenizer()
    lines = ["ROMEO:", "JULIET:\nO Romeo", "To be, or not", "HAMLET:", "KING:", "First Citizen:", "O, that", "Now is"]
    logits = jnp.stack([gpt2_jax.forward(params, [enc.encode(t)], config)[0, -1] for t in lines])
    settings = row_settings(1.0, 0, 0.9, 8)
    keys = jax.random.split(jax.random.key(0), 8)
    window = jax.jit(sample_rows)

    @jax.jit
    def full(keys, logits, settings):  # the reference's filter over a full sort, then the same draw
        scaled = sampling.apply_temperature(logits, settings)
        kept = filter_scaled(scaled, settings) > -jnp.inf
        weight = jnp.where(kept, jnp.exp(scaled - scaled.max(-1, keepdims=True)), 0.0)
        return race(weight / exponential_clocks(keys, weight.shape[-1])), kept.sum(-1)

    same = (np.asarray(window(keys, logits, settings)) == np.asarray(full(keys, logits, settings)[0])).all()
    tw = best_of(lambda: window(keys, logits, settings).block_until_ready(), repeats + 2)
    tf = best_of(lambda: full(keys, logits, settings)[0].block_until_ready(), repeats + 2)
    sizes = np.asarray(full(keys, logits, settings)[1])
    print(
        f"sampler alone, B=8, top-p 0.9 (bundled model's logits, nuclei of {sizes.min()}-{sizes.max()} tokens): "
        f"candidate window {tw * 1e3:.2f} ms vs full sort {tf * 1e3:.2f} ms ({tf / tw:.0f}x); same tokens: {same}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--skip-xl", action="store_true", help="no gpt2-xl first call (it needs ~7 GB)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    import gpt2_jax
    from gpt2_jax import kernels
    from gpt2_jax.model.params import param_bytes

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = describe(jax, jnp, args.threads)
    bw, flops = machine["bandwidth"], machine["flops"]
    path = tempfile.mkdtemp()
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    params, config = gpt2_jax.load(path)
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"float32 matmuls: {f'rowdot ({kernels.available()})' if kernels.available() else 'XLA (rowdot not built)'}"
    )

    L, D, V = config.n_layer, config.n_embd, config.vocab_size
    weights = param_bytes(params) - params["wpe"].nbytes  # decode reads one wpe row per token
    block_params = config.n_params - (V + config.n_positions) * D

    def bound(B: int, T: int, S: int, logits: int) -> float:
        """Seconds: max(bytes / bandwidth, FLOPs / FLOP/s) for B rows of T new tokens over S slots."""
        kv_bytes = 2 * L * B * S * D * 4
        work = 2 * B * T * block_params + 2 * logits * V * D + 4 * L * B * T * S * D
        return max((weights + kv_bytes) / bw, work / flops)

    rng = np.random.default_rng(0)

    def ours(B, n, kw, prompt=PROMPT):
        prompts = rng.integers(0, V, (B, prompt)).tolist()
        return lambda: gpt2_jax.generate(params, config, prompts, jax.random.key(0), max_new_tokens=n, eos_id=None,
                                         **kw)  # fmt: skip

    def theirs(B, n, kw, prompt=PROMPT):
        ids = torch.as_tensor(rng.integers(0, V, (B, prompt)))
        sample = dict(do_sample=True, **kw) if kw else dict(do_sample=False)

        def run():
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=50256, **sample)  # fmt: skip

        return run

    def per_step(mine, other) -> tuple[float, float]:
        """Seconds per decode step for both libraries, timed in turns."""
        fns = [mine(NEW), mine(1), other(NEW), other(1)]
        for fn in fns:  # warm up (and compile) both lengths
            fn()
        long_a, short_a, long_b, short_b = best_of_each(fns, args.repeats)
        return (long_a - short_a) / (NEW - 1), (long_b - short_b) / (NEW - 1)

    rows = []

    def report(name, ours_s, theirs_s, bound_s, unit="ms/step"):
        rows.append(dict(name=name, ours=ours_s, theirs=theirs_s, bound=bound_s))
        print(f"{name:34s} gpt2_jax {ours_s * 1e3:7.1f} {unit} | transformers {theirs_s * 1e3:7.1f} | "
              f"ratio {theirs_s / ours_s:5.2f}x | bound {bound_s * 1e3:6.1f} ms, {ours_s / bound_s:5.2f}x of bound",
              flush=True)  # fmt: skip

    S = PROMPT + NEW
    for B in (1, 8):
        for name, kw in (("greedy", {}), ("sampled (top-k 50, top-p 0.9)", SAMPLED)):
            jt, ht = per_step(lambda n: ours(B, n, {"temperature": 0.0} if not kw else kw), lambda n: theirs(B, n, kw))
            report(f"decode B={B} {name}", jt, ht, bound(B, 1, S, B))
    top_p = dict(temperature=1.0, top_p=0.9)
    jt, ht = per_step(lambda n: ours(8, n, top_p), lambda n: theirs(8, n, top_p))
    report("decode B=8 top-p 0.9 only", jt, ht, bound(8, 1, S, 8))

    ours_prefill, theirs_prefill = ours(1, 1, {"temperature": 0.0}, PREFILL), theirs(1, 1, {}, PREFILL)
    ours_prefill(), theirs_prefill()
    jt, ht = best_of_each([ours_prefill, theirs_prefill], args.repeats)
    report(f"prefill {PREFILL} tokens + 1 new, B=1", jt, ht, bound(1, PREFILL, PREFILL + 16, 1), "ms     ")

    sampler_top_p(jax, jnp, np, gpt2_jax, args.repeats)
    print(f"KV cache at B=1, S={S}: {2 * L * S * D * 4:,} bytes; weights read per decode step: {weights / 1e6:.0f} MB")
    for preset, new in (("gpt2", NEW), ("gpt2-xl", 16)):
        if preset == "gpt2-xl" and args.skip_xl:
            continue
        fc = first_call(preset, new)
        print(
            f"first call, {preset} widths ({new} new tokens, fresh process, no compile cache): "
            f"{fc['wall']:.1f} s, of which compiling {fc['compile']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - t0:.0f} s)")
