"""gpt2-jax serve: an OpenAI-compatible completions API over HTTP (gpt2_jax.serving)."""

from __future__ import annotations

import argparse
import sys

from gpt2_jax.cli.generate import load_model
from gpt2_jax.errors import GPT2JaxError


def serve_parser(serve: argparse.ArgumentParser, cache_arg) -> None:
    serve.add_argument(
        "--model",
        default=None,
        help="checkpoint path or hub id, as for generate (default: the bundled Shakespeare model)",
    )
    serve.add_argument(
        "--model-name", default=None, help="the model id clients send (default: the --model value, or 'shakespeare')"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    serve.add_argument("--max-batch", type=int, default=8, help="slots: requests generated at once")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    serve.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help="prompt + max_tokens limit per request, the KV cache's length (default: the context)",
    )
    serve.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "int8"],
        default=None,
        help="cast the weights; int8 = weight-only int8 blocks, bfloat16 otherwise (gpt2_jax.model.precision)",
    )
    serve.add_argument("--mesh", help="run sharded over a device mesh, e.g. model=2 (see gpt2_jax.parallel.sharding)")
    cache_arg(serve)


def run_serve(args: argparse.Namespace) -> int:
    """gpt2-jax serve: load, start the engine, compile every shape with warm-up requests, then serve until
    SIGINT/SIGTERM, which fail the requests in flight, stop the engine and release the port (exit 0)."""
    import signal
    import socket
    import threading

    try:
        import uvicorn

        from gpt2_jax.serving import create_app, warm_up
    except ImportError as e:
        raise GPT2JaxError(f"gpt2-jax serve needs fastapi and uvicorn: pip install 'gpt2-jax[serve]' ({e})") from None
    from gpt2_jax.parallel import parse_mesh
    from gpt2_jax.serving import Engine
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
        params, config = load_model(args, mesh)
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
                    say(
                        f"{name} (max_batch={engine.max_batch}, max_queue={engine.max_queue}, max_seq="
                        f"{engine.max_seq}), compiled in {seconds:.1f} s"
                    )
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
