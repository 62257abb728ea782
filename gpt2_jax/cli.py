"""The gpt2-jax command line: generate text, convert checkpoints. Errors are one line, never a traceback."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from gpt2_jax import convert as convert_mod
from gpt2_jax.errors import GPT2JaxError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2-jax", description="GPT-2 in JAX: generate text, convert checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", required=True, help="checkpoint path (any format load() reads) or a hub id like gpt2")
    gen.add_argument("--prompt", help="the prompt text (default: read from stdin)")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-samples", type=int, default=1)
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="cast the weights")
    convert_mod.build_parser(sub.add_parser("convert", help="convert a checkpoint (see convert/convert_pytorch.py)"))
    return parser


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


def _generate(args: argparse.Namespace) -> int:
    from gpt2_jax.cache import cache_bytes
    from gpt2_jax.hub import resolve_model
    from gpt2_jax.loading import load
    from gpt2_jax.params import unstack_layers
    from gpt2_jax.generate import _generate, _prepare
    from gpt2_jax.tokenizer import EOT, tokenizer

    if args.num_samples < 1:
        raise GPT2JaxError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.stream and args.num_samples != 1:
        raise GPT2JaxError("--stream prints one sample; use --num-samples 1")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    enc = tokenizer()
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]  # an empty prompt starts from <|endoftext|>
    params, config = load(resolve_model(args.model), dtype=args.dtype)
    params = unstack_layers(params)  # the fast decode layout (see model.forward_cached)
    eos = EOT if EOT < config.vocab_size else None
    batch, settings, stop = _prepare(config, [ids] * args.num_samples, jax.random.key(args.seed),
                                         args.max_new_tokens, args.temperature, args.top_k, args.top_p, eos, ())
    cache = cache_bytes(config, args.num_samples, batch.capacity, params["wte"].dtype)
    if args.stream:
        return _stream(params, config, batch, settings, stop, args, enc, cache)
    t0 = time.perf_counter()
    compiled = _generate.lower(params, batch.tokens, batch.start, batch.keys, settings, stop,
                                   np.int32(args.max_new_tokens), config, batch.capacity, batch.steps).compile()
    t1 = time.perf_counter()
    toks, _, lengths = compiled(params, batch.tokens, batch.start, batch.keys, settings, stop,
                                np.int32(args.max_new_tokens))
    toks, lengths = np.asarray(toks), np.asarray(lengths)
    t2 = time.perf_counter()
    for b in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {b + 1} ---")
        print(prompt + enc.decode([t for t in toks[b, : lengths[b]].tolist() if t != eos]))
    _summary(int(lengths.sum()), t2 - t1, t1 - t0, cache)
    return 0


def _stream(params, config, batch, settings, stop, args, enc, cache) -> int:
    from gpt2_jax.generate import decode_step, prefill

    t0 = time.perf_counter()
    run_prefill = prefill.lower(params, batch.tokens, batch.start, batch.keys, config, batch.capacity).compile()
    state = jax.eval_shape(prefill, params, batch.tokens, batch.start, batch.keys, config, batch.capacity)
    run_step = decode_step.lower(params, state, settings, stop, config).compile()
    t1 = time.perf_counter()
    out = TextStream(enc)
    out.out.write(args.prompt if args.prompt is not None else "")
    state = run_prefill(params, batch.tokens, batch.start, batch.keys)
    n = 0
    for _ in range(args.max_new_tokens):
        state, token, _ = run_step(params, state, settings, stop)
        t, n = int(np.asarray(token)[0]), n + 1
        if t == int(stop.eos_id):
            break
        out.add(t)
    t2 = time.perf_counter()
    out.out.write("\n")
    _summary(n, t2 - t1, t1 - t0, cache)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "convert":
            return convert_mod.run(args)
        return _generate(args)
    except GPT2JaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
