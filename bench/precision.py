"""Logit error of each precision mode (gpt2_jax.model.precision) against float32, as a markdown table.

    python bench/precision.py [--data DIR]

Perplexity: the bundled model on the Shakespeare val split (156,600 tokens, `gpt2-jax data shakespeare`;
--data reuses a prepared directory, else it is fetched into a temp dir), every token scored once, in
consecutive windows of 256 tokens (each window's first token predicted from nothing but the previous
window's last: none, as nanoGPT's eval does; the last partial window dropped).

Models: the bundled Shakespeare GPT-2 (trained weights, stored in bfloat16, upcast for the float32
reference) and a GPT-2 124M with GPT-2's random initialisation. Input: the opening of Hamlet's
soliloquy, 128 tokens, batch 1. For every position: the logits of each mode against float32's.
Columns: max |dlogit| / max |logit| (the tests' relative error), mean |dlogit|, mean KL(fp32 || mode)
in nats, top-1 agreement, and the bytes of the weights.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

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


def val_tokens(data: str | None) -> np.ndarray:
    from gpt2_jax.training.data import TokenData, fetch_shakespeare

    if data is None:
        data = Path(tempfile.mkdtemp(prefix="gpt2_jax_shakespeare_")) / "data"
        fetch_shakespeare(data)
    return np.asarray(TokenData(data).splits["val"], np.int32)


def perplexity(params, config, val: np.ndarray, window: int = 256, batch: int = 8) -> float:
    """exp(mean NLL) of the val tokens, in consecutive windows of `window` predictions."""
    starts = list(range(0, len(val) - window - 1, window))
    score = jax.jit(lambda p, x: -jnp.take_along_axis(jax.nn.log_softmax(gpt2_jax.model.apply(p, x[:, :-1], config)),
                                                      x[:, 1:, None], -1)[..., 0].sum())  # fmt: skip
    total = 0.0
    for i in range(0, len(starts), batch):
        rows = starts[i : i + batch]
        x = np.stack([val[s : s + window + 1] for s in rows])
        total += float(score(params, x))  # a last short batch compiles once more
    return float(np.exp(total / (len(starts) * window)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", help="a prepared Shakespeare directory (gpt2-jax data shakespeare --out DIR)")
    args = parser.parse_args()
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
    val = val_tokens(args.data)
    print(f"\nbundled Shakespeare model, Shakespeare val split ({len(val):,} tokens): perplexity")
    print("\n| mode | perplexity | nats/token |\n| --- | --- | --- |")
    for mode in MODES:
        ppl = perplexity(with_precision(shakespeare, mode), small_config, val)
        print(f"| {mode} | {ppl:.3f} | {np.log(ppl):.4f} |", flush=True)


if __name__ == "__main__":
    main()
