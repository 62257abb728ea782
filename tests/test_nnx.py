"""gpt2_jax.nnx: GPT2LMHead against the functional API (bits), transformers (1e-5) and make_train_step (1e-6);
its state is the params pytree's arrays; split/merge, save/load both ways, every format, a classifier on top."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import gpt2_jax
from gpt2_jax.errors import CheckpointError, ConfigError, InputError
from gpt2_jax.model import apply
from gpt2_jax.model.invariant import matmul
from gpt2_jax.model.tree_layout import dotted
from gpt2_jax.nnx import GPT2LMHead, params_of
from gpt2_jax.nnx.tree import Block
from gpt2_jax.parallel.sharding import make_mesh
from gpt2_jax.training.step import decay_mask
from tests.reference import (
    exact_logits,
    hf_state,
    make_hf_model,
    random_tokens,
    rel_err,
    save_bin_dir,
    save_nanogpt,
    save_sharded_bin_dir,
)

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=32)
DROPOUT = dict(embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)
TOKENS = random_tokens(101, (3, 12), seed=1)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and bool((bits(a) == bits(b)).all())


@pytest.fixture(scope="module")
def hf():
    return make_hf_model(seed=27, **SHAPE)


@pytest.fixture(scope="module")
def loaded(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "model"
    hf.save_pretrained(path)
    return gpt2_jax.load(path)


def test_state_is_the_params_pytree_no_copy(loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    assert model.h[1].attn.c_attn.weight.get_value() is params["h"][1]["attn"]["c_attn"]["weight"]
    back = model.params()
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    # nnx.state reads like the params pytree: the same names, the same buffers
    state = nnx.state(model, nnx.Param)
    flat = {dotted(p): a for p, a in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
    want = {dotted(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert sorted(flat) == sorted(want) and "h.1.attn.c_attn.weight" in flat
    assert all(flat[n].unsafe_buffer_pointer() == want[n].unsafe_buffer_pointer() for n in want)
    assert all(a is b for a, b in zip(jax.tree.leaves(params_of(nnx.state(model))), jax.tree.leaves(params)))
    # stacked params stay stacked: h is one Block of [L, ...] leaves, still no copy
    stacked = gpt2_jax.model.stack_layers(params)
    smodel = GPT2LMHead.from_params(stacked, config)
    assert isinstance(smodel.h, Block) and smodel.h.mlp.c_fc.weight.shape == (2, 192, 48)
    assert all(a is b for a, b in zip(jax.tree.leaves(smodel.params()), jax.tree.leaves(stacked)))


def test_built_with_init_params_and_bad_params_named(loaded):
    _, config = loaded
    model = GPT2LMHead(config, rngs=nnx.Rngs(3))
    want = gpt2_jax.init_params(nnx.Rngs(3).params(), config)  # the same stream: its first params key
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(model.params()), jax.tree.leaves(want)))
    assert isinstance(GPT2LMHead(config, rngs=nnx.Rngs(3), stacked=True).h, Block)
    with pytest.raises(ConfigError, match=r"rngs=nnx\.Rngs"):
        GPT2LMHead(config)
    wrong = gpt2_jax.init_params(jax.random.key(0), config.replace(n_embd=24))
    with pytest.raises(
        CheckpointError,
        match=r"n_embd=48, but GPT2LMHead params holds wte\.weight of shape \(101, 24\) \(expected \(101, 48\)\)",
    ):
        GPT2LMHead.from_params(wrong, config)


def test_logits_bit_for_bit_and_transformers(hf, loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    want = gpt2_jax.forward(params, TOKENS, config)
    assert same_bits(model(TOKENS), want)
    assert same_bits(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)), want)
    assert rel_err(model(TOKENS), exact_logits(hf, TOKENS)) <= 1e-5
    with pytest.raises(InputError, match=r"token id 101 at \[0, 1\]"):
        model([[3, 101]])


def test_split_merge_round_trip(loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    again = nnx.merge(graphdef, state)
    assert isinstance(again, GPT2LMHead) and again.config == config
    assert all(a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
               for a, b in zip(jax.tree.leaves(again.params()), jax.tree.leaves(params)))  # fmt: skip
    # the Flax pattern for jax.jit: graphdef static, state an argument
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(TOKENS))
    assert same_bits(logits, gpt2_jax.forward(params, TOKENS, config))


def test_dropout_keys_from_the_module_rngs(loaded):
    params, config = loaded
    config = config.replace(**DROPOUT)
    model = GPT2LMHead.from_params(params, config, rngs=nnx.Rngs(5))
    twin, dropped = nnx.Rngs(5), jax.jit(apply, static_argnames="config")  # the training forward, one program
    first, second = model(TOKENS, train=True), model(TOKENS, train=True)
    eval_logits = gpt2_jax.forward(params, TOKENS, config)
    assert same_bits(first, dropped(params, jnp.asarray(TOKENS), config, twin.dropout()))
    assert same_bits(second, dropped(params, jnp.asarray(TOKENS), config, twin.dropout()))
    assert not same_bits(first, eval_logits) and not same_bits(first, second)  # dropout on, a new key per call
    assert same_bits(model(TOKENS), eval_logits)  # train=False drops nothing
    jitted = nnx.jit(lambda m, t: m(t, train=True))
    third, fourth = jitted(model, jnp.asarray(TOKENS)), jitted(model, jnp.asarray(TOKENS))
    assert int(model.rngs.default.count[...]) == 4  # the key counter advances through nnx.jit too
    assert same_bits(third, dropped(params, jnp.asarray(TOKENS), config, twin.dropout()))
    assert not same_bits(third, fourth)
    with pytest.raises(ConfigError, match="has none"):
        GPT2LMHead.from_params(params, config)(TOKENS, train=True)


def test_features_are_transformers_last_hidden_state(hf, loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    h = model.features(TOKENS)
    with torch.no_grad():
        ref = hf.transformer(torch.as_tensor(TOKENS, dtype=torch.long)).last_hidden_state.numpy()
    assert h.shape == (3, 12, 48) and rel_err(h, ref) <= 1e-5
    assert same_bits(matmul(h, params["wte"]), gpt2_jax.forward(params, TOKENS, config))  # what unembed reads


def test_generate_and_logprobs_bit_for_bit(loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    for sampling in (gpt2_jax.SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True),
                     gpt2_jax.SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, logprobs=True)):  # fmt: skip
        got = model.generate(prompts, jax.random.key(4), sampling=sampling)
        want = gpt2_jax.generate(params, config, prompts, jax.random.key(4), sampling=sampling)
        assert (got.tokens == want.tokens).all() and (got.lengths == want.lengths).all()
        assert same_bits(got.logprobs, want.logprobs) and got.finish_reason == want.finish_reason
    other = model.generate(prompts, jax.random.key(5), sampling=sampling)
    assert not (other.tokens == want.tokens).all()  # the key is used


def test_hooks_through_the_module(loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    logits, cache = model.run_with_cache(TOKENS)
    want_logits, want = gpt2_jax.run_with_cache(params, TOKENS, config)
    assert same_bits(logits, want_logits) and list(cache) == list(want)
    assert all(same_bits(cache[n], want[n]) for n in want)
    ablate = {"blocks.0.hook_mlp_out": jnp.zeros_like}
    edited = model.run_with_hooks(TOKENS, ablate)
    assert same_bits(edited, gpt2_jax.run_with_hooks(params, TOKENS, config, ablate))
    assert not same_bits(edited, logits)


def test_decay_mask_sees_the_params_paths(loaded):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config)
    want = jax.tree.leaves(decay_mask(params))
    assert any(want) and not all(want)
    assert jax.tree.leaves(decay_mask(nnx.state(model, nnx.Param))) == want  # Variables: a .value on each path
    assert jax.tree.leaves(decay_mask(nnx.as_pure(nnx.state(model, nnx.Param)))) == want


def test_nnx_optimizer_steps_equal_make_train_step(loaded):
    """The Flax way (nnx.Optimizer over make_optimizer, nnx.value_and_grad of loss_fn under nnx.jit) and
    the functional make_train_step: the same losses and params over 4 steps, dropout and weight decay on."""
    params, config = loaded
    config = config.replace(**DROPOUT)
    hyper = gpt2_jax.Hyper(lr=3e-3, min_lr=3e-4, warmup=2, steps=6, weight_decay=0.5, clip=0.5)
    state = gpt2_jax.init_state(params, gpt2_jax.make_optimizer(hyper))
    step = gpt2_jax.make_train_step(config, gpt2_jax.make_optimizer(hyper))
    model = GPT2LMHead.from_params(jax.tree.map(jnp.copy, params), config)
    opt = nnx.Optimizer(model, gpt2_jax.make_optimizer(hyper), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, opt, batch, key):
        loss_of = lambda m: gpt2_jax.loss_fn(m.params(), batch, m.config, key=key, train=True)
        loss, grads = nnx.value_and_grad(loss_of)(model)
        opt.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    for s in range(4):
        batch, key = jnp.asarray(rng.integers(0, 101, (2, 17)), jnp.int32), jax.random.key(s)
        state, metrics = step(state, batch[None], key)
        loss = nnx_step(model, opt, batch, jax.random.fold_in(key, 0))  # micro-batch 0's key in make_train_step
        assert abs(float(loss) - float(metrics["loss"])) <= 1e-6
        for a, b in zip(jax.tree.leaves(model.params()), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert int(opt.step[...]) == 4
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(model.params()), jax.tree.leaves(params)))
    assert moved > 1e-3  # the steps did move the params, so the comparison above means something


def test_save_with_one_api_load_with_the_other(loaded, tmp_path):
    params, config = loaded
    model = GPT2LMHead.from_params(params, config, rngs=nnx.Rngs(0))
    model.save(tmp_path / "module")
    gpt2_jax.nnx.save(tmp_path / "state", nnx.state(model), config)  # rngs in the state: left out
    for path in ("module", "state"):
        back, back_config = gpt2_jax.load(tmp_path / path)
        assert back_config == config
        assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
    with pytest.raises(CheckpointError, match="force"):
        model.save(tmp_path / "module")
    gpt2_jax.checkpoints.native.save(tmp_path / "functional", params, config)
    again = GPT2LMHead.from_pretrained(tmp_path / "functional")
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(again.params()), jax.tree.leaves(params)))
    target = GPT2LMHead(config, rngs=nnx.Rngs(1))  # the Flax way: restore into a built module
    nnx.update(target, nnx.state(GPT2LMHead.from_pretrained(tmp_path / "module"), nnx.Param))
    assert same_bits(target(TOKENS), gpt2_jax.forward(params, TOKENS, config))


GELU = dict(SHAPE, activation_function="gelu")  # nanoGPT's exact GELU, so its reference uses it too
WRITERS = {
    "hf-safetensors": lambda m, p: (m.save_pretrained(p), p)[1],
    "hf-sharded-safetensors": lambda m, p: (m.save_pretrained(p, max_shard_size="20KB"), p)[1],
    "hf-bin": lambda m, p: save_bin_dir(m, p, prefix=True, lm_head=True),
    "hub-bin-no-prefix-buffers": lambda m, p: save_bin_dir(m, p, prefix=False, buffers=True),
    "hf-sharded-bin": save_sharded_bin_dir,
    "safetensors-file": lambda m, p: (m.save_pretrained(p), p / "model.safetensors")[1],
    "nanogpt-ckpt": lambda m, p: save_nanogpt(m, p / "ckpt.pt"),
    "nanogpt-out-dir": lambda m, p: save_nanogpt(m, p / "ckpt.pt").parent,
    "nanogpt-no-bias": lambda m, p: save_nanogpt(m, p / "ckpt.pt", bias=False),
    "gpt2_jax": lambda m, p: (m.save_pretrained(p / "hf"), gpt2_jax.convert(p / "hf", p / "ours"))[1],
}


@pytest.fixture(scope="module")
def references():
    return {"gpt2": make_hf_model(seed=27, **SHAPE), "gelu": make_hf_model(seed=28, **GELU),
            "gelu-no-bias": make_hf_model(seed=29, zero_biases=True, **GELU)}  # fmt: skip


@pytest.mark.parametrize("fmt", [*WRITERS, "bin-file"])
def test_from_pretrained_every_format(references, fmt, tmp_path):
    kind = "gelu-no-bias" if fmt == "nanogpt-no-bias" else "gelu" if fmt.startswith("nanogpt") else "gpt2"
    hf = references[kind]
    if fmt == "bin-file":  # a lone .bin: its config given
        path = tmp_path / "weights.bin"
        torch.save(hf_state(hf), path)
        model = GPT2LMHead.from_pretrained(path, config=gpt2_jax.GPT2Config(**SHAPE))
    else:
        path = WRITERS[fmt](hf, tmp_path)
        model = GPT2LMHead.from_pretrained(path)
    assert rel_err(model(TOKENS), exact_logits(hf, TOKENS)) <= 1e-5
    params, config = gpt2_jax.load(path, config=None if fmt != "bin-file" else model.config)
    assert model.config == config and same_bits(model(TOKENS), gpt2_jax.forward(params, TOKENS, config))
    assert ("bias" in model.params()["h"][0]["mlp"]["c_fc"]) is (fmt != "nanogpt-no-bias")


def test_from_pretrained_dtype_and_mesh(references, tmp_path):
    hf = references["gpt2"]
    hf.save_pretrained(tmp_path / "hf")
    half = GPT2LMHead.from_pretrained(tmp_path / "hf", dtype="bfloat16")
    assert {a.dtype for a in jax.tree.leaves(half.params())} == {jnp.dtype(jnp.bfloat16)}
    mesh = make_mesh(data=2, model=3, devices=jax.devices()[:6])
    sharded = GPT2LMHead.from_pretrained(tmp_path / "hf", mesh=mesh)
    assert sharded.h[0].attn.c_attn.weight.get_value().sharding.mesh.shape == {"data": 2, "model": 3}
    rows = random_tokens(101, (2, 12), seed=2)  # a batch the data axis divides
    assert rel_err(sharded(rows), exact_logits(hf, rows)) <= 1e-5


class Sentiment(nnx.Module):
    """A user's model: the bundled GPT-2 as a submodule, a linear head on its last real token's features."""

    def __init__(self, gpt2: GPT2LMHead, *, rngs: nnx.Rngs):
        self.gpt2 = gpt2
        self.head = nnx.Linear(gpt2.config.n_embd, 2, rngs=rngs)

    def __call__(self, tokens: jax.Array, last: jax.Array) -> jax.Array:  # [B, T], [B] -> [B, 2]
        h = self.gpt2.features(tokens)
        return self.head(h[jnp.arange(tokens.shape[0]), last])


LINES = [("What a wonderful, joyful day", 1), ("I love this sweet song", 1), ("A kind and gentle friend", 1),
         ("Fair and happy news", 1), ("What a terrible, hateful day", 0), ("I hate this bitter lie", 0),
         ("A cruel and wicked villain", 0), ("Foul and wretched news", 0)]  # fmt: skip


def test_classifier_with_gpt2_inside_trains_end_to_end():
    enc = gpt2_jax.tokenizer()
    ids = [enc.encode(text) for text, _ in LINES]
    T = max(map(len, ids))
    tokens = jnp.asarray([row + [enc.eot_token] * (T - len(row)) for row in ids], jnp.int32)  # right padding
    last, labels = jnp.asarray([len(row) - 1 for row in ids]), jnp.asarray([y for _, y in LINES])
    gpt2 = GPT2LMHead.from_pretrained(gpt2_jax.BUNDLED_MODEL, dtype="float32")
    start = jax.tree.map(jnp.copy, gpt2.params())
    model = Sentiment(gpt2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_of(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(tokens, last), labels).mean()

    @nnx.jit
    def train_step(model, opt):
        loss, grads = nnx.value_and_grad(loss_of)(model)
        opt.update(model, grads)
        return loss

    losses = [float(train_step(model, opt)) for _ in range(12)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert (jnp.argmax(model(tokens, last), -1) == labels).all()
    assert model.gpt2 is gpt2  # trained in place, end to end: the GPT-2 weights moved too
    moved = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(gpt2.params()), jax.tree.leaves(start))]
    assert min(moved) > 0
