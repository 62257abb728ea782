"""Host-side preparation of a generation batch: ragged prompts and one SamplingParams per row -> right-padded,
bucketed arrays, keys and the rules a decode step applies (`prepare`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket, traced
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.generation.decode import Rules, StopRule
from gpt2_jax.interp.hooks import checked_hooks
from gpt2_jax.kernels.invariance import pad_rows
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.model.axes import data_size, mesh_of
from gpt2_jax.model.params import Params
from gpt2_jax.sampling import constraints
from gpt2_jax.sampling.checks import MAX_STOP_IDS
from gpt2_jax.sampling.constraints.automaton import Automaton
from gpt2_jax.sampling.constraints.tables import pack
from gpt2_jax.sampling.metadata import pack_processors, pack_settings, row_keys
from gpt2_jax.sampling.params import SamplingParams

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Int, Key

MIN_BUCKET = 16


class Batch(NamedTuple):
    tokens: np.ndarray  # [B, P] int32: row b's prompt in [0, lengths[b]), then padding that is never attended
    lengths: np.ndarray  # [B] int32: prompt lengths
    keys: Any  # [B] PRNG keys
    capacity: int  # S = P + steps rounded up to whole blocks of KEY_BLOCK slots, the cache size
    steps: int  # N, decode steps compiled (max_new_tokens rounded up)
    rows: int  # the caller's prompts; rows beyond (padding for a mesh) are copies of the last one


def bucket(n: int, cap: int) -> int:
    """n rounded up to a power of two (at least MIN_BUCKET), at most cap."""
    return min(pow2_bucket(n, MIN_BUCKET), cap)


def as_prompts(prompts: Any) -> list[list[int]]:
    """A list of token-id lists (ragged), a [B, T] array, or one flat list of ids -> list of lists."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        prompts = np.asarray(prompts).tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]  # a single prompt
    if not prompts:
        raise InputError("no prompts given")
    out = []
    for b, p in enumerate(prompts):
        p = list(p) if not isinstance(p, (int, np.integer)) else None
        if not p:
            raise InputError(f"prompt {b} is empty; every prompt needs at least one token")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            raise InputError(f"prompt {b} must be a list of int token ids")
        out.append([int(t) for t in p])
    return out


def make_batch(prompts: Any, config: GPT2Config, max_new_tokens: Sequence[int]) -> Batch:
    """Check prompts and lengths (max_new_tokens: one per row), then right-pad into a bucketed [B, P] array:
    every prompt starts at slot 0, its tokens at the positions a full forward gives them (see
    gpt2_jax.model.kv_cache). Padding repeats each row's last token: a real token of that row, never
    attended (the mask hides it) and overwritten by the row's first generated tokens."""
    rows = as_prompts(prompts)
    if len(max_new_tokens) != len(rows):
        raise ConfigError(f"max_new_tokens given per row must have one entry per prompt ({len(rows)})")
    for b, (p, n) in enumerate(zip(rows, max_new_tokens)):
        bad = [t for t in p if not 0 <= t < config.valid_vocab]
        if bad:
            raise InputError(f"prompt {b}: token id {bad[0]} is outside the vocab [0, {config.valid_vocab})")
        if len(p) + n > config.n_positions:
            raise InputError(
                f"prompt {b}: {len(p)} prompt tokens + max_new_tokens={n} exceed the context "
                f"n_positions={config.n_positions}"
            )
    lengths = np.array([len(p) for p in rows], np.int32)
    P = bucket(int(lengths.max()), config.n_positions)
    tokens = np.empty((len(rows), P), np.int32)
    for b, p in enumerate(rows):
        tokens[b, : len(p)], tokens[b, len(p) :] = p, p[-1]
    steps = bucket(int(max(max_new_tokens)), config.n_positions)
    return Batch(tokens, lengths, None, cache_capacity(P, steps, config), steps, len(rows))


