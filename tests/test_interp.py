"""Look inside: every hook point against TransformerLens 4.3's TransformerBridge on the same random checkpoint
(no weight processing), edits that change what they should, gradients, vmap, a mesh, bad input, the tools.

One small random GPT-2 (every parameter random, LayerNorms included), one bridge and one run of each side
are shared by the whole module.
"""

import copy
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gpt2_jax
from gpt2_jax import interp as inspect
from gpt2_jax.errors import InputError
from gpt2_jax.model.gpt2 import forward_cached
from gpt2_jax.model.kv_cache import init_cache
from gpt2_jax.parallel.sharding import make_mesh, shard_params
from tests.reference import hf_logits, make_hf_model, random_tokens, rel_err

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bridge reads the saved directory, never the Hub

SHAPE = dict(n_layer=2, n_head=3, n_embd=48, vocab_size=101, n_positions=64)
TOL = 1e-5
TOKENS = random_tokens(101, (2, 12), seed=14)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def masked_rel_err(ours, theirs, name: str) -> float:
    """rel_err over the finite entries, once both have -inf in the same places (masked attention scores)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    masked = np.isneginf(theirs)
    np.testing.assert_array_equal(np.isneginf(ours), masked, err_msg=name)
    return rel_err(ours[~masked], theirs[~masked])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers model, its save_pretrained directory, gpt2_jax params, config)."""
    hf = make_hf_model(seed=14, **SHAPE)
    path = tmp_path_factory.mktemp("inspect") / "hf"
    hf.save_pretrained(path)
    return hf, path, *gpt2_jax.load(path)


def boot(model, **compat):
    """A TransformerBridge on a copy of the model (weight processing rewrites the model it wraps)."""
    from transformer_lens.model_bridge import TransformerBridge

    hf, path, _, _ = model
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=copy.deepcopy(hf))
    bridge.enable_compatibility_mode(disable_warnings=True, **compat)
    return bridge


@pytest.fixture(scope="module")
def bridge(model):
    return boot(model, no_processing=True)  # the checkpoint's own weights, as gpt2_jax keeps them


@pytest.fixture(scope="module")
def tl_run(bridge):
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(torch.as_tensor(TOKENS, dtype=torch.long))
    return logits.numpy(), {name: t.numpy() for name, t in cache.items()}


@pytest.fixture(scope="module")
def our_run(model):
    _, _, params, config = model
    logits, cache = gpt2_jax.run_with_cache(params, TOKENS, config)
    return np.asarray(logits), {name: np.asarray(a) for name, a in cache.items()}


def test_every_hook_point_matches_transformer_lens(model, tl_run, our_run):
    hf, _, _, config = model
    (tl_logits, tl_cache), (logits, cache) = tl_run, our_run
    assert list(cache) == list(inspect.hook_names(config)) and len(cache) == 4 + 17 * config.n_layer
    for name, ours in cache.items():
        theirs = tl_cache[name]
        assert ours.shape == theirs.shape, f"{name}: {ours.shape} vs TransformerLens {theirs.shape}"
        err = masked_rel_err(ours, theirs, name)  # attention scores: -inf above the diagonal on both sides
        assert err <= TOL, f"{name}: relative error {err:.2e} against TransformerLens"
    assert rel_err(logits, tl_logits) <= TOL and rel_err(logits, hf_logits(hf, TOKENS)) <= TOL
    assert cache["blocks.1.attn.hook_pattern"].sum(-1) == pytest.approx(1.0, abs=1e-6)


def zero_head(head: int):
    return lambda z: z.at[:, :, head].set(0.0)  # z [B, T, H, K]


def test_head_ablation_matches_transformer_lens(model, bridge, tl_run, our_run):
    _, _, params, config = model

    def tl_hook(z, hook):
        z[:, :, 1] = 0.0
        return z

    with torch.no_grad():
        theirs = bridge.run_with_hooks(torch.as_tensor(TOKENS, dtype=torch.long),
                                       fwd_hooks=[("blocks.0.attn.hook_z", tl_hook)]).numpy()  # fmt: skip
    ours = np.asarray(gpt2_jax.run_with_hooks(params, TOKENS, config, {"blocks.0.attn.hook_z": zero_head(1)}))
    assert rel_err(ours, theirs) <= TOL
    assert np.abs(ours - our_run[0]).max() > 0.05  # the ablation really changed the logits


