"""The checkpoint's layout against the params pytree's: every tensor's flat name and checkpoint shape, and the
conversion of a block tensor between the two (Conv1D [in, out] in checkpoints, [out, in] in the tree, c_attn
split into q | k | v). gpt2_jax.model.params describes the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpt2_jax.config import GPT2Config

# Flat checkpoint name of the embeddings -> their key in the params pytree.
_EMBEDDINGS = {"wte.weight": "wte", "wpe.weight": "wpe"}


def layer_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Shapes of one block's tensors, keyed by their name inside h.{i}."""
    d, f = config.n_embd, config.mlp_dim
    shapes = {
        "ln_1.weight": (d,), "ln_1.bias": (d,),
        "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,), "ln_2.bias": (d,),
        "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,),
    }  # fmt: skip
    return {k: s for k, s in shapes.items() if config.bias or not k.endswith(".bias")}


_LINEAR_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def tree_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A block tensor's shape in the params pytree, from its checkpoint (Conv1D [in, out]) shape:
    linear weights turn to [out, in], and c_attn's 3D outputs split into (3, D) = (q|k|v, heads x K)."""
    if name == "attn.c_attn.weight":
        return (3, shape[1] // 3, shape[0])
    if name == "attn.c_attn.bias":
        return (3, shape[0] // 3)
    if name in _LINEAR_WEIGHTS:
        return (shape[1], shape[0])
    return shape


def to_tree(name: str, a: Any) -> Any:
    """One block tensor, checkpoint layout (Conv1D [in, out]) -> pytree layout (see tree_shape)."""
    if name == "attn.c_attn.weight":
        return a.reshape(a.shape[0], 3, a.shape[1] // 3).transpose(1, 2, 0)
    if name in _LINEAR_WEIGHTS:
        return a.T
    return a.reshape(tree_shape(name, a.shape))


def from_tree(name: str, a: Any) -> Any:
    """The inverse of to_tree: pytree layout -> checkpoint layout [in, out]."""
    if name == "attn.c_attn.weight":
        return a.transpose(2, 0, 1).reshape(a.shape[2], 3 * a.shape[1])
    if name in _LINEAR_WEIGHTS:
        return a.T
    return a.reshape(-1) if name == "attn.c_attn.bias" else a


def flat_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint by its flat name (h.{i}.attn.c_attn.weight, ...) and shape."""
    d = config.n_embd
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (config.vocab_size, d), "wpe.weight": (config.n_positions, d)}
    for i in range(config.n_layer):
        shapes.update({f"h.{i}.{k}": s for k, s in layer_shapes(config).items()})
    shapes["ln_f.weight"] = (d,)
    if config.bias:
        shapes["ln_f.bias"] = (d,)
    return shapes


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: Mapping, dotted: str) -> Any:
    for p in dotted.split("."):
        tree = tree[p]
    return tree


def dotted(path) -> str:
    """A pytree key path -> its dotted name (h.attn.c_attn.weight)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