def cache_capacity(prompt_len: int, max_new_tokens: int, config: GPT2Config) -> int:
    """The cache slots S for a prompt and a step count: both bucketed, then rounded up to whole blocks of
    attention's key slots, so the cache is scored without padding (see gpt2_jax.model.attention)."""
    total = bucket(prompt_len, config.n_positions) + bucket(max_new_tokens, config.n_positions)
    return -(-total // KEY_BLOCK) * KEY_BLOCK


class Prepared(NamedTuple):
    """A checked batch, ready for prefill: what generate, generate_stream and the engine start from."""

    batch: Batch
    rules: Rules  # every row's settings as traced values (rows padded for a mesh included)
    mesh: Any  # the params' mesh, or None
    sampling: list[SamplingParams]  # the caller's rows
    r: int  # top logprobs asked for (the most any row asked)
    hooks: Any  # a gpt2_jax.interp.Hooks editing the forward (steering), or None

    @property
    def stops(self) -> list[tuple[str, ...]]:
        """Each row's stop strings."""
        return [s.stop for s in self.sampling]

    @property
    def max_new_tokens(self) -> np.ndarray:
        """[B] each row's max_new_tokens."""
        return np.array([s.max_new_tokens for s in self.sampling], np.int32)


def _stop_rule(rows: list[SamplingParams], eos: list[int | None]) -> StopRule:
    ids = np.full((len(rows), MAX_STOP_IDS), -1, np.int32)
    for b, r in enumerate(rows):
        ids[b, : len(r.stop_ids)] = r.stop_ids
    return StopRule(traced(np.array([-1 if e is None else e for e in eos], np.int32)), traced(ids))


def _keys(key: Any, rows: list[SamplingParams]) -> Key[Array, " B"]:
    """Row b's key: fold_in(jax.random.key(seed), b) when its SamplingParams has a seed, else from `key`
    (one key: fold_in(key, b); or one per row)."""
    B = len(rows)
    seeds = np.array([-1 if r.seed is None else r.seed for r in rows], np.int64)
    if key is None and (seeds < 0).any():
        raise ConfigError("generate needs a key (jax.random.key(...)), or a seed in every row's SamplingParams")
    keys = None if key is None else row_keys(key, B)
    if (seeds < 0).all():
        if keys is None:  # checked above: a row without a seed needs the key
            raise ConfigError("generate needs a key (jax.random.key(...)) for the rows without a seed")
        return keys
    seeded = _seeded_keys(jnp.asarray(seeds.astype(np.uint32)), jnp.arange(B, dtype=jnp.int32))
    return seeded if keys is None else _pick_keys(jnp.asarray(seeds >= 0), seeded, keys)


@jax.jit
def _seeded_keys(seeds: Int[Array, " B"], rows: Int[Array, " B"]) -> Key[Array, " B"]:
    return jax.vmap(lambda s, b: jax.random.fold_in(jax.random.key(s), b))(seeds, rows)


@jax.jit
def _pick_keys(use: Bool[Array, " B"], a: Key[Array, " B"], b: Key[Array, " B"]) -> Key[Array, " B"]:
    data = jnp.where(use[:, None], jax.random.key_data(a), jax.random.key_data(b))
    return jax.random.wrap_key_data(data)


def _automaton(s: SamplingParams, vocab_size: int, eos: int | None) -> Automaton | None:
    """The row's compiled constraint, or None without one."""
    if s.constraint is None:
        return None
    if eos is None:  # SamplingParams.check refuses a constraint without an EOS, so this is a bug
        raise ConfigError("a constraint needs an EOS id to end on; pass eos_id=50256")
    return constraints.compile_constraint(s.constraint, vocab_size, eos)


def prepare(params: Params, config: GPT2Config, prompts: Any, key: Any, sampling: list[SamplingParams],
            hooks: Any = None) -> Prepared:  # fmt: skip
    """Check everything on the host, before anything is traced: the prompts, one SamplingParams per prompt
    (against this model), the hooks; compile each row's constraint. A mesh's data axis must divide the
    rows: copies of the last row fill up to a multiple of it (rows never affect each other, so the caller
    just drops the copies' results)."""
    mesh = mesh_of(params)
    batch = make_batch(prompts, config, [s.max_new_tokens for s in sampling])
    B = batch.tokens.shape[0]
    if len(sampling) != B:
        raise ConfigError(f"sampling given per row must have one SamplingParams per prompt ({B}), got {len(sampling)}")
    eos = [s.eos(config) for s in sampling]
    for s, e in zip(sampling, eos):
        s.check(config.vocab_size, e)
    settings = pack_settings(sampling)
    procs = pack_processors(sampling, eos)
    automata = [_automaton(s, config.vocab_size, e) for s, e in zip(sampling, eos)]
    tables = pack(automata, config.vocab_size)
    rows = -(-B // data_size(mesh)) * data_size(mesh)
    tokens, lengths, keys, settings, procs, stop, group, start = jax.tree.map(
        lambda x: pad_rows(x, rows),
        (batch.tokens, batch.lengths, _keys(key, sampling), settings, procs, _stop_rule(sampling, eos), tables.group,
         tables.start),
    )  # fmt: skip
    rules = Rules(settings, procs, stop, tables._replace(group=group, start=start))
    batch = batch._replace(tokens=tokens, lengths=lengths, keys=keys)
    edits = checked_hooks(hooks, config) or None  # None: the plain programs
    return Prepared(batch, rules, mesh, list(sampling), max(s.top_logprobs for s in sampling), edits)
