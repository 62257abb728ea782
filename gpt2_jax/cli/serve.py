"""gpt2-jax serve: an OpenAI-compatible completions API over HTTP (gpt2_jax.serving)."""

from __future__ import annotations

import argparse
import os
import sys

from gpt2_jax.cli.generate import load_draft, load_model
from gpt2_jax.errors import GPT2JaxError


def api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key and --api-key-file's keys together, else $GPT2_JAX_API_KEY's, else none."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                keys += [line for line in f.read().splitlines() if line.strip()]
        except OSError as e:
            raise GPT2JaxError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror or e}") from None
        if len(keys) == len(args.api_key or []):
            raise GPT2JaxError(f"--api-key-file {args.api_key_file} holds no key")
    if not keys and os.environ.get("GPT2_JAX_API_KEY"):
        keys = [os.environ["GPT2_JAX_API_KEY"]]
    if any(not k.strip() for k in keys):
        raise GPT2JaxError("--api-key (or GPT2_JAX_API_KEY) must not be empty")
    return [k.strip() for k in keys]


def limits(args: argparse.Namespace, max_seq: int):
    """The per-request bounds from the flags (serving.limits.Limits)."""
    from gpt2_jax.serving import Limits

    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--idle-timeout", args.idle_timeout),
                        ("--max-beam-tokens", args.max_beam_tokens), ("--constraint-workers", args.constraint_workers)):  # fmt: skip
        if value is not None and value <= 0:
            raise GPT2JaxError(f"{flag} must be > 0, got {value:g}")
    return Limits.for_context(max_seq, args.max_body_bytes, args.idle_timeout, args.max_beam_tokens)


