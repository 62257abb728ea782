"""Checkpoints against configs: each check names the file, the config field or tensor, and both shapes.

Sizes are checked from tensor names and header shapes before anything is sized from a config, so a config
that claims a billion layers is an error in milliseconds, not a billion expected names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError
from gpt2_jax.model.params import BYTE_INPUTS, MATMULS, flat_shapes, init_params
from gpt2_jax.model.tree_layout import dotted


def listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


_BLOCK = re.compile(r"h\.(\d+)\.")


def layer_count(flat: Mapping[str, Any], source: str) -> int:
    """How many blocks the tensor names hold: h.0. to h.{n-1}., any other numbering an error. From the
    names alone (kept as strings: a name may hold more digits than int() takes)."""
    found = {m.group(1) for name in flat if (m := _BLOCK.match(name))}
    odd = sorted(found - {str(i) for i in range(len(found))}, key=lambda s: (len(s), s))
    if odd:
        raise CheckpointError(f"{source}: blocks are numbered h.0 to h.{len(found) - 1}, found h.{odd[0][:20]}")
    return len(found)


def _sizes(config: GPT2Config) -> dict[tuple[str, int], str]:
    """(tensor, axis) -> the config field that sizes it, as field=value."""
    f = f"n_inner={config.n_inner}" + (f" (so 4 * n_embd = {config.mlp_dim})" if config.n_inner is None else "")
    return {("wte.weight", 0): f"vocab_size={config.vocab_size}", ("wte.weight", 1): f"n_embd={config.n_embd}",
            ("wpe.weight", 0): f"n_positions={config.n_positions}", ("h.0.mlp.c_fc.weight", 1): f}  # fmt: skip


def check_sizes(flat: Mapping[str, Any], config: GPT2Config, source: str, config_source: str) -> None:
    """The config's sizes against the tensors present (names and header shapes only), before anything is
    sized from the config: a config.json saying n_layer=10**9 is this error, not 10**9 expected names."""
    n = layer_count(flat, source)
    if n != config.n_layer:
        raise CheckpointError(f"{config_source}: n_layer={config.n_layer}, but {source} holds {n} blocks")
    check_widths({key: tuple(flat[key].shape) for key, _ in _sizes(config) if key in flat}, config, source,
                 config_source)  # fmt: skip


def check_widths(shapes: Mapping[str, Any], config: GPT2Config, source: str, config_source: str) -> None:
    """vocab_size, n_embd, n_positions and the MLP width against the shapes (checkpoint layout) of wte.weight,
    wpe.weight and h.0.mlp.c_fc.weight, the error naming the config field."""
    expected = flat_shapes(config.replace(n_layer=1))
    for (key, axis), field in _sizes(config).items():
        got = shapes.get(key)
        if got is not None and len(got) == 2 and got[axis] != expected[key][axis]:
            raise CheckpointError(
                f"{config_source}: {field}, but {source} holds {key} of shape {got} (expected {expected[key]})"
            )


def check_flat(flat: Mapping[str, Any], config: GPT2Config, source: str, config_source: str = "the config") -> None:
    """Raise CheckpointError naming the config field at odds with the tensors (check_sizes), else every missing
    or unexpected key, or the first wrong shape."""
    check_sizes(flat, config, source, config_source)
    expected = flat_shapes(config)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {listing(missing)} for {config.n_layer}-layer config")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {listing(unexpected)}")
    for key, shape in expected.items():
        got = tuple(flat[key].shape)
        if got != shape:
            raise CheckpointError(f"{source}: tensor {key} has shape {got}, expected {shape}")


def check_tree(shapes: Any, config: GPT2Config, source: str, config_source: str = "the config") -> None:
    """Raise CheckpointError unless a (stacked) params pytree, of arrays or shape metadata, has exactly
    the leaves and shapes that config implies; the message names the first difference (n_layer first)."""
    want = {dotted(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda: init_params(jax.random.key(0), config, stacked=True)))[0]}  # fmt: skip
    got = {dotted(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    if "wte_scale" in got:  # int8 (gpt2_jax.model.precision): a float32 scale per output of each matmul weight
        want["wte_scale"] = want["wte"][:1]
        if "wte_qsum" in got:  # w8a8: the weight rows' sums of the matmuls with byte inputs (BYTE_INPUTS)
            want["wte_qsum"] = want["wte"][:1]
        if "wte_residual" in got:  # the embedding's second byte (int8 checkpoints written before it lack it)
            want["wte_residual"] = want["wte"]
        kinds = {m: ("scale", "qsum") if "wte_qsum" in got and m in BYTE_INPUTS else ("scale",) for m in MATMULS}
        want.update({n[: -len("weight")] + kind: s[:-1] for n, s in list(want.items())
                     if n.endswith(".weight") and n.split(".")[-2] in kinds for kind in kinds[n.split(".")[-2]]})  # fmt: skip
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        what = f"missing {listing(missing)}" if missing else f"unexpected {listing(unexpected)}"
        raise CheckpointError(f"{source}: {what} for the {config.n_layer}-layer config beside it")
    layers = {got[name][0] for name in got if name.startswith("h.") and got[name]}
    if layers and layers != {config.n_layer}:
        raise CheckpointError(f"{config_source}: n_layer={config.n_layer}, but {source} holds {min(layers)} layers")
    fc = got["h.mlp.c_fc.weight"]  # [L, out, in]
    check_widths({"wte.weight": got["wte"], "wpe.weight": got["wpe"], "h.0.mlp.c_fc.weight": fc[:0:-1]}, config,
                 source, config_source)  # fmt: skip
    for name, shape in want.items():
        if got[name] != shape:
            permuted = "weight" in name and sorted(got[name]) == sorted(shape)
            hint = " (a layout older than gpt2_jax 0.3: convert the source checkpoint again)" if permuted else ""
            raise CheckpointError(
                f"{source}: {name} has shape {got[name]}, expected {shape}{hint}, as {config_source} says"
            )
