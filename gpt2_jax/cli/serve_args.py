"""gpt2-jax serve's (and explain's) flags: the server, its limits, its pool and its process."""

from __future__ import annotations

import argparse

from gpt2_jax.model.precision_type import MODES


def serve_parser(serve: argparse.ArgumentParser, cache_arg) -> None:
    add = serve.add_argument
    add(
        "--model",
        default=None,
        help="checkpoint path or hub id, as for generate (default: the bundled Shakespeare model)",
    )
    add("--model-name", default=None, help="the model id clients send (default: the --model value, or 'shakespeare')")
    add("--host", default="127.0.0.1", help="address to listen on; beyond localhost, put a TLS proxy in front")
    add("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    add("--max-batch", type=int, default=32, help="rows: requests generated at once, at most")
    add("--max-queue", type=int, default=64, help="requests waiting for a row before 429s")
    add("--max-seq", type=int, default=None, help="prompt + max_tokens limit per request (default: the context)")
    add(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks of 128 tokens in the pool every request draws from (default: as many tokens as 8 "
        "requests of max_seq; a request holds the blocks its prompt and max_tokens need)",
    )
    add("--kv-cache-mb", type=float, default=None, help="size the KV pool in MiB instead of --num-blocks")
    add(
        "--prefill-chunk",
        type=int,
        default=None,
        help="the most prompt tokens computed between two decode steps, so running streams keep flowing while "
        "a long prompt arrives (default: 32; bench/serve.py compares chunk sizes)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds the requests in flight get to finish (new ones get 503) before the "
        "rest end with finish_reason 'abort'",
    )
    add(
        "--dtype",
        choices=list(MODES),
        default=None,
        help="the weights' precision (default on a CPU: float32, whatever the checkpoint stores, since it is "
        "exact and fast there; elsewhere the stored dtype); float32-packed = float32's exact values in 3.5 bytes "
        "a weight; int8 = weight-only int8 blocks; w8a8 = the same "
        "weights with 8-bit matmul inputs (faster at a few rows on AVX512-VNNI, less exact)",
    )
    add("--mesh", help="run sharded over a device mesh, e.g. model=2 (see gpt2_jax.parallel.sharding)")
    add(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require Authorization: Bearer KEY (repeatable). A key given here shows in `ps` to every user of the "
        "machine: prefer --api-key-file or $GPT2_JAX_API_KEY (default: $GPT2_JAX_API_KEY, else no key)",
    )
    add("--api-key-file", default=None, metavar="FILE", help="read the API keys from FILE, one a line (not in `ps`)")
    add(
        "--max-body-bytes",
        type=int,
        default=None,
        help="the largest request body; larger ones get 413 before they are read (default: 4 KiB per max_seq "
        "token, at least 1 MiB)",
    )
    add(
        "--idle-timeout",
        type=float,
        default=15.0,
        help="seconds a connection may take to send a request's headers, or between two chunks of its body "
        "(408), and may stay idle between requests",
    )
    add(
        "--max-beam-tokens",
        type=int,
        default=None,
        help="the most tokens one use_beam_search request may hold: beams x prompts x (prompt + max_tokens) "
        "(default: 8 x max_seq); two such searches run at once, smaller ones beside them",
    )
    add(
        "--max-constraint-states",
        type=int,
        default=4096,
        help="the most states one request's regex, choice or JSON-schema constraint may compile to",
    )
    add("--constraint-classes", type=int, default=512, help="the most token classes one constraint may have")
    add("--constraint-timeout", type=float, default=30.0, help="seconds a constraint may take to compile")
    add(
        "--constraint-workers",
        type=int,
        default=2,
        help="constraints compiled at once, each in its own process (a cheap one waits only while all are busy)",
    )
    spec = serve.add_mutually_exclusive_group()
    spec.add_argument("--prompt-lookup", action="store_true",
                      help="speculative decoding proposing the continuation of earlier matches in each request's text "
                      "(the output is the same, only faster where text repeats itself)")  # fmt: skip
    spec.add_argument(
        "--draft-model",
        "--draft",
        dest="draft",
        metavar="MODEL",
        help="speculative decoding with this smaller draft model (same vocabulary; any --model form)",
    )
    add("--speculate-when", choices=["auto", "always"], default="auto",
        help="auto: a speculative round only when it is measured to give more tokens per second than a plain step; "
        "always: every step a round (benches, tests)")  # fmt: skip
    add("--num-speculative-tokens", "--speculate", dest="speculate", type=int, default=4, metavar="K",
        help="tokens proposed per round (with --prompt-lookup or --draft-model); the engine runs a round only when "
        "it is measured to give more tokens per second than a plain step; a request opts out with \"speculative\": false")  # fmt: skip
    add(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="the Jinja template (HuggingFace's chat_template convention: messages, add_generation_prompt, "
        "bos_token, eos_token) that turns /v1/chat/completions' messages into a prompt (default: the "
        "chat_template of the model's tokenizer_config.json; without either, chat requests get a 400)",
    )
    add("--no-playground", action="store_true", help="serve no page at / (the API only)")
    add("--allocator", choices=["auto", "jemalloc", "glibc"], default="auto",
        help="the process's malloc: auto runs on jemalloc where it is installed (libjemalloc2), whose RSS stays "
        "flat over long runs, where glibc's creeps (gpt2_jax/serving/memory.py)")  # fmt: skip
    cache_arg(serve)  # fmt: skip
