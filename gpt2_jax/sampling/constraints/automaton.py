"""Compile a Constraint into a dense token-level DFA on the host: token classes, a state table, accepting states.

Shapes: V vocabulary (token ids), Q states, C token classes, E (state, token, next) transitions.
outlines-core's Index gives, per state, {token: next state}. Tokens whose transition column is the
same in every state form one class, so the table is [Q, C] instead of [Q, V]; class 0 holds every
token allowed nowhere (EOS, ids past the tokenizer, bytes the pattern never uses).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import numpy as np

from gpt2_jax.sampling.constraints.spec import Constraint, ConstraintError

GPT2_VOCAB = 50257  # 50256 byte-level BPE tokens, then <|endoftext|>
GPT2_EOS = 50256
NEVER = 0  # the class of tokens allowed in no state


class Automaton(NamedTuple):
    """One constraint's token-level DFA, host numpy. State 0 is the initial state."""

    class_of: np.ndarray  # [V] int32: token -> class id (NEVER for EOS and tokens allowed nowhere)
    next_state: np.ndarray  # [Q, C] int32: next state, -1 = class not allowed in that state
    accept: np.ndarray  # [Q] bool: EOS allowed, the text so far is a complete match
    build_seconds: float  # outlines Index build plus table build


def gpt2_vocabulary(eos_id: int = GPT2_EOS):
    """outlines-core Vocabulary of GPT-2's tokens as raw bytes (built once per eos id)."""
    return _vocabulary(int(eos_id))


@functools.lru_cache(maxsize=4)
def _vocabulary(eos_id: int):
    from outlines_core import Vocabulary

    from gpt2_jax.tokenizer import tokenizer

    enc = tokenizer()
    tokens: dict[bytes, list[int]] = {}
    for i in range(GPT2_EOS):
        if i != eos_id:
            tokens.setdefault(enc.decode_single_token_bytes(i), []).append(i)
    return Vocabulary(eos_id, tokens)


def _edges(index, eos_id: int):
    """Flatten outlines' transitions, EOS dropped: (state, token, next) arrays and the distinct
    (state, next) edges, both in outlines' own (sparse) state ids."""
    transitions = index.get_transitions()  # {state: {token: next}}
    src, tok, dst, edges = [], [], [], []
    for s, row in transitions.items():
        t = np.fromiter(row.keys(), np.int64, len(row))
        n = np.fromiter(row.values(), np.int64, len(row))
        keep = t != eos_id  # outlines lists EOS as a self-loop of each final state
        t, n = t[keep], n[keep]
        src.append(np.full(len(t), s, np.int64))
        tok.append(t)
        dst.append(n)
        targets = np.unique(n)
        edges.append(np.stack([np.full(len(targets), s, np.int64), targets]))
    empty = np.zeros(0, np.int64)
    src, tok, dst = (np.concatenate(x) if x else empty for x in (src, tok, dst))
    edges = np.concatenate(edges, axis=1) if edges else np.zeros((2, 0), np.int64)
    return src, tok, dst, edges


