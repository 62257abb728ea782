"""The explainer's data layer (gpt2_jax.interp.explain_data): every number it sends is the library's, bit for
bit (compared as uint32), on the bundled model: a layer's stages against run_with_cache, the padded bucket
against the unpadded run, the sampling stages against next_token_probs, the steps against generate."""

import numpy as np
import pytest

import gpt2_jax
from gpt2_jax.errors import GPT2JaxError, InputError
from gpt2_jax.interp import decode_array, explain_data
from gpt2_jax.interp.explain_views import MAX_TOKENS
from gpt2_jax.sampling import next_token_probs, process_logits

PROMPT = "ROMEO: what light through yonder"
SETTINGS = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5,
                frequency_penalty=0.3, logit_bias={"11": 2.0})  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return gpt2_jax.load(gpt2_jax.BUNDLED_MODEL)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_layer_view_is_run_with_cache(model):
    params, config = model
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    assert explain_data(params, config, PROMPT, "tokens")["ids"] == ids
    _, cache = gpt2_jax.run_with_cache(params, np.array([ids]), config)
    for layer in (0, config.n_layer - 1):
        h = config.n_head - 1
        v = explain_data(params, config, PROMPT, "layer", layer=layer, head=h)
        b = f"blocks.{layer}."
        assert v["head"] == h and np.array_equal(
            bits(decode_array(v["pattern"])), bits(cache[b + "attn.hook_pattern"][0])
        )
        for name, point in (("stage_softmax", "attn.hook_pattern"), ("stage_masked", "attn.hook_attn_scores")):
            assert np.array_equal(bits(decode_array(v[name])), bits(cache[b + point][0, h : h + 1])), name
        for name, point in (("q", "attn.hook_q"), ("z", "attn.hook_z"), ("mlp_pre", "mlp.hook_pre"),
                            ("mlp_post", "mlp.hook_post"), ("resid_post", "hook_resid_post")):  # fmt: skip
            assert np.array_equal(bits(decode_array(v[name])), bits(cache[b + point][0])), name
    emb = explain_data(params, config, PROMPT, "embedding")
    assert np.array_equal(bits(decode_array(emb["wte"])), bits(cache["hook_embed"][0]))


def test_lens_and_output(model):
    params, config = model
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    logits, cache = gpt2_jax.run_with_cache(params, np.array([ids]), config)
    out = explain_data(params, config, PROMPT, "output")
    assert np.array_equal(bits(decode_array(out["logits"])), bits(logits[0, -1])) and out["tied"]
    lens = explain_data(params, config, PROMPT, "lens")
    resid = gpt2_jax.interp.accumulated_resid(cache, config)[:, 0]
    import jax

    logits = gpt2_jax.interp.logit_lens(params, resid[2], config)
    p = np.stack([np.asarray(jax.nn.softmax(row)) for row in logits])  # each position's own distribution
    assert decode_array(lens["top_ids"])[2].tolist() == p.argmax(-1).tolist()
    assert np.array_equal(bits(decode_array(lens["top_p"])[2]), bits(p.max(-1)))


