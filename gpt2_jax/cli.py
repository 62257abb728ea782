"""The gpt2-jax command line: generate text, convert checkpoints. Errors are one line, never a traceback."""

from __future__ import annotations

import argparse
import io
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Mapping

import jax
import numpy as np

from gpt2_jax import cli_train
from gpt2_jax import convert as convert_mod
from gpt2_jax.convert import HelpFormatter
from gpt2_jax.errors import GPT2JaxError

# A small GPT-2 trained on Shakespeare's plays, shipped so that generate works offline (see its README.md).
BUNDLED_MODEL = Path(__file__).parent / "assets" / "shakespeare"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser (gpt2-jax generate|convert|train|data)."""
    parser = argparse.ArgumentParser(prog="gpt2-jax", description="GPT-2 in JAX: generate text, convert checkpoints")
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
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed (default: a random one, printed in the summary line)")
    gen.add_argument("--num-samples", type=int, default=1, help="samples of the same prompt, one batch")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default=None,
                     help="cast the weights; int8 = weight-only int8 blocks, bfloat16 otherwise (gpt2_jax.precision)")
    gen.add_argument("--mesh", help="run sharded over a device mesh, e.g. data=2,model=4 (see gpt2_jax.sharding)")
    spec = gen.add_mutually_exclusive_group()
    spec.add_argument("--draft", metavar="MODEL", help="speculative decoding with this smaller draft model (same "
                      "vocabulary; any --model form); the output is the same, only faster")  # fmt: skip
    spec.add_argument("--prompt-lookup", action="store_true",
                      help="speculative decoding proposing the continuation of earlier matches in the text")
    gen.add_argument("--speculate", type=int, default=4, metavar="K", help="tokens proposed per round (with --draft "
                     "or --prompt-lookup)")  # fmt: skip
    _cache_arg(gen)
    cli_train.distributed_args(gen)
    convert_mod.build_parser(sub.add_parser("convert", help="convert a checkpoint (see convert/convert_pytorch.py)",
                                            formatter_class=HelpFormatter))  # fmt: skip
    train = sub.add_parser("train", help="train or fine-tune with AdamW", formatter_class=HelpFormatter)
    cli_train.train_parser(train)
    _cache_arg(train)
    cli_train.data_parser(sub.add_parser("data", help="prepare training data"))
    _serve_parser(sub.add_parser("serve", help="serve an OpenAI-compatible completions API over HTTP",
                                 formatter_class=HelpFormatter))  # fmt: skip
    return parser


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--model", default=None,
                       help="checkpoint path or hub id, as for generate (default: the bundled Shakespeare model)")
    serve.add_argument("--model-name", default=None,
                       help="the model id clients send (default: the --model value, or 'shakespeare')")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    serve.add_argument("--max-batch", type=int, default=8, help="slots: requests generated at once")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    serve.add_argument("--max-seq", type=int, default=None,
                       help="prompt + max_tokens limit per request, the KV cache's length (default: the context)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default=None,
                       help="cast the weights; int8 = weight-only int8 blocks, bfloat16 otherwise (gpt2_jax.precision)")
    serve.add_argument("--mesh", help="run sharded over a device mesh, e.g. model=2 (see gpt2_jax.sharding)")
    _cache_arg(serve)


def _processor_args(gen: argparse.ArgumentParser) -> None:
    """Logits processors, stop strings, constraints and top logprobs (see gpt2_jax.generate)."""
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off; drop tokens below min_p x the top probability")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' (prompt + output); 1 = off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]; 0 = off")
    gen.add_argument("--no-repeat-ngram-size", type=int, default=0, help="never repeat an n-gram; 0 = off")
    gen.add_argument("--min-new-tokens", type=int, default=0, help="hold back EOS until this many tokens")
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="stop string (repeatable); the text is cut just before it")
    c = gen.add_mutually_exclusive_group()
    c.add_argument("--regex", help="constrain the output to match this regex")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT", help="the output is one of these (repeatable)")
    c.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema file")
    gen.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                     help="after the text, list each token's N most likely alternatives (N <= 20)")


def _constraint(args: argparse.Namespace):
    """--regex / --choice / --json-schema -> a gpt2_jax.constraints object, or None."""
    from gpt2_jax import constraints

    if args.regex is not None:
        return constraints.regex(args.regex)
    if args.choice:
        return constraints.choice(args.choice)
    if args.json_schema:
        path = Path(args.json_schema)
        if not path.is_file():
            raise GPT2JaxError(f"--json-schema {path}: no such file")
        return constraints.json_schema(path.read_text())
    return None


def _show_top_logprobs(enc, completion, out) -> None:
    print("--- top logprobs (raw distribution) ---", file=out)
    for tok, lp, top in zip(completion.tokens, completion.logprobs, completion.top_logprobs):
        alts = ", ".join(f"{enc.decode([t])!r} {v:.3f}" for t, v in top.items())
        print(f"{enc.decode([tok])!r:>16} {lp:8.3f} | {alts}", file=out)


def _cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use JAX's persistent compilation cache (see GPT2_JAX_COMPILATION_CACHE)")


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
    if where is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the default (1 s) skips small programs
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


class TextStream:
    """Prints the decoded text of a growing token list, holding back an incomplete UTF-8 character and
    any tail that could still become a stop string; the text ends just before a stop string."""

    def __init__(self, enc, out=None, stops=()):
        self.enc, self.out, self.tokens, self.shown, self.stops = enc, out or sys.stdout, [], 0, list(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.stopped = False

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self._show(final=False)

    def _show(self, final: bool) -> None:
        text = self.enc.decode(self.tokens)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(text)
        elif text.endswith("\ufffd"):
            return
        else:
            end = len(text) - self.hold
        if end > self.shown and not (self.stopped and self.shown >= end):
            self.out.write(text[self.shown:end])
            self.out.flush()
            self.shown = end

    def close(self) -> None:
        if not self.stopped:
            self._show(final=True)


def _summary(n_tokens: int, seconds: float, compile_s: float, cache_bytes: int, args: argparse.Namespace) -> None:
    rate = n_tokens / seconds if seconds > 0 else float("inf")
    size = f"{cache_bytes / 2**20:.1f} MiB" if cache_bytes >= 2**20 else f"{cache_bytes / 2**10:.1f} KiB"
    seed = f"seed {args.seed}; --seed {args.seed} reproduces this" if args.seed_drawn else f"seed {args.seed}"
    print(f"gpt2-jax: {n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), compile {compile_s:.2f} s, "
          f"KV cache {size}, {seed}", file=sys.stderr)  # fmt: skip


def _load_model(args: argparse.Namespace, mesh):
    """--model (default: the bundled one) in --dtype, on --mesh."""
    from gpt2_jax import load
    from gpt2_jax.hub import resolve_model
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
    return params, config


def _draft_option(args: argparse.Namespace, mesh) -> dict:
    """--draft / --prompt-lookup / --speculate -> generate's draft options (none without the first two)."""
    if args.prompt_lookup:
        return dict(draft="prompt_lookup", num_speculative_tokens=args.speculate)
    if args.draft is None:
        return {}
    from gpt2_jax import load
    from gpt2_jax.hub import resolve_model

    draft = load(resolve_model(args.draft), dtype=None if args.dtype == "int8" else args.dtype, mesh=mesh, progress=True)
    return dict(draft=draft, num_speculative_tokens=args.speculate)


