"""One process of a 2-process run (tests/test_multihost.py starts two, each with 2 CPU devices).

    python -m tests.multihost_worker PROCESS_ID PORT CHECKPOINT OUT_DIR DATA MODEL

Joins the other process through gpt2_jax.parallel.distributed.initialize, restores the checkpoint straight into
a data x model mesh over all 4 devices, and writes what it computed to OUT_DIR/process{id}.npz:
forward logits (gathered from both processes), greedy and sampled tokens, and a train step's loss
and updated parameters (gathered).
"""

import sys

import numpy as np

# The inputs, the same in both processes and in the single-process reference (tests/test_multihost.py).
TOKENS = np.random.default_rng(0).integers(0, 50257, (4, 12)).astype(np.int32)
PROMPTS = [[464, 3290, 318], [40, 1101], [1532]]  # ragged, 3 rows over a data axis of 2
SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.95)
BATCH = np.random.default_rng(1).integers(0, 50257, (1, 4, 9)).astype(np.int32)  # [A, B, T+1]


def main(process_id: int, port: int, checkpoint: str, out_dir: str, data: int, model: int) -> None:
    from gpt2_jax.parallel.distributed import initialize

    initialize(f"127.0.0.1:{port}", 2, process_id)  # before anything else touches JAX

    import jax
    import optax
    from jax.experimental import multihost_utils

    import gpt2_jax
    from gpt2_jax.parallel.sharding import make_mesh
    from gpt2_jax.training.step import init_state, make_train_step

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = make_mesh(data, model)
    params, config = gpt2_jax.load(checkpoint, mesh=mesh)
    local = [s.data.shape for s in params["h"][0]["mlp"]["c_fc"]["weight"].addressable_shards]
    logits = multihost_utils.process_allgather(gpt2_jax.forward(params, TOKENS, config), tiled=True)
    greedy = gpt2_jax.generate(params, config, PROMPTS, jax.random.key(3), max_new_tokens=10, temperature=0.0)
    sampled = gpt2_jax.generate(params, config, PROMPTS, jax.random.key(3), max_new_tokens=10, **SAMPLED)
    step = make_train_step(config, optax.sgd(0.5))
    state, metrics = step(init_state(params, optax.sgd(0.5)), BATCH, jax.random.key(4))
    c_fc = multihost_utils.process_allgather(state.params["h"][0]["mlp"]["c_fc"]["weight"], tiled=True)
    np.savez(f"{out_dir}/process{process_id}.npz", logits=logits, greedy=greedy.tokens, sampled=sampled.tokens,
             loss=float(metrics["loss"]), c_fc=c_fc, local_shapes=np.array(local))  # fmt: skip
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, port, ckpt, out, data, model = sys.argv[1:]
    main(int(pid), int(port), ckpt, out, int(data), int(model))
