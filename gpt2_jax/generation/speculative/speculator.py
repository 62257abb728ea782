"""The Speculator: a generate call's proposer (prompt lookup or a draft model) checked once, then its
rounds run (see the package's docstring)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import ConfigError
from gpt2_jax.generation.speculative.verify import speculate_chunk, start_draft
from gpt2_jax.model.params import Params

PROMPT_LOOKUP = "prompt_lookup"
MAX_SPECULATIVE = 16  # k: proposals per round


def check_draft(draft: Any, config: GPT2Config, k: Any, needed: int) -> tuple[Params | None, GPT2Config | None]:
    """draft ("prompt_lookup" or (draft_params, draft_config)) -> (draft params, draft config), both None
    for prompt lookup. needed: prompt + new tokens the draft must be able to position."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE:
        raise ConfigError(f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE}], got {k!r}")
    if k + 1 > config.n_positions:
        raise ConfigError(f"num_speculative_tokens={k} is too large for the context: a round feeds k + 1 = {k + 1} "
                          f"tokens in one forward, more than the model's n_positions={config.n_positions}")  # fmt: skip
    if isinstance(draft, str):
        if draft != PROMPT_LOOKUP:
            raise ConfigError(f"draft must be {PROMPT_LOOKUP!r} or (draft_params, draft_config), got {draft!r}")
        return None, None
    if not (isinstance(draft, (tuple, list)) and len(draft) == 2 and isinstance(draft[1], GPT2Config)):
        raise ConfigError(
            f"draft must be {PROMPT_LOOKUP!r} or (draft_params, draft_config), got {type(draft).__name__}"
        )
    draft_params, draft_config = draft
    if draft_config.vocab_size != config.vocab_size or draft_config.valid_vocab != config.valid_vocab:
        raise ConfigError(
            f"the draft model's vocabulary ({draft_config.vocab_size} ids, {draft_config.valid_vocab} real) differs "
            f"from the target's ({config.vocab_size}, {config.valid_vocab}); a draft must share the target's tokenizer"
        )
    if draft_config.n_positions < needed:
        raise ConfigError(f"the draft model's context n_positions={draft_config.n_positions} is shorter than the "
                          f"prompt + max_new_tokens = {needed} it must follow")  # fmt: skip
    wte = draft_params.get("wte") if isinstance(draft_params, dict) else None
    if wte is None or tuple(wte.shape) != (draft_config.vocab_size, draft_config.n_embd):
        raise ConfigError("draft params do not fit the draft config: wte must be "
                          f"[{draft_config.vocab_size}, {draft_config.n_embd}]")  # fmt: skip
    return draft_params, draft_config


class Speculator:
    """Drives speculative rounds for generate / generate_stream: start() prefills the draft (the target's
    state comes from decode.prefill), run() continues until each row holds `until` tokens."""

    def __init__(self, params: Params, config: GPT2Config, draft: Any, k: int, needed: int, hooks: Any = None):
        self.params, self.config, self.k, self.hooks = params, config, int(k), hooks
        self.draft_params, self.draft_config = check_draft(draft, config, k, needed)
        self.dcache = None
        self.stats = None

    def start(self, tokens: Any, lengths: Any, capacity: int) -> None:
        if self.draft_config is not None:
            self.dcache = start_draft(self.draft_params, jnp.asarray(tokens), jnp.asarray(lengths), self.draft_config,
                                      capacity)  # fmt: skip

    def run(self, state: Any, rules: Any, until: int, steps: int, r: int, rounds: int = 1 << 30):
        """-> (state, Steps [B, steps] from each row's count at entry, tokens made [B] (numpy))."""
        state, self.dcache, (out, made, stats) = speculate_chunk(
            self.params, self.draft_params, state, self.dcache, rules, jnp.int32(until), jnp.int32(rounds),
            self.config, self.draft_config, steps, self.k, r, self.hooks)  # fmt: skip
        stats = jax.tree.map(np.asarray, stats)
        self.stats = stats if self.stats is None else jax.tree.map(np.add, self.stats, stats)
        return state, out, np.asarray(made)