def _generate(args: argparse.Namespace) -> int:
    from gpt2_jax import complete, generate_stream
    from gpt2_jax.cache import cache_bytes
    from gpt2_jax.compiling import CompileTimer
    from gpt2_jax.distributed import is_main
    from gpt2_jax.prompts import cache_capacity
    from gpt2_jax.sharding import parse_mesh
    from gpt2_jax.tokenizer import EOT, tokenizer

    if args.num_samples < 1:
        raise GPT2JaxError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.stream and args.num_samples != 1:
        raise GPT2JaxError("--stream prints one sample; use --num-samples 1")
    joined = cli_train.join(args)
    out = _own_stdout() if joined else sys.stdout  # before the first collective, which prints from C++
    args.seed_drawn = args.seed is None
    if args.seed_drawn:  # a fresh seed each run, printed so the run can be repeated
        args.seed = secrets.randbelow(1_000_000)
        if joined:  # every process must sample with process 0's seed
            from jax.experimental.multihost_utils import broadcast_one_to_all

            args.seed = int(broadcast_one_to_all(np.int32(args.seed)))
    mesh = parse_mesh(args.mesh) if args.mesh else None
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    enc = tokenizer()
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]  # an empty prompt starts from <|endoftext|>
    params, config = _load_model(args, mesh)
    kw = _draft_option(args, mesh)
    prompts = [ids] * args.num_samples
    if args.stream and args.top_logprobs:
        raise GPT2JaxError("--top-logprobs prints a table after the text; use it without --stream")
    kw.update(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
              presence_penalty=args.presence_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
              min_new_tokens=args.min_new_tokens, stop=args.stop, constraint=_constraint(args))  # fmt: skip
    cache = cache_bytes(config, args.num_samples, cache_capacity(len(ids), args.max_new_tokens, config),
                        params["wte"].dtype)  # fmt: skip
    out = out if is_main() else io.StringIO()  # every process computes; process 0 prints
    key = jax.random.key(args.seed)
    with CompileTimer() as compiling:
        t0 = time.perf_counter()
        if args.stream:
            text, n = TextStream(enc, out, args.stop or ()), 0
            out.write(prompt)
            for tokens, live in generate_stream(params, config, prompts, key, **kw):
                if not live[0]:
                    break
                n += 1
                if int(tokens[0]) == config.eos_id:
                    break
                text.add(int(tokens[0]))
            text.close()
            out.write("\n")
        else:
            results = complete(params, config, [prompt] * args.num_samples, key, top_logprobs=args.top_logprobs, **kw)
            for b, result in enumerate(results):
                if args.num_samples > 1:
                    print(f"--- sample {b + 1} ---", file=out)
                print(prompt + result.text, file=out)
                if args.top_logprobs:
                    _show_top_logprobs(enc, result, out)
            n = sum(len(r.tokens) for r in results)
        out.flush()
        seconds = time.perf_counter() - t0
    if is_main():
        _summary(n, seconds - compiling.seconds, compiling.seconds, cache, args)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """gpt2-jax serve: load, start the engine, compile every shape with warm-up requests, then serve until
    SIGINT/SIGTERM, which fail the requests in flight, stop the engine and release the port (exit 0)."""
    import signal
    import socket
    import threading

    try:
        import uvicorn

        from gpt2_jax.serving.api import create_app, warm_up
    except ImportError as e:
        raise GPT2JaxError(f"gpt2-jax serve needs fastapi and uvicorn: pip install 'gpt2-jax[serve]' ({e})") from None
    from gpt2_jax.serving import Engine
    from gpt2_jax.sharding import parse_mesh
    from gpt2_jax.tokenizer import tokenizer

    def say(line: str) -> None:
        print(f"gpt2-jax serve: {line}", file=sys.stderr, flush=True)

    def interrupt(*_):
        raise KeyboardInterrupt

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # put back at the end
    signal.signal(signal.SIGTERM, interrupt)  # until uvicorn takes over: stop like Ctrl-C
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # now, so a busy port fails before minutes of compiling
    except OSError as e:
        sock.close()
        raise GPT2JaxError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    engine, stopping = None, []
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else None
        params, config = _load_model(args, mesh)
        engine = Engine(params, config, max_batch=args.max_batch, max_queue=args.max_queue,
                        max_seq=args.max_seq).start()  # fmt: skip
        say(f"compiling (warm-up requests for max_seq={engine.max_seq}, max_batch={engine.max_batch}) ...")
        seconds = warm_up(engine)
        name = args.model_name or args.model or "shakespeare"
        app = create_app(engine, tokenizer(), name)

        def stop_engine() -> None:
            app.state.stopping = True  # new requests: 503
            stopping.append(threading.Thread(target=engine.stop, name="gpt2-jax-stop", daemon=True))
            stopping[0].start()  # fails the requests in flight, so their connections close

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                first = not self.should_exit
                super().handle_exit(sig, frame)
                if first:
                    stop_engine()

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started:
                    say(f"{name} (max_batch={engine.max_batch}, max_queue={engine.max_queue}, max_seq="
                        f"{engine.max_seq}), compiled in {seconds:.1f} s")
                    shown = f"[{host}]" if family == socket.AF_INET6 else host
                    say(f"ready on http://{shown}:{port}")

        server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                       timeout_graceful_shutdown=10))  # fmt: skip
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it stopped on: make that a no-op
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        say("interrupted before it was ready")
    finally:
        if stopping:
            stopping[0].join(timeout=60)
        elif engine is not None:
            engine.stop()
        sock.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    say("stopped")
    return 0


def _own_stdout():
    """The generated text's own handle on stdout; file descriptor 1 then points at stderr, because the
    gloo collectives print progress lines ("[Gloo] Rank 0 is connected ...") to it from C++."""
    import os

    sys.stdout.flush()
    text = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            return convert_mod.run(args)
        if args.command in ("generate", "train", "serve"):
            _use_compile_cache(args)
        return {"generate": _generate, "train": cli_train.run_train, "data": cli_train.run_data,
                "serve": _serve}[args.command](args)  # fmt: skip
    except GPT2JaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
