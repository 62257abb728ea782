"""Sharded over 8 CPU devices (tests/conftest.py): the same logits, tokens and training as one device,
parameters really split, Megatron's communication pattern, loading into a mesh, the CLI, bad meshes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import gpt2_jax
from gpt2_jax.checkpoints import native as checkpoint
from gpt2_jax.cli import main
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.decode import prefill
from gpt2_jax.generation.generator import generate, generate_stream
from gpt2_jax.model.gpt2 import _forward
from gpt2_jax.model.params import stack_layers, unstack_layers
from gpt2_jax.parallel.sharding import make_mesh, on_mesh, param_shardings, parse_mesh, shard_params
from gpt2_jax.training.step import Hyper, init_state, make_optimizer, make_train_step
from tests.reference import hf_logits, make_hf_model, random_tokens, rel_err, saved_and_loaded

MESHES = [(8, 1), (1, 8), (2, 4), (4, 2)]
IDS = [f"data{d}xmodel{m}" for d, m in MESHES]
# 8 heads of 8, F = 256: every mesh above divides both. Vocab 101 leaves wte replicated; 128 splits it.
SHAPE = dict(n_layer=2, n_head=8, n_embd=64, n_positions=64)
PROMPTS = [[5, 17, 3], [9] * 11, [42, 7, 7, 1, 0]]  # ragged, 3 rows: no data axis above 1 divides them
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9)


def test_all_eight_devices_are_there():
    assert jax.device_count() == 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {v: saved_and_loaded(make_hf_model(seed=61, vocab_size=v, **SHAPE), tmp_path_factory) for v in (101, 128)}


@pytest.fixture(scope="module", params=[101, 128], ids=["wte-replicated", "wte-vocab-split"])
def model(request, models):
    return models[request.param]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=IDS)
def test_sharded_forward_matches_one_device_and_transformers(model, mesh_shape):
    hf, params, config = model
    tokens = random_tokens(config.vocab_size, (8, 24), seed=3)
    single = np.asarray(gpt2_jax.forward(params, tokens, config))
    sharded = gpt2_jax.forward(shard_params(params, config, make_mesh(*mesh_shape)), tokens, config)
    assert isinstance(sharded.sharding, NamedSharding) and sharded.sharding.mesh.devices.size == 8
    assert rel_err(sharded, single) <= 1e-5
    assert rel_err(sharded, hf_logits(hf, tokens)) <= 1e-5


# generate's programs are the slowest here to compile for a mesh (40-90 s each on a 2-core machine): the pure data
# split (8 devices, 3 ragged rows padded) and both axes at once; forward above covers all four meshes.
@pytest.mark.parametrize("mesh_shape", [(8, 1), (2, 4)], ids=["data8xmodel1", "data2xmodel4"])
def test_sharded_generate_gives_the_same_tokens(model, mesh_shape):
    _, params, config = model
    sharded = shard_params(params, config, make_mesh(*mesh_shape))
    # Greedy through per-layer buffers (what load() gives); seeded sampling through stacked layers.
    for kw, layout in (({"temperature": 0.0}, sharded), (SAMPLED, stack_layers(sharded))):
        one = generate(params, config, PROMPTS, jax.random.key(7), max_new_tokens=12, eos_id=None,
                       return_logprobs=True, **kw)  # fmt: skip
        many = generate(layout, config, PROMPTS, jax.random.key(7), max_new_tokens=12, eos_id=None,
                        return_logprobs=True, **kw)  # fmt: skip
        np.testing.assert_array_equal(many.tokens, one.tokens)
        np.testing.assert_array_equal(many.lengths, one.lengths)
        assert rel_err(many.logprobs, one.logprobs) <= 1e-5


def test_sharded_stream_gives_the_same_tokens(models):
    _, params, config = models[128]  # wte split over "model" too
    sharded = shard_params(params, config, make_mesh(2, 4))
    one = generate(params, config, PROMPTS, jax.random.key(7), max_new_tokens=12, eos_id=None, **SAMPLED)
    streamed = [t for t, _ in generate_stream(sharded, config, PROMPTS, jax.random.key(7), max_new_tokens=12,
                                              eos_id=None, **SAMPLED)]  # fmt: skip
    np.testing.assert_array_equal(np.stack(streamed, axis=1), one.tokens)


def _collectives(hlo: str) -> dict[str, int]:
    return {op: len(re.findall(rf"\b{op}(-start)?\(", hlo)) for op in
            ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")}  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=["data1xmodel8", "data2xmodel4"])
def test_megatron_layout_moves_activations_never_weights(model, mesh_shape):
    """Per block, one all-reduce after attention's c_proj and one after the MLP's, plus one for the lookup in a
    vocab-split wte; nothing is ever gathered. (Each layer's matmuls sit in that layer's branch of a
    lax.switch inside the one scan body, so the program text holds each all-reduce once per layer.)"""
    _, params, config = model
    mesh = make_mesh(*mesh_shape)
    sharded = shard_params(params, config, mesh)
    with on_mesh(mesh):
        hlo = _forward.lower(sharded, random_tokens(config.vocab_size, (4, 16)), config).compile().as_text()
    wte_split = config.vocab_size % mesh.shape["model"] == 0
    assert _collectives(hlo) == {"all-reduce": 2 * config.n_layer + wte_split, "all-gather": 0, "all-to-all": 0,
                                 "collective-permute": 0, "reduce-scatter": 0}  # fmt: skip


def test_each_device_holds_its_share(model):
    _, params, config = model
    mesh = make_mesh(2, 4)
    params = stack_layers(params)
    sharded = shard_params(params, config, mesh)
    L, D, F, V = config.n_layer, config.n_embd, config.mlp_dim, config.vocab_size
    h = sharded["h"]
    expected = {  # the shape every device holds: 1/4 of the split axis, the rest whole (weights [out, in])
        "c_attn.weight": (h["attn"]["c_attn"]["weight"], (L, 3, D // 4, D)),
        "c_attn.bias": (h["attn"]["c_attn"]["bias"], (L, 3, D // 4)),
        "attn.c_proj.weight": (h["attn"]["c_proj"]["weight"], (L, D, D // 4)),
        "attn.c_proj.bias": (h["attn"]["c_proj"]["bias"], (L, D)),
        "c_fc.weight": (h["mlp"]["c_fc"]["weight"], (L, F // 4, D)),
        "c_fc.bias": (h["mlp"]["c_fc"]["bias"], (L, F // 4)),
        "mlp.c_proj.weight": (h["mlp"]["c_proj"]["weight"], (L, D, F // 4)),
        "ln_1.weight": (h["ln_1"]["weight"], (L, D)),
        "wpe": (sharded["wpe"], (config.n_positions, D)),
        "wte": (sharded["wte"], (V // 4, D) if V % 4 == 0 else (V, D)),
    }
    for name, (array, shape) in expected.items():
        assert len(array.addressable_shards) == 8, name
        assert {s.data.shape for s in array.addressable_shards} == {shape}, name
    # Each head's columns stay together: device (0, m) holds heads 2m, 2m+1 of q, of k and of v.
    w = np.asarray(params["h"]["attn"]["c_attn"]["weight"])  # stacked, as sharded above
    for shard in h["attn"]["c_attn"]["weight"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    # The KV cache: rows over "data", heads over "model".
    L, H, K = config.n_layer, config.n_head, config.head_dim
    for layout in (sharded, unstack_layers(sharded)):  # either layout: one [L, B, H, S, K] cache
        with on_mesh(mesh):
            state = prefill(layout, np.zeros((4, 16), np.int32), np.full(4, 16, np.int32),
                            jax.random.split(jax.random.key(0), 4), config, 32)  # fmt: skip
        assert {s.data.shape for s in state.cache.k.addressable_shards} == {(L, 2, H // 4, K, 32)}  # transposed
        assert {s.data.shape for s in state.cache.v.addressable_shards} == {(L, 2, H // 4, 32, K)}


def _train_both(params, config, mesh_shape, optimizer, steps=2):
    """The same steps (micro-batch accumulation and dropout on) on one device and on a mesh."""
    step = make_train_step(config, optimizer)
    batch = random_tokens(config.vocab_size, (2, 8, 17), seed=5)  # [A=2 micro-batches, B=8, T+1]
    one = init_state(params, optimizer)
    mesh = make_mesh(*mesh_shape)
    many = init_state(shard_params(params, config, mesh), optimizer)
    metrics = []
    for s in range(steps):
        one, m1 = step(one, batch, jax.random.key(s))
        many, m2 = step(many, batch, jax.random.key(s))
        metrics.append((m1, m2))
    # The step keeps the layout: parameters stay where shard_params put them.
    for a, sharding in zip(jax.tree.leaves(many.params), jax.tree.leaves(param_shardings(params, config, mesh))):
        assert a.sharding.is_equivalent_to(sharding, a.ndim)
    return one, many, metrics


@pytest.mark.parametrize(
    "vocab, mesh_shape",
    [(101, (8, 1)), (128, (2, 4))],
    ids=["wte-replicated-data8xmodel1", "wte-vocab-split-data2xmodel4"],
)
def test_sharded_train_step_matches_one_device(models, vocab, mesh_shape):
    _, params, config = models[vocab]
    config = config.replace(embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1)  # dropout masks must agree too
    # Plain SGD: parameters move linearly with the gradients, so they must agree as closely as those.
    one, many, metrics = _train_both(params, config, mesh_shape, optax.sgd(0.5))
    for m1, m2 in metrics:
        assert rel_err(m2["loss"], m1["loss"]) <= 1e-6 and rel_err(m2["grad_norm"], m1["grad_norm"]) <= 1e-5
    for a, b in zip(jax.tree.leaves(many.params), jax.tree.leaves(one.params)):
        assert rel_err(a, b) <= 1e-5
    if vocab != 128:
        return  # (the AdamW check below costs two more compiles: once is enough)
    # The project's AdamW: the same losses and gradient norms. (Adam divides by sqrt(v): where a
    # gradient is ~1e-9, rounding noise flips its update's sign, so parameters agree only to ~lr there.)
    one, many, metrics = _train_both(params, config, mesh_shape, make_optimizer(Hyper(lr=1e-3, warmup=1, steps=10)))
    for m1, m2 in metrics:
        assert rel_err(m2["loss"], m1["loss"]) <= 1e-6 and rel_err(m2["grad_norm"], m1["grad_norm"]) <= 1e-5
    mu = many.opt_state[1][0].mu  # AdamW's first moment lives where its parameter does
    assert mu["h"][0]["mlp"]["c_fc"]["weight"].sharding == many.params["h"][0]["mlp"]["c_fc"]["weight"].sharding


def test_checkpoints_restore_straight_into_a_mesh(model, tmp_path):
    _, params, config = model
    path = checkpoint.save(tmp_path / "ckpt", params, config)
    mesh = make_mesh(2, 4)
    for dtype in (None, "bfloat16"):
        restored, _ = gpt2_jax.load(path, mesh=mesh, dtype=dtype)
        for a, want, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(params),
                                     jax.tree.leaves(param_shardings(params, config, mesh))):  # fmt: skip
            assert a.sharding == sharding and a.dtype == (want.dtype if dtype is None else jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(want.astype(a.dtype), np.float32))


def test_a_huggingface_directory_loads_into_a_mesh(model, tmp_path):
    hf, params, config = model
    hf.save_pretrained(tmp_path / "hf")
    sharded, _ = gpt2_jax.load(tmp_path / "hf", mesh=make_mesh(1, 8))
    assert tuple(sharded["h"][0]["mlp"]["c_fc"]["weight"].sharding.spec) == ("model", None)  # [F, D]: F split
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cli_mesh_prints_the_same_text(tmp_path, capsys):
    model = make_hf_model(seed=62, n_layer=1, n_head=4, n_embd=32, vocab_size=50257, n_positions=64)
    model.save_pretrained(tmp_path / "hf")
    args = [
        "generate",
        "--model",
        str(tmp_path / "hf"),
        "--prompt",
        "To be",
        "--max-new-tokens",
        "10",
        "--top-k",
        "40",
        "--seed",
        "0",
    ]  # the same seed in each run
    assert main([*args, "--num-samples", "3"]) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--num-samples", "3", "--mesh", "data=2,model=4"]) == 0  # 3 rows on 2 data slices
    assert capsys.readouterr().out == plain
    assert main([*args, "--stream", "--mesh", "model=2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == plain.splitlines()[1]  # sample 1, streamed


def test_bad_meshes_name_both_numbers(capsys):
    twelve_heads = gpt2_jax.GPT2Config(n_layer=1, n_head=12, n_embd=96, vocab_size=64, n_positions=16)  # gpt2's 12
    with pytest.raises(ConfigError, match=r"model axis of size 8 does not divide n_head = 12"):
        shard_params(gpt2_jax.init_params(jax.random.key(0), twelve_heads), twelve_heads, make_mesh(1, 8))
    odd_mlp = gpt2_jax.GPT2Config(n_layer=1, n_head=8, n_embd=64, n_inner=100, vocab_size=64, n_positions=16)
    with pytest.raises(ConfigError, match=r"model axis of size 8 does not divide the MLP width = 100"):
        shard_params(gpt2_jax.init_params(jax.random.key(0), odd_mlp), odd_mlp, make_mesh(1, 8))
    with pytest.raises(ConfigError, match=r"data=3 x model=4 needs 12 devices, but 8 are available"):
        make_mesh(3, 4)
    with pytest.raises(ConfigError, match=r"mesh model=3 does not divide the 8 available devices"):
        make_mesh(model=3)
    with pytest.raises(ConfigError, match=r"expected data=N,model=M"):
        parse_mesh("data=2,heads=4")
    assert main(["generate", "--model", "gpt2-none", "--prompt", "x", "--mesh", "data=0"]) == 2
    assert "mesh data size must be an int >= 1, got 0" in capsys.readouterr().err


def test_mesh_defaults_and_partial_sizes():
    assert dict(make_mesh().shape) == {"data": 8, "model": 1}
    assert dict(make_mesh(model=4).shape) == {"data": 2, "model": 4}
    assert dict(parse_mesh("data=2").shape) == {"data": 2, "model": 4}
    assert make_mesh(1, 2).devices.size == 2  # a mesh may use fewer devices than there are


def test_stacked_and_unstacked_shard_alike(model):
    _, params, config = model
    mesh = make_mesh(2, 4)
    a = unstack_layers(shard_params(stack_layers(params), config, mesh))
    b = shard_params(params, config, mesh)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
