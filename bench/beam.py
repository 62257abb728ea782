"""Beam search speed of gpt2_jax against transformers' beam search (PyTorch), on the same checkpoint, in the
same run.

    python bench/beam.py [--repeats 3] [--threads N] [--new 64]

One random-weight 124M GPT-2 is saved with save_pretrained and loaded by both libraries. Both run greedy beam
search with no EOS (eos_token_id None), so every search runs all its steps; the time per step is
(time for NEW new tokens - time for 1) / (NEW - 1), so the 32-token prefill cancels out. The libraries take
turns within each repeat (best of each kept), so a slow spell of a shared machine falls on both. A step's
bound is its bytes over the measured read bandwidth: every weight once, the KV cache read by attention and
read and written again by the reorder (a gather of the beams' rows), max(bytes / bandwidth, FLOPs / FLOP/s).
The first call (compile included) is measured in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from machine import describe
from timing import best_of_each  # bench/timing.py, beside this script

PROMPT = 32
ROWS = [(4, 1), (8, 1), (4, 4)]  # (beams, prompts)

FIRST_CALL = """
import json, sys, time, jax, gpt2_jax
from gpt2_jax.compiling import CompileTimer
config = gpt2_jax.GPT2Config.preset("gpt2")
params = gpt2_jax.init_params(jax.random.key(0), config)
jax.block_until_ready(params)
with CompileTimer() as c:
    t = time.perf_counter()
    gpt2_jax.beam_search(params, config, [[1] * 32], num_beams=4, max_new_tokens=int(sys.argv[1]), eos_id=None)
    wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "compile": c.seconds}))
"""


def first_call(new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, str(new)], capture_output=True, text=True,
                         env={**os.environ, "GPT2_JAX_COMPILATION_CACHE": "off"}, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--new", type=int, default=64, help="new tokens per search")
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
    path = tempfile.mkdtemp()
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    params, config = gpt2_jax.load(path)
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"float32 matmuls: {f'rowdot ({kernels.available()})' if kernels.available() else 'XLA (rowdot not built)'}"
    )
    L, D, V, new = config.n_layer, config.n_embd, config.vocab_size, args.new
    weights = param_bytes(params) - params["wpe"].nbytes
    rng = np.random.default_rng(0)

    def ours(beams, prompts, n):
        ids = rng.integers(0, V, (prompts, PROMPT)).tolist()
        return lambda: gpt2_jax.beam_search(params, config, ids, num_beams=beams, max_new_tokens=n, eos_id=None)

    def theirs(beams, prompts, n):
        ids = torch.as_tensor(rng.integers(0, V, (prompts, PROMPT)))

        def run():
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, num_beams=beams,
                            do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip

        return run

    def bound(rows: int) -> float:
        slots = gpt2_jax.generation.batching.cache_capacity(PROMPT, new, config)
        kv = 2 * L * rows * slots * D * 4
        work = 2 * rows * (config.n_params - config.n_positions * D)
        return max((weights + 3 * kv) / machine["bandwidth"], work / machine["flops"])

    print(f"greedy beam search, {PROMPT}-token prompts, {new} new tokens, no EOS; ms per step (best of {args.repeats})")
    print(f"{'beams x prompts':>16s} {'gpt2_jax':>10s} {'transformers':>13s} {'speed-up':>9s} {'of bound':>9s}")
    for beams, prompts in ROWS:
        fns = [ours(beams, prompts, new), ours(beams, prompts, 1), theirs(beams, prompts, new),
               theirs(beams, prompts, 1)]  # fmt: skip
        for fn in fns:  # warm up (and compile) both lengths
            fn()
        long_a, short_a, long_b, short_b = best_of_each(fns, args.repeats)
        a, b = (long_a - short_a) / (new - 1), (long_b - short_b) / (new - 1)
        rows = (1 << (beams - 1).bit_length()) * prompts
        print(f"{beams:>9d} x {prompts:<4d} {a * 1e3:10.1f} {b * 1e3:13.1f} {b / a:8.2f}x {a / bound(rows):8.2f}x",
              flush=True)  # fmt: skip
    first = first_call(new)
    print(f"first call, 4 beams x 1 prompt, {new} new tokens, fresh process: {first['wall']:.1f} s "
          f"(compile {first['compile']:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
