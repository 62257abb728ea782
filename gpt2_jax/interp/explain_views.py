"""The explainer's data: GPT-2's real numbers for one prompt, view by view, as the library computes them.

Every view is a dict ready for JSON; float arrays travel as `encode_array` dicts (base64 of little-endian
float32 bytes, with shape and dtype), so the page draws the exact bits. The forward is
gpt2_jax.interp._explain_run.explain_forward: the model's `apply` with a recording tap, over the prompt
right-padded to a power-of-two bucket with copies of its last token (a row's values never depend on
padding), with the layer a traced value: a new prompt length or layer inside a bucket compiles nothing.

  prompt_ids(prompt, config)                  text -> ids, InputError for an empty or too long prompt
  tokens_view, embedding_view, layer_view, output_view, lens_view, dla_view, dropout_view
  sampling_view, steps_view (gpt2_jax.interp._explain_sampling): the sampler's stages and the draws
  explain_data(params, config, prompt, view, ...): one view by name, what the server answers

Shape legend (gpt2_jax.config): T positions, D width, H heads, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.interp._explain_run import explain_forward
from gpt2_jax.interp.lens import direct_logit_attribution, head_attribution, logit_lens
from gpt2_jax.tokenizer import tokenizer

MIN_BUCKET = 16  # the smallest padded prompt length
TOP = 10  # top tokens listed per distribution
DROPOUT_RATE = 0.1  # GPT-2's training rate, for the dropout view of a checkpoint that stores none
# The most tokens a view shows. A layer's attention is H tables of T x T per stage, so the forward's memory
# and a layer view's answer grow as H * T^2; the page cannot draw more than a few hundred columns anyway.
MAX_TOKENS = 256


def encode_array(a: Any) -> dict:
    """An array -> {"dtype", "shape", "b64"}: its float32 (or int32) bytes, little-endian, lossless."""
    a = np.asarray(a)
    a = a.astype("<i4") if np.issubdtype(a.dtype, np.integer) else a.astype("<f4")
    return {"dtype": "int32" if a.dtype.kind == "i" else "float32", "shape": list(a.shape),
            "b64": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}  # fmt: skip


def decode_array(d: dict) -> np.ndarray:
    """encode_array's dict -> the array, bit for bit."""
    dtype = "<i4" if d["dtype"] == "int32" else "<f4"
    return np.frombuffer(base64.b64decode(d["b64"]), dtype).reshape(d["shape"])


