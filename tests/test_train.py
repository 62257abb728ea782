"""Training: loss and gradients vs transformers, overfitting, dropout, accumulation, resume, data, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gpt2_jax
from gpt2_jax.cli import main
from gpt2_jax.errors import ConfigError, GPT2JaxError
from gpt2_jax.model.layers import attend, attend_causal, causal_mask, dropout
from gpt2_jax.model.params import from_tree
from gpt2_jax.parallel.sharding import make_mesh
from gpt2_jax.training.data import DataError, TokenData, prepare
from gpt2_jax.training.loop import train
from gpt2_jax.training.loss_head import head_loss
from gpt2_jax.training.step import Hyper, decay_mask, init_state, loss_fn, make_optimizer, make_train_step
from tests.reference import make_hf_model, prepared_text, rel_err, saved_and_loaded

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=32)
TINY = gpt2_jax.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, embd_pdrop=0.0, attn_pdrop=0.0,
                           resid_pdrop=0.0)  # fmt: skip


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=31, **SHAPE), tmp_path_factory)


def torch_grads(model, tokens):
    model.zero_grad()
    logits = model(torch.as_tensor(tokens[:, :-1], dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.as_tensor(tokens[:, 1:], dtype=torch.long).reshape(-1)
    )
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("path", ["eval", "train", "train-remat"])
def test_loss_and_every_gradient_match_transformers(hf_and_ours, path):
    """eval: loss_fn's inference attention; train: the train step's (attend_causal, unrolled layers,
    dropout rates 0 so that PyTorch's eval-mode model is the reference); train-remat: recomputed."""
    model, params, config = hf_and_ours
    tokens = np.random.default_rng(0).integers(0, 101, (3, 21)).astype(np.int32)
    ref_loss, ref = torch_grads(model, tokens)
    if path == "eval":
        loss, grads = jax.value_and_grad(loss_fn)(params, jnp.asarray(tokens), config)
    else:
        config = config.replace(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
        loss, grads = jax.value_and_grad(loss_fn)(params, jnp.asarray(tokens), config, key=jax.random.key(0),
                                                  train=True, remat=path == "train-remat")  # fmt: skip
    assert abs(float(loss) - ref_loss) / ref_loss <= 1e-5
    assert rel_err(grads["wte"], ref["transformer.wte.weight"]) <= 1e-4  # embedding + unembedding: tied
    assert rel_err(grads["wpe"], ref["transformer.wpe.weight"]) <= 1e-4
    assert rel_err(grads["ln_f"]["weight"], ref["transformer.ln_f.weight"]) <= 1e-4
    assert rel_err(grads["ln_f"]["bias"], ref["transformer.ln_f.bias"]) <= 1e-4
    checked = 4
    for name, g in ref.items():
        if not name.startswith("transformer.h."):
            continue
        _, _, layer, *rest = name.split(".")
        ours = grads["h"][int(layer)]
        for part in rest:
            ours = ours[part]
        ours = from_tree(".".join(rest), np.asarray(ours))  # [out, in] (c_attn [3, D, D]) -> Conv1D [in, out]
        assert rel_err(ours, g) <= 1e-4, name
        checked += 1
    assert checked == 4 + config.n_layer * 12


@pytest.mark.parametrize("B, T", [(3, 100), (130, 2)])  # 3 chunks, the last padded; 1 position per chunk
def test_fused_head_matches_numpy(B, T):
    """head_loss (chunked, its own derivative) against the textbook in float64: mean(logsumexp - picked),
    d/dh = (softmax - onehot) @ wte / N, d/dwte = (softmax - onehot).T @ h / N."""
    rng = np.random.default_rng(7)
    h, wte = rng.normal(size=(B, T, 48)), 0.3 * rng.normal(size=(101, 48))
    targets = rng.integers(0, 101, (B, T))
    logits = h.reshape(-1, 48) @ wte.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    n = B * T
    loss = -np.log(p[np.arange(n), targets.reshape(-1)]).mean()
    d = p.copy()
    d[np.arange(n), targets.reshape(-1)] -= 1.0
    d /= n
    ours, (dh, dwte) = jax.value_and_grad(head_loss, argnums=(0, 1))(
        jnp.asarray(h, jnp.float32), jnp.asarray(wte, jnp.float32), jnp.asarray(targets, jnp.int32)
    )
    assert abs(float(ours) - loss) / loss <= 1e-6
    assert rel_err(dh, (d @ wte).reshape(B, T, 48)) <= 1e-5
    assert rel_err(dwte, d.T @ h.reshape(-1, 48)) <= 1e-5
    assert float(
        jax.grad(lambda h: 3.0 * head_loss(h, jnp.asarray(wte, jnp.float32), jnp.asarray(targets)))(
            jnp.asarray(h, jnp.float32)
        )[0, 0, 0]
    ) == pytest.approx(3.0 * float(dh[0, 0, 0]), rel=1e-6)  # chain rule


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_rate_and_scale(rate):
    """A million decisions: the dropped share is the rate (to 0.002, over 6 standard deviations), the
    kept values are scaled so that the mean stays 1, and the key alone decides the mask."""
    x = jnp.ones((1000, 1000))
    y = np.asarray(dropout(x, rate, jax.random.key(3)))
    assert abs((y == 0).mean() - rate) < 0.002
    assert abs(y.mean() - 1.0) < 0.005
    kept = np.unique(y[y != 0])
    assert kept.size == 1 and kept[0] == pytest.approx(1.0 / (1.0 - rate), rel=1e-4)
    np.testing.assert_array_equal(y, np.asarray(dropout(x, rate, jax.random.key(3))))
    other = np.asarray(dropout(x, rate, jax.random.key(4)))  # another key: an independent mask
    assert abs((other != y).mean() - 2 * rate * (1 - rate)) < 0.003


def test_training_attention_equals_inference_attention():
    """attend_causal (the train step's) and attend (inference's block-wise sums) compute the same
    attention, to float32 rounding."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 4, 37, 16))
    fast = attend_causal(q, k, v, jnp.float32(0.25))
    blocked = attend(q, jnp.swapaxes(k, -1, -2), v, causal_mask(37), jnp.float32(0.25))  # keys transposed
    assert rel_err(fast, blocked) <= 1e-6


def test_tied_wte_gradient_has_both_contributions(hf_and_ours):
    _, params, config = hf_and_ours
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 50, (2, 9)), jnp.int32)  # ids < 50 only
    g = jax.grad(loss_fn)(params, tokens, config)["wte"]
    # rows never used as input still get gradient through the unembedding (logits = h @ wte.T)
    assert float(jnp.abs(g[60:]).max()) > 0


def test_bfloat16_params_train_and_inference_forms_are_refused(hf_and_ours):
    """bfloat16 params take gradient steps in their own dtype, their loss and gradients close to float32's (the
    fused head's custom VJP gives each primal its own dtype); int8, w8a8 and float32-packed are refused by name."""
    _, params, config = hf_and_ours
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 101, (2, 9)), jnp.int32)
    low = gpt2_jax.model.precision.with_precision(params, "bfloat16")
    loss16, g16 = jax.value_and_grad(loss_fn)(low, tokens, config)
    loss32, g32 = jax.value_and_grad(loss_fn)(params, tokens, config)
    assert g16["wte"].dtype == jnp.bfloat16 and abs(float(loss16) - float(loss32)) < 2e-2 * float(loss32)
    assert rel_err(np.asarray(g16["wte"], np.float32), np.asarray(g32["wte"])) < 5e-2
    optimizer = make_optimizer(Hyper(lr=1e-3, warmup=0, steps=2))
    state, metrics = make_train_step(config, optimizer)(init_state(low, optimizer), tokens[None], jax.random.key(0))
    assert state.params["wte"].dtype == jnp.bfloat16 and np.isfinite(float(metrics["loss"]))
    for mode in ("int8", "w8a8", "float32-packed"):
        with pytest.raises(ConfigError, match=f"{mode} params are for inference only"):
            init_state(gpt2_jax.model.precision.with_precision(params, mode), optimizer)


