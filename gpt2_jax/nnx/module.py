"""GPT2LMHead: GPT-2 as an nnx.Module whose state is the params pytree and whose calls are gpt2_jax's functions.

The module holds each array of the params pytree as an nnx.Param (gpt2_jax.nnx.tree), nothing else but
the config and, when given, an nnx.Rngs for dropout. Every call builds the params pytree from the
Params (`params()`: the same array objects, no copy) and runs the pure function: `model(tokens)` is
gpt2_jax.forward, `model.generate` is gpt2_jax.generate, `model.run_with_cache` is gpt2_jax.run_with_cache,
so their results are the functional API's bit for bit, and no model math lives here. Training the Flax way
differentiates gpt2_jax.loss_fn of `model.params()` with nnx.value_and_grad and updates the Params with
nnx.Optimizer (see docs/guides/flax_nnx.md).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpt2_jax.checkpoints import load, native
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation import complete, generate
from gpt2_jax.interp import run_with_cache, run_with_hooks
from gpt2_jax.model import apply, forward, init_params, stack_layers
from gpt2_jax.model.axes import mesh_of, on_mesh
from gpt2_jax.model.checks import check_tree
from gpt2_jax.model.gpt2 import check_tokens, trunk
from gpt2_jax.model.layers import layer_norm
from gpt2_jax.model.params import Params
from gpt2_jax.nnx.tree import LayerNorm, Node, blocks, params_of


@functools.partial(jax.jit, static_argnames="config")
def _dropped(params: Params, tokens: jax.Array, config: GPT2Config, key: jax.Array) -> jax.Array:
    return apply(params, tokens, config, key)  # the forward with dropout: what the training loss runs


@functools.partial(jax.jit, static_argnames="config")
def _features(params: Params, tokens: jax.Array, config: GPT2Config, key: jax.Array | None) -> jax.Array:
    return layer_norm(params["ln_f"], trunk(params, tokens, config, key), config.layer_norm_epsilon)


def _tokens(tokens: Any, config: GPT2Config) -> jax.Array:
    """tokens [B, T] checked as forward checks them (InputError), as int32."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    check_tokens(tokens, config)
    return jnp.asarray(tokens, jnp.int32)


