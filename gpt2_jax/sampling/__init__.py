"""Choosing the next token: SamplingParams, the logits processors, then temperature, top-k, top-p and min-p,
then one keyed draw per row; and constrained decoding.

  params.py      SamplingParams: everything one request sets, checked in one place
  metadata.py    what is packed per row: RowSettings (the warpers), ProcessorSettings, row keys
  processors.py  the logits processors (bias, penalties, banned n-grams/words, min new tokens), their order;
                 process_logits
  filters.py     the reference: apply_temperature, top_k_mask, top_p_mask, filter_logits, next_token_probs
  draw.py        the fast per-row programs (reusing those masks) and the path-independent draw (an exponential race)
  constraints/   regex / choice / JSON schema -> a token automaton -> device tables
"""

from gpt2_jax.sampling import constraints as constraints
from gpt2_jax.sampling.draw import sample
from gpt2_jax.sampling.filters import (
    apply_temperature,
    filter_logits,
    min_p_mask,
    next_token_probs,
    top_k_mask,
    top_p_mask,
)
from gpt2_jax.sampling.params import SamplingParams
from gpt2_jax.sampling.processors import process_logits

__all__ = [
    "SamplingParams",
    "apply_temperature",
    "filter_logits",
    "min_p_mask",
    "next_token_probs",
    "process_logits",
    "sample",
    "top_k_mask",
    "top_p_mask",
]
