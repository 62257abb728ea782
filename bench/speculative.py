"""Speculative decoding against plain decoding and against transformers' assisted generation, batch 1,
gpt2-small widths, one run, the same weights in both libraries.

    python bench/speculative.py [--new 128] [--k 4,8] [--repeats 3] [--damp 0.02] [--cases draft,sampled,lookup]

--damp sets how well the draft agrees (it prints the total variation between the two models' distributions at
temperature 1): 0.02 gives about 1.5e-2, 0.001 about the 7e-4 of issue 49's draft.

The models (random weights, built honestly so that a small draft agrees with the target):
- target: transformers' random GPT-2 (12 layers, 768 wide), then the output projections (attn.c_proj,
  mlp.c_proj: weights and biases) of layers 1..11 multiplied by --damp, so those layers barely change
  the residual stream;
- draft: a 1-layer GPT-2 holding the target's embeddings, layer 0 and final LayerNorm. Its greedy
  token equals the target's most of the time (the bench prints how often: the acceptance rate).
Both are saved with save_pretrained and loaded by gpt2_jax and transformers alike.

Inputs: a 32-token random prompt for the draft model, greedy and sampled (temperature 1, no top-k or
top-p, in transformers too: top_k=0); for prompt lookup, that prompt followed by the target's own
128-token greedy continuation (a random model's greedy text falls into a loop, so the model goes on by
copying what is already in its input), greedy. 128 new tokens, eos off. Sampled rows keep plain
decoding's tokens too: the draft proposes with the target's own draw (same key, so the same exponential
race clocks), so it loses a proposal about as often as the two models' total variation. transformers' sampled assisted
generation keeps the distribution instead (its own ratio test), so its tokens differ from its plain run.

Time per token = (t(new) - t(1 new)) / (new - 1): the prompt pass cancels. A round is one target
forward; rounds = proposed / k. Break-even acceptance: the per-proposal acceptance rate a at which
1 + a + ... + a^k tokens per round pay for the measured round time (time / rounds) against a plain
step; below it speculation loses. The bound is plain decode's: weight bytes / measured bandwidth per
token (speculation reads the weights once per round, so it can go below it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from machine import describe
from timing import best_of  # bench/timing.py, beside this script

PROMPT = 32


def build(transformers, torch, damp: float) -> tuple[str, str]:
    """Save the target and the 1-layer draft (module docstring) -> their directories."""
    torch.manual_seed(0)
    target = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    with torch.no_grad():
        for i, block in enumerate(target.transformer.h):
            if i >= 1:
                for proj in (block.attn.c_proj, block.mlp.c_proj):
                    proj.weight.mul_(damp)
                    proj.bias.mul_(damp)
    draft = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1)).eval()
    state = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("transformer.h.") or k.startswith("transformer.h.0.")
    }
    draft.load_state_dict(state)
    tdir, ddir = tempfile.mkdtemp(), tempfile.mkdtemp()
    target.save_pretrained(tdir)
    draft.save_pretrained(ddir)
    return tdir, ddir


def break_even(ratio: float, k: int) -> float:
    """The a in [0, 1] with 1 + a + ... + a^k = ratio (round time / plain step), by bisection."""
    if ratio <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(k + 1)) < ratio else (lo, a)
    return lo if ratio <= k + 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--k", default="4,8", help="proposals per round, comma-separated")
    parser.add_argument("--cases", default="draft,sampled,lookup", help="draft (greedy), sampled (the draft at "
                        "temperature 1), lookup (prompt lookup, greedy); comma-separated")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--damp", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                        help="also time transformers (--no-transformers: gpt2_jax only, its columns read nan)")  # fmt: skip
    args = parser.parse_args()

    import jax
    import numpy as np
    import torch
    import transformers

    import gpt2_jax
    from gpt2_jax.model.params import param_bytes

    torch.set_num_threads(args.threads)
    machine = describe(jax, jax.numpy, args.threads)
    print(f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    tdir, ddir = build(transformers, torch, args.damp)
    params, config = gpt2_jax.load(tdir)
    draft = gpt2_jax.load(ddir)
    hf_target = transformers.GPT2LMHeadModel.from_pretrained(tdir).eval()
    hf_draft = transformers.GPT2LMHeadModel.from_pretrained(ddir).eval()
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    n, ks = args.new, [int(k) for k in args.k.split(",")]
    bound = (param_bytes(params) - params["wpe"].nbytes) / machine["bandwidth"]

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, PROMPT).tolist()
    loop = gpt2_jax.generate(
        params, config, [prompt], jax.random.key(0), max_new_tokens=128, temperature=0.0, eos_id=None
    )
    copying = prompt + loop.tokens[0].tolist()
    cases = {"draft": (prompt, 0.0), "sampled": (prompt, 1.0), "lookup": (copying, 0.0)}
    unknown = set(args.cases.split(",")) - set(cases)
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}, choose among {sorted(cases)}")
    cases = {name: cases[name] for name in args.cases.split(",")}

    def softmax64(logits):
        x = np.asarray(logits, np.float64)
        x = np.exp(x - x.max(-1, keepdims=True))
        return x / x.sum(-1, keepdims=True)

    # How well the draft agrees, along the target's own sampled text: the per-position total variation between the
    # two next-token distributions at temperature 1, and how often their argmaxes agree.
    text = prompt + gpt2_jax.generate(params, config, [prompt], jax.random.key(0), max_new_tokens=n,
                                      temperature=1.0, eos_id=None).tokens[0].tolist()  # fmt: skip
    p, q = (softmax64(gpt2_jax.forward(pp, [text], c)[0, PROMPT - 1 :]) for pp, c in ((params, config), draft))
    tv = 0.5 * np.abs(p - q).sum(-1)
    same_argmax = (p.argmax(-1) == q.argmax(-1)).mean()
    print(
        f"draft vs target at temperature 1: total variation mean {tv.mean():.2e} (median {np.median(tv):.2e}), "
        f"argmax agreement {same_argmax:.1%}, target's top probability median {np.median(p.max(-1)):.2e}"
    )

    def ours(tokens, temperature, **kw):
        def make(m):
            return lambda: gpt2_jax.generate(params, config, [tokens], jax.random.key(0), max_new_tokens=m,
                                             temperature=temperature, eos_id=None, **kw)  # fmt: skip

        return make

    def theirs(tokens, temperature, **kw):
        ids = torch.tensor([tokens])
        sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature else dict(do_sample=False)

        def make(m):
            def run():
                with torch.no_grad():
                    return hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                                              eos_token_id=None, pad_token_id=0, **sampling, **kw)  # fmt: skip

            return run

        return make

    def per_token(make) -> float:
        make(n)(), make(1)()  # compile / warm up both lengths
        return (best_of(make(n), args.repeats) - best_of(make(1), args.repeats)) / (n - 1)

    rows = []
    for name, (tokens, temp) in cases.items():
        plain = per_token(ours(tokens, temp))
        hf_plain = per_token(theirs(tokens, temp)) if args.transformers else float("nan")
        print(f"[{name}] plain decode: gpt2_jax {plain * 1e3:.1f} ms/token ({plain / bound:.2f}x the bound "
              f"{bound * 1e3:.1f} ms) | transformers {hf_plain * 1e3:.1f} ms/token", flush=True)  # fmt: skip
        for k in ks:
            spec_kw = dict(draft="prompt_lookup" if name == "lookup" else draft, num_speculative_tokens=k)
            t = per_token(ours(tokens, temp, **spec_kw))
            result = ours(tokens, temp, **spec_kw)(n)()
            hf_kw = dict(prompt_lookup_num_tokens=k) if name == "lookup" else dict(assistant_model=hf_draft)
            hf_draft.generation_config.num_assistant_tokens = k
            ht = per_token(theirs(tokens, temp, **hf_kw)) if args.transformers else float("nan")
            same = result.tokens[0].tolist() == ours(tokens, temp)(n)().tokens[0].tolist()
            rounds = int(result.proposed[0]) // k
            accept = int(result.accepted[0]) / int(result.proposed[0])
            round_t = t * n / rounds
            rows.append((name, k, plain, t, hf_plain, ht, accept, n / rounds, break_even(round_t / plain, k)))
            print(f"[{name}] k={k}: gpt2_jax {t * 1e3:.1f} ms/token = {plain / t:.2f}x plain | transformers "
                  f"{ht * 1e3:.1f} ms/token = {hf_plain / ht:.2f}x its plain | gpt2_jax/transformers {ht / t:.2f}x | "
                  f"acceptance {accept:.1%}, {n / rounds:.2f} tokens per target forward, round {round_t * 1e3:.1f} ms "
                  f"= {round_t / plain:.2f} plain steps, break-even acceptance {rows[-1][-1]:.1%}, {t / bound:.2f}x "
                  f"the bound | tokens equal plain: {same}", flush=True)  # fmt: skip

    print(
        "\n| proposer | k | plain ms/token | speculative ms/token | speedup | transformers plain | transformers "
        "speculative | its speedup | ours / theirs | acceptance | tokens / forward | break-even acceptance |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    labels = {"draft": "draft model (1 layer), greedy", "sampled": "draft model (1 layer), temperature 1",
              "lookup": "prompt lookup, greedy"}  # fmt: skip
    for name, k, plain, t, hp, ht, acc, tpf, be in rows:
        print(
            f"| {labels[name]} | {k} | {plain * 1e3:.1f} | {t * 1e3:.1f} | {plain / t:.2f}x | {hp * 1e3:.1f} | "
            f"{ht * 1e3:.1f} | {hp / ht:.2f}x | {ht / t:.2f}x | {acc:.1%} | {tpf:.2f} | {be:.1%} |"
        )
    best = {name: max(plain / t for nm, _, plain, t, *_ in rows if nm == name) for name in cases}
    goals = {"draft": ("draft model", 2.0), "sampled": ("sampled draft model", 2.0), "lookup": ("prompt lookup", 1.8)}
    met = "; ".join(f"{goals[nm][0]} >= {goals[nm][1]}x plain: {x:.2f}x {'PASS' if x >= goals[nm][1] else 'MISS'}"
                    for nm, x in best.items())  # fmt: skip
    print(
        f"\ntargets: {met}; plain decode bound {bound * 1e3:.1f} ms/token "
        f"({(param_bytes(params) - params['wpe'].nbytes) / 1e6:.0f} MB at {machine['bandwidth'] / 1e9:.1f} GB/s)"
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    main()
    print(f"(bench took {time.perf_counter() - t0:.0f} s)")