def test_identity_hooks_and_capture_keep_every_bit(model, our_run):
    _, _, params, config = model
    plain = gpt2_jax.forward(params, TOKENS, config)
    identity = {name: (lambda x: x) for name in inspect.hook_names(config)}
    edited = gpt2_jax.run_with_hooks(params, TOKENS, config, identity)
    np.testing.assert_array_equal(bits(edited), bits(plain))
    np.testing.assert_array_equal(bits(our_run[0]), bits(plain))
    stacked = gpt2_jax.run_with_cache(gpt2_jax.model.stack_layers(params), TOKENS, config,
                                      names=lambda n: n.startswith("blocks.1"))[1]  # fmt: skip
    for name, a in stacked.items():  # the other param layout: the same activations
        np.testing.assert_array_equal(bits(a), bits(our_run[1][name]), err_msg=name)


def test_names_keep_only_what_is_asked(model, our_run):
    _, _, params, config = model
    full = our_run[1]
    for names, expected in [
        ("blocks.1.attn.hook_pattern", ["blocks.1.attn.hook_pattern"]),
        (["ln_final.hook_scale", "blocks.0.mlp.hook_post"], ["blocks.0.mlp.hook_post", "ln_final.hook_scale"]),
        (lambda n: n.endswith("hook_resid_post"), ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]),
        ([], []),
    ]:
        logits, cache = gpt2_jax.run_with_cache(params, TOKENS, config, names=names)
        assert list(cache) == expected  # in forward order
        for name in expected:
            np.testing.assert_array_equal(bits(cache[name]), bits(full[name]))
        np.testing.assert_array_equal(bits(logits), bits(our_run[0]))


def test_memory_follows_the_names(model):
    """One layer's pattern holds 2 slots (it and the spare), not L; all of them L + 1."""
    _, _, params, config = model
    from gpt2_jax.interp.hooks import Tap

    one = Tap(None, ["blocks.1.attn.hook_pattern"], config).new_store(2, 12, 12)
    every = Tap(None, [n for n in inspect.hook_names(config) if n.endswith("pattern")], config).new_store(2, 12, 12)
    assert {k: v.shape for k, v in one.items()} == {"attn.hook_pattern": (2, 2, 3, 12, 12)}
    assert every["attn.hook_pattern"].shape == (config.n_layer + 1, 2, 3, 12, 12)


def test_gradient_through_a_hook_matches_finite_differences(model):
    """Attribution patching: d(logit) / d(a steering coefficient) and d(logit) / d(an activation)."""
    _, _, params, config = model
    direction = jnp.asarray(np.random.default_rng(0).standard_normal(config.n_embd), jnp.float32)
    target = 7

    def steered(alpha):
        hooks = {"blocks.0.hook_resid_mid": lambda x: x + alpha * direction}
        return gpt2_jax.run_with_hooks(params, TOKENS, config, hooks)[0, -1, target]

    def patched(delta):  # delta [T, H, K] added to layer 1's z
        return gpt2_jax.run_with_hooks(params, TOKENS, config, {"blocks.1.attn.hook_z": lambda z: z + delta})[
            0, -1, target
        ]

    # jitted once each: the value at the finite-difference points comes from the same compiled program
    steered, patched = jax.jit(jax.value_and_grad(steered)), jax.jit(jax.value_and_grad(patched))
    h = 1e-2
    grad = float(steered(0.3)[1])
    fd = (float(steered(0.3 + h)[0]) - float(steered(0.3 - h)[0])) / (2 * h)
    assert grad == pytest.approx(fd, rel=1e-2) and abs(grad) > 1e-2
    delta = jnp.zeros((12, config.n_head, config.head_dim))
    g = np.asarray(patched(delta)[1])
    assert (
        np.abs(g[-1]).max() > 0 and not g[:-1].any()
    )  # the last block's z at t < T-1: no attention after it carries it to T-1
    e = jnp.zeros_like(delta).at[-1, 2, 5].set(h)
    fd = (float(patched(delta + e)[0]) - float(patched(delta - e)[0])) / (2 * h)
    assert g[-1, 2, 5] == pytest.approx(fd, rel=1e-2)


def test_vmap_sweeps_patches_in_one_call(model, our_run):
    _, _, params, config = model

    @jax.jit
    def ablate_position(t):  # zero layer 1's MLP output at position t
        return gpt2_jax.run_with_hooks(params, TOKENS, config,
                                       {"blocks.1.hook_mlp_out": lambda x: x.at[:, t].set(0.0)})  # fmt: skip

    positions = jnp.array([0, 5, 11])
    swept = np.asarray(jax.vmap(ablate_position)(positions))
    for i, t in enumerate(positions.tolist()):
        one = np.asarray(ablate_position(jnp.int32(t)))
        assert rel_err(swept[i], one) <= 1e-6
        np.testing.assert_array_equal(swept[i][:, :t], our_run[0][:, :t])  # earlier positions untouched
        assert np.abs(swept[i][:, t] - our_run[0][:, t]).max() > 1e-3  # position t changed


