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

from gpt2_jax.generation.beam import BeamResult, beam_search
from gpt2_jax.generation.completion import Completion, complete
from gpt2_jax.generation.decode import decode_step, prefill
from gpt2_jax.generation.generator import GenerateResult, generate, generate_stream
from gpt2_jax.generation.scoring import prompt_logprobs, score_tokens

__all__ = [
    "BeamResult",
    "Completion",
    "GenerateResult",
    "beam_search",
    "complete",
    "decode_step",
    "generate",
    "generate_stream",
    "prefill",
    "prompt_logprobs",
    "score_tokens",
]
