"""The gpt2-jax command line: its parser, the compile cache and main. Each command lives in its own module
(generate.py, convert.py, train.py for train and data, serve.py). Errors are one line, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from gpt2_jax.cli import convert as cli_convert
from gpt2_jax.cli import generate as cli_generate
from gpt2_jax.cli import info as cli_info
from gpt2_jax.cli import rl as cli_rl
from gpt2_jax.cli import serve as cli_serve
from gpt2_jax.cli import serve_args as cli_serve_args
from gpt2_jax.cli import train as cli_train
from gpt2_jax.cli.help import HelpFormatter
from gpt2_jax.compiling import use_persistent_cache
from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.model.precision_type import MODES


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser (gpt2-jax generate|convert|train|data|serve|explain|rl|info)."""
    parser = argparse.ArgumentParser(prog="gpt2-jax", description="GPT-2 in JAX: generate text, convert checkpoints")
    parser.add_argument("--version", action="version", version=cli_info.version())
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt", formatter_class=HelpFormatter)
    gen.add_argument("--model", default=None,
                     help="checkpoint path (any format load() reads, or a gpt2-jax train --out directory) or a "
                          "hub id like gpt2 (default: the bundled Shakespeare model)")  # fmt: skip
    gen.add_argument("--prompt", help="the prompt text (default: read from stdin)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    _processor_args(gen)
    _beam_args(gen)
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (default: a random one, printed in the summary line); "
        "the server's request seed gives the same text with the same settings and --dtype",
    )
    gen.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt, one batch")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument(
        "--dtype",
        choices=list(MODES),
        default=None,
        help="the weights' precision (default on a CPU: float32, whatever the checkpoint stores, as serve does, so "
        "a --seed gives the server's text for that seed; elsewhere the stored dtype); "
        "float32-packed = float32's exact values in 3.5 bytes a weight (the same tokens, "
        "faster at B=1 on a CPU); int8 = weight-only int8 blocks, w8a8 = the same weights with 8-bit matmul inputs "
        "(faster at a few rows on AVX512-VNNI, less exact), bfloat16 otherwise (gpt2_jax.model.precision)",
    )
    gen.add_argument(
        "--mesh", help="run sharded over a device mesh, e.g. data=2,model=4 (see gpt2_jax.parallel.sharding)"
    )
    spec = gen.add_mutually_exclusive_group()
    spec.add_argument("--draft", "--draft-model", metavar="MODEL", help="speculative decoding with this smaller draft model (same "
                      "vocabulary; any --model form); the output is the same, only faster")  # fmt: skip
    spec.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="speculative decoding proposing the continuation of earlier matches in the text",
    )
    gen.add_argument("--speculate", "--num-speculative-tokens", type=int, default=4, metavar="K", help="tokens proposed per round (with --draft "
                     "or --prompt-lookup)")  # fmt: skip
    _cache_arg(gen)
    cli_train.distributed_args(gen)
    cli_convert.build_parser(sub.add_parser("convert", help="convert a checkpoint to gpt2_jax's format or HuggingFace's",
                                            formatter_class=HelpFormatter))  # fmt: skip
    train = sub.add_parser("train", help="train or fine-tune with AdamW", formatter_class=HelpFormatter)
    cli_train.train_parser(train)
    _cache_arg(train)
    cli_train.data_parser(sub.add_parser("data", help="prepare training data"))
    rl = sub.add_parser("rl", help="fine-tune on a reward with GRPO, exactly on-policy", formatter_class=HelpFormatter)
    cli_rl.rl_parser(rl)
    _cache_arg(rl)
    cli_serve_args.serve_parser(sub.add_parser("serve", help="serve an OpenAI-compatible completions API over HTTP",
                                               formatter_class=HelpFormatter), _cache_arg)  # fmt: skip
    cli_serve_args.serve_parser(sub.add_parser("explain", help="serve the explainer page (GPT-2's real internals "
                                               "for a prompt, view by view) and print its URL; every serve flag "
                                               "applies", formatter_class=HelpFormatter), _cache_arg)  # fmt: skip
    sub.add_parser("info", help="print the version, jax's devices and which path each CPU kernel takes here")
    return parser