class GPT2LMHead(Node):
    """GPT-2 with its tied LM head, as an nnx.Module.

    GPT2LMHead(config, rngs=nnx.Rngs(0)): GPT-2's initialisation (gpt2_jax.init_params with the rngs'
    params key; stacked=True holds the blocks as one Block of [L, ...] leaves). The rngs are kept:
    `train=True` calls draw their dropout keys from rngs.dropout(). from_pretrained(path) reads any
    checkpoint gpt2_jax.load reads; from_params(params, config) wraps a params pytree without a copy."""

    CHILDREN: ClassVar[dict[str, Any]] = {"h": blocks, "ln_f": LayerNorm}

    def __init__(
        self,
        config: GPT2Config,
        *,
        rngs: nnx.Rngs | None = None,
        dtype: Any = jnp.float32,
        stacked: bool = False,
        params: Params | None = None,
    ):
        if params is None:
            if rngs is None:
                raise ConfigError(
                    "GPT2LMHead(config) initialises new weights and needs rngs=nnx.Rngs(seed); "
                    "GPT2LMHead.from_pretrained(path) or .from_params(params, config) wrap existing ones"
                )
            params = init_params(rngs.params(), config, dtype, stacked=stacked)
        # shapes only (jax.eval_shape): checking stacked per-layer params copies nothing
        check_tree(jax.eval_shape(stack_layers, params), config, "GPT2LMHead params")
        super().__init__(params)
        self.config = config
        self.rngs = rngs

    @classmethod
    def from_params(cls, params: Params, config: GPT2Config, *, rngs: nnx.Rngs | None = None) -> GPT2LMHead:
        """A module over these params (per-layer or stacked): each Param holds the pytree's own array."""
        return cls(config, rngs=rngs, params=params)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: Any = None, mesh: Any = None, *, rngs: nnx.Rngs | None = None, **load_kwargs
    ) -> GPT2LMHead:
        """Any checkpoint gpt2_jax.load reads (HuggingFace, safetensors, .bin, nanoGPT, gpt2_jax's own),
        in its stored dtype or dtype=, on one device or laid out on mesh=. load_kwargs: load's others
        (config=, stacked=, progress=)."""
        params, config = load(path, dtype=dtype, mesh=mesh, **load_kwargs)
        return cls(config, rngs=rngs, params=params)

    def params(self) -> Params:
        """The params pytree gpt2_jax's functions take: the module's own arrays (h a list of per-layer
        dicts, or one stacked dict, as built). A view of the current values: an optimizer update
        replaces the Params' arrays, and a later params() returns the new ones."""
        return self.tree()

    def dropout_key(self) -> jax.Array:
        """A fresh key from the module's rngs (their dropout stream, else their default one)."""
        if self.rngs is None:
            raise ConfigError(
                "train=True draws dropout keys from the module's rngs, and this GPT2LMHead has none: "
                "build it with rngs=nnx.Rngs(seed) (from_pretrained and from_params take rngs= too)"
            )
        return self.rngs.dropout()

    def __call__(self, tokens: Any, *, train: bool = False) -> jax.Array:
        """tokens int [B, T] -> logits float32 [B, T, V]: gpt2_jax.forward; with train=True the forward
        the training loss runs, dropout at the config's rates with a key from the module's rngs."""
        if not train:
            return forward(self.params(), tokens, self.config)
        params = self.params()
        with on_mesh(mesh_of(params)):
            return _dropped(params, _tokens(tokens, self.config), self.config, self.dropout_key())

    def features(self, tokens: Any, *, train: bool = False) -> jax.Array:
        """tokens int [B, T] -> float32 [B, T, D]: the final LayerNorm's output, what the unembedding
        multiplies by wte (transformers' last hidden state): the input a head of one's own reads."""
        params = self.params()
        key = self.dropout_key() if train else None
        with on_mesh(mesh_of(params)):
            return _features(params, _tokens(tokens, self.config), self.config, key)

    def generate(self, prompts: Any, key: Any = None, **kwargs: Any):
        """gpt2_jax.generate(params, config, prompts, key, **kwargs) on the module's params."""
        return generate(self.params(), self.config, prompts, key, **kwargs)

    def complete(self, prompt: Any, key: Any = None, **kwargs: Any):
        """gpt2_jax.complete(params, config, prompt, key, **kwargs) on the module's params."""
        return complete(self.params(), self.config, prompt, key, **kwargs)

    def run_with_cache(self, tokens: Any, names: Any = None, hooks: Any = None):
        """gpt2_jax.run_with_cache: (logits, {TransformerLens hook name: activation})."""
        return run_with_cache(self.params(), tokens, self.config, names=names, hooks=hooks)

    def run_with_hooks(self, tokens: Any, hooks: Any) -> jax.Array:
        """gpt2_jax.run_with_hooks: logits with each hook's edit applied."""
        return run_with_hooks(self.params(), tokens, self.config, hooks)

    def save(self, dst: str | Path, *, force: bool = False) -> Path:
        """Write a gpt2_jax checkpoint (gpt2_jax.json + orbax params/) that gpt2_jax.load reads."""
        return native.save(dst, self.params(), self.config, force=force)


def save(dst: str | Path, state: Any, config: GPT2Config, *, force: bool = False) -> Path:
    """An nnx.State of a GPT2LMHead (nnx.state(model), filtered or not) -> a gpt2_jax checkpoint at dst,
    through orbax, atomically (an existing dst only with force=True); gpt2_jax.load reads it back."""
    return native.save(dst, params_of(state), config, force=force)
