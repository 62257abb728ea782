"""Two processes on localhost stand in for two hosts: jax.distributed.initialize over gloo, 2 CPU devices
each, one global mesh of 4. Each process restores the checkpoint into the mesh (its own shards only) and
must compute what one process does: logits, greedy and sampled tokens, a train step. The CLI too.

What this does not test: real networks between machines, GPUs/NCCL, or more than 2 processes.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import gpt2_jax
from gpt2_jax.checkpoints import native as checkpoint
from gpt2_jax.training.step import init_state, make_train_step
from tests.multihost_worker import BATCH, PROMPTS, SAMPLED, TOKENS
from tests.reference import make_hf_model, prepared_text, rel_err, saved_and_loaded

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
        # Each process holds only its 2 devices' shards: layer 0's c_fc [F, D] split F-wise over "model".
        assert got["local_shapes"].tolist() == [[F // model_size, config.n_embd]] * 2
        assert rel_err(got["logits"], logits) <= 1e-5
        np.testing.assert_array_equal(got["greedy"], greedy.tokens)
        np.testing.assert_array_equal(got["sampled"], sampled.tokens)
        assert abs(float(got["loss"]) - float(metrics["loss"])) <= 1e-6 * float(metrics["loss"])
        assert rel_err(got["c_fc"], state.params["h"][0]["mlp"]["c_fc"]["weight"]) <= 1e-5


def test_the_cli_across_two_processes(model):
    path, params, config = model
    port = _free_port()
    args = ["generate", "--model", str(path), "--prompt", "The cat", "--max-new-tokens", "8", "--top-k", "20",
            "--num-samples", "3", "--seed", "4"]  # fmt: skip
    single = subprocess.run([sys.executable, "-m", "gpt2_jax", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    p0, p1 = _run_two(lambda i: [sys.executable, "-m", "gpt2_jax", *args, "--mesh", "data=2,model=2",
                                 "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                 "--process-id", str(i)])  # fmt: skip
    assert p0.stdout == single.stdout and single.stdout.count("--- sample") == 3
    assert p1.stdout == ""  # every process computes; only process 0 prints
    assert "tokens/s" in p0.stderr and "tokens/s" not in p1.stderr


def test_a_drawn_seed_is_process_0s_everywhere(model):
    path, _, _ = model
    port = _free_port()
    args = ["generate", "--model", str(path), "--prompt", "The cat", "--max-new-tokens", "8", "--num-samples", "2"]
    p0, _ = _run_two(lambda i: [sys.executable, "-m", "gpt2_jax", *args, "--mesh", "data=2,model=2", "--coordinator",
                                f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)])  # fmt: skip
    seed = re.search(r"seed (\d+); --seed \1 reproduces this", p0.stderr)
    assert seed, p0.stderr[-2000:]
    single = subprocess.run(
        [sys.executable, "-m", "gpt2_jax", *args, "--seed", seed.group(1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert single.returncode == 0 and single.stdout == p0.stdout  # both rows sampled with process 0's seed


def test_training_across_two_processes_matches_one_and_resumes(tmp_path):
    from gpt2_jax.training.loop import train
    from gpt2_jax.training.step import Hyper

    data = str(prepared_text(tmp_path))
    config = gpt2_jax.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, embd_pdrop=0.0, attn_pdrop=0.0,
                                 resid_pdrop=0.0)  # fmt: skip
    one = train(data, str(tmp_path / "one"), config=config, init="scratch",
                hyper=Hyper(lr=3e-3, warmup=2, steps=4), batch_size=4, block_size=16, eval_every=2, eval_batches=2,
                ckpt_every=2, progress=False)  # fmt: skip
    args = ["train", "--data", data, "--config", config.to_json(), "--out", str(tmp_path / "two"),
            "--lr", "3e-3", "--warmup", "2", "--batch-size", "4", "--block-size", "16", "--eval-every", "2",
            "--eval-batches", "2", "--ckpt-every", "2", "--no-progress", "--mesh", "data=2,model=2"]  # fmt: skip
    for steps, more in (("2", []), ("4", ["--resume"])):  # 2 steps, then 2 more from the sharded checkpoint
        port = _free_port()
        _run_two(lambda i: [sys.executable, "-m", "gpt2_jax", *args, "--steps", steps, *more, "--coordinator",
                            f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)])  # fmt: skip
    two = json.loads((tmp_path / "two" / "history.json").read_text())
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in two["val"]], [v for _, v in one["val"]], rtol=1e-5)
    # The saved models compute the same function. (Not every weight to 1e-5: where a gradient is ~0,
    # AdamW's division by sqrt(v) turns rounding noise into updates of up to lr.)
    (params_one, _), (params_two, _) = (
        gpt2_jax.load(tmp_path / "one" / "model"),
        gpt2_jax.load(tmp_path / "two" / "model"),
    )
    assert rel_err(gpt2_jax.forward(params_two, TOKENS, config), gpt2_jax.forward(params_one, TOKENS, config)) <= 1e-4
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.name.startswith(".")) == []  # no temp dirs left
