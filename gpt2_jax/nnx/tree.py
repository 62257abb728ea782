"""The params pytree as a tree of small nnx.Modules: each leaf an nnx.Param holding the pytree's own array.

    GPT2LMHead
      wte  Param [V, D]      wpe  Param [P, D]
      h    List[Block] (per-layer params; one Block of [L, ...] leaves for stacked params)
             Block: ln_1 LayerNorm, attn Attention(c_attn Linear, c_proj Linear),
                    ln_2 LayerNorm, mlp MLP(c_fc Linear, c_proj Linear)
      ln_f LayerNorm
    LayerNorm: weight [D], bias [D]      Linear: weight [out, in] (c_attn: [3, D, D]), bias [out]

The names are the checkpoint's (gpt2_jax.model.params), so `nnx.state(model, nnx.Param)` reads like
the params pytree, and `model.h[0].attn.c_attn.weight` is `params["h"][0]["attn"]["c_attn"]["weight"]`,
the same array object (nnx.Param keeps the array it is given; nothing is copied either way). These
modules hold parameters only: the math stays in gpt2_jax.model, which GPT2LMHead's calls run.
Without biases (nanoGPT bias=False) the "bias" leaves are absent here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from flax import nnx

from gpt2_jax.model.params import Params


class Node(nnx.Module):
    """One dict of the params pytree as a module: each array an nnx.Param attribute of the same name, each
    sub-tree what CHILDREN's entry for its name builds from it (a Node class, or blocks for "h")."""

    CHILDREN: ClassVar[dict[str, Any]] = {}

    def __init__(self, tree: Mapping[str, Any]):
        for name, value in tree.items():
            child = self.CHILDREN.get(name)
            setattr(self, name, child(value) if child is not None else nnx.Param(value))

    def tree(self) -> dict[str, Any]:
        """This node's params pytree: the Params' own arrays (a view, no copy). Its attributes that are
        parameters or modules of them; anything else (GPT2LMHead's config and rngs) is no part of it."""
        return {name: _tree_of(v) for name, v in vars(self).items() if isinstance(v, (Node, nnx.List, nnx.Param))}


def _tree_of(value: Any) -> Any:
    if isinstance(value, Node):
        return value.tree()
    if isinstance(value, nnx.List):
        return [_tree_of(v) for v in value]
    return value.get_value()  # an nnx.Param: the very array it holds


class LayerNorm(Node):
    """weight [D] (the gain), bias [D] (the shift)."""


class Linear(Node):
    """weight [out, in] (torch.nn.Linear's layout; c_attn's q | k | v as [3, D, D]), bias [out]."""


class Attention(Node):
    """c_attn: the fused q, k, v projection; c_proj: the output projection."""

    CHILDREN: ClassVar[dict[str, Any]] = {"c_attn": Linear, "c_proj": Linear}


class MLP(Node):
    """c_fc: D -> F; c_proj: F -> D."""

    CHILDREN: ClassVar[dict[str, Any]] = {"c_fc": Linear, "c_proj": Linear}


class Block(Node):
    """One transformer block's params (or all L blocks', stacked [L, ...])."""

    CHILDREN: ClassVar[dict[str, Any]] = {"ln_1": LayerNorm, "attn": Attention, "ln_2": LayerNorm, "mlp": MLP}


def blocks(h: Any) -> nnx.List | Block:
    """params["h"] as modules: a list of per-layer dicts -> nnx.List of Blocks; a stacked dict -> one Block."""
    return nnx.List([Block(layer) for layer in h]) if isinstance(h, (list, tuple)) else Block(h)


def params_of(state: Any) -> Params:
    """An nnx.State of a GPT2LMHead (nnx.state(model), with or without a filter; Variables or pure arrays)
    -> the params pytree, the state's own arrays: h's integer keys back to a list, anything that is no
    parameter (the module's rngs) left out."""
    pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else dict(state)
    params = {name: pure[name] for name in ("wte", "wpe", "h", "ln_f") if name in pure}
    h = params.get("h")
    if isinstance(h, Mapping) and h and all(isinstance(k, int) for k in h):
        params["h"] = [h[i] for i in range(len(h))]
    return params
