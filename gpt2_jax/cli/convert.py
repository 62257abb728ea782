"""gpt2-jax convert: any checkpoint gpt2_jax reads -> a gpt2_jax (orbax) or HuggingFace directory."""

from __future__ import annotations

import argparse
import sys

from gpt2_jax.checkpoints import convert
from gpt2_jax.cli.help import HelpFormatter
from gpt2_jax.errors import GPT2JaxError


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """convert's arguments, on parser (gpt2-jax convert) or a new one (the standalone convert script)."""
    parser = parser or argparse.ArgumentParser(prog="convert_pytorch.py", description=__doc__,
                                               formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("src", help="HF directory, .safetensors/.bin file, nanoGPT ckpt.pt, or gpt2_jax checkpoint")
    parser.add_argument("dst", help="output directory (written atomically)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "int8"],
        default=None,
        help="cast the weights; int8 = weight-only int8, stored quantized (gpt2_jax.model.precision) (default: keep)",
    )
    parser.add_argument("--force", action="store_true",
                        help="replace dst if it is a checkpoint (gpt2_jax or HuggingFace) or an empty directory")  # fmt: skip
    parser.add_argument("--to-hf", action="store_true", help="write a HuggingFace directory instead of orbax")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        out = convert(args.src, args.dst, dtype=args.dtype, force=args.force, to_hf=args.to_hf, progress=True)
    except GPT2JaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {'HuggingFace' if args.to_hf else 'gpt2_jax'} checkpoint {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