def test_tiny_model_overfits_one_batch():
    config = gpt2_jax.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=32, embd_pdrop=0.0,
                                 attn_pdrop=0.0, resid_pdrop=0.0)  # fmt: skip
    batch = jnp.asarray(np.random.default_rng(2).integers(0, 100, (1, 4, 17)), jnp.int32)
    optimizer = make_optimizer(Hyper(lr=1e-2, min_lr=1e-3, warmup=10, steps=150, weight_decay=0.0))
    state = init_state(gpt2_jax.init_params(jax.random.key(0), config), optimizer)
    step = make_train_step(config, optimizer)
    first = None
    for i in range(150):
        state, m = step(state, batch, jax.random.key(i))
        first = float(m["loss"]) if first is None else first
    assert first > 4.0 and float(m["loss"]) < 0.05  # from ~log(100) to memorised


def test_dropout_only_in_train_mode(hf_and_ours):
    _, params, config = hf_and_ours
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 101, (2, 17)), jnp.int32)
    eval1 = loss_fn(params, tokens, config)
    assert float(eval1) == float(loss_fn(params, tokens, config, key=jax.random.key(0)))  # key ignored in eval
    logits = gpt2_jax.forward(params, tokens[:, :-1], config)  # inference: no dropout
    ref = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1).mean()
    assert abs(float(eval1) - float(ref)) < 1e-6
    a = loss_fn(params, tokens, config, key=jax.random.key(1), train=True)
    b = loss_fn(params, tokens, config, key=jax.random.key(1), train=True)
    c = loss_fn(params, tokens, config, key=jax.random.key(2), train=True)
    assert float(a) == float(b) and float(a) != float(c) and float(a) != float(eval1)
    no_drop = config.replace(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    assert abs(float(loss_fn(params, tokens, no_drop, key=jax.random.key(1), train=True)) - float(eval1)) < 1e-6
    with pytest.raises(ConfigError, match="needs a PRNG key"):
        loss_fn(params, tokens, config, train=True)


def test_accumulation_equals_one_big_batch(hf_and_ours):
    _, params, config = hf_and_ours
    config = config.replace(embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    optimizer = make_optimizer(Hyper(lr=1e-3, warmup=1, steps=10))
    step = make_train_step(config, optimizer)
    batch = jnp.asarray(np.random.default_rng(4).integers(0, 101, (4, 13)), jnp.int32)
    big, m1 = step(init_state(params, optimizer), batch[None], jax.random.key(0))
    acc, m2 = step(init_state(params, optimizer), batch.reshape(2, 2, 13), jax.random.key(0))
    assert abs(float(m1["loss"]) - float(m2["loss"])) < 1e-6
    for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(acc.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_weight_decay_mask(hf_and_ours):
    _, params, _ = hf_and_ours
    mask = decay_mask(params)
    assert mask["wte"] and not mask["wpe"]
    for layer in mask["h"]:
        assert layer["attn"]["c_attn"]["weight"] and layer["mlp"]["c_proj"]["weight"]
        assert not layer["attn"]["c_attn"]["bias"] and not layer["ln_1"]["weight"] and not mask["ln_f"]["bias"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_text(tmp_path_factory.mktemp("data"))


def test_prepared_data_and_keyed_batches(data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    data = TokenData(data_dir)
    assert meta["files"] == ["play0.txt", "play1.txt"]
    assert len(data.splits["train"]) == meta["n_train"] and len(data.splits["val"]) == meta["n_val"]
    assert data.splits["train"].dtype == np.uint16
    a = data.batch("train", jax.random.key(0), 4, 16)
    assert a.shape == (4, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, data.batch("train", jax.random.key(0), 4, 16))
    assert (a != data.batch("train", jax.random.key(1), 4, 16)).any()
    assert 0 < data.unigram_loss() < np.log(50257)


def run_train(data_dir, out, steps, resume=False, mesh=None):
    hyper = Hyper(lr=3e-3, warmup=2, steps=steps)
    return train(str(data_dir), str(out), config=TINY, init="scratch", hyper=hyper, batch_size=4, block_size=16,
                 eval_every=3, eval_batches=2, ckpt_every=3, resume=resume, progress=False, mesh=mesh)  # fmt: skip


def test_resume_equals_uninterrupted_run(data_dir, tmp_path):
    full = run_train(data_dir, tmp_path / "full", 6)
    run_train(data_dir, tmp_path / "split", 3)
    resumed = run_train(data_dir, tmp_path / "split", 6, resume=True)
    assert resumed["loss"] == full["loss"] and resumed["val"] == full["val"]
    assert len(full["loss"]) == 6 and (tmp_path / "full" / "loss.png").stat().st_size > 1000
    params, config = gpt2_jax.load(tmp_path / "full" / "model")
    assert config == TINY
    with pytest.raises(GPT2JaxError, match="already holds checkpoints; pass --resume"):
        run_train(data_dir, tmp_path / "full", 6)


def test_train_on_a_mesh_matches_one_device_and_resumes(data_dir, tmp_path, capsys):
    one = run_train(data_dir, tmp_path / "one", 6)
    # 3 steps through the CLI on a 2 x 2 mesh with --remat, then 3 more resumed (no remat) from its sharded
    # checkpoint: recomputing the blocks in the backward changes no loss.
    assert main(["train", "--data", str(data_dir), "--config", json.dumps(TINY.to_dict()), "--out",
                 str(tmp_path / "mesh"), "--steps", "3", "--lr", "3e-3", "--warmup", "2", "--batch-size", "4",
                 "--block-size", "16", "--eval-every", "3", "--eval-batches", "2", "--ckpt-every", "3",
                 "--no-progress", "--mesh", "data=2,model=2", "--remat"]) == 0  # fmt: skip
    mesh = make_mesh(2, 2)
    resumed = run_train(data_dir, tmp_path / "mesh", 6, resume=True, mesh=mesh)
    np.testing.assert_allclose(resumed["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose([v for _, v in resumed["val"]], [v for _, v in one["val"]], rtol=1e-5)
    params, _ = gpt2_jax.load(tmp_path / "mesh" / "model", mesh=mesh)
    assert {s.data.shape for s in params["h"][0]["mlp"]["c_fc"]["weight"].addressable_shards} == {(64, 32)}  # [F/2, D]


def test_train_cli_and_fine_tune(data_dir, tmp_path, capsys):
    cfg = json.dumps(TINY.to_dict())
    args = [
        "train",
        "--data",
        str(data_dir),
        "--config",
        cfg,
        "--out",
        str(tmp_path / "a"),
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--block-size",
        "16",
        "--warmup",
        "1",
        "--eval-every",
        "2",
        "--no-progress",
    ]
    assert main(args) == 0
    assert "val loss" in capsys.readouterr().err
    assert main(["train", "--data", str(data_dir), "--init", str(tmp_path / "a" / "model"), "--out",
                 str(tmp_path / "b"), "--steps", "2", "--batch-size", "2", "--block-size", "16", "--warmup", "1",
                 "--no-progress", "--dropout", "0.2"]) == 0  # fmt: skip
    assert gpt2_jax.load(tmp_path / "b" / "model")[1] == TINY.replace(embd_pdrop=0.2, attn_pdrop=0.2, resid_pdrop=0.2)
    code = main(["train", "--data", str(data_dir), "--config", cfg, "--out", str(tmp_path / "c"), "--dropout", "1.5"])
    assert code == 2 and "embd_pdrop must be a dropout rate, in [0, 1), got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    code = main(["generate", "--model", str(tmp_path / "b" / "model"), "--prompt", "to be", "--max-new-tokens", "5",
                 "--seed", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("to be")
    # The run directory itself loads its model/; a training checkpoint (no config) is an error naming model/.
    code = main(
        ["generate", "--model", str(tmp_path / "b"), "--prompt", "to be", "--max-new-tokens", "5", "--seed", "0"]
    )
    assert code == 0 and capsys.readouterr().out == out
    history = json.loads((tmp_path / "a" / "history.json").read_text())
    assert history["first_step_s"] > 0 and history["tokens_per_s"] > 0
    code = main(["generate", "--model", str(tmp_path / "a" / "checkpoints" / "4"), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"error: {tmp_path / 'a' / 'checkpoints' / '4'}: a training checkpoint (params + "
        f"optimizer state, no config); load the run's final model: --model {tmp_path / 'a' / 'model'}"
    )


def test_bad_training_input(data_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"holds no \.txt files"):
        prepare(tmp_path / "empty", tmp_path / "p1")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="the text is empty"):
        prepare(tmp_path / "blank", tmp_path / "p2")
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("to be or not to be " * 5)
    prepare(tmp_path / "short", tmp_path / "short_data")
    base = ["train", "--steps", "2", "--batch-size", "2", "--no-progress"]
    cfg = ["--config", json.dumps(TINY.to_dict())]
    cases = [
        ([*cfg, "--data", str(tmp_path / "short_data"), "--block-size", "32", "--out", str(tmp_path / "o1")],
         "split has .* tokens, fewer than block_size \\+ 1 = 33"),
        ([*cfg, "--data", str(data_dir), "--block-size", "16", "--out", str(tmp_path / "o2"), "--init",
          str(tmp_path / "missing")], "no such file or directory"),
        ([*cfg, "--data", str(tmp_path / "empty"), "--block-size", "16", "--out", str(tmp_path / "o3")],
         "not a prepared data directory"),
        ([*cfg, "--data", str(data_dir), "--block-size", "100", "--out", str(tmp_path / "o4")],
         "--block-size 100 exceeds the model's context n_positions=64"),
        (["--data", str(data_dir), "--block-size", "16", "--out", str(tmp_path / "o5")],
         "--init scratch needs --config"),
        ([*cfg, "--data", str(tmp_path / "no-such-data"), "--block-size", "16", "--out", str(tmp_path / "o6")],
         "not a prepared data directory"),
    ]  # fmt: skip
    (tmp_path / "file").write_text("not a directory")
    cases.append(
        (
            [*cfg, "--data", str(data_dir), "--block-size", "16", "--out", str(tmp_path / "file" / "out")],
            "is not writable",
        )
    )
    for extra, message in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err
    for out in ("o1", "o2", "o3", "o4", "o5", "o6"):  # a failed run leaves no --out behind, not even an empty one
        assert not (tmp_path / out).exists(), out
    assert not (tmp_path / "file" / "out").exists()


def test_recent_rate_leaves_out_the_compiling_first_step():
    from gpt2_jax.training.loop import RecentRate

    rate = RecentRate(window=3)
    rate.add(12.0, 100)  # the first step: compile included
    assert rate.first_s == 12.0 and rate.rate() == 0.0
    for seconds in (1.0, 1.0, 0.5, 0.25, 0.25):
        rate.add(seconds, 100)
    assert rate.rate() == 300 / 1.0  # the last three steps only


def test_init_config_mismatch(data_dir, tmp_path, capsys):
    assert main(["train", "--data", str(data_dir), "--config", json.dumps(TINY.to_dict()), "--out",
                 str(tmp_path / "a"), "--steps", "1", "--batch-size", "2", "--block-size", "16", "--warmup", "1",
                 "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    other = TINY.replace(n_embd=64)
    code = main(
        [
            "train",
            "--data",
            str(data_dir),
            "--config",
            json.dumps(other.to_dict()),
            "--init",
            str(tmp_path / "a" / "model"),
            "--out",
            str(tmp_path / "b"),
            "--steps",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--config does not match --init" in err and "'n_embd': (64, 32)" in err


def test_bundled_model_predicts_shakespeare():
    """The shipped model is trained: a famous passage scores far below a random model's log V.
    (Its val loss against the unigram baseline is computed in notebooks/06_training.)"""
    from gpt2_jax import BUNDLED_MODEL

    params, config = gpt2_jax.load(BUNDLED_MODEL)
    enc = gpt2_jax.tokenizer()
    text = (
        "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief."
    )
    tokens = jnp.asarray([enc.encode(text)], jnp.int32)
    loss = float(loss_fn(params, tokens, config))
    uniform = float(np.log(50257))
    assert loss < uniform - 3.0, (loss, uniform)  # a random model scores about log V = 10.8
