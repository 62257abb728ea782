"""Reading the residual stream: the logit lens and direct logit attribution.

Both rest on one fact about GPT-2: the residual stream entering the final LayerNorm is a plain sum,
hook_embed + hook_pos_embed + every block's hook_attn_out and hook_mlp_out. The logit lens decodes a
partial sum as if the blocks after it added nothing; direct logit attribution splits the final logit
into one term per summand, holding the final LayerNorm's scale (ln_final.hook_scale) fixed, which
makes the LayerNorm linear in its input.

Each block's attention output is itself a sum, one term per head (that head's z through its K rows of c_proj)
plus c_proj's bias, so the attention terms split once more, by head (head_attribution).

Shape legend (gpt2_jax.config): B batch, T positions, D width, H heads, K head dim, V vocab rows, L layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.gpt2 import unembed
from gpt2_jax.model.layers import F32
from gpt2_jax.model.params import Params, wte_rows
from gpt2_jax.model.precision import float_weight
from gpt2_jax.model.precision_type import Precision

_unembed = jax.jit(unembed, static_argnames="config")


def logit_lens(params: Params, resid, config: GPT2Config) -> jax.Array:
    """resid [..., T, D] (any residual stream: a block's hook_resid_pre/mid/post, or a stack of them
    from accumulated_resid) -> logits [..., T, V]: the final LayerNorm and the tied unembedding
    applied to it, which is what the model would predict if the later blocks added nothing."""
    resid = jnp.asarray(resid, F32)
    if resid.shape[-1] != config.n_embd:
        raise InputError(f"logit_lens: a residual's last axis is D = {config.n_embd}, got shape {tuple(resid.shape)}")
    with on_mesh(mesh_of(params)):
        return _unembed(params, resid, config)


def resid_names(config: GPT2Config) -> tuple[str, ...]:
    """The L + 1 points accumulated_resid stacks: each block's hook_resid_pre, then the last hook_resid_post."""
    L = config.n_layer
    return tuple(f"blocks.{l}.hook_resid_pre" for l in range(L)) + (f"blocks.{L - 1}.hook_resid_post",)


def require(cache: Mapping[str, jax.Array], names: tuple[str, ...], what: str) -> None:
    """Raise InputError naming the hook names `what` needs that the cache lacks."""
    missing = [n for n in names if n not in cache]
    if missing:
        raise InputError(f"{what} needs {len(missing)} activations the cache lacks ({', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''}); record them with run_with_cache(..., "
                         f"names=None) or names=[...] including them")  # fmt: skip


def accumulated_resid(cache: Mapping[str, jax.Array], config: GPT2Config) -> jax.Array:
    """cache from run_with_cache -> [L + 1, B, T, D]: the residual stream entering each block, then
    leaving the last one (entry l: after l blocks)."""
    names = resid_names(config)
    require(cache, names, "accumulated_resid")
    return jnp.stack([cache[n] for n in names])


class Attribution(NamedTuple):
    """One token's logit split by the residual stream's summands (each [B] or [B, L])."""

    embed: jax.Array  # [B] the token embedding's term
    pos_embed: jax.Array  # [B] the position embedding's term
    attn: jax.Array  # [B, L] each block's attention output (hook_attn_out)
    mlp: jax.Array  # [B, L] each block's MLP output (hook_mlp_out)
    bias: jax.Array  # [B] the final LayerNorm's bias

    def total(self) -> jax.Array:
        """[B]: the sum of the terms, which is the logit itself (up to float rounding)."""
        return self.embed + self.pos_embed + self.attn.sum(-1) + self.mlp.sum(-1) + self.bias


def dla_names(config: GPT2Config) -> tuple[str, ...]:
    """The hook names direct_logit_attribution reads from a cache."""
    blocks = tuple(f"blocks.{l}.{p}" for l in range(config.n_layer) for p in ("hook_attn_out", "hook_mlp_out"))
    return ("hook_embed", "hook_pos_embed") + blocks + ("ln_final.hook_scale",)


def logit_direction(params: Params, target: jax.Array) -> jax.Array:
    """target [B] -> [B, D]: the direction in the final LayerNorm's normalised space whose dot product
    is the target's logit (ln_f's weight times the target's row of the tied unembedding)."""
    return params["ln_f"]["weight"].astype(F32) * wte_rows(params, target)


