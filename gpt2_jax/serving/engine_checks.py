"""What the engine checks before it runs anything: its own settings when it is built, each request when it is
submitted (a ConfigError or InputError then, never a failure later on the engine thread)."""

from __future__ import annotations

from typing import Any

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError, InputError
from gpt2_jax.generation.batching import prepare
from gpt2_jax.model import Params
from gpt2_jax.model.attention import KEY_BLOCK
from gpt2_jax.sampling import constraints
from gpt2_jax.serving.slots import Request, fixed_processors

OLD_SLOTS = 8  # the default pool holds the KV of the 8 max_seq-long slots the engine used to reserve


def default_blocks(max_seq: int) -> int:
    """The pool's default size: as many slots as OLD_SLOTS rows of max_seq, plus the null block."""
    return OLD_SLOTS * -(-max_seq // KEY_BLOCK) + 1


def check_settings(config: GPT2Config, max_batch: int, max_queue: int, max_seq: int | None, num_blocks: int | None,
                   prefill_chunk: int, max_constraint_states: int,
                   constraint_classes: int) -> tuple[int, int]:  # fmt: skip
    """The engine's settings checked (ConfigError) -> (max_seq, num_blocks) with their defaults filled in."""
    if max_batch < 1 or max_queue < 0:
        raise ConfigError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
    max_seq = config.n_positions if max_seq is None else max_seq
    if not 1 <= max_seq <= config.n_positions:
        raise ConfigError(f"max_seq must be in [1, n_positions={config.n_positions}], got {max_seq}")
    if max_constraint_states < 1 or constraint_classes < 1:
        raise ConfigError("max_constraint_states and constraint_classes must be >= 1")
    if not 1 <= prefill_chunk <= config.n_positions:
        raise ConfigError(f"prefill_chunk must be in [1, n_positions={config.n_positions}], got {prefill_chunk}")
    blocks_per_row = -(-max_seq // KEY_BLOCK)
    num_blocks = default_blocks(max_seq) if num_blocks is None else num_blocks
    if num_blocks < blocks_per_row + 1:
        raise ConfigError(f"num_blocks must be >= {blocks_per_row + 1} (one max_seq={max_seq} request's "
                          f"{blocks_per_row} blocks of {KEY_BLOCK} tokens, plus the null block), "
                          f"got {num_blocks}")  # fmt: skip
    return max_seq, num_blocks


def automaton(request: Request, config: GPT2Config) -> Any:
    """The request's constraint as an automaton over the vocabulary, or None when it has none."""
    c, eos = request.sampling.constraint, request.sampling.eos(config)
    if c is None:
        return None
    assert eos is not None, "checked by prepare: a constraint needs an EOS (SamplingParams.check)"
    return constraints.compile_constraint(c, config.vocab_size, eos)


def check_request(params: Params, config: GPT2Config, request: Request, max_seq: int, max_constraint_states: int,
                  constraint_classes: int) -> Any:  # fmt: skip
    """Validate a request as generate would (ConfigError / InputError) -> generate's preparation of it."""
    n = request.sampling.max_new_tokens
    if len(request.prompt) + n > max_seq:
        raise InputError(f"{len(request.prompt)} prompt tokens + max_tokens={n} exceed this server's max_seq={max_seq}")
    prep = prepare(params, config, [request.prompt], request.key[None], [request.sampling.replace(seed=None)])
    fixed_processors(prep.rules.processors, 1)  # a 400 now, not later, for too many biases or bad words
    a = automaton(request, config)
    if a is not None:
        q, k = a.next_state.shape
        if q > max_constraint_states or k > constraint_classes:
            raise ConfigError(f"the constraint needs {q} states and {k} token classes; this server allows at "
                              f"most {max_constraint_states} states and {constraint_classes} classes "
                              f"(--max-constraint-states, --constraint-classes)")  # fmt: skip
    # generate's constraint tables for this one row (G x V: 400 KB even unconstrained) are not the engine's,
    # whose rows share one fixed set (batch.py): kept for the request's lifetime they would leave long-lived
    # buffers of many sizes all through the heap, which is what made RSS creep (serving/memory.py).
    return prep._replace(rules=prep.rules._replace(constraint=None))