def _reach(n_states: int, a: np.ndarray, b: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """[n_states] bool: states reachable from `seeds` along edges a -> b."""
    seen = np.zeros(n_states, bool)
    seen[seeds] = True
    frontier = seen.copy()
    while frontier.any():
        step = np.zeros(n_states, bool)
        step[b[frontier[a]]] = True
        frontier = step & ~seen
        seen |= step
    return seen


def _mix(x: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of uint64 values: a well-spread 64-bit hash (wrapping arithmetic)."""
    z = x + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _classes(n_tokens: int, q: np.ndarray, t: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, int]:
    """Group tokens by identical column {state: next}: [n_tokens] class ids (NEVER = no entries), C.

    Each column is summarised by two order-free 64-bit hash sums and its entry count, so grouping is
    one np.unique over [n_tokens, 3]; build() then proves every grouping exact.
    """
    pair = (q.astype(np.uint64) << np.uint64(32)) | n.astype(np.uint64)
    key = np.zeros((n_tokens, 3), np.uint64)
    for j, seed in enumerate((1, 2)):
        np.add.at(key[:, j], t, _mix(pair, seed))
    key[:, 2] = np.bincount(t, minlength=n_tokens).astype(np.uint64)
    used = np.flatnonzero(key[:, 2] > 0)
    order = used[np.lexsort(key[used].T[::-1])]  # sorted by (hash 1, hash 2, count)
    new = np.ones(len(order), bool)
    new[1:] = (key[order[1:]] != key[order[:-1]]).any(1)
    class_of = np.full(n_tokens, NEVER, np.int64)
    class_of[order] = np.cumsum(new)  # classes 1..C-1 in hash order
    return class_of, int(new.sum()) + 1


def build(index, vocab_size: int, eos_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """outlines Index -> (class_of [V], next_state [Q, C], accept [Q]), dense, trimmed and checked."""
    src, tok, dst, edges = _edges(index, eos_id)
    initial = index.get_initial_state()
    finals = np.array(sorted(index.get_final_states()), np.int64)
    states = np.unique(np.concatenate([edges.ravel(), [initial]]))
    finals = finals[np.isin(finals, states)]
    order = np.concatenate([[initial], states[states != initial]])  # dense id: initial first
    if states[-1] < 64 * len(states) + 65536:  # outlines' ids are small: a lookup table
        lut = np.zeros(int(states[-1]) + 1, np.int64)
        lut[order] = np.arange(len(order))
        dense = lambda x: lut[x]
    else:
        dense_of_sorted = np.empty(len(states), np.int64)
        dense_of_sorted[np.searchsorted(states, order)] = np.arange(len(order))
        dense = lambda x: dense_of_sorted[np.searchsorted(states, x)]
    q, n = dense(src), dense(dst)
    accept = np.zeros(len(order), bool)
    accept[dense(finals)] = True
    # trim: keep states reachable from the start that can still reach an accepting state (outlines'
    # own DFA is already trim; this keeps the guarantee that an allowed token never leads to a dead end)
    a, b = dense(edges[0]), dense(edges[1])
    live = _reach(len(order), a, b, np.array([0])) & _reach(len(order), b, a, np.flatnonzero(accept))
    if not live[0]:
        raise ConstraintError("no GPT-2 token sequence can complete this pattern")
    renumber = np.cumsum(live) - 1
    kept = live[q] & live[n]
    q, t, n = renumber[q[kept]], tok[kept], renumber[n[kept]]
    accept = accept[live]
    class_of, n_classes = _classes(GPT2_EOS, q, t, n)
    next_state = np.full((len(accept), n_classes), -1, np.int64)
    next_state[q, class_of[t]] = n
    # exactness: every transition is in its class's column, and no column holds more than its tokens' own
    allowed_per_class = (next_state >= 0).sum(0)
    counts = np.bincount(t, minlength=GPT2_EOS)
    if not (next_state[q, class_of[t]] == n).all() or not (counts == allowed_per_class[class_of]).all():
        raise ConstraintError("internal error: token classes of this constraint collided; please report it")
    stuck = ~accept & (next_state < 0).all(1)
    if stuck.any():
        raise ConstraintError(f"internal error: states {np.flatnonzero(stuck)[:8].tolist()} allow nothing")
    full = np.full(vocab_size, NEVER, np.int32)
    full[:GPT2_EOS] = class_of
    full[eos_id] = NEVER
    return full, next_state.astype(np.int32), accept


def compile_constraint(c: Constraint, vocab_size: int = GPT2_VOCAB, eos_id: int = GPT2_EOS) -> Automaton:
    """Compile `c` against the GPT-2 vocabulary (cached on (c, vocab_size, eos_id): the same
    constraint gives the same Automaton object, which pack stores once).

    Token ids from 50256 up to vocab_size - 1 (padding) are never allowed; eos_id is allowed exactly
    in the accepting states, through Automaton.accept, not through a class.
    """
    known = _remembered.get((c, int(vocab_size), int(eos_id)))
    return known if known is not None else _compile(c, int(vocab_size), int(eos_id))


_remembered: dict = {}


def remember(c: Constraint, vocab_size: int, eos_id: int, automaton: Automaton) -> Automaton:
    """Make compile_constraint return `automaton` for (c, vocab_size, eos_id): one compiled elsewhere (the
    server compiles constraints in a separate process, so that outlines-core never holds this one's GIL)."""
    _remembered[(c, int(vocab_size), int(eos_id))] = automaton
    if len(_remembered) > 256:
        _remembered.pop(next(iter(_remembered)))
    return automaton


@functools.lru_cache(maxsize=64)
def _compile(c: Constraint, vocab_size: int, eos_id: int) -> Automaton:
    from outlines_core import Index

    if not isinstance(c, Constraint):
        raise ConstraintError(f"compile_constraint needs a Constraint, got {type(c).__name__}")
    if vocab_size < GPT2_VOCAB:
        raise ConstraintError(
            f"constraints need the GPT-2 vocabulary ({GPT2_VOCAB} tokens); this model has {vocab_size}"
        )
    if not 0 <= eos_id < vocab_size:
        raise ConstraintError(f"eos_id must be a token id below vocab_size {vocab_size}, got {eos_id}")
    vocabulary = gpt2_vocabulary(eos_id)
    start = time.perf_counter()
    try:
        index = Index(c.source, vocabulary)
    except Exception as e:
        raise ConstraintError(f"{c!r} cannot be indexed over GPT-2's tokens: outlines-core says: {e}") from None
    class_of, next_state, accept = build(index, vocab_size, eos_id)
    return Automaton(class_of, next_state, accept, time.perf_counter() - start)


def _clear() -> None:
    _compile.cache_clear()
    _remembered.clear()


compile_constraint.cache_clear = _clear  # for benches: time a cold compile
gpt2_vocabulary.cache_clear = _vocabulary.cache_clear
