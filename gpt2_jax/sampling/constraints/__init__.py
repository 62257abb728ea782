"""Constrained decoding: a regex, a choice or a JSON schema, compiled ahead of time to device tables.

A constraint says what the whole generated text must be: `regex(pattern)` (a full match),
`choice(options)` (exactly one option) or `json_schema(schema)` (JSON valid under the schema). Each
is compiled once, on the host, into a token-level DFA over GPT-2's 50257 tokens (compile_constraint),
and the DFAs of one batch are packed into a few small arrays (pack). Inside the jitted decode loop
two pure functions use them, with no host round trip: `allowed` gives the [B, V] mask of tokens each
row may take next, and `advance` moves each row's state along the token it took.

The guarantee: EOS is allowed only in accepting states, and every other allowed token leads to a
state from which the match can still be completed. So a row that stops on EOS has text that matches
the constraint completely; a row that runs out of tokens first has a prefix of a match and reports
finish_reason "length".

Why outlines-core: it precomputes the complete token-level index, state -> {token: next state},
ahead of time, which is exactly a table that can live on the device and be read by a gather per
step. llguidance and xgrammar take the other road: they compute each step's mask on the host,
incrementally, with an Earley parser (llguidance) or a pushdown automaton (xgrammar), so every step
would need the sampled token back on the host and the mask sent out again. In exchange they accept
recursive grammars (arbitrarily nested JSON, context-free languages) that no finite table can hold;
outlines-core unrolls recursive JSON schemas to a fixed depth instead.

  spec.py       Constraint, regex / choice / json_schema, ConstraintError, escape (Rust regex)
  automaton.py  compile_constraint -> Automaton: class_of [V], next_state [Q, C], accept [Q]
  tables.py     pack -> ConstraintTables (padded to buckets), allowed, advance
"""

from gpt2_jax.sampling.constraints.automaton import compile_constraint
from gpt2_jax.sampling.constraints.spec import Constraint, ConstraintError, choice, json_schema, regex

__all__ = ["Constraint", "ConstraintError", "choice", "compile_constraint", "json_schema", "regex"]