def test_sampling_stages_and_steps_are_the_library(model):
    params, config = model
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    view = explain_data(params, config, PROMPT, "sampling", settings=SETTINGS, seed=7)
    logits = gpt2_jax.forward(params, np.array([ids]), config)[:, -1]
    procs = {k: SETTINGS[k] for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")}
    processed = process_logits(logits, prompts=[ids], eos_id=config.eos_id, logit_bias={11: 2.0}, **procs)
    final = next_token_probs(processed, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, n_valid=config.valid_vocab)
    last = view["stages"][-1]
    assert np.array_equal(bits(decode_array(last["probs"])), bits(final[0]))
    assert last["kept"] == int((np.asarray(final[0]) > 0).sum())
    assert [s["kept"] for s in view["stages"]][:3] == [config.vocab_size] * 3 and view["stages"][3]["kept"] >= 40
    steps = explain_data(params, config, PROMPT, "steps", settings=SETTINGS, seed=7, steps=8)
    want = gpt2_jax.generate(params, config, [ids], seed=7, max_new_tokens=8, **{**SETTINGS, "logit_bias": {11: 2.0}})
    assert steps["tokens"] == want.tokens[0].tolist() and steps["tokens"][0] == view["token"]
    assert steps["steps"][1]["kv_reused"] == len(ids) and steps["steps"][1]["kv_new"] == [len(ids)]
    # continuing from drawn tokens: the penalties count them as outputs, so the draws go on as generate's do
    drawn = want.tokens[0, :3].tolist()
    later = explain_data(params, config, PROMPT, "steps", outputs=drawn, settings=SETTINGS, seed=7, steps=5)
    assert later["tokens"] == want.tokens[0, 3:8].tolist() and later["steps"][0]["kv_new"] == list(range(len(ids) + 3))
    nxt = explain_data(params, config, PROMPT, "sampling", outputs=drawn, settings=SETTINGS, seed=7)
    assert nxt["token"] == want.tokens[0, 3]


def test_padding_changes_nothing(model):
    params, config = model
    from gpt2_jax.interp.explain_views import run

    ids = gpt2_jax.tokenizer().encode(PROMPT)
    a = run(params, config, ids, 1)
    b = run(params, config, ids + [ids[-1]] * 20, 1)  # another bucket: this prompt's rows as a prefix
    for name in ("one.attn.hook_pattern", "one.mlp.hook_post", "logits"):
        x, y = a[name], b[name]
        y = y[..., : len(ids), : len(ids)] if "pattern" in name else y[:, : len(ids)]
        assert np.array_equal(bits(x), bits(y)), name


def test_bad_input_is_refused_clearly(model):
    params, config = model
    with pytest.raises(InputError, match="empty"):
        explain_data(params, config, "", "tokens")
    with pytest.raises(InputError, match="context"):
        explain_data(params, config, " a" * (config.n_positions + 1), "tokens")
    with pytest.raises(InputError, match="unknown layer"):
        explain_data(params, config, PROMPT, "layer", layer=config.n_layer)
    with pytest.raises(InputError, match="unknown head"):
        explain_data(params, config, PROMPT, "layer", head=config.n_head)
    with pytest.raises(GPT2JaxError, match="top_p"):
        explain_data(params, config, PROMPT, "sampling", settings={"top_p": 0})


def test_twelve_layers_of_gpt2_small_widths():
    """A random checkpoint of gpt2-small's shape: the last block's pattern, scores and MLP are
    run_with_cache's bits, with 64 tokens in the 64 bucket."""
    import jax

    config = gpt2_jax.PRESETS["gpt2"]
    params = gpt2_jax.init_params(jax.random.key(0), config)
    ids = [int(t) for t in np.random.RandomState(0).randint(0, config.vocab_size, 64)]
    _, cache = gpt2_jax.run_with_cache(params, np.array([ids]), config, names=lambda n: n.startswith("blocks.11."))
    v = explain_data(params, config, ids, "layer", layer=11)
    for name, point in (("pattern", "attn.hook_pattern"), ("mlp_post", "mlp.hook_post"), ("v", "attn.hook_v")):
        assert np.array_equal(bits(decode_array(v[name])), bits(cache[f"blocks.11.{point}"][0])), name
    assert decode_array(v["stage_raw"]).shape == (1, 64, 64)  # head 0's stages only, not all 12 heads'
    # The explainer's bound: at most MAX_TOKENS tokens (T x T per head), though the context is 1024.
    with pytest.raises(InputError, match=f"more than the explainer shows \\({MAX_TOKENS};"):
        explain_data(params, config, ids * 5, "tokens")


def test_a_new_prompt_length_within_its_bucket_compiles_nothing(model):
    """Prompts are padded to power-of-two buckets and the layer is a traced value: after one prompt's views,
    another length in the same bucket, on another layer, compiles no program (counted from JAX's own
    compile events)."""
    import jax

    params, config = model
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    views = (("embedding", {}), ("layer", {"layer": 0}), ("output", {}), ("lens", {}), ("dla", {}),
             ("sampling", {"settings": SETTINGS}), ("dropout", {"layer": 0}))  # fmt: skip
    for view, kw in views:
        explain_data(params, config, "ROMEO: what", view, **kw)
    compiles.clear()
    for view, kw in views:
        kw = {**kw, "layer": 2} if "layer" in kw else kw
        explain_data(params, config, "JULIET: O Romeo, Romeo", view, **kw)  # 8 tokens: the same 16 bucket
    assert compiles == [], f"{len(compiles)} programs compiled for a new length in the bucket"


def test_each_heads_share_of_the_logit_is_its_z_through_its_c_proj_rows():
    """head_attribution against a float64 numpy loop over run_with_cache's hook_z and the params' c_proj; a
    layer's heads and c_proj bias add up to direct_logit_attribution's attn term; the dla view sends both."""
    from gpt2_jax.interp import direct_logit_attribution, head_attribution

    params, config = gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")  # a bfloat16 c_proj rounds its sum
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    _, cache = gpt2_jax.run_with_cache(params, np.array([ids]), config)
    target, H, K = 198, config.n_head, config.n_embd // config.n_head
    got = head_attribution(params, cache, config, target)
    f64 = lambda a: np.asarray(a, np.float64)
    direction = f64(params["ln_f"]["weight"]) * f64(params["wte"][target])
    scale = float(cache["ln_final.hook_scale"][0, -1, 0])
    share = lambda x: float(((x - x.mean()) / scale * direction).sum())
    for l in range(config.n_layer):
        w = f64(params["h"][l]["attn"]["c_proj"]["weight"])  # [D out, D in]: head h's inputs are columns hK..hK+K
        z = f64(cache[f"blocks.{l}.attn.hook_z"][0, -1])  # [H, K]
        for h in range(H):
            assert float(got.heads[0, l, h]) == pytest.approx(
                share(w[:, h * K : (h + 1) * K] @ z[h]), rel=1e-4, abs=1e-5
            )
        b = f64(params["h"][l]["attn"]["c_proj"]["bias"])
        assert float(got.bias[0, l]) == pytest.approx(share(b), rel=1e-4, abs=1e-5)
    attn = direct_logit_attribution(params, cache, config, target).attn
    np.testing.assert_allclose(np.asarray(got.heads.sum(-1) + got.bias), np.asarray(attn), rtol=1e-5, atol=1e-5)
    # int8 params: each c_proj read as the float values it holds, the bits dequantize's whole model gives
    from gpt2_jax.model.precision import dequantize, with_precision

    q = with_precision(params, "int8")
    _, qcache = gpt2_jax.run_with_cache(q, np.array([ids]), config)
    qa, qb = head_attribution(q, qcache, config, target), head_attribution(dequantize(q), qcache, config, target)
    assert np.array_equal(bits(qa.heads), bits(qb.heads)) and np.array_equal(bits(qa.bias), bits(qb.bias))
    v = explain_data(params, config, PROMPT, "dla", settings={"temperature": 0.0})
    drawn = v["target"]
    want = head_attribution(params, cache, config, drawn)
    assert np.array_equal(bits(decode_array(v["heads"])), bits(want.heads[0]))
    assert np.array_equal(bits(decode_array(v["attn_bias"])), bits(want.bias[0]))
