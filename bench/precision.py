"""Logit error of each precision mode (gpt2_jax.model.precision) against float32, as a markdown table.

    python bench/precision.py

Models: the bundled Shakespeare GPT-2 (trained weights, stored in bfloat16, upcast for the float32
reference) and a GPT-2 124M with GPT-2's random initialisation. Input: the opening of Hamlet's
soliloquy, 128 tokens, batch 1. For every position: the logits of each mode against float32's.
Columns: max |dlogit| / max |logit| (the tests' relative error), mean |dlogit|, mean KL(fp32 || mode)
in nats, top-1 agreement, and the bytes of the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gpt2_jax
from gpt2_jax import BUNDLED_MODEL
from gpt2_jax.model.params import param_bytes
from gpt2_jax.model.precision import MODES, with_precision

TEXT = """HAMLET. To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them? To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;"""


def row(name: str, mode: str, params, ref: np.ndarray, tokens: np.ndarray, config) -> str:
    p = with_precision(params, mode)
    with jax.default_matmul_precision("highest"):
        out = np.asarray(gpt2_jax.forward(p, tokens, config), np.float64)
    diff = np.abs(out - ref)
    logp_ref, logp = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
    kl = float(jnp.mean(jnp.sum(jnp.exp(logp_ref) * (logp_ref - logp), axis=-1)))
    top1 = float((out.argmax(-1) == ref.argmax(-1)).mean())
    return (f"| {name} | {mode} | {diff.max() / np.abs(ref).max():.1e} | {diff.mean():.1e} | {kl:.1e} | "
            f"{top1:.1%} | {param_bytes(p) / 1e6:.0f} MB |")  # fmt: skip


def main() -> None:
    tokens = np.array([gpt2_jax.tokenizer().encode(TEXT)[:128]], np.int32)
    shakespeare, small_config = gpt2_jax.load(BUNDLED_MODEL, dtype="float32")
    gpt2_config = gpt2_jax.GPT2Config.preset("gpt2")
    models = [
        ("bundled Shakespeare (4x128, trained)", shakespeare, small_config),
        ("gpt2 124M (random init)", gpt2_jax.init_params(jax.random.key(0), gpt2_config), gpt2_config),
    ]
    print(f"{tokens.shape[1]} tokens of Hamlet, batch 1; reference: float32 with matmul precision 'highest'\n")
    print("| model | mode | max err / max logit | mean abs err | KL(fp32 ‖ mode) | top-1 agree | weights |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, params, config in models:
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(gpt2_jax.forward(params, tokens, config), np.float64)
        for mode in MODES[1:]:
            print(row(name, mode, params, ref, tokens, config), flush=True)


if __name__ == "__main__":
    main()