def test_hooks_on_a_mesh(model, our_run):
    _, _, params, config = model
    sharded = shard_params(params, config, make_mesh(data=2, model=3))  # 3 heads and F = 192 split over "model"
    logits, cache = gpt2_jax.run_with_cache(sharded, TOKENS, config, names=lambda n: "attn" in n or "mlp" in n)
    assert cache["blocks.0.attn.hook_q"].sharding.mesh.shape == {"data": 2, "model": 3}
    for name, a in cache.items():
        assert masked_rel_err(a, our_run[1][name], name) <= TOL, name
    hooks = {"blocks.0.attn.hook_z": zero_head(1)}
    ablated = gpt2_jax.run_with_hooks(sharded, TOKENS, config, hooks)
    assert rel_err(ablated, gpt2_jax.run_with_hooks(params, TOKENS, config, hooks)) <= TOL


def test_bad_input_is_a_clear_error(model):
    _, _, params, config = model
    with pytest.raises(
        InputError, match=r"unknown hook name 'blocks.0.hook_resid_pree'; close matches: blocks.0.hook_resid_pre"
    ):
        gpt2_jax.run_with_hooks(params, TOKENS, config, {"blocks.0.hook_resid_pree": lambda x: x})
    with pytest.raises(
        InputError, match=r"'blocks.2.attn.hook_z'; close matches: blocks.1.attn.hook_z, blocks.0.attn.hook_z"
    ):
        gpt2_jax.run_with_cache(params, TOKENS, config, names=["blocks.2.attn.hook_z"])  # 2 layers: 0 and 1
    with pytest.raises(InputError, match=r"hook 'blocks.1.hook_mlp_out' returned shape \(2, 12, 1\), but the "
                                         r"activation has shape \(2, 12, 48\)"):  # fmt: skip
        gpt2_jax.run_with_hooks(params, TOKENS, config, {"blocks.1.hook_mlp_out": lambda x: x[..., :1]})
    with pytest.raises(InputError, match="a hook is a \\(name, function\\) pair"):
        inspect.hooks({"hook_embed": 3.0})
    with pytest.raises(InputError, match=r"unknown block hook point 'resid_pre'.*hook_resid_pre"):
        inspect.activation_patching(params, TOKENS, TOKENS, config, lambda lg: lg.sum(), "resid_pre")


def test_logit_lens_against_transformers(model, our_run):
    """The logit lens of the residual entering block l = ln_f + the tied unembedding of transformers' hidden_states[l]."""
    hf, _, params, config = model
    with torch.no_grad():
        hidden = hf.transformer(torch.as_tensor(TOKENS), output_hidden_states=True).hidden_states
        reference = [hf.lm_head(hf.transformer.ln_f(h)).numpy() for h in hidden[:-1]]  # the last has ln_f applied
    stack = inspect.accumulated_resid(our_run[1], config)
    assert stack.shape == (config.n_layer + 1, 2, 12, config.n_embd)
    lens = np.asarray(inspect.logit_lens(params, stack, config))  # [L + 1, B, T, V]
    for l, ref in enumerate(reference):
        assert rel_err(lens[l], ref) <= TOL
    np.testing.assert_allclose(lens[-1], our_run[0], rtol=0, atol=1e-5)  # after the last block: the logits


