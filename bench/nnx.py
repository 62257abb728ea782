"""The cost of the Flax NNX face: GPT2LMHead's calls and its nnx.Optimizer step against the functional API's, in
one run, interleaved.

    python bench/nnx.py [--repeats 20] [--threads N]

On the bundled model's shape (4 layers x 128, the real 50257-token vocabulary, float32, random weights):
- forward, B=1 x 32 tokens: gpt2_jax.forward(params, ...) against model(tokens) (the same function, called
  through the module: params() builds the pytree), against nnx.jit(lambda m, t: m(t)) (nnx.jit walks the
  module's graph on every call: splits it into graph and state, merges it back inside, and writes back), and
  against jax.jit over nnx.split's state (the graph split once, outside; merged inside the trace);
- one AdamW step (dropout 0.1, clipping, weight decay), batch 8 x 128: make_train_step (the state donated)
  against the Flax way, nnx.value_and_grad of loss_fn and nnx.Optimizer.update under nnx.jit (nothing
  donated), and against the same body under jax.jit over nnx.split((model, optimizer))'s state, donated.
Each pair takes turns and each side's best time is kept; the ratio is the module's time over the function's
(1.00: no overhead). The two steps give the same losses and params (tests/test_nnx.py).
"""

from __future__ import annotations

import argparse
import functools
import os

from machine import describe
from timing import best_of_each  # bench/timing.py, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per side (best kept)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()

    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import gpt2_jax
    from gpt2_jax.nnx import GPT2LMHead

    describe(jax, jnp, args.threads)
    print(f"flax {flax.__version__}; best of {args.repeats} interleaved calls per side", flush=True)
    config = gpt2_jax.GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=256, embd_pdrop=0.1, attn_pdrop=0.1,
                                 resid_pdrop=0.1)  # fmt: skip
    params = gpt2_jax.init_params(jax.random.key(0), config)
    model = GPT2LMHead.from_params(params, config)
    rng = np.random.default_rng(0)

    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, 32)), jnp.int32)
    jitted = nnx.jit(lambda m, t: m(t))
    functional = lambda: gpt2_jax.forward(params, tokens, config).block_until_ready()
    module = lambda: model(tokens).block_until_ready()
    module_jit = lambda: jitted(model, tokens).block_until_ready()
    graphdef, weights = nnx.split(model)
    merged = jax.jit(lambda w, t: nnx.merge(graphdef, w)(t))
    split_jit = lambda: merged(weights, tokens).block_until_ready()
    sides = [functional, module, module_jit, split_jit]
    for fn in sides:
        fn()  # compile
    t_fn, t_mod, t_jit, t_split = best_of_each(sides, args.repeats)
    print(f"forward 1 x 32: gpt2_jax.forward {t_fn * 1e3:.2f} ms | model(tokens) {t_mod * 1e3:.2f} ms "
          f"({t_mod / t_fn:.2f}x) | nnx.jit(model) {t_jit * 1e3:.2f} ms ({t_jit / t_fn:.2f}x) | "
          f"jax.jit over nnx.split {t_split * 1e3:.2f} ms ({t_split / t_fn:.2f}x)", flush=True)  # fmt: skip

    hyper = gpt2_jax.Hyper(lr=3e-4, warmup=10, steps=1000)
    batch = jnp.asarray(rng.integers(0, config.vocab_size, (8, 129)), jnp.int32)
    step = gpt2_jax.make_train_step(config, gpt2_jax.make_optimizer(hyper))
    state = [gpt2_jax.init_state(params, gpt2_jax.make_optimizer(hyper))]
    trained = GPT2LMHead.from_params(jax.tree.map(jnp.copy, params), config)
    opt = nnx.Optimizer(trained, gpt2_jax.make_optimizer(hyper), wrt=nnx.Param)

    def body(model, opt, batch, key):
        loss_of = lambda m: gpt2_jax.loss_fn(m.params(), batch, m.config, key=key, train=True)
        loss, grads = nnx.value_and_grad(loss_of)(model)
        opt.update(model, grads)
        return loss

    nnx_step = nnx.jit(body)
    pair = GPT2LMHead.from_params(jax.tree.map(jnp.copy, params), config)
    pair_graph, pair_state = nnx.split((pair, nnx.Optimizer(pair, gpt2_jax.make_optimizer(hyper), wrt=nnx.Param)))
    pair_state = [pair_state]

    @functools.partial(jax.jit, donate_argnums=0)
    def pure_step(state, batch, key):
        model, opt = nnx.merge(pair_graph, state)
        loss = body(model, opt, batch, key)
        return nnx.state((model, opt)), loss

    def split_step():
        pair_state[0], loss = pure_step(pair_state[0], batch, jax.random.key(1))
        float(loss)

    def functional_step():
        state[0], metrics = step(state[0], batch[None], jax.random.key(1))
        float(metrics["loss"])

    flax_step = lambda: float(nnx_step(trained, opt, batch, jax.random.key(1)))
    sides = [functional_step, flax_step, split_step]
    for fn in sides:
        fn()  # compile
    t_fn, t_nnx, t_split = best_of_each(sides, max(3, args.repeats // 4))
    print(f"train step 8 x 128: make_train_step {t_fn * 1e3:.0f} ms | nnx.Optimizer under nnx.jit "
          f"{t_nnx * 1e3:.0f} ms ({t_nnx / t_fn:.2f}x) | jax.jit over nnx.split, donated {t_split * 1e3:.0f} ms "
          f"({t_split / t_fn:.2f}x)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
