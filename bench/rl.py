"""One GRPO step: gpt2_jax's rl.grpo against TRL's GRPOTrainer, both on this CPU, in one run, taking turns.

    python bench/rl.py [--repeats 3] [--threads N] [--group-size 8] [--prompts 4] [--completion 48]

The same step on both sides: the bundled model in float32, exported with gpt2_jax.convert(..., to_hf=True)
(config.json + model.safetensors; TRL reads that directory, gpt2_jax loads the same file); the same prompts
(--prompts of them), --group-size completions each of exactly --completion tokens (no early stop on either side:
gpt2_jax eos_id=None, TRL min_new_tokens), temperature 1 and no filters; the same reward (speaker lines,
rl.regex_reward); the same objective (advantages within the group, the clipped ratio at 0.2, beta 0.04 to the
starting model, DeepSeekMath's per-completion mean, one optimisation epoch: TRL's num_iterations=1); the same
optimizer (AdamW lr 1e-5 constant, betas 0.9/0.999, eps 1e-8, no weight decay, clipping at 1.0), float32 (TRL's
default bf16 autocast off). TRL needs a tokenizer: its files are built here from gpt2_jax's own BPE ranks
(transformers' TikTokenConverter -> GPT2Tokenizer), checked to encode like gpt2_jax's on a text.

Timing: TRL's own train loop runs 1 + --repeats steps (each timed from its on_step_begin to its on_step_end
callback: generation, reward, reference, loss, backward, optimizer); after each, its callback runs one
gpt2_jax step, `rl.grpo(..., steps=1)` from the same weights, timed as a whole call. The first step of each
compiles or warms up and is left out; the median of the others is printed, with the best. Throughput: the
step's sampled completion tokens per second of step.

The sampler-trainer mismatch, measured the same way on both: the largest |sampler logprob - trainer logprob| over
a step's sampled tokens, on the weights that sampled them. gpt2_jax's is what rl.grpo records on the first
epoch. TRL's: its generate call is wrapped to return the logits it sampled from (output_logits), its
_get_per_token_logps_and_entropies (the trainer's forward) wrapped to keep its logprobs, and rows are matched by
their tokens. TRL left-pads prompts of different lengths and its forward passes no position_ids, so with GPT-2's
absolute position embeddings a padded row is scored at shifted positions; the bench prints that part apart from
the rows without padding, whose gap is arithmetic alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from machine import describe  # bench/machine.py, beside this script

PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING HENRY.\n", "First Citizen:\n", "HAMLET.\n", "Second Servant:\n",
           "LADY MACBETH.\n", "To be"]  # fmt: skip
SPEAKERS = r"^[A-Z][A-Z ]+[.:]$"
LR, BETA, EPSILON = 1e-5, 0.04, 0.2


def hf_export(work: Path):
    """The bundled model as a HuggingFace directory (float32), with tokenizer files TRL can load."""
    from transformers import GPT2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    import gpt2_jax
    from gpt2_jax.tokenizer import BUNDLED_RANKS

    out = work / "hf"
    gpt2_jax.convert(gpt2_jax.BUNDLED_MODEL, out, dtype="float32", to_hf=True)
    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(BUNDLED_RANKS))
    vocab["<|endoftext|>"] = 50256
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges)
    tokenizer.pad_token = tokenizer.eos_token
    text = (gpt2_jax.BUNDLED_MODEL / "README.md").read_text()
    assert tokenizer(text)["input_ids"] == gpt2_jax.tokenizer().encode(text), "the tokenizers disagree"
    tokenizer.save_pretrained(out)
    return out, tokenizer


class Capture:
    """TRL's sampler logits and trainer logprobs, kept for the mismatch."""

    def __init__(self, trainer):
        import torch

        self.sampled, self.trained = [], []
        model, generate, score = trainer.model, trainer.model.generate, trainer._get_per_token_logps_and_entropies

        def generating(*args, **kw):
            out = generate(*args, **kw, output_logits=True, return_dict_in_generate=True)
            self.sampled.append((kw["input_ids"].clone(), kw["attention_mask"].clone(), out.sequences.clone(),
                                 torch.stack(out.logits, 1).float()))  # fmt: skip
            return out.sequences

        def scoring(*args, **kw):
            out = score(*args, **kw)
            if torch.is_grad_enabled():  # the loss's forward (not the reference's, which runs under no_grad)
                self.trained.append((args[1].clone(), out[0].detach().clone()))
            return out

        model.generate, trainer._get_per_token_logps_and_entropies = generating, scoring

    def mismatch(self) -> tuple[float, float]:
        """(largest gap over left-padded rows, over rows without padding), over every captured step."""
        import torch

        padded, unpadded = 0.0, 0.0
        for (prompt, mask, seq, logits), (ids, trained) in zip(self.sampled, self.trained):
            P, N = prompt.shape[1], trained.shape[1]
            sampler = torch.log_softmax(logits, -1).gather(-1, seq[:, P:, None])[..., 0]
            for b in range(seq.shape[0]):
                row = next(k for k in range(ids.shape[0]) if torch.equal(ids[k, -N:], seq[b, P : P + N]))
                gap = float((sampler[b, :N] - trained[row]).abs().max())
                if bool(mask[b].all()):
                    unpadded = max(unpadded, gap)
                else:
                    padded = max(padded, gap)
        return padded, unpadded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per library (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help=f"prompts per step (at most {len(PROMPTS)})")
    parser.add_argument("--completion", type=int, default=48, help="tokens per completion")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    import gpt2_jax
    from gpt2_jax import rl
    from gpt2_jax.rl.loop import DEFAULT_HYPER

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    describe(jax, jnp, args.threads)
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; jax "
          f"{jax.__version__}, kernels {gpt2_jax.kernels.available()}", flush=True)  # fmt: skip
    P, G, N = args.prompts, args.group_size, args.completion
    prompts = PROMPTS[:P]
    work = Path(tempfile.mkdtemp())
    hf_dir, tokenizer = hf_export(work)
    reward = rl.regex_reward(SPEAKERS)

    # gpt2_jax: the same weights, read from the exported directory.
    params, config = gpt2_jax.load(hf_dir, dtype="float32")
    sampling = gpt2_jax.SamplingParams(max_new_tokens=N, eos_id=None)
    hyper = DEFAULT_HYPER._replace(lr=LR, min_lr=LR, b1=0.9, b2=0.999, clip=1.0, weight_decay=0.0)
    objective = rl.Objective(epsilon=EPSILON, beta=BETA, loss_type="grpo")
    ours, mismatch = [], []

    def gpt2_jax_step(seed: int) -> None:
        t0 = time.perf_counter()
        _, history = rl.grpo(params, config, prompts, reward, jax.random.key(seed), steps=1, group_size=G,
                             prompts_per_step=P, sampling=sampling, epochs=1, hyper=hyper, objective=objective)  # fmt: skip
        ours.append(time.perf_counter() - t0)
        mismatch.append(history["mismatch"][0])

    # TRL: its own trainer and loop.
    trl_args = trl.GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=P * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=N, generation_kwargs={"min_new_tokens": N}, temperature=1.0,
        top_p=1.0, top_k=0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=BETA, epsilon=EPSILON, loss_type="grpo",
        scale_rewards="group", num_iterations=1, max_steps=1 + args.repeats, bf16=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True, shuffle_dataset=False,
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip

    def trl_reward(prompts, completions, **kw):
        return [reward(p, c) for p, c in zip(prompts, completions)]

    data = Dataset.from_dict({"prompt": prompts * (2 + args.repeats)})
    trainer = trl.GRPOTrainer(model=str(hf_dir), reward_funcs=trl_reward, args=trl_args, train_dataset=data,
                              processing_class=tokenizer)  # fmt: skip
    capture = Capture(trainer)
    theirs: list[float] = []

    class Turns(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            theirs.append(-time.perf_counter())

        def on_step_end(self, *a, **kw):
            theirs[-1] += time.perf_counter()
            gpt2_jax_step(len(theirs))  # gpt2_jax's turn, outside TRL's timed step

    trainer.add_callback(Turns())
    trainer.train()

    tokens = P * G * N
    med = lambda xs: statistics.median(xs[1:])
    print(f"one GRPO step: {P} prompts x {G} completions x {N} tokens = {tokens} sampled tokens; beta {BETA}, "
          f"1 epoch, AdamW lr {LR}; {args.repeats} timed steps each after a warm-up (median, best)")  # fmt: skip
    print(f"  gpt2_jax: {med(ours):.2f} s, {min(ours[1:]):.2f} s -> {tokens / med(ours):.0f} tokens/s "
          f"(first step, compiling: {ours[0]:.1f} s)")  # fmt: skip
    print(f"  TRL:      {med(theirs):.2f} s, {min(theirs[1:]):.2f} s -> {tokens / med(theirs):.0f} tokens/s "
          f"(first step: {theirs[0]:.1f} s)")  # fmt: skip
    print(f"  gpt2_jax / TRL step throughput: {med(theirs) / med(ours):.2f}x (best against best "
          f"{min(theirs[1:]) / min(ours[1:]):.2f}x)")  # fmt: skip
    padded, unpadded = capture.mismatch()
    print("sampler-trainer mismatch, the largest |sampler logprob - trainer logprob| over a step's sampled tokens:")
    print(f"  gpt2_jax: {max(mismatch)!r} (each of {len(mismatch)} steps: {sorted(set(mismatch))})")
    print(f"  TRL:      {max(padded, unpadded):.3g} nats over all rows: {unpadded:.3g} on rows without padding "
          f"(arithmetic: generate's KV-cached decode against the chunked log-softmax head), {padded:.3g} on "
          f"left-padded rows (scored at positions shifted by the padding)")  # fmt: skip
    print(json.dumps({"gpt2_jax_s": ours, "trl_s": theirs, "gpt2_jax_mismatch": mismatch,
                      "trl_mismatch_unpadded": unpadded, "trl_mismatch_padded": padded}))  # fmt: skip


if __name__ == "__main__":
    main()
