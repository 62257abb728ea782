"""Logits processors: logit bias, penalties, banned n-grams and words, min new tokens, one pure function each.

They run on the raw next-token logits [B, V], per row, before the sampler's warpers, in this order
(the one place it is written; the README repeats it):

  1. logit_bias          logits + bias[token]                                   (OpenAI; bias in [-100, 100])
  2. repetition_penalty  a token of prompt + output: x / theta if x > 0 else x * theta, once per token (HF)
  3. frequency_penalty,  x - frequency * count - presence * (count > 0), over the output only (OpenAI)
     presence_penalty
  4. no_repeat_ngram     -inf for a token that would repeat an n-gram of prompt + output (HF)
  5. bad_words_ids       -inf for a sequence's last token when its prefix ends the text (HF)
  6. min_new_tokens      -inf for EOS and the stop ids until that many tokens are generated (HF)
  7. constraint          -inf for a token the row's automaton does not allow (gpt2_jax.sampling.constraints)
then the warpers of gpt2_jax.sampling.filters: temperature -> top-k -> top-p -> min-p (transformers' order).
When 4-6 would leave a row no token at all, they are lifted for that step (transformers would sample
from NaNs); a constraint's mask (7) never is, so its guarantee holds.

Against transformers: 2, 4, 5, 6 and min-p are its processors with its semantics and relative order.
Against vLLM: the same order of bias then repetition, frequency and presence penalties; vLLM applies
min-p before top-k/top-p, transformers (and we) after top-p.

Every setting is one traced value per row, and a row whose settings are off (bias 0, theta 1,
penalties 0, n 0, no words, 0 min tokens, no constraint) gets its logits back bit for bit, so
rows never affect each other. The state the processors read (the token history, output counts)
is carried in the decode loop as a ProcessorState. process_logits runs them alone, outside the loop,
on token lists (the settings packed per row by gpt2_jax.sampling.metadata). Steps 4-6's masks are
gpt2_jax.sampling.bans'.

Shape legend: B batch, V vocab, S cache slots (positions), W banned words, M tokens per word,
N logit-bias entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.compiling import pow2_bucket
from gpt2_jax.errors import ConfigError
from gpt2_jax.sampling.bans import bad_word_tokens, ban, early_stop_tokens, repeated_ngrams, token_mask
from gpt2_jax.sampling.metadata import ProcessorSettings, processor_settings

if TYPE_CHECKING:  # shapes as annotations only: jaxtyping is not a runtime dependency
    from jaxtyping import Array, Bool, Float, Int


class ProcessorState(NamedTuple):
    """What the processors read, updated after every draw."""

    history: jax.Array  # [B, S] int32: the row's prompt then output tokens, token at position s in slot s
    in_prompt: jax.Array  # [B, V] bool: the token occurs in the prompt
    counts: jax.Array  # [B, V] int32: times the token was generated


def apply_logit_bias(
    logits: Float[Array, "B V"], ids: Int[Array, "B N"], bias: Float[Array, "B N"]
) -> Float[Array, "B V"]:
    """[B, V] + bias [B, N] at token ids [B, N]. Entries with bias 0 (unused ones among them) are dropped, not
    added: -0.0 + 0.0 would turn a logit of -0.0 into +0.0."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(bias != 0, ids, logits.shape[-1])].add(bias, mode="drop")


def apply_repetition_penalty(logits: Float[Array, "B V"], seen: Bool[Array, "B V"],
                             theta: Float[Array, " B"]) -> Float[Array, "B V"]:  # fmt: skip
    """transformers' RepetitionPenaltyLogitsProcessor: a seen token's logit [B, V] (seen [B, V]) is divided
    by theta [B] when positive, multiplied when negative; theta 1 leaves every bit as it was."""
    t = theta[:, None]
    return jnp.where(seen, jnp.where(logits < 0, logits * t, logits / t), logits)


def apply_presence_frequency(
    logits: jax.Array, counts: jax.Array, frequency: jax.Array, presence: jax.Array
) -> jax.Array:
    """OpenAI's penalties over the output tokens: logits - frequency * count - presence * (count > 0)."""
    logits = logits - frequency[:, None] * counts.astype(jnp.float32)
    return logits - presence[:, None] * (counts > 0).astype(jnp.float32)


