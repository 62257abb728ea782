"""Training speed: one gpt2_jax train step against PyTorch (transformers' GPT2LMHeadModel, torch.optim.AdamW,
gradient clipping) on the same CPU, in one run, interleaved.

    python bench/train.py [--repeats 5] [--threads N] [--shapes 4x128,6x384,2x768] [--trainer-steps 30]

Per shape, both libraries take the same step: a random-init model with embd/attn/resid dropout 0.1, one
[B, T+1] batch of random tokens, next-token cross-entropy, global-norm clipping at 1.0, then AdamW
(betas 0.9/0.95, weight decay 0.1). gpt2_jax's is make_train_step (the state donated, the loss read back
to the host, as `gpt2-jax train` does); PyTorch's is zero_grad, forward, cross_entropy, backward,
clip_grad_norm_, step, float(loss). The steps alternate (gpt2_jax, torch, gpt2_jax, ...) and each
library's best time is kept, so a load that comes and goes hits both alike.

Printed per shape: tokens/s of each, the ratio (gpt2_jax / torch, >= 1.00 is at least as fast), model
FLOPs utilisation (6 x params x tokens/s over the machine's measured float32 matmul FLOP/s; params
include the tied embedding, whose unembedding matmul is real work), and peak memory: in a fresh process
per library, the peak resident set over its first 3 steps (compilation included) minus the resident set
before them. Then the same for gpt2_jax with --remat (each block recomputed in the backward) at 6x384.
Then `gpt2-jax train`'s own steady-state tokens/s (gpt2_jax.training.loop.train on random tokens, the bundled
model's shape; its rate leaves out the first, compiling step and evals/checkpoints) against the bare
step's mean over as many consecutive steps; the target is within 5%.

Shapes: 4x128 is the bundled Shakespeare model's (4 layers, 4 heads, 128 wide), batch 8 x 128;
6x384 (6 heads), batch 8 x 256; 2x768 is gpt2-small's widths (12 heads, 768) with 2 layers, batch 8 x 256.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe
from timing import best_of, peak_rss, rss_now, timed  # bench/timing.py, beside this script

SHAPES = {
    "4x128": dict(n_layer=4, n_head=4, n_embd=128, n_positions=256, batch=8, block=128),
    "6x384": dict(n_layer=6, n_head=6, n_embd=384, n_positions=1024, batch=8, block=256),
    "2x768": dict(n_layer=2, n_head=12, n_embd=768, n_positions=1024, batch=8, block=256),
}
DROPOUT = 0.1


def peak_memory(library: str, shape: str, remat: bool = False) -> float:
    """Bytes: a fresh process builds the model, optimizer and batch, then takes 3 steps; this is its peak
    resident set (VmHWM) minus its resident set just before the first step. Compilation's memory counts
    (a user needs it too). In a process of its own because the allocators keep what they freed."""
    cmd = [sys.executable, __file__, "--memory-child", library, shape] + (["--remat"] if remat else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("peak_bytes ")))


def memory_child(library: str, shape: str, remat: bool) -> None:
    if library == "jax":
        step, _ = jax_side(SHAPES[shape], remat=remat)
    else:
        import torch
        import transformers

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        step = torch_side(SHAPES[shape], torch, transformers)
    before = rss_now()
    for _ in range(3):
        step()
    print("peak_bytes", float(peak_rss() - before))


def jax_side(shape: dict, seed: int = 0, remat: bool = False):
    """(step(), config): one gpt2_jax train step on a fixed batch, the loss read back as float."""
    import jax
    import numpy as np

    import gpt2_jax
    from gpt2_jax.training.step import Hyper, init_state, make_optimizer, make_train_step

    config = gpt2_jax.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                 n_positions=shape["n_positions"], embd_pdrop=DROPOUT, attn_pdrop=DROPOUT,
                                 resid_pdrop=DROPOUT)  # fmt: skip
    optimizer = make_optimizer(Hyper())
    step_fn = make_train_step(config, optimizer, remat=remat)
    state = [init_state(gpt2_jax.init_params(jax.random.key(seed), config, stacked=True), optimizer)]
    rng = np.random.default_rng(seed)
    batch = rng.integers(0, config.vocab_size, (1, shape["batch"], shape["block"] + 1)).astype(np.int32)
    key, count = jax.random.key(seed + 1), [0]

    def step() -> float:
        state[0], metrics = step_fn(state[0], batch, jax.random.fold_in(key, count[0]))
        count[0] += 1
        return float(metrics["loss"])

    return step, config


def torch_side(shape: dict, torch, transformers, seed: int = 0):
    """step(): the same step in PyTorch."""
    import numpy as np

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                     n_positions=shape["n_positions"], embd_pdrop=DROPOUT, attn_pdrop=DROPOUT,
                                     resid_pdrop=DROPOUT)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=6e-4, betas=(0.9, 0.95))  # fmt: skip
    rng = np.random.default_rng(seed)
    batch = torch.as_tensor(rng.integers(0, config.vocab_size, (shape["batch"], shape["block"] + 1)))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach())

    return step


def trainer_rate(shape: dict, steps: int) -> tuple[float, float]:
    """(gpt2-jax train's steady-state tokens/s, the bare step's tokens/s over as many consecutive steps
    right before it), on random tokens in the bundled model's shape."""
    import numpy as np

    from gpt2_jax.training.loop import train
    from gpt2_jax.training.step import Hyper

    tokens = shape["batch"] * shape["block"]
    step, config = jax_side(shape)
    step(), step()
    bare = [timed(step) for _ in range(min(steps - 1, 20))]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        rng = np.random.default_rng(0)
        rng.integers(0, 50257, 200_000).astype(np.uint16).tofile(data / "train.bin")
        rng.integers(0, 50257, 20_000).astype(np.uint16).tofile(data / "val.bin")
        (data / "meta.json").write_text(json.dumps({"n_train": 200_000, "n_val": 20_000, "files": [], "vocab": 50257}))
        history = train(str(data), str(Path(tmp) / "run"), config=config, init="scratch",
                        hyper=Hyper(steps=steps, warmup=10), batch_size=shape["batch"], block_size=shape["block"],
                        eval_every=10**9, eval_batches=1, ckpt_every=10**9, progress=False)  # fmt: skip
    return history["tokens_per_s"], tokens * len(bare) / sum(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per library and shape (best kept)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"some of {', '.join(SHAPES)}")
    parser.add_argument("--trainer-steps", type=int, default=30, help="gpt2-jax train's steps (0: skip it)")
    parser.add_argument("--memory-child", nargs=2, metavar=("LIBRARY", "SHAPE"), help=argparse.SUPPRESS)
    parser.add_argument("--remat", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(*args.memory_child, args.remat)

    import jax
    import jax.numpy as jnp
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    machine = describe(jax, jnp, args.threads)
    print(
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"dropout {DROPOUT}, AdamW + clipping, best of {args.repeats} interleaved steps",
        flush=True,
    )
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        ours, config = jax_side(shape)
        theirs = torch_side(shape, torch, transformers)
        for _ in range(2):  # compile, warm up
            ours(), theirs()
        t_ours, t_theirs = [], []
        for _ in range(args.repeats):
            t_ours.append(timed(ours))
            t_theirs.append(timed(theirs))
        mem_ours, mem_theirs = peak_memory("jax", name), peak_memory("torch", name)
        tokens = shape["batch"] * shape["block"]
        rate_ours, rate_theirs = tokens / min(t_ours), tokens / min(t_theirs)
        mfu = lambda rate: 6 * config.n_params * rate / machine["flops"]
        print(f"{name} ({config.n_params / 1e6:.1f}M params), batch {shape['batch']} x {shape['block']}: "
              f"gpt2_jax {rate_ours:6.0f} tok/s ({min(t_ours) * 1e3:.0f} ms/step, median {statistics.median(t_ours) * 1e3:.0f}), "
              f"torch {rate_theirs:6.0f} tok/s ({min(t_theirs) * 1e3:.0f} ms, median {statistics.median(t_theirs) * 1e3:.0f}) | "
              f"ratio {rate_ours / rate_theirs:4.2f}x | MFU {mfu(rate_ours):.1%} vs {mfu(rate_theirs):.1%} | "
              f"peak memory +{mem_ours / 2**20:.0f} MiB vs +{mem_theirs / 2**20:.0f} MiB", flush=True)  # fmt: skip
        del ours, theirs
    if "6x384" in args.shapes.split(","):
        shape = SHAPES["6x384"]
        plain, _ = jax_side(shape)
        remat, _ = jax_side(shape, remat=True)
        plain(), remat(), plain(), remat()
        t_plain, t_remat = best_of(plain, args.repeats), best_of(remat, args.repeats)
        print(
            f"6x384 with --remat: {shape['batch'] * shape['block'] / t_remat:.0f} tok/s ({t_remat / t_plain:.2f}x "
            f"the step's time), peak memory +{peak_memory('jax', '6x384', remat=True) / 2**20:.0f} MiB",
            flush=True,
        )
        del plain, remat
    if args.trainer_steps:
        trained, bare = trainer_rate(SHAPES["4x128"], args.trainer_steps)
        print(
            f"gpt2-jax train, 4x128, batch 8 x 128: {trained:.0f} tok/s steady state vs the bare step's "
            f"{bare:.0f} tok/s over consecutive steps ({trained / bare - 1:+.1%}; target within 5%)",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - t0:.0f} s)")