def _term(x: jax.Array, scale: jax.Array, direction: jax.Array) -> jax.Array:
    """x [B, D], scale [B, 1], direction [B, D] -> [B]: x's share of the logit. The final LayerNorm
    subtracts the mean and divides by the (fixed) scale, both linear in x."""
    return jnp.sum((x - x.mean(-1, keepdims=True)) / scale * direction, axis=-1)


def direct_logit_attribution(
    params: Params, cache: Mapping[str, jax.Array], config: GPT2Config, target, position: int = -1
) -> Attribution:
    """The logit of token `target` (an id, or [B] ids) at `position`, split into the direct
    contribution of the embeddings and of each block's attention and MLP output (cache from
    run_with_cache, with at least dla_names(config)). Each term is that output read through the
    final LayerNorm at the run's own scale and the target's unembedding, so the terms add up to the
    logit; what a block contributes indirectly, through later blocks, is not counted here."""
    require(cache, dla_names(config), "direct_logit_attribution")
    B = cache["hook_embed"].shape[0]
    target = jnp.broadcast_to(jnp.asarray(target, jnp.int32), (B,))
    direction = logit_direction(params, target)
    scale = cache["ln_final.hook_scale"][:, position]  # [B, 1]

    def term(name: str) -> jax.Array:
        return _term(cache[name][:, position], scale, direction)

    def per_block(point: str) -> jax.Array:
        return jnp.stack([term(f"blocks.{l}.{point}") for l in range(config.n_layer)], axis=-1)

    return Attribution(
        term("hook_embed"),
        term("hook_pos_embed"),
        per_block("hook_attn_out"),
        per_block("hook_mlp_out"),
        _bias_term(params, target),
    )


def _bias_term(params: Params, target: jax.Array) -> jax.Array:
    """target [B] -> [B]: the final LayerNorm's bias read by the target's unembedding (0 without a bias)."""
    ln_f = params["ln_f"]
    if "bias" not in ln_f:
        return jnp.zeros(target.shape, F32)
    return jnp.sum(ln_f["bias"].astype(F32) * wte_rows(params, target), axis=-1)


class HeadAttribution(NamedTuple):
    """The attention terms of direct_logit_attribution split by head: a layer's heads and its c_proj bias add
    up to its attn term (up to float rounding)."""

    heads: jax.Array  # [B, L, H] each head's output (its z through its K rows of c_proj)
    bias: jax.Array  # [B, L] c_proj's bias


def head_names(config: GPT2Config) -> tuple[str, ...]:
    """The hook names head_attribution reads from a cache."""
    return tuple(f"blocks.{l}.attn.hook_z" for l in range(config.n_layer)) + ("ln_final.hook_scale",)


def head_attribution(
    params: Params, cache: Mapping[str, jax.Array], config: GPT2Config, target, position: int = -1
) -> HeadAttribution:
    """The logit of token `target` (an id, or [B] ids) at `position`: each attention head's direct share
    and each c_proj bias's (cache from run_with_cache, with at least head_names(config)), read through the
    final LayerNorm at the run's own scale and the target's unembedding, as direct_logit_attribution reads
    a block's whole attention output."""
    require(cache, head_names(config), "head_attribution")
    H, K = config.n_head, config.n_embd // config.n_head
    scale = cache["ln_final.hook_scale"][:, position]  # [B, 1]
    B = scale.shape[0]
    direction = logit_direction(params, jnp.broadcast_to(jnp.asarray(target, jnp.int32), (B,)))  # [B, D]
    precision, blocks = Precision.of(params), params["h"]  # per-layer dicts, or leaves stacked on L
    heads, bias = [], []
    for l in range(config.n_layer):
        c_proj = blocks[l]["attn"]["c_proj"] if isinstance(blocks, (list, tuple)) else \
            jax.tree.map(lambda a: a[l], blocks["attn"]["c_proj"])  # fmt: skip
        w = float_weight(c_proj, precision).reshape(config.n_embd, H, K)  # [D out, H, K]: head h's K inputs
        z = jnp.asarray(cache[f"blocks.{l}.attn.hook_z"][:, position], F32)  # [B, H, K]
        out = jnp.einsum("BHK,DHK->BHD", z, w)  # each head's output, before the others are added
        heads.append(_term(out, scale[:, None], direction[:, None]))
        b = c_proj["bias"].astype(F32) if "bias" in c_proj else jnp.zeros(config.n_embd, F32)
        bias.append(_term(jnp.broadcast_to(b, (B, config.n_embd)), scale, direction))
    return HeadAttribution(jnp.stack(heads, axis=1), jnp.stack(bias, axis=1))
