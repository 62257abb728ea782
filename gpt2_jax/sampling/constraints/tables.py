"""A batch's automata packed into one padded set of tables, and the two jit-safe steps that read them.

Shapes: B batch rows, V vocabulary, G distinct automata (+ the free one), Q global states, C token classes.
Global state 0 is FREE: every token allowed, a self-loop, accepting; class_of row 0 puts every token
in class 0. Automaton i keeps its classes and gets states offset_i .. offset_i + Q_i - 1, so C is the
largest C_i, not the sum. G, Q and C are padded up to powers of two (at least MIN_G, MIN_Q, MIN_C) so
a batch with similar patterns gets the same shapes and reuses the compiled decode loop; padded
states, classes and groups are never reachable and allow nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket
from gpt2_jax.sampling.constraints.automaton import Automaton
from gpt2_jax.sampling.constraints.spec import ConstraintError

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Int

MIN_G, MIN_Q, MIN_C = 2, 64, 64
FREE = 0  # global state (and class_of row) of an unconstrained row


class ConstraintTables(NamedTuple):
    """Numpy arrays (the caller device_puts or traces them); a pytree, so it passes through jit."""

    class_of: np.ndarray  # [G, V] int32: token -> class, per distinct automaton (row 0: FREE, all 0)
    next_state: np.ndarray  # [Q, C] int32: global next state, -1 = not allowed
    accept: np.ndarray  # [Q] bool: EOS allowed (a complete match so far); True in FREE
    group: np.ndarray  # [B] int32: the class_of row each batch row uses
    start: np.ndarray  # [B] int32: each batch row's initial global state


def bucket(tables: ConstraintTables) -> tuple[int, int, int]:
    """The padded (G, Q, C) of `tables`: equal buckets and equal B, V mean the same traced shapes."""
    return tables.class_of.shape[0], tables.next_state.shape[0], tables.next_state.shape[1]


def nbytes(tables: ConstraintTables) -> int:
    """Bytes the tables take on device."""
    return sum(np.asarray(a).nbytes for a in tables)


def pack(
    automata: list[Automaton | None], vocab_size: int, shape: tuple[int, int, int] | None = None
) -> ConstraintTables:
    """One entry per batch row (None = free row) -> one set of global tables.

    Identical automaton objects (compile_constraint's cache returns the same one for the same
    constraint) are stored once. shape (G, Q, C): fixed table sizes instead of buckets (a server's: one
    compiled step for every constraint), a ConstraintError when the automata need more.
    """
    distinct: dict[int, int] = {}  # id(automaton) -> group
    parts: list[Automaton] = []
    for i, a in enumerate(automata):
        if a is None or id(a) in distinct:
            continue
        if not isinstance(a, Automaton):
            raise ConstraintError(f"pack: row {i} must be an Automaton or None, got {type(a).__name__}")
        if a.class_of.shape != (vocab_size,):
            raise ConstraintError(
                f"pack: row {i}'s automaton was compiled for vocab_size {a.class_of.shape[0]}, not {vocab_size}"
            )
        distinct[id(a)] = len(parts) + 1
        parts.append(a)
    n_states = 1 + sum(a.next_state.shape[0] for a in parts)
    n_classes = max([1] + [a.next_state.shape[1] for a in parts])
    G, Q, C = pow2_bucket(1 + len(parts), MIN_G), pow2_bucket(n_states, MIN_Q), pow2_bucket(n_classes, MIN_C)
    if shape is not None:
        need = {"automata (+ the free one)": (1 + len(parts), shape[0]), "states": (n_states, shape[1]),
                "token classes": (n_classes, shape[2])}  # fmt: skip
        for what, (n, cap) in need.items():
            if n > cap:
                raise ConstraintError(f"the constraints need {n} {what}, over the tables' capacity of {cap}")
        G, Q, C = shape
    class_of = np.zeros((G, vocab_size), np.int32)  # padded groups: class 0, used by no row
    next_state = np.full((Q, C), -1, np.int32)
    accept = np.zeros(Q, bool)
    next_state[FREE] = FREE  # the free state allows every class and stays put
    accept[FREE] = True
    offsets = {}
    offset = 1
    for g, a in enumerate(parts, start=1):
        q, c = a.next_state.shape
        class_of[g] = a.class_of
        next_state[offset : offset + q, :c] = np.where(a.next_state >= 0, a.next_state + offset, -1)
        accept[offset : offset + q] = a.accept
        offsets[g] = offset
        offset += q
    group = np.array([0 if a is None else distinct[id(a)] for a in automata], np.int32)
    start = np.array([FREE if g == 0 else offsets[g] for g in group.tolist()], np.int32)
    return ConstraintTables(class_of, next_state, accept, group, start)


def allowed(
    tables: ConstraintTables, state: Int[Array, " B"], eos_id: Int[Array, " B"] | int | None
) -> Bool[Array, "B V"]:
    """[B, V] bool: token t is allowed in row b iff next_state[state_b, class_of[group_b, t]] >= 0.

    Row b's EOS, eos_id[b] ([B] int32, or one int for every row), is allowed iff accept[state_b]. A row whose
    EOS is -1 (or eos_id None) keeps EOS in the never-allowed class, so in an accepting state with no
    continuation (a finished choice) it allows nothing: the caller must stop such rows itself. Rows in FREE
    allow every token. Pure jnp: jit-safe, no host work.
    """
    rows = jnp.asarray(tables.next_state)[state]  # [B, C]
    classes = jnp.asarray(tables.class_of)[jnp.asarray(tables.group)]  # [B, V]
    ok = jnp.take_along_axis(rows, classes, axis=1) >= 0  # [B, V]
    if eos_id is not None:
        b = ok.shape[0]
        eos = jnp.broadcast_to(jnp.asarray(eos_id, jnp.int32), (b,))
        col = jnp.where(eos >= 0, eos, ok.shape[1])  # -1: no column (dropped)
        ok = ok.at[jnp.arange(b), col].set(jnp.asarray(tables.accept)[state], mode="drop")
    return ok


def advance(tables: ConstraintTables, state: Int[Array, " B"], token: Int[Array, " B"]) -> Int[Array, " B"]:
    """[B] int32: each row's state after `token` [B]; a token with no transition (EOS, or one that
    was not allowed) leaves the state as it is. Pure jnp: jit-safe, no host work."""
    state = jnp.asarray(state, jnp.int32)
    classes = jnp.asarray(tables.class_of)[jnp.asarray(tables.group), jnp.asarray(token)]  # [B]
    nxt = jnp.asarray(tables.next_state)[state, classes]  # [B]
    return jnp.where(nxt >= 0, nxt, state).astype(jnp.int32)