def pool_blocks(args: argparse.Namespace, config, dtype) -> int | None:
    """--num-blocks, or --kv-cache-mb as blocks (plus the null block); None: the engine's default."""
    from gpt2_jax.model.paged_cache import pool_bytes

    if args.num_blocks is not None and args.kv_cache_mb is not None:
        raise GPT2JaxError("give --num-blocks or --kv-cache-mb, not both")
    if args.kv_cache_mb is None:
        return args.num_blocks
    if args.kv_cache_mb <= 0:
        raise GPT2JaxError(f"--kv-cache-mb must be > 0, got {args.kv_cache_mb:g}")
    return int(args.kv_cache_mb * 2**20 // pool_bytes(config, 1, dtype)) + 1


def speculation(args: argparse.Namespace, mesh):
    """--prompt-lookup / --draft-model / --num-speculative-tokens -> the engine's Speculation, or None."""
    from gpt2_jax.serving.speculation import Speculation

    if not args.prompt_lookup and args.draft is None:
        return None
    draft = None if args.prompt_lookup else load_draft(args, mesh)
    return Speculation(k=args.speculate, draft=draft, when=args.speculate_when)


def run_serve(args: argparse.Namespace) -> int:
    """gpt2-jax serve: load, start the engine, compile the essential programs, serve while the rest compile in
    the background, until SIGINT/SIGTERM: new requests then get 503, the ones in flight get --shutdown-timeout
    seconds to finish (the rest end with finish_reason "abort"), and the port is released. The process then exits
    at once (exit 0), whatever is still compiling; a second signal stops it without waiting."""
    import signal
    import socket
    import threading

    from gpt2_jax.serving.memory import serve_allocator

    try:
        env, malloc_line = serve_allocator(args.allocator, dict(os.environ))
    except FileNotFoundError as e:
        raise GPT2JaxError(str(e)) from None
    argv = getattr(args, "argv", None)
    if env is not None and argv is not None:
        # Start again on jemalloc: a preload must be there when the process starts. Nothing is open yet.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "gpt2_jax", *argv], env)
    import time

    try:
        import jinja2  # noqa: F401  (chat templates)
        import uvicorn

        from gpt2_jax.serving import chat_template
        from gpt2_jax.serving.api import create_app
        from gpt2_jax.serving.limits import header_timeout
    except ImportError as e:
        raise GPT2JaxError(
            f"gpt2-jax serve needs fastapi, uvicorn and jinja2: pip install 'gpt2-jax[serve]' ({e})"
        ) from None

    from gpt2_jax.checkpoints import BUNDLED_MODEL, resolve_model
    from gpt2_jax.model.attention import KEY_BLOCK
    from gpt2_jax.model.paged_cache import pool_bytes
    from gpt2_jax.model.params import float_dtype
    from gpt2_jax.parallel.sharding import parse_mesh
    from gpt2_jax.serving import Engine
    from gpt2_jax.serving.constraint_worker import ConstraintCompiler
    from gpt2_jax.serving.memory import tune_malloc
    from gpt2_jax.serving.warmup import warm_up
    from gpt2_jax.tokenizer import tokenizer

    def say(line: str) -> None:
        print(f"gpt2-jax serve: {line}", file=sys.stderr, flush=True)

    tune_malloc()  # before the threads start: a long-lived process's RSS tracks what it holds
    say(malloc_line)

    def interrupt(*_):
        raise KeyboardInterrupt

    keys = api_keys(args)
    limits(args, 1)  # the flags' ranges, before anything loads
    template = chat_template.find(args.chat_template, None)  # a file that does not parse: an error before loading
    if args.max_constraint_states < 1 or args.constraint_classes < 1 or args.constraint_timeout <= 0:
        raise GPT2JaxError("--max-constraint-states, --constraint-classes and --constraint-timeout must be > 0")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # put back at the end
    signal.signal(signal.SIGTERM, interrupt)  # until uvicorn takes over: stop like Ctrl-C
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # now, so a busy port fails before the compiling
    except OSError as e:
        sock.close()
        raise GPT2JaxError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host, port = sock.getsockname()[:2]
    engine, stopping, compiler = None, [], None
    try:
        mesh = parse_mesh(args.mesh) if args.mesh else None
        params, config = load_model(args, mesh)
        if template is None:
            template = chat_template.find(None, resolve_model(args.model) if args.model else BUNDLED_MODEL)
        compiler = ConstraintCompiler(args.constraint_timeout, args.max_constraint_states, args.constraint_workers)
        starting = threading.Thread(target=compiler.start, daemon=True)  # its child starts while we compile
        starting.start()

        def compiled(key, seconds):
            left = engine.programs.pending() if engine is not None else ()
            say(
                f"compiled {key[0]} {key[1]} in {seconds:.1f} s"
                + (f" ({len(left)} to go)" if left else "; all compiled")
            )

        engine = Engine(params, config, max_batch=args.max_batch, max_queue=args.max_queue, max_seq=args.max_seq,
                        num_blocks=pool_blocks(args, config, float_dtype(params)), max_constraint_states=
                        args.max_constraint_states, constraint_classes=args.constraint_classes, on_compiled=compiled,
                        speculation=speculation(args, mesh),
                        **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk})).start()  # fmt: skip
        pool_mb = pool_bytes(config, engine.num_blocks, float_dtype(params)) / 2**20
        say(f"compiling the essential programs (max_seq={engine.max_seq}, max_batch={engine.max_batch}, KV pool "
            f"{engine.num_blocks - 1} blocks of {KEY_BLOCK} tokens = {pool_mb:.0f} MiB, prefill chunks of "
            f"{engine.prefill_chunk}, weights {args.dtype or params['wte'].dtype}) ...")  # fmt: skip
        starting.join()
        seconds = warm_up(engine, compiler=compiler)
        name = args.model_name or args.model or "shakespeare"
        bounds = limits(args, engine.max_seq)
        app = create_app(engine, tokenizer(), name, api_keys=keys, compiler=compiler, playground=not args.no_playground,
                         limits=bounds, chat_template=template)  # fmt: skip
        say(f"chat template: {template.origin}" if template is not None else
            "no chat template: /v1/chat/completions answers 400 (give --chat-template FILE)")  # fmt: skip

        def drain(server) -> None:
            """Let the requests in flight finish (new ones: 503), then stop serving."""
            stats = engine.stats()
            say(f"draining: {stats['active']} requests running and {stats['queued']} queued get up to "
                f"{args.shutdown_timeout:g} s to finish; new requests get 503")  # fmt: skip
            finished = engine.drain(args.shutdown_timeout)
            say("drained" if finished else "drained; the requests still running ended with finish_reason 'abort'")
            time.sleep(0.2)  # their last chunks leave the event loop
            server.should_exit = True

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if stopping:  # a second signal: stop now
                    self.should_exit = self.force_exit = True
                    return
                app.state.stopping = True  # new requests: 503
                stopping.append(threading.Thread(target=drain, args=(self,), name="gpt2-jax-drain", daemon=True))
                stopping[0].start()

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started:
                    left = len(engine.programs.pending())
                    say(f"{name} (max_batch={engine.max_batch}, max_queue={engine.max_queue}, max_seq="
                        f"{engine.max_seq}), ready after {seconds:.1f} s of compiling; {left} programs compiling "
                        f"in the background{'; API keys required' if keys else ''}")  # fmt: skip
                    shown = f"[{host}]" if family == socket.AF_INET6 else host
                    say(f"ready on http://{shown}:{port}")
                    if args.command == "explain":  # the one line the reader needs, on stdout
                        print(f"the explainer: http://{shown}:{port}/explain", flush=True)

        # uvicorn annotates timeout_keep_alive as int but hands it to loop.call_later, which takes float seconds
        server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                       timeout_graceful_shutdown=10,
                                       timeout_keep_alive=bounds.idle_timeout,  # pyright: ignore[reportArgumentType]
                                       http=header_timeout(bounds.idle_timeout)))  # fmt: skip
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it stopped on: make that a no-op
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        say("interrupted before it was ready")
    finally:
        if engine is not None:
            engine.stop()  # anything still in flight (a forced exit) fails now
        if compiler is not None:
            compiler.stop()
        sock.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    say("stopped")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a program compiling in the background must not keep the process alive
