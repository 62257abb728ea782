"""Choosing the next token: SamplingParams, the logits processors, then temperature, top-k, top-p and min-p,
then one keyed draw per row; and constrained decoding.

  params.py      SamplingParams: everything one request sets, checked in one place
  metadata.py    what is packed per row: RowSettings (the warpers), ProcessorSettings, row keys
  processors.py  the logits processors (bias, penalties, banned n-grams/words, min new tokens), their order;
                 process_logits
  filters.py     the reference: apply_temperature, top_k_mask, top_p_mask, filter_logits, next_token_probs
  draw.py        the fast per-row programs (reusing those masks) and the path-independent inverse-CDF draw
  constraints/   regex / choice / JSON schema -> a token automaton -> device tables
"""

from gpt2_jax.sampling import constraints
from gpt2_jax.sampling.draw import (
    CANDIDATES,
    FULL,
    GREEDY,
    PLAIN,
    WINDOW,
    argmax,
    inverse_cdf,
    row_programs,
    sample,
    sample_rows,
    token_logprobs,
)  # fmt: skip
from gpt2_jax.sampling.filters import (
    apply_temperature,
    cumsum,
    filter_logits,
    filter_scaled,
    min_p_mask,
    next_token_probs,
    top_k_mask,
    top_p_mask,
)  # fmt: skip
from gpt2_jax.sampling.metadata import (
    ProcessorSettings,
    RowSettings,
    check_sampling_args,
    pack_processors,
    pack_settings,
    processor_settings,
    row_keys,
    row_settings,
)  # fmt: skip
from gpt2_jax.sampling.params import (
    BOUNDS,
    MAX_NGRAM,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    RULES,
    SamplingParams,
    sampling_rows,
)
from gpt2_jax.sampling.processors import (
    ProcessorState,
    apply_logit_bias,
    apply_presence_frequency,
    apply_processors,
    apply_repetition_penalty,
    bad_word_tokens,
    early_stop_tokens,
    process_logits,
    repeated_ngrams,
)  # fmt: skip

__all__ = [
    "BOUNDS",
    "CANDIDATES",
    "FULL",
    "GREEDY",
    "MAX_NGRAM",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "PLAIN",
    "RULES",
    "WINDOW",
    "ProcessorSettings",
    "ProcessorState",
    "RowSettings",
    "SamplingParams",
    "apply_logit_bias",
    "apply_presence_frequency",
    "apply_processors",
    "apply_repetition_penalty",
    "apply_temperature",
    "argmax",
    "bad_word_tokens",
    "check_sampling_args",
    "constraints",
    "cumsum",
    "early_stop_tokens",
    "filter_logits",
    "filter_scaled",
    "inverse_cdf",
    "min_p_mask",
    "next_token_probs",
    "pack_processors",
    "pack_settings",
    "process_logits",
    "processor_settings",
    "repeated_ngrams",
    "row_keys",
    "row_programs",
    "row_settings",
    "sample",
    "sample_rows",
    "sampling_rows",
    "token_logprobs",
    "top_k_mask",
    "top_p_mask",
]  # fmt: skip
