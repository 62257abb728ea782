"""Turning prompts into tokens: batching, prefill and decode steps, the generate loop, text in and out.

batching.py     ragged prompts + one SamplingParams per row -> padded arrays, keys and rules (prepare)
decode.py       prefill, draw, feed, decode_step, the jitted decode loop (gpt-fast's shape)
paged.py        the same over a paged KV cache, prompts in chunks: the serving engine's state
generator.py    generate and generate_stream, the public entry points
beam.py         beam_search (and beam sampling): transformers' beam search, checked settings in, hypotheses out
beam_loop.py    its one jitted program: prefill, then a lax.while_loop of beam steps over the KV cache
beam_hyps.py    its bookkeeping in transformers' arithmetic: candidates, running beams, finished hypotheses
completion.py   complete: text in, text out, cut as OpenAI does
stop_strings.py stop strings, matched on the host
scoring.py      prompt_logprobs: given tokens scored as generate reports them
speculative/    speculative decoding that keeps plain decoding's tokens
"""

from gpt2_jax.generation.batching import Prepared, bucket, cache_capacity, prepare
from gpt2_jax.generation.beam import MAX_BEAMS, BeamResult, BeamSteps, beam_search
from gpt2_jax.generation.completion import Completion, complete
from gpt2_jax.generation.decode import DecodeState, Rules, Step, StopRule, decode_step, halt, prefill
from gpt2_jax.generation.generator import GenerateResult, encoding, generate, generate_stream, start, token_bytes
from gpt2_jax.generation.paged import decode_rows, init_paged, prefill_chunk, start_row, stop_rows
from gpt2_jax.generation.scoring import PromptScores, prompt_logprobs, score_tokens
from gpt2_jax.generation.stop_strings import StopMatcher

__all__ = [
    "MAX_BEAMS",
    "BeamResult",
    "BeamSteps",
    "Completion",
    "DecodeState",
    "GenerateResult",
    "Prepared",
    "PromptScores",
    "Rules",
    "Step",
    "StopMatcher",
    "StopRule",
    "beam_search",
    "bucket",
    "cache_capacity",
    "complete",
    "decode_rows",
    "decode_step",
    "encoding",
    "generate",
    "generate_stream",
    "halt",
    "init_paged",
    "prefill",
    "prefill_chunk",
    "prepare",
    "prompt_logprobs",
    "score_tokens",
    "start",
    "start_row",
    "stop_rows",
    "token_bytes",
]  # fmt: skip
