"""The explainer's one forward: the model's own `apply` with a tap that records one chosen layer in full and
every layer's residual-width points, the layer index a traced value, so each layer of a prompt-length
bucket is the same compiled program (gpt2_jax.interp.explain reads it).

Why not run_with_cache: its recorded layers are static, so asking for layer 7 after layer 3 would compile
again. The tap here is the same kind of object (gpt2_jax.interp.hooks.Tap's interface: a call per
point, `within`, `layer`, `new_store`, `load`) and records without editing, so every value is the forward's.

Shape legend (gpt2_jax.config): B batch (1 here), T positions (the bucket), S key slots (= T), D width,
H heads, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.interp.hooks import BLOCK_POINTS, _Scoped, point_shape
from gpt2_jax.kernels.ffi import fits, softmax
from gpt2_jax.model import apply
from gpt2_jax.model.attention import KEY_BLOCK, NEG_INF, block_scores, block_softmax, causal_mask
from gpt2_jax.model.layers import attn_scale, gelu

# Points recorded for every layer: [L, B, T, D] each (hook_z's heads side by side, H x K = D), small next to
# one layer's attention and MLP.
EVERY_LAYER = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
GELU_GRID = 241  # points of the GELU curve drawn under a layer's pre-activations


class Recorder:
    """A tap for apply(): the embedding and final points as they pass, layer `want`'s block points in
    full and every layer's EVERY_LAYER points, in a store carried through the layer scan."""

    def __init__(self, config: GPT2Config, want: jax.Array):
        self.config, self.want = config, want
        self.captured: dict[str, jax.Array] = {}

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        self.captured[name] = x
        return x

    def within(self, prefix: str) -> _Scoped:
        return _Scoped(self, f"{prefix}.")

    def layer(self, i: jax.Array) -> LayerRecorder:
        """Block i's tap (run_blocks' interface)."""
        return LayerRecorder(self, i)

    def new_store(self, B: int, T: int, S: int) -> dict[str, jax.Array]:
        one = {f"one.{p}": jnp.zeros(point_shape(p, B, T, S, self.config), jnp.float32) for p in BLOCK_POINTS}
        every = {f"all.{p}": jnp.zeros((self.config.n_layer, B, T, self.config.n_embd), jnp.float32)
                 for p in EVERY_LAYER}  # fmt: skip
        return {**one, **every}

    def load(self, store: dict[str, jax.Array]) -> None:
        self.captured.update(store)


class LayerRecorder:
    """Block i's view of the recorder: keeps what passes, then writes it into the store."""

    def __init__(self, root: Recorder, i: jax.Array):
        self.root, self.i = root, i
        self.recorded: dict[str, jax.Array] = {}

    def __call__(self, point: str, x: jax.Array) -> jax.Array:
        self.recorded[point] = x
        return x

    def within(self, prefix: str) -> _Scoped:
        return _Scoped(self, f"{prefix}.")

    def save(self, store: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = dict(store)
        for p in BLOCK_POINTS:  # the chosen layer's values, the others' left as they were
            out[f"one.{p}"] = jnp.where(
                self.i == self.root.want, self.recorded[p].astype(jnp.float32), store[f"one.{p}"]
            )
        for p in EVERY_LAYER:
            x = self.recorded[p].astype(jnp.float32)
            out[f"all.{p}"] = store[f"all.{p}"].at[self.i].set(x.reshape(*x.shape[:2], -1))
        return out


def attention_stages(q: jax.Array, k: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    """q, k [B, T, H, K] (hook_q, hook_k) -> the scores' stages [B, H, T, S]: raw q.k, scaled, masked
    (-inf above the diagonal, as hook_attn_scores shows it) and the softmax, with attend's arithmetic
    (block_scores' chain, the block-by-block softmax), so the last equals hook_pattern bit for bit."""
    B, T, H, K = q.shape
    n = -(-T // KEY_BLOCK)
    qh, kt = jnp.swapaxes(q, 1, 2), jnp.einsum("BTHK->BHKT", k)
    raw = block_scores(qh, kt, n)  # [B, H, T, N, C]
    scaled = raw * scale
    blocked = jnp.pad(causal_mask(T), ((0, 0), (0, 0), (0, n * KEY_BLOCK - T))).reshape(1, 1, T, n, KEY_BLOCK)
    masked = jnp.where(blocked, scaled, NEG_INF)
    weights = softmax(masked, block_softmax) if fits(masked) else block_softmax(masked)
    flat = lambda x: x.reshape(B, H, T, n * KEY_BLOCK)[..., :T]
    shown = jnp.where(causal_mask(T)[:, None], flat(scaled), -jnp.inf)
    return {"raw": flat(raw), "scaled": flat(scaled), "masked": shown, "softmax": flat(weights)}


@functools.partial(jax.jit, static_argnames=("config",))
def explain_forward(params, tokens: jax.Array, layer: jax.Array, config: GPT2Config, key=None) -> dict:
    """tokens [1, T] (a bucket), layer [] int32 -> {name: array}: logits [1, T, V], the embedding and final
    points, "one.{point}" for `layer`'s block points, "all.{point}" [L, 1, T, D], the attention stages
    of `layer` and a GELU curve. key: dropout on (training's forward, at config's rates)."""
    tap = Recorder(config, layer)
    logits = apply(params, tokens, config, key=key, tap=tap)
    out = dict(tap.captured, logits=logits)
    out.update({f"stage.{s}": a for s, a in attention_stages(out["one.attn.hook_q"], out["one.attn.hook_k"],
                                                             attn_scale(config, layer)).items()})  # fmt: skip
    for ln, resid in (("ln1", "one.hook_resid_pre"), ("ln2", "one.hook_resid_mid")):  # LayerNorm's centre
        out[f"{ln}.mean"] = jnp.mean(out[resid], axis=-1)
    for p in ("hook_resid_mid", "hook_resid_post"):  # the residual stream's size after each half-block
        out[f"norm.{p}"] = jnp.sqrt(jnp.sum(jnp.square(out[f"all.{p}"]), axis=-1))
    xs = jnp.linspace(-6.0, 6.0, GELU_GRID, dtype=jnp.float32)
    out["gelu.x"], out["gelu.y"] = xs, gelu(xs, config.gelu_approximate)
    return out