def test_direct_logit_attribution_matches_transformer_lens(model, our_run):
    """Against TransformerLens's logit_attrs with the final LayerNorm's weight folded into W_U (its only way
    to apply it), and the terms add up to the logit."""
    _, _, params, config = model
    target = np.array([5, 9])
    ours = inspect.direct_logit_attribution(params, our_run[1], config, target, position=-1)
    np.testing.assert_allclose(ours.total(), our_run[0][[0, 1], -1, target], rtol=1e-5, atol=1e-5)
    folded = boot(model, fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    with torch.no_grad():
        _, cache = folded.run_with_cache(torch.as_tensor(TOKENS, dtype=torch.long))
        stack, labels = cache.decompose_resid(apply_ln=False, pos_slice=-1, return_labels=True)
        attrs = cache.logit_attrs(stack, tokens=torch.as_tensor(target), pos_slice=-1).numpy()  # [2 + 2L, B]
        bias = folded.b_U[torch.as_tensor(target)].numpy()
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    mine = np.stack([ours.embed, ours.pos_embed, ours.attn[:, 0], ours.mlp[:, 0], ours.attn[:, 1], ours.mlp[:, 1]])
    assert rel_err(mine, attrs) <= TOL and rel_err(ours.bias, bias) <= TOL


def test_activation_patching_matches_transformer_lens(model, bridge, our_run):
    from transformer_lens import patching

    _, _, params, config = model
    corrupt = TOKENS.copy()
    corrupt[:, 4] = (corrupt[:, 4] + 1) % config.vocab_size

    def metric(logits):  # the mean logit difference of tokens 5 and 9 at the last position
        return (logits[:, -1, 5] - logits[:, -1, 9]).mean()

    result = inspect.activation_patching(params, TOKENS, corrupt, config, metric, ["hook_resid_pre", "hook_attn_out"])
    with torch.no_grad():
        clean_cache = bridge.run_with_cache(torch.as_tensor(TOKENS, dtype=torch.long))[1]
        theirs = patching.get_act_patch_resid_pre(bridge, torch.as_tensor(corrupt, dtype=torch.long), clean_cache,
                                                  metric).numpy()  # fmt: skip
    grid = np.asarray(result.patched["hook_resid_pre"])
    assert grid.shape == (config.n_layer, 12) and rel_err(grid, theirs) <= TOL
    effect = np.asarray(result.effect("hook_resid_pre"))
    assert effect[0, 4] == pytest.approx(1.0, abs=1e-4)  # the only changed token, put back before block 0: all restored
    np.testing.assert_allclose(effect[:, :4], 0.0, atol=1e-4)  # positions before it never saw the change
    np.testing.assert_allclose(effect[0, 5:], 0.0, atol=1e-4)  # nor did the embeddings after it
    hook = {"blocks.1.hook_attn_out": lambda x: x.at[:, 7].set(jnp.asarray(our_run[1]["blocks.1.hook_attn_out"])[:, 7])}
    one = metric(gpt2_jax.run_with_hooks(params, corrupt, config, hook))
    assert float(result.patched["hook_attn_out"][1, 7]) == pytest.approx(float(one), abs=1e-5)


def test_forward_cached_takes_hooks_under_jit(model):
    """The hashable Hooks goes through a jitted prefill and decode step as a static argument: steering every
    position of layer 0's residual gives the logits run_with_hooks gives over the whole sequence."""
    _, _, params, config = model
    steer = jnp.asarray(np.random.default_rng(1).standard_normal(config.n_embd), jnp.float32)
    hooks = inspect.hooks({"blocks.0.hook_resid_post": lambda x: x + 2.0 * steer})
    assert hash(hooks) == hash(inspect.hooks(hooks.items)) and hooks == inspect.hooks(hooks.items)

    @jax.jit
    def plain(params, tokens, cache):
        return forward_cached(params, tokens, cache, config)

    step = jax.jit(forward_cached, static_argnames=("config", "hooks"))
    cache = init_cache(config, 2, 32)
    prompt, rest = jnp.asarray(TOKENS[:, :9]), jnp.asarray(TOKENS[:, 9:])
    first, cache1 = step(params, prompt, cache, config, hooks=hooks)
    steps = [first]
    for t in range(rest.shape[1]):
        out, cache1 = step(params, rest[:, t : t + 1], cache1, config, hooks=hooks)
        steps.append(out)
    steered = np.concatenate([np.asarray(s) for s in steps], axis=1)
    whole = np.asarray(gpt2_jax.run_with_hooks(params, TOKENS, config, hooks))
    assert rel_err(steered, whole) <= TOL
    unsteered = np.asarray(plain(params, prompt, cache)[0])
    assert np.abs(steered[:, :9] - unsteered).max() > 0.05  # the steering changes the logits
    identity = inspect.hooks({"blocks.0.mlp.hook_post": lambda x: x})
    np.testing.assert_array_equal(bits(step(params, prompt, cache, config, hooks=identity)[0]), bits(unsteered))
    none = jax.jit(forward_cached, static_argnames=("config", "hooks")).lower(params, prompt, cache, config).as_text()
    empty = step.lower(params, prompt, cache, config, hooks=inspect.hooks()).as_text()
    assert empty == none  # no edits: the plain program
