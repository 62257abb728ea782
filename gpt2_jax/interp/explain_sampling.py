"""The explainer's sampler: the next token's distribution stage by stage over the full vocabulary, in
generate's order (processors -> temperature -> top-k -> top-p -> min-p -> the seeded draw), and steps that
append the drawn token and run again, giving generate's tokens for the same seed and settings.

Each stage is the library's own function: gpt2_jax.sampling.process_logits for the processors, and
next_token_probs / filter_logits with the warpers' settings up to that stage (each warper removes a lowest
part of the sorted row after the ones before it, so a prefix of the settings is that stage). The draw is
gpt2_jax.sampling.sample with generate's key for row 0: fold_in(fold_in(key(seed), 0), position), the
position being that of the token drawn (gpt2_jax.generation.decode.draw).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.interp.explain_views import encode_array, run, tokens_view, top_tokens
from gpt2_jax.sampling import SamplingParams, filter_logits, next_token_probs, process_logits, sample
from gpt2_jax.sampling.metadata import row_settings

PROCESSORS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
WARPERS = ("temperature", "top_k", "top_p", "min_p")
STAGES = ("raw", "processors", "temperature", "top_k", "top_p", "min_p")  # each with the settings before it


def checked(settings: dict[str, Any]) -> SamplingParams:
    """The sampling settings (SamplingParams' names; logit_bias keys may be strings of ids), checked as
    generate checks them: a ConfigError names the bad one."""
    if not isinstance(settings, dict):
        raise InputError(f"settings must be an object of sampling settings, got {type(settings).__name__}")
    settings = {k: v for k, v in settings.items() if v is not None}
    unknown = sorted(set(settings) - set(PROCESSORS + WARPERS))
    if unknown:
        raise InputError(f"{unknown[0]} is not an explainer setting; settings: {', '.join(PROCESSORS + WARPERS)}")
    bias = settings.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InputError(f"logit_bias must map token ids to biases, got {type(bias).__name__}")
        ids = {t: int(t) if isinstance(t, str) and t.strip().isdigit() else t for t in bias}
        settings["logit_bias"] = {ids[t]: b for t, b in bias.items()}
    return SamplingParams(**settings)


def stage_settings(s: SamplingParams, stage: str) -> dict[str, Any]:
    """The warpers in force at `stage`: the ones up to it as set, the later ones off."""
    upto = STAGES.index(stage)
    on = lambda name: STAGES.index(name) <= upto
    return {"temperature": s.temperature if on("temperature") else 1.0, "top_k": s.top_k if on("top_k") else 0,
            "top_p": s.top_p if on("top_p") else 1.0, "min_p": s.min_p if on("min_p") else 0.0}  # fmt: skip


def processors(s: SamplingParams) -> dict[str, Any]:
    return {name: getattr(s, name) for name in PROCESSORS if getattr(s, name)}


def processed_logits(raw: np.ndarray, s: SamplingParams, prompt: list[int], outputs: list[int], config) -> np.ndarray:
    """Raw next-token logits [V] -> after the processors [V] (the raw ones when none is on)."""
    return np.asarray(process_logits(raw[None], prompts=[prompt], outputs=[outputs], eos_id=config.eos_id,
                                     **processors(s)))[0]  # fmt: skip


def entropy(p: np.ndarray) -> float:
    """Shannon entropy in nats of a distribution [V] (zeros contribute nothing)."""
    q = p[p > 0].astype(np.float64)
    return float(-(q * np.log(q)).sum())


def stage(name: str, logits: np.ndarray, s: SamplingParams, config: GPT2Config) -> dict:
    """One stage: the distribution with the warpers up to `name`, its kept count and entropy."""
    w = stage_settings(s, name)
    row = jnp.asarray(logits)[None]  # [1, V]
    probs = np.asarray(next_token_probs(row, n_valid=config.valid_vocab, **w))[0]
    kept = filter_logits(row, row_settings(w["temperature"], w["top_k"], w["top_p"], 1, w["min_p"]),
                         config.valid_vocab)  # fmt: skip
    return {"name": name, "settings": w, "kept": int(np.isfinite(np.asarray(kept)).sum()),
            "entropy": entropy(probs), "probs": encode_array(probs), "top": top_tokens(probs)}  # fmt: skip


def row_key(seed: int, position: int) -> jax.Array:
    """generate's key for the token drawn at `position` of row 0 of a request with this seed."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), position)[None]


def draw(logits: np.ndarray, s: SamplingParams, seed: int, position: int, config: GPT2Config) -> int:
    """The seeded draw from processed logits [V], as generate's decode step makes it."""
    w = stage_settings(s, "min_p")
    return int(sample(row_key(seed, position), jnp.asarray(logits)[None], n_valid=config.valid_vocab, **w)[0])


def sampling_view(params, config: GPT2Config, prompt: list[int], outputs: list[int], settings: dict, seed: int):
    """Every stage of the next token after prompt + outputs, and the token drawn."""
    s = checked(settings)
    ids = prompt + outputs
    raw = run(params, config, ids)["logits"][0, -1]
    processed = processed_logits(raw, s, prompt, outputs, config)
    stages = [stage("raw", raw, s, config)] + [stage(n, processed, s, config) for n in STAGES[1:]]
    token = draw(processed, s, seed, len(ids), config)
    return {"stages": stages, "token": token, "text": tokens_view([token])["pieces"][0], "position": len(ids),
            "seed": seed}  # fmt: skip


def steps_view(params, config: GPT2Config, prompt: list[int], drawn: list[int], n: int, settings: dict, seed: int):
    """n more draws after prompt + drawn, each appended and the sequence run again (the penalties count the
    drawn tokens as generate's outputs); per step the token, and which key/value entries a KV cache would
    reuse (every earlier position) and which it computes new (the whole sequence at the first step, then the
    one token fed)."""
    s, outputs, steps = checked(settings), list(drawn), []
    for i in range(n):
        ids = prompt + outputs
        processed = processed_logits(run(params, config, ids)["logits"][0, -1], s, prompt, outputs, config)
        token = draw(processed, s, seed, len(ids), config)
        new = list(range(len(ids))) if i == 0 else [len(ids) - 1]
        steps.append({"token": token, "position": len(ids), "kv_reused": len(ids) - len(new), "kv_new": new})
        outputs.append(token)
        if token == config.eos_id:  # generate's row ends here
            break
    made = outputs[len(drawn) :]
    return {"tokens": made, "pieces": tokens_view(made)["pieces"] if made else [], "steps": steps}