def rows_in_use(p: ProcessorSettings, generated: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """[B] bool: the rows whose settings let some processor change a logit (a bias, a penalty, an n-gram size,
    a banned word, or min_new_tokens not yet reached while the row has stop ids [B, P] (-1 = unused))."""
    return (
        (p.bias != 0).any(-1)
        | (p.repetition_penalty != 1)
        | (p.frequency_penalty != 0)
        | (p.presence_penalty != 0)
        | (p.no_repeat_ngram_size > 0)
        | (p.bad_word_lengths > 0).any(-1)
        | ((generated < p.min_new_tokens) & (stop_ids >= 0).any(-1))
    )


def apply_processors(
    logits: jax.Array,
    p: ProcessorSettings,
    state: ProcessorState,
    length: jax.Array,
    generated: jax.Array,
    stop_ids: jax.Array,
    allowed: jax.Array | None = None,
) -> jax.Array:
    """Raw logits [B, V] -> processed float32 logits [B, V], in the module docstring's order. length [B]: the
    text's length (prompt + output); generated [B]: output tokens so far; allowed [B, V]: a constraint's mask.
    Only a batch with some row in use (or constrained) runs them at all, and the n-gram and word scans only
    when some row uses those (lax.cond): otherwise they cost nothing, not even a pass over the vocabulary.
    Either branch gives an unaffected row the same bits."""
    use = rows_in_use(p, generated, stop_ids)
    if allowed is not None:
        use |= ~allowed.all(-1)
    process = lambda: _process(logits, p, state, length, generated, stop_ids, allowed)
    return jax.lax.cond(jnp.any(use), process, lambda: logits.astype(jnp.float32))


def _process(logits, p, state, length, generated, stop_ids, allowed):
    v = logits.shape[-1]
    x = apply_logit_bias(logits.astype(jnp.float32), p.bias_ids, p.bias)
    x = apply_repetition_penalty(x, state.in_prompt | (state.counts > 0), p.repetition_penalty)
    x = apply_presence_frequency(x, state.counts, p.frequency_penalty, p.presence_penalty)
    none = jnp.zeros(x.shape, bool)
    banned = jax.lax.cond(
        jnp.any(p.no_repeat_ngram_size > 0),
        lambda: repeated_ngrams(state.history, length, p.no_repeat_ngram_size, v),
        lambda: none,
    )
    banned |= jax.lax.cond(jnp.any(p.bad_word_lengths > 0),
                           lambda: bad_word_tokens(state.history, length, p.bad_words, p.bad_word_lengths, v),
                           lambda: none)  # fmt: skip
    banned |= early_stop_tokens(generated, p.min_new_tokens, stop_ids, v)
    if allowed is None:
        allowed = jnp.ones(x.shape, bool)
    out = ban(x, banned | ~allowed)
    # Bans that leave a row no token at all (min_new_tokens while a constraint allows only EOS, every
    # token a banned word) are lifted for that step; a constraint's mask never is.
    stuck = jnp.max(out, axis=-1, keepdims=True) == -jnp.inf
    return jnp.where(stuck, ban(x, ~allowed), out)


def init_state(prompts: Int[Array, "B P"], lengths: Int[Array, " B"], capacity: int, v: int) -> ProcessorState:
    """Right-padded prompts [B, P], lengths [B] -> the state before the first draw (history of S slots)."""
    b, p = prompts.shape
    history = jnp.zeros((b, capacity), jnp.int32).at[:, :p].set(prompts)
    real = jnp.arange(p)[None, :] < lengths[:, None]
    return ProcessorState(history, token_mask(prompts, real, v), jnp.zeros((b, v), jnp.int32))


def update_state(state: ProcessorState, token: Int[Array, " B"], length: Int[Array, " B"],
                 live: Bool[Array, " B"]) -> ProcessorState:  # fmt: skip
    """Record the drawn tokens [B] at positions length [B]; rows that are not live [B] (stopped) keep theirs."""
    rows = jnp.arange(token.shape[0])
    s, v = state.history.shape[1], state.counts.shape[1]
    history = state.history.at[rows, jnp.where(live, length, s)].set(token, mode="drop")
    counts = state.counts.at[rows, jnp.where(live, token, v)].add(1, mode="drop")
    return state._replace(history=history, counts=counts)


def _token(t: Any, vocab: int, what: str) -> int:
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
        raise ConfigError(f"{what}: token id {t!r} must be an int in [0, {vocab})")
    return int(t)


def history_state(prompts: Any, outputs: Any, vocab: int) -> tuple[ProcessorState, np.ndarray, np.ndarray]:
    """Token lists per row: prompts and the outputs generated after them -> (ProcessorState, text lengths
    [B], output lengths [B]), as the decode loop holds them before its next draw."""
    outputs = [[] for _ in prompts] if outputs is None else outputs
    if len(outputs) != len(prompts):
        raise ConfigError(f"outputs must have one token list per prompt ({len(prompts)}), got {len(outputs)}")
    texts = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    history = np.zeros((len(texts), pow2_bucket(max(map(len, texts)), 16)), np.int32)
    in_prompt, counts = np.zeros((len(texts), vocab), bool), np.zeros((len(texts), vocab), np.int32)
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        history[b, : len(texts[b])] = [_token(t, vocab, "prompts/outputs") for t in texts[b]]
        in_prompt[b, list(p)] = True
        np.add.at(counts[b], list(o), 1)
    # numpy leaves, built on the host: jit takes them as it takes the loop's jax arrays
    state = ProcessorState(history, in_prompt, counts)  # pyright: ignore[reportArgumentType]
    return state, np.array(list(map(len, texts)), np.int32), np.array(list(map(len, outputs)), np.int32)


_process_jit = jax.jit(apply_processors)


def process_logits(
    logits: Any, *, prompts: Any, outputs: Any = None, eos_id: int | None = None, stop_ids: Any = (), **processors: Any
) -> jax.Array:
    """The processors alone, outside the decode loop: raw logits [B, V] for the next token after each row's
    prompt + outputs (token-id lists) -> processed logits [B, V] (-inf where banned). The same function
    (apply_processors) the loop runs; the settings are generate's."""
    logits = jnp.asarray(logits)
    b, v = logits.shape
    p = processor_settings(b, v, eos_id, **processors)
    state, length, generated = history_state(prompts, outputs, v)
    stops = np.array([-1 if eos_id is None else eos_id, *stop_ids], np.int32)
    return _process_jit(logits, p, state, length, generated, np.broadcast_to(stops, (b, len(stops))))
