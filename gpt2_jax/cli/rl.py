"""gpt2-jax rl: GRPO fine-tuning on a reward, exactly on-policy (gpt2_jax.rl): its arguments and what it runs."""

from __future__ import annotations

import argparse
import codecs
import sys
from pathlib import Path

from gpt2_jax.checkpoints import BUNDLED_MODEL
from gpt2_jax.errors import GPT2JaxError, InputError


def rl_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint to fine-tune (any --model form generate takes; "
                   "default: the bundled Shakespeare model), loaded in float32")  # fmt: skip
    p.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line (blank lines skipped; "
                   r"\n in a line is a line break)")  # fmt: skip
    p.add_argument("--reward", required=True, metavar="SPEC",
                   help="regex:PATTERN (count of matches, ^ and $ at every line), length:N (-|chars - N| / N), "
                        "or python:MODULE:FUNCTION (FUNCTION(prompt, completion) -> float; MODULE may be a .py file)")  # fmt: skip
    p.add_argument("--out", required=True, help="run directory: checkpoints/, model/, history.json, reward.png")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps in all (a resumed run counts on)")
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per prompt (G >= 2)")
    p.add_argument("--prompts-per-step", type=int, default=None, help="prompts per step (default: up to 4)")
    p.add_argument("--epochs", type=int, default=2, help="optimizer updates per sampled batch")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per completion at most")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1 = the policy itself)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (constant)")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the KL to the initial model")
    p.add_argument("--epsilon", type=float, default=0.2, help="ratio clip: [1 - epsilon, 1 + epsilon-high]")
    p.add_argument("--epsilon-high", type=float, default=None, help="upper clip (default: --epsilon)")
    p.add_argument("--loss-type", choices=["grpo", "dapo"], default="grpo",
                   help="grpo: mean per completion, then over completions; dapo: mean over all tokens")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="drives every step's sampling")
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_prompts(path: str) -> list[str]:
    """One prompt per line; blank lines skipped; backslash escapes (\\n, \\t) decoded."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--prompts {path}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path}: cannot be read as UTF-8 text ({e})") from None
    try:
        prompts = [codecs.decode(line, "unicode_escape") if "\\" in line else line for line in lines if line.strip()]
    except UnicodeDecodeError as e:
        raise InputError(f"--prompts {path}: a bad backslash escape ({e.reason})") from None
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompts (every line is blank)")
    return prompts


def run_rl(args: argparse.Namespace) -> int:
    import jax

    from gpt2_jax import SamplingParams, load, rl
    from gpt2_jax.checkpoints import resolve_model
    from gpt2_jax.rl.loop import DEFAULT_HYPER

    reward = rl.parse_reward(args.reward)  # every argument is checked before the model loads
    prompts = read_prompts(args.prompts)
    stop = tuple(args.stop or ())
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, stop=stop)  # fmt: skip
    objective = rl.Objective(args.epsilon, args.epsilon_high, args.beta, args.loss_type).check()
    hyper = DEFAULT_HYPER._replace(lr=args.lr, min_lr=args.lr)
    if args.model is None and not BUNDLED_MODEL.is_dir():
        raise GPT2JaxError(f"no --model given and the bundled model {BUNDLED_MODEL} is missing")
    params, config = load(resolve_model(args.model) if args.model else BUNDLED_MODEL, dtype="float32")
    _, history = rl.grpo(params, config, prompts, reward, jax.random.key(args.seed), steps=args.steps,
                         group_size=args.group_size, prompts_per_step=args.prompts_per_step, sampling=sampling,
                         epochs=args.epochs, hyper=hyper, objective=objective, out=args.out, resume=args.resume,
                         ckpt_every=args.ckpt_every, progress=not args.no_progress)  # fmt: skip
    r, gap = history["reward_mean"], max(history["mismatch"])
    print(f"gpt2-jax: reward {r[0]:.3f} at step 1 -> {r[-1]:.3f} at step {len(r)}; largest sampler-trainer logprob "
          f"mismatch {gap!r} over {len(r)} steps; KL to the initial model {history['kl'][-1]:.4f}; "
          f"{history['sampled_tokens_per_s'][-1]:.0f} sampled and {history['trained_tokens_per_s'][-1]:.0f} trained "
          f"tokens/s at the last step; model in {args.out}/model", file=sys.stderr)  # fmt: skip
    return 0
