"""The engine's DeviceBatch: one paged decode state for every row, and every row's rules at fixed widths (the
device side of the slots in serving.slots), and with a draft model its pool.

The rules (sampling settings, processors, stop ids, constraint tables) live on the host as numpy arrays at the
engine's fixed shapes, are edited row by row when a request starts, and are sent to the device whole only when
they change; the constraint tables are re-sent only when the set of constraints changes.

Shape legend: B rows, V vocab; constraint tables G automata, Q states, C classes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket
from gpt2_jax.config import GPT2Config
from gpt2_jax.generation.batching import prepare
from gpt2_jax.generation.paged import init_paged
from gpt2_jax.generation.speculative.paged import init_draft_pool
from gpt2_jax.model import Params
from gpt2_jax.model.params import float_dtype
from gpt2_jax.sampling import SamplingParams
from gpt2_jax.sampling.constraints.tables import pack
from gpt2_jax.serving.slots import fit, fixed_processors


def spec(tree: Any) -> Any:
    """Shapes, dtypes and shardings of a pytree of arrays (what a program is compiled for)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)


class DeviceBatch:
    """The engine's batch on the device: B rows over a pool of num_blocks blocks (M per row), and their rules."""

    def __init__(self, params: Params, config: GPT2Config, rows: int, num_blocks: int, blocks_per_row: int,
                 max_constraint_states: int, constraint_classes: int, draft: Any = None):  # fmt: skip
        self.config, self.rows = config, rows
        self.filler = config.eos_id if config.eos_id is not None else 0  # what an idle row emits, never read
        self.table_shape = (
            pow2_bucket(rows + 1),
            pow2_bucket(2 * max_constraint_states + 1),
            pow2_bucket(constraint_classes),
        )
        prep = prepare(params, config, [[self.filler]] * rows, jax.random.key(0),
                       [SamplingParams(max_new_tokens=1)] * rows)  # fmt: skip
        rules = prep.rules._replace(processors=fixed_processors(prep.rules.processors, rows))
        tables = pack([None] * rows, config.vocab_size, self.table_shape)
        self.host = jax.tree.map(np.array, rules._replace(constraint=tables))
        self.tables = jax.device_put(self.host.constraint)
        self.rules = self._device_rules()
        self.state = init_paged(config, rows, num_blocks, blocks_per_row, float_dtype(params), self.filler)
        self.state_spec, self.rules_spec = spec(self.state), spec(self.rules)
        # speculation (serving.speculation): the draft model's pool under the same tables, if there is a draft;
        # each row's max_new_tokens and whether it speculates
        self.draft_pool = None if draft is None else init_draft_pool(draft[1], num_blocks, float_dtype(draft[0]))
        self.draft_spec = spec(self.draft_pool)
        self.until, self.want = np.zeros(rows, np.int32), np.zeros(rows, bool)

    def _device_rules(self) -> Any:
        r = self.host
        return r._replace(settings=jax.device_put(r.settings), processors=jax.device_put(r.processors),
                          stop=jax.device_put(r.stop), constraint=self.tables)  # fmt: skip

    def set_row(self, b: int, rules: Any) -> None:
        """Write a one-row Rules (generate's, for the request) into row b of the host rules."""

        def put(big, small):
            big[b] = fit(np.asarray(small)[0], big.shape[1:], "a setting")

        for part in ("settings", "processors", "stop"):
            jax.tree.map(put, getattr(self.host, part), getattr(rules, part))
        self.rules = self._device_rules()

    def swap_rows(self, b: int, j: int) -> None:
        """Swap rows b and j's host rules, max_new_tokens and speculation flag (two rows whose decode state is
        not live: a prompt going in, or a free row)."""

        def swap(a):
            a[[b, j]] = a[[j, b]]

        for part in ("settings", "processors", "stop"):
            jax.tree.map(swap, getattr(self.host, part))
        swap(self.until)
        swap(self.want)
        self.rules = self._device_rules()

    def fits(self, automata: list, new: Any) -> bool:
        """Whether the tables can hold `new` beside the automata rows hold now (each distinct one is stored once)."""
        held = {id(a): a for a in automata if a is not None}
        held[id(new)] = new
        G, Q, _ = self.table_shape
        return len(held) + 1 <= G and 1 + sum(a.next_state.shape[0] for a in held.values()) <= Q

    def repack(self, automata: list, decoding: np.ndarray, move: Any) -> None:
        """Re-pack the rows' automata into the fixed tables. Decoding rows keep their local state (`move`, the
        compiled set_automaton); a row whose prompt is still going in starts from its start state (start_state)."""
        old = self.host.constraint
        new = pack(automata, self.config.vocab_size, self.table_shape)
        states = np.asarray(self.state.automaton)
        local = np.where(old.group > 0, states - old.start, 0)
        moved = np.where((new.group > 0) & decoding, new.start + local, 0).astype(np.int32)
        self.host = self.host._replace(constraint=new)
        self.tables = jax.device_put(new)
        self.rules = self._device_rules()
        self.state = move(self.state, jnp.asarray(moved))

    def start_state(self, b: int) -> int:
        """Row b's constraint start state in the current tables (0: free)."""
        c = self.host.constraint
        return int(c.start[b]) if c.group[b] > 0 else 0
