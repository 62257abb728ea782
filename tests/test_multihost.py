"""Two processes on localhost stand in for two hosts: jax.distributed.initialize over gloo, 2 CPU devices
each, one global mesh of 4. Each process restores the checkpoint into the mesh (its own shards only) and
must compute what one process does: logits, greedy and sampled tokens, a train step. The CLI too.

What this does not test: real networks between machines, GPUs/NCCL, or more than 2 processes.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import gpt2_jax
from gpt2_jax import checkpoint
from gpt2_jax.train import init_state, make_train_step
from tests.multihost_worker import BATCH, PROMPTS, SAMPLED, TOKENS
from tests.reference import make_hf_model, rel_err, saved_and_loaded

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(argv_of, timeout=300) -> list[subprocess.CompletedProcess]:
    """Start processes 0 and 1 (argv_of(process_id)), each with 2 CPU devices; wait for both."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen(argv_of(i), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]  # fmt: skip
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()  # if one failed, the other may wait for it forever
    done = [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, results)]
    for d in done:
        assert d.returncode == 0, d.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf, params, config = saved_and_loaded(
        make_hf_model(seed=71, n_layer=2, n_head=4, n_embd=32, vocab_size=50257, n_positions=64), tmp_path_factory
    )
    path = checkpoint.save(tmp_path_factory.mktemp("mh") / "ckpt", params, config)
    return path, params, config


@pytest.mark.parametrize("data, model_size", [(2, 2), (1, 4)], ids=["data-across-hosts", "model-across-hosts"])
def test_two_processes_compute_what_one_does(model, data, model_size, tmp_path):
    path, params, config = model
    port = _free_port()
    _run_two(lambda i: [sys.executable, "-m", "tests.multihost_worker", str(i), str(port), str(path), str(tmp_path),
                        str(data), str(model_size)])  # fmt: skip
    greedy = gpt2_jax.generate(params, config, PROMPTS, jax.random.key(3), max_new_tokens=10, temperature=0.0)
    sampled = gpt2_jax.generate(params, config, PROMPTS, jax.random.key(3), max_new_tokens=10, **SAMPLED)
    state, metrics = make_train_step(config, optax.sgd(0.5))(init_state(params, optax.sgd(0.5)), BATCH,
                                                             jax.random.key(4))  # fmt: skip
    logits = np.asarray(gpt2_jax.forward(params, TOKENS, config))
    F = config.mlp_dim
    for i in range(2):
        got = np.load(tmp_path / f"process{i}.npz")
        # Each process holds only its 2 devices' shards: c_fc [L, D, F] split F-wise over "model".
        assert got["local_shapes"].tolist() == [[config.n_layer, config.n_embd, F // model_size]] * 2
        assert rel_err(got["logits"], logits) <= 1e-5
        np.testing.assert_array_equal(got["greedy"], greedy.tokens)
        np.testing.assert_array_equal(got["sampled"], sampled.tokens)
        assert abs(float(got["loss"]) - float(metrics["loss"])) <= 1e-6 * float(metrics["loss"])
        assert rel_err(got["c_fc"], state.params["h"]["mlp"]["c_fc"]["weight"]) <= 1e-5


def test_the_cli_across_two_processes(model):
    path, params, config = model
    port = _free_port()
    args = ["generate", "--model", str(path), "--prompt", "The cat", "--max-new-tokens", "8", "--top-k", "20",
            "--num-samples", "3"]  # fmt: skip
    single = subprocess.run([sys.executable, "-m", "gpt2_jax", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    p0, p1 = _run_two(lambda i: [sys.executable, "-m", "gpt2_jax", *args, "--mesh", "data=2,model=2",
                                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                 "--process-id", str(i)])  # fmt: skip
    assert p0.stdout == single.stdout and single.stdout.count("--- sample") == 3
    assert p1.stdout == ""  # every process computes; only process 0 prints
    assert "tokens/s" in p0.stderr and "tokens/s" not in p1.stderr