def _processor_args(gen: argparse.ArgumentParser) -> None:
    """Logits processors, stop strings, constraints and top logprobs (see gpt2_jax.generate)."""
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off; drop tokens below min_p x the top probability")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' (prompt + output); 1 = off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--no-repeat-ngram-size", type=int, default=0, help="never repeat an n-gram; 0 = off")
    gen.add_argument("--min-new-tokens", type=int, default=0, help="hold back EOS until this many tokens")
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop string (repeatable); the text is cut just before it",
    )
    c = gen.add_mutually_exclusive_group()
    c.add_argument("--regex", help="constrain the output to match this regex")
    c.add_argument(
        "--choice", action="append", default=None, metavar="TEXT", help="the output is one of these (repeatable)"
    )
    c.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema file")
    gen.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        metavar="N",
        help="after the text, list each token's N most likely alternatives (N <= 20)",
    )


def _beam_args(gen: argparse.ArgumentParser) -> None:
    """Beam search (see gpt2_jax.beam_search): --num-beams turns it on."""
    gen.add_argument("--num-beams", type=int, default=None, metavar="N",
                     help="beam search with N beams (transformers' num_beams; 1 = greedy); off by default")  # fmt: skip
    gen.add_argument("--num-return-sequences", type=int, default=1, metavar="K",
                     help="with --num-beams: print the K best hypotheses (K <= N)")  # fmt: skip
    gen.add_argument("--length-penalty", type=float, default=1.0, metavar="X",
                     help="with --num-beams: a hypothesis scores sum(logprobs) / length ** X (> 0 favours longer)")  # fmt: skip
    gen.add_argument("--early-stopping", choices=["false", "true", "never"], default="false",
                     help="with --num-beams: when a prompt's search ends (transformers' early_stopping)")  # fmt: skip
    gen.add_argument("--do-sample", action="store_true",
                     help="with --num-beams: beam sampling (--temperature, --top-k, --top-p, --min-p and --seed apply)")  # fmt: skip


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not use JAX's persistent compilation cache (see GPT2_JAX_COMPILATION_CACHE)",
    )


def compile_cache_dir(environ: Mapping[str, str], disabled: bool = False) -> Path | None:
    """Where the CLI keeps XLA's compiled programs between runs, or None when off: $GPT2_JAX_COMPILATION_CACHE
    (a directory, or off/0), else $XDG_CACHE_HOME/gpt2_jax/jax-cache, else ~/.cache/gpt2_jax/jax-cache."""
    where = environ.get("GPT2_JAX_COMPILATION_CACHE", "").strip()
    if disabled or where.lower() in ("off", "0", "false", "no"):
        return None
    if where:
        return Path(where).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpt2_jax" / "jax-cache"


def _use_compile_cache(args: argparse.Namespace) -> None:
    """Turn on JAX's persistent compilation cache, so a second run reuses the first run's programs."""
    where = compile_cache_dir(os.environ, args.no_compile_cache)
    use_persistent_cache(None if where is None else str(where))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:
        args.argv = sys.argv[1:]  # the command line itself: serve may start the process again with it
    try:
        if args.command == "convert":
            return cli_convert.run(args)
        if args.command in ("generate", "train", "serve", "explain", "rl"):
            _use_compile_cache(args)
        return {"generate": cli_generate.run_generate, "train": cli_train.run_train, "data": cli_train.run_data,
                "serve": cli_serve.run_serve, "explain": cli_serve.run_serve, "rl": cli_rl.run_rl,
                "info": cli_info.run_info}[args.command](args)  # fmt: skip
    except GPT2JaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
