"""Training: next-token loss, AdamW with warmup + cosine decay and clipping, a jitted train step.

Weight decay (our choice, stated): decay the matmul weights, i.e. every c_attn/c_proj/c_fc weight and
wte (which is also the unembedding matrix); never biases, LayerNorm gains/shifts or wpe. nanoGPT
decays every tensor of rank >= 2, wpe included; we leave the position table undecayed, as the issue asks.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.tree_util import DictKey, SequenceKey

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.model.axes import constrain, mesh_of, on_mesh
from gpt2_jax.model.gpt2 import trunk
from gpt2_jax.model.layers import layer_norm
from gpt2_jax.model.params import MATMULS, Params, check_trainable, stack_layers
from gpt2_jax.training.loss_head import head_loss


def apply_updates(params: Params, updates: Any) -> Params:
    """optax.apply_updates: the params tree, updated (optax types its result as any tree; it is params' own)."""
    return cast(Params, optax.apply_updates(params, updates))


class TrainState(NamedTuple):
    step: jax.Array  # [] int32: optimizer updates done
    params: Params
    opt_state: Any


class Hyper(NamedTuple):
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup: int = 100
    steps: int = 1000
    weight_decay: float = 0.1
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95


TRAIN_UNROLL = 12  # layers per iteration of the training step's layer scan (see loss_fn)


def loss_fn(
    params: Params,
    tokens: jax.Array,
    config: GPT2Config,
    *,
    key: jax.Array | None = None,
    train: bool = False,
    remat: bool = False,
) -> jax.Array:
    """tokens int32 [B, T+1] -> mean cross-entropy (nats) of tokens[:, 1:] given tokens[:, :-1].
    Dropout (config's embd/attn/resid rates) only when train=True, driven by key. remat: recompute
    each block's activations in the backward instead of keeping them (less memory, more time).

    The layers run as one scan unrolled TRAIN_UNROLL layers at a time: unrolled, XLA keeps each
    layer's activations for the backward in buffers of their own instead of writing them into and
    reading them out of [L, ...] stacks (the 6 x 384 step: 1.32 s -> 1.08 s for the blocks'
    forward and backward), at a compile time that grows with the unrolled layers (a 12-layer model
    compiles 12 blocks; a deeper one compiles 12 plus its remainder L mod 12)."""
    if train and key is None:
        raise ConfigError("loss_fn(train=True) needs a PRNG key for dropout")
    tokens = constrain(tokens, "BT")  # on a mesh: data parallel, each "data" slice takes its rows
    # The layers stacked: their scan slices each weight (a copy that is nothing next to B x T tokens of
    # work), and the backward pass stays a plain scan (per-layer buffers are read through lax.switch,
    # whose backward adds a zero cotangent for every layer at every layer). A no-op for stacked params.
    params = stack_layers(params)
    unroll = min(TRAIN_UNROLL, config.n_layer)
    x = trunk(params, tokens[:, :-1], config, key if train else None, unroll=unroll, remat=remat)
    h = layer_norm(params["ln_f"], x, config.layer_norm_epsilon)
    return head_loss(h, params["wte"], tokens[:, 1:])  # = the mean of -log_softmax(h @ wte.T)[target]


def decay_mask(params: Params) -> Params:
    """True on the leaves that get weight decay: matmul weights and wte. The names are the path's dict
    keys and list indices only: a Flax nnx.State (gpt2_jax.nnx) holds each array as an attribute of a
    Variable, one more step on its path (.value) that names no parameter, so the state's mask is the
    params pytree's."""

    def decayed(path, _):
        names = [k.key if isinstance(k, DictKey) else k.idx for k in path if isinstance(k, (DictKey, SequenceKey))]
        return names == ["wte"] or (names[-1] == "weight" and any(n in MATMULS for n in names))

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(h: Hyper) -> optax.GradientTransformation:
    """Clip the global gradient norm, then AdamW on a linear-warmup + cosine schedule (to min_lr)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, h.lr, h.warmup, max(h.steps, h.warmup + 1), h.min_lr)
    return optax.chain(
        optax.clip_by_global_norm(h.clip),
        optax.adamw(schedule, b1=h.b1, b2=h.b2, weight_decay=h.weight_decay, mask=decay_mask),
    )


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0 for these params. The state holds its own copy of them: the train step donates the state
    (updates it in place), which must not delete the caller's params. float32 and bfloat16 params train;
    int8, w8a8 and float32-packed ones (gpt2_jax.model.precision) are for inference and are refused here."""
    check_trainable(params)
    params = jax.tree.map(jnp.copy, params)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def make_train_step(config: GPT2Config, optimizer: optax.GradientTransformation, *, remat: bool = False):
    """A jitted (state, batch [A, B, T+1], key) -> (state, {loss, grad_norm}), the state donated (pass the
    returned one on; the old one is consumed): A micro-batches are
    accumulated (mean gradient) before one optimizer update; micro-batch a's dropout uses fold_in(key, a).
    A state whose params are sharded (gpt2_jax.parallel.sharding) trains on their mesh: every process passes
    the same global batch, each "data" slice computes its rows, gradients are all-reduced.
    remat: recompute each block's activations in the backward (loss_fn); the same losses, less memory."""

    def grads_of(params, tokens, key):
        return jax.value_and_grad(loss_fn)(params, tokens, config, key=key, train=True, remat=remat)

    @functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers become the new state's
    def jitted(state: TrainState, batch: jax.Array, key: jax.Array):
        def micro(acc, a):
            loss, grads = grads_of(state.params, batch[a], jax.random.fold_in(key, a))
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(micro, zero, jnp.arange(batch.shape[0]))
        n = batch.shape[0]
        loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def train_step(state: TrainState, batch: Any, key: jax.Array):
        with on_mesh(mesh_of(state.params)):
            return jitted(state, batch, key)

    return train_step


@functools.partial(jax.jit, static_argnames="config")
def _eval_loss(params: Params, tokens: jax.Array, config: GPT2Config) -> jax.Array:
    return loss_fn(params, tokens, config)


def eval_loss(params: Params, batches: jax.Array | np.ndarray, config: GPT2Config) -> float:
    """Mean loss (no dropout) over batches [N, B, T+1]."""
    with on_mesh(mesh_of(params)):
        return float(jnp.mean(jnp.stack([_eval_loss(params, b, config) for b in batches])))
