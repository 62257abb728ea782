"""Hook points under TransformerLens's names, and the tap that records and edits them during a forward.

The model's functions (gpt2_jax.model.layers, gpt2_jax.model.gpt2) call `tap(name, x) -> x` at each point when
given a tap. A Tap holds the edits (a Hooks: (name, fn) pairs) and the names to record. Its blocks
run inside one lax.scan over the layer index, so at a block's point the layer is a traced integer:
  edits      a lax.switch on the layer picks the functions given for that layer (identity otherwise);
  recording  each point's values go into a carried buffer of one slot per requested layer, plus one
             spare slot that every other layer overwrites: memory grows with what is asked for, not L.

Shape legend (gpt2_jax.config): B batch, T positions, S key slots (= T without a KV cache), D width,
H heads, K head dim, F MLP width, L layers.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import cast

import jax
import jax.numpy as jnp

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError

EMBED_POINTS = ("hook_embed", "hook_pos_embed")  # [B, T, D]
BLOCK_POINTS = (  # in the order a block computes them; "blocks.{l}." + each is a hook name
    "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k", "attn.hook_v",
    "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
    "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
)  # fmt: skip
FINAL_POINTS = ("ln_final.hook_scale", "ln_final.hook_normalized")
_BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")

Edit = Callable[[jax.Array], jax.Array]


def hook_names(config: GPT2Config) -> tuple[str, ...]:
    """Every hook name of a model, in the order the forward pass reaches them."""
    blocks = tuple(f"blocks.{l}.{p}" for l in range(config.n_layer) for p in BLOCK_POINTS)
    return EMBED_POINTS + blocks + FINAL_POINTS


def split_name(name: str) -> tuple[int | None, str]:
    """ "blocks.3.attn.hook_z" -> (3, "attn.hook_z"); "hook_embed" -> (None, "hook_embed")."""
    m = _BLOCK_NAME.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def point_shape(point: str, B: int, T: int, S: int, config: GPT2Config) -> tuple[int, ...]:
    """The shape of a block's hook point ("attn.hook_q", ...) for B rows of T tokens over S key slots."""
    H, K = config.n_head, config.head_dim
    if point.endswith("hook_scale"):
        return (B, T, 1)
    if point in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z"):
        return (B, T, H, K)
    if point in ("attn.hook_attn_scores", "attn.hook_pattern"):
        return (B, H, T, S)
    return (B, T, config.mlp_dim) if point.startswith("mlp.") else (B, T, config.n_embd)


def check_names(names: Iterable[str], config: GPT2Config) -> None:
    """Raise InputError for a name that is no hook point of this model, listing the close ones."""
    valid = hook_names(config)
    known = set(valid)
    for name in names:
        if not isinstance(name, str) or name not in known:
            close = difflib.get_close_matches(str(name), valid, n=5, cutoff=0.6)
            hint = (
                f"close matches: {', '.join(close)}"
                if close
                else f"names look like {valid[0]!r}, "
                f"'blocks.0.attn.hook_pattern', {valid[-1]!r} (layers 0..{config.n_layer - 1})"
            )
            raise InputError(f"unknown hook name {name!r}; {hint}")


def select_names(names, config: GPT2Config) -> tuple[str, ...]:
    """What run_with_cache records: None (everything), one name, exact names, or a predicate on names;
    returned in forward order."""
    valid = hook_names(config)
    if names is None:
        return valid
    if callable(names):
        return tuple(n for n in valid if names(n))
    wanted = [names] if isinstance(names, str) else list(names)
    check_names(wanted, config)
    return tuple(n for n in valid if n in set(wanted))


@dataclasses.dataclass(frozen=True)
class Hooks:
    """Edits by hook name: (name, fn) pairs, applied in order where the forward reaches `name`;
    fn(activation) -> an array of the activation's shape (a pure JAX function). Frozen and hashable
    (functions compare by identity), so a Hooks can be a static argument of jax.jit: build it once
    and reuse it, since a new function means a new compile."""

    items: tuple[tuple[str, Edit], ...] = ()

    def __post_init__(self):
        for item in self.items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and callable(item[1])):
                raise InputError(f"a hook is a (name, function) pair, got {item!r}")

    def __bool__(self) -> bool:
        return bool(self.items)

    def tap(self, config: GPT2Config) -> Tap:
        """The tap that applies these edits in one forward (how gpt2_jax.model.gpt2.forward_cached takes them)."""
        return Tap(self, (), config)


def hooks(edits: Hooks | Mapping[str, Edit] | Iterable[tuple[str, Edit]] | None = None) -> Hooks:
    """A Hooks from {name: fn}, (name, fn) pairs (several per name allowed) or None (no edits)."""
    if isinstance(edits, Hooks):
        return edits
    pairs = () if edits is None else edits.items() if isinstance(edits, Mapping) else edits
    items = tuple(tuple(p) if isinstance(p, list) else p for p in pairs)  # Hooks checks each is a (name, fn) pair
    return Hooks(cast("tuple[tuple[str, Edit], ...]", items))