def prompt_ids(prompt: Any, config: GPT2Config) -> list[int]:
    """The prompt's token ids (text through gpt2_jax.tokenizer(), or ids as given), checked: at least one
    token, at most the context, every id in the vocab."""
    if isinstance(prompt, str):
        ids = tokenizer().encode(prompt, allowed_special={"<|endoftext|>"})
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise InputError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InputError("the prompt is empty: type at least one token")
    if len(ids) > config.n_positions:
        raise InputError(f"the prompt has {len(ids)} tokens, more than the context n_positions={config.n_positions}")
    if len(ids) > MAX_TOKENS:
        raise InputError(f"the prompt has {len(ids)} tokens, more than the explainer shows ({MAX_TOKENS}; "
                         f"the context is n_positions={config.n_positions})")  # fmt: skip
    bad = [t for t in ids if not 0 <= t < config.vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocab [0, {config.vocab_size})")
    return ids


def _index(kind: str, value: Any, n: int) -> int:
    """A layer's or head's index in [0, n), or an InputError naming what this model has."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < n:
        raise InputError(f"unknown {kind} {value!r}: this model has {kind}s 0..{n - 1}")
    return int(value)


def check_layer(layer: Any, config: GPT2Config) -> int:
    return _index("layer", layer, config.n_layer)


def check_head(head: Any, config: GPT2Config) -> int | None:
    """A head index, or None for every head (a saved page holds them all)."""
    return None if head is None else _index("head", head, config.n_head)


def padded(ids: list[int], config: GPT2Config) -> np.ndarray:
    """ids -> [1, bucket] int32, right-padded with copies of the last token (never token 0)."""
    size = min(pow2_bucket(len(ids), MIN_BUCKET), config.n_positions)
    return np.asarray([ids + [ids[-1]] * (size - len(ids))], np.int32)


def run(params, config: GPT2Config, ids: list[int], layer: int = 0, key=None) -> dict[str, np.ndarray]:
    """The explainer's forward for `ids` -> {name: host array} cut back to the T real positions."""
    out = explain_forward(params, jnp.asarray(padded(ids, config)), jnp.int32(layer), config, key)
    T = len(ids)
    cut = {}
    for name, a in out.items():
        a = np.asarray(a)
        if name.startswith(("one.attn.hook_attn_scores", "one.attn.hook_pattern", "stage.")):
            a = a[..., :T, :T]
        elif name.startswith("gelu."):
            pass
        elif name.startswith(("all.", "norm.")):
            a = a[:, :, :T]
        else:
            a = a[:, :T]
        cut[name] = a
    return cut


def tokens_view(ids: list[int]) -> dict:
    enc = tokenizer()
    pieces = [enc.decode_single_token_bytes(t).decode("utf-8", "replace") for t in ids]
    return {"ids": ids, "pieces": pieces, "positions": list(range(len(ids)))}


def embedding_view(out: dict) -> dict:
    """wte[id] (hook_embed), wpe[pos] (hook_pos_embed) and their sum, the first residual stream [T, D]."""
    return {"wte": encode_array(out["hook_embed"][0]), "wpe": encode_array(out["hook_pos_embed"][0]),
            "sum": encode_array(out["all.hook_resid_pre"][0, 0])}  # fmt: skip


LAYER_FIELDS = {  # the page's name -> the recorded point, [T, ...] after the batch axis
    "ln1_mean": "ln1.mean", "ln1_scale": "one.ln1.hook_scale", "q": "one.attn.hook_q", "k": "one.attn.hook_k",
    "v": "one.attn.hook_v", "z": "one.attn.hook_z", "attn_out": "one.hook_attn_out",
    "resid_mid": "one.hook_resid_mid", "ln2_mean": "ln2.mean", "ln2_scale": "one.ln2.hook_scale",
    "mlp_pre": "one.mlp.hook_pre", "mlp_post": "one.mlp.hook_post", "mlp_out": "one.hook_mlp_out",
    "resid_post": "one.hook_resid_post",
}  # fmt: skip


def layer_view(out: dict, layer: int, head: int | None = 0) -> dict:
    """One block by stages: LayerNorm, Q/K/V per head, every head's pattern [H, T, T], the scores' stages
    (raw q.k, / sqrt(K), causal mask, softmax = hook_pattern) of `head` [1, T, T] (of every head [H, T, T]
    when head is None), the weighted sum, c_proj, MLP pre/post GELU. One head's stages, not all H: the
    answer stays a few megabytes at the longest prompt."""
    view: dict[str, Any] = {name: encode_array(out[point][0]) for name, point in LAYER_FIELDS.items()}
    heads = slice(None) if head is None else slice(head, head + 1)
    stages = ("raw", "scaled", "masked", "softmax")
    view.update({f"stage_{s}": encode_array(out[f"stage.{s}"][0, heads]) for s in stages})
    view.update(pattern=encode_array(out["stage.softmax"][0]), head=head)
    view.update(layer=layer, gelu_x=encode_array(out["gelu.x"]), gelu_y=encode_array(out["gelu.y"]))
    view["norms"] = {p: encode_array(out[f"norm.{p}"][:, 0]) for p in ("hook_resid_mid", "hook_resid_post")}
    return view


def top_tokens(probs: np.ndarray, n: int = TOP) -> list[dict]:
    """probs [V] -> the n most likely tokens (ties: the lower id first), each id, text and probability; a
    token a filter removed (probability 0) is never listed."""
    enc, order = tokenizer(), np.lexsort((np.arange(probs.size), -probs))[:n]
    order = order[probs[order] > 0]
    return [{"id": int(t), "text": enc.decode([int(t)]), "p": float(probs[t])} for t in order]


def output_view(params, out: dict, config: GPT2Config) -> dict:
    """ln_f at the last position, the last position's logits [V] and probabilities, the top tokens; the
    unembedding is wte itself (tied: GPT-2 has no separate output matrix)."""
    logits = out["logits"][0, -1]
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
    tied = "lm_head" not in params
    return {"ln_f_scale": encode_array(out["ln_final.hook_scale"][0, :, 0]),
            "ln_f_normalized": encode_array(out["ln_final.hook_normalized"][0, -1]),
            "logits": encode_array(logits), "top": top_tokens(probs), "tied": tied,
            "unembedding": "wte.T (tied: logits = ln_f(x) @ wte.T)" if tied else "a separate lm_head"}  # fmt: skip


@functools.partial(jax.jit, static_argnames="config")
def _lens_logits(params, resid: jax.Array, config: GPT2Config) -> jax.Array:
    """The residual stream [T, D] decoded by the lens -> logits [T, V] (logit_lens, its bits)."""
    return logit_lens(params, resid, config)


def lens_view(params, out: dict, config: GPT2Config) -> dict:
    """The logit lens over the accumulated residual stream: for each of L + 1 depths and each position,
    the top token and its probability, the stream decoded by ln_f and wte as if the later blocks added nothing."""
    resid = np.concatenate([out["all.hook_resid_pre"], out["all.hook_resid_post"][-1:]])  # [L + 1, 1, T, D]
    ids, probs = [], []
    T = resid.shape[2]
    size = min(pow2_bucket(T, MIN_BUCKET), config.n_positions)  # the bucket's length: a new T compiles nothing
    for depth in resid:  # one depth at a time bounds the [T, V] logits held at once
        logits = _lens_logits(params, jnp.asarray(np.pad(depth[0], ((0, size - T), (0, 0)), mode="edge")), config)
        # each position's softmax over its own row [V]: a softmax over [T, V] sums a row in an order that
        # depends on T on a multi-device CPU, so its bits would change with the prompt's length
        rows = [np.asarray(jax.nn.softmax(logits[t])) for t in range(T)]
        top = np.array([row.argmax() for row in rows])
        ids.append(top)
        probs.append(np.array([row[i] for row, i in zip(rows, top)], np.float32))
    enc = tokenizer()
    texts = [[enc.decode([int(t)]) for t in row] for row in ids]
    return {"top_ids": encode_array(np.stack(ids)), "top_p": encode_array(np.stack(probs)), "texts": texts}


def dla_cache(out: dict, config: GPT2Config) -> dict:
    """The recorded points under run_with_cache's names, as direct_logit_attribution reads them."""
    cache = {"hook_embed": out["hook_embed"], "hook_pos_embed": out["hook_pos_embed"],
             "ln_final.hook_scale": out["ln_final.hook_scale"]}  # fmt: skip
    for l in range(config.n_layer):
        for p in ("hook_attn_out", "hook_mlp_out"):
            cache[f"blocks.{l}.{p}"] = out[f"all.{p}"][l]
        z = out["all.attn.hook_z"][l]  # [B, T, D]: the heads side by side
        cache[f"blocks.{l}.attn.hook_z"] = z.reshape(*z.shape[:2], config.n_head, -1)
    return cache


def dla_view(params, out: dict, config: GPT2Config, target: int) -> dict:
    """Direct logit attribution of `target` at the last position: the embeddings', each block's attention
    and MLP output's and ln_f's bias' shares of its logit (they add up to it), and each attention output's
    split by head (with c_proj's bias)."""
    cache = dla_cache(out, config)
    a = direct_logit_attribution(params, cache, config, target, position=-1)
    h = head_attribution(params, cache, config, target, position=-1)
    return {"target": int(target), "text": tokenizer().decode([int(target)]), "embed": float(a.embed[0]),
            "pos_embed": float(a.pos_embed[0]), "attn": encode_array(a.attn[0]), "mlp": encode_array(a.mlp[0]),
            "bias": float(a.bias[0]), "heads": encode_array(h.heads[0]),
            "attn_bias": encode_array(h.bias[0]), "total": float(a.total()[0]), "logit": float(out["logits"][0, -1, target])}  # fmt: skip


def dropout_view(params, config: GPT2Config, ids: list[int], layer: int, seed: int, rate: float = DROPOUT_RATE):
    """Training mode at `rate` with key(seed): which of `layer`'s attention weights and output entries dropout
    zeroes (the recorded values are after it), and how the last position's top tokens move."""
    rates = dict(embd_pdrop=rate, attn_pdrop=rate, resid_pdrop=rate)
    train_config = dataclasses.replace(config, **{k: v if getattr(config, k) == 0 else getattr(config, k)
                                                  for k, v in rates.items()})  # fmt: skip
    train = run(params, train_config, ids, layer, jax.random.key(seed))
    plain = run(params, config, ids, layer)
    dropped = {p: encode_array((train[f"one.{p}"][0] == 0) & (plain[f"one.{p}"][0] != 0))
               for p in ("attn.hook_pattern", "hook_attn_out", "hook_mlp_out")}  # fmt: skip
    probs = lambda o: np.asarray(jax.nn.softmax(jnp.asarray(o["logits"][0, -1])))
    shift = np.abs(train["logits"][0, -1] - plain["logits"][0, -1])
    return {
        "rate": {k: getattr(train_config, k) for k in rates},
        "seed": seed,
        "layer": layer,
        "dropped": dropped,
        "train_top": top_tokens(probs(train)),
        "eval_top": top_tokens(probs(plain)),
        "max_logit_shift": float(shift.max()),
        "train_pattern": encode_array(train["one.attn.hook_pattern"][0]),
    }
