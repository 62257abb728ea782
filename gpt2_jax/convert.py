"""Checkpoint conversion: any loadable GPT-2 checkpoint -> gpt2_jax (orbax) or a HuggingFace directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpt2_jax import checkpoint, hf
from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.files import atomic_dir, check_writable_destination
from gpt2_jax.loading import load, resolve_dtype
from gpt2_jax.params import param_bytes, to_flat
from gpt2_jax.streaming import progress_bar


def convert(src: str | Path, dst: str | Path, *, dtype: Any = None, force: bool = False, to_hf: bool = False,
            progress: bool = False) -> Path:  # fmt: skip
    """Read src (any format load() takes) and write dst atomically: orbax, or HF with to_hf=True.
    The tensors stream into their final buffers and are written from there, so the peak memory is
    about the weights once (to_hf: twice, as safetensors serialises the whole file in memory).
    progress: tqdm bars (bytes) on stderr, reading then writing."""
    dst = Path(dst).absolute()
    check_writable_destination(dst, force)  # fail before the (slow) load, not after
    params, config = load(src, dtype=resolve_dtype(dtype), progress=progress, stacked=True)  # as stored
    with progress_bar(param_bytes(params), progress, f"writing {dst}") as bar:
        if not to_hf:
            checkpoint.save(dst, params, config, force=force)
        else:
            with atomic_dir(dst, force) as tmp:
                hf.write_dir(to_flat(params, config), config, tmp)
        bar.update(param_bytes(params))  # orbax and safetensors write in one call each, so the bar jumps
    return dst


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except unset ones (None, False) and those whose help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in (action.help or ""):  # fmt: skip
            return action.help
        return super()._get_help_string(action)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """convert's arguments, on parser (gpt2-jax convert) or a new one (convert/convert_pytorch.py)."""
    parser = parser or argparse.ArgumentParser(prog="convert_pytorch.py", description=__doc__,
                                               formatter_class=HelpFormatter)  # fmt: skip
    parser.add_argument("src", help="HF directory, .safetensors/.bin file, nanoGPT ckpt.pt, or gpt2_jax checkpoint")
    parser.add_argument("dst", help="output directory (written atomically)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="cast the weights (default: keep)"
    )
    parser.add_argument("--force", action="store_true", help="replace dst if it exists")
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