def checked_hooks(edits, config: GPT2Config) -> Hooks:
    """hooks(edits), every name checked against this model's hook points (before anything is traced)."""
    edits = hooks(edits)
    check_names([name for name, _ in edits.items], config)
    return edits


def apply_edit(name: str, fn: Edit, x: jax.Array) -> jax.Array:
    """fn(x), checked to keep x's shape and cast to x's dtype."""
    y = jnp.asarray(fn(x))
    if y.shape != x.shape:
        raise InputError(f"hook {name!r} returned shape {tuple(y.shape)}, but the activation has shape "
                         f"{tuple(x.shape)}; a hook must return an array of its input's shape")  # fmt: skip
    return y.astype(x.dtype)


def _chain(name: str, fns: list[Edit]) -> Edit:
    def edit(x):
        for fn in fns:
            x = apply_edit(name, fn, x)
        return x

    return edit


class _Scoped:
    """A tap seen from inside a sub-module: names get the sub-module's prefix ("ln1.", "attn.", ...)."""

    def __init__(self, root, prefix: str):
        self.root, self.prefix = root, prefix

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        return self.root(self.prefix + name, x)

    def within(self, prefix: str) -> _Scoped:
        return _Scoped(self.root, f"{self.prefix}{prefix}.")


class Tap:
    """One forward's hooks: applies `hooks`' edits and records `record` (hook names) as it passes them.
    After the forward, `captured` maps each recorded name to its (edited) value."""

    def __init__(self, edits, record: Iterable[str], config: GPT2Config):
        edits, record = hooks(edits), tuple(record)
        check_names([name for name, _ in edits.items] + list(record), config)
        self.config = config
        self.edits: dict[str, list[Edit]] = {}
        for name, fn in edits.items:
            self.edits.setdefault(name, []).append(fn)
        self.record = frozenset(record)
        self.captured: dict[str, jax.Array] = {}
        # per block point: {layer: its edit} and the layers to record, sorted
        self.layer_edits: dict[str, dict[int, Edit]] = {}
        self.layer_record: dict[str, list[int]] = {}
        for name in self.edits:
            layer, point = split_name(name)
            if layer is not None:
                self.layer_edits.setdefault(point, {})[layer] = _chain(name, self.edits[name])
        for name in sorted(self.record, key=lambda n: split_name(n)[0] or 0):
            layer, point = split_name(name)
            if layer is not None:
                self.layer_record.setdefault(point, []).append(layer)

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        """A point outside the blocks (embeddings, ln_final)."""
        x = _chain(name, self.edits.get(name, []))(x)
        if name in self.record:
            self.captured[name] = x
        return x

    def within(self, prefix: str) -> _Scoped:
        return _Scoped(self, f"{prefix}.")

    def layer(self, i: jax.Array) -> LayerTap:
        """The tap of block i (traced) inside the scan."""
        return LayerTap(self, i)

    def new_store(self, B: int, T: int, S: int) -> dict[str, jax.Array]:
        """Zeroed buffers [len(layers) + 1, *shape] for each recorded block point (the last slot is the spare)."""
        return {point: jnp.zeros((len(layers) + 1, *point_shape(point, B, T, S, self.config)), jnp.float32)
                for point, layers in self.layer_record.items()}  # fmt: skip

    def slot(self, point: str, i: jax.Array) -> jax.Array:
        """The store slot of layer i at `point`: its rank among the recorded layers, else the spare."""
        layers = self.layer_record[point]
        table = [layers.index(l) if l in layers else len(layers) for l in range(self.config.n_layer)]
        return jnp.asarray(table, jnp.int32)[i]

    def load(self, store: dict[str, jax.Array]) -> None:
        """The buffers the scan filled -> captured["blocks.{l}.{point}"]."""
        for point, buffer in store.items():
            for k, layer in enumerate(self.layer_record[point]):
                self.captured[f"blocks.{layer}.{point}"] = buffer[k]


class LayerTap:
    """Block i's view of a Tap; what it records during the block is saved into the store by save()."""

    def __init__(self, tap: Tap, i: jax.Array):
        self.tap, self.i = tap, i
        self.recorded: dict[str, jax.Array] = {}

    def __call__(self, point: str, x: jax.Array) -> jax.Array:
        by_layer = self.tap.layer_edits.get(point)
        if by_layer:  # branch 0 leaves x alone; branch k applies the edit of the k-th edited layer
            table = [0] * self.tap.config.n_layer
            for k, layer in enumerate(by_layer, 1):
                table[layer] = k
            x = jax.lax.switch(jnp.asarray(table, jnp.int32)[self.i], [lambda a: a, *by_layer.values()], x)
        if point in self.tap.layer_record:
            self.recorded[point] = x
        return x

    def within(self, prefix: str) -> _Scoped:
        return _Scoped(self, f"{prefix}.")

    def save(self, store: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """store with this block's recorded values written into layer i's slots."""
        return {point: buffer.at[self.tap.slot(point, self.i)].set(self.recorded[point].astype(buffer.dtype))
                for point, buffer in store.items()}  # fmt: skip
