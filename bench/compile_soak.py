"""A long-lived process that compiles hundreds to thousands of decode programs: the XLA segfault hunt.

    nice -n 10 python bench/compile_soak.py [--programs 600] [--minutes 30] [--kinds aot,generate,stream,engine,sharded]
        [--kernels on|off] [--cache off|tmp|DIR] [--devices 8|1] [--threads 1|2] [--torch off|on]
        [--tiny off|on] [--clear-caches off|on] [--seed 0]

XLA's CPU compiler once segfaulted twice in one pytest process that had compiled a few hundred
programs, each time on a decode program that compiled fine in a fresh process. This script is that process
on purpose: random small GPT-2 configs (layers, width, heads, vocab, context), and for each of them the
decode programs of many buckets, through the public API (generate and generate_stream with random
SamplingParams, the serving Engine's ahead-of-time compile for a random max_batch/max_seq, decode_step and
prefill lowered and compiled by hand, sharded generate on a random 8-device mesh). It counts XLA compiles
(jax.monitoring's backend-compile events less the persistent cache's hits; "big": over a second of XLA)
and prints a line per action: programs so far, seconds, RSS, threads, and what it is compiling, so a crash
shows where it happened; faulthandler prints every thread's Python stack on SIGSEGV. Each suspect has a flag
(the FFI kernels, the persistent compilation cache, the 8 fake devices, two compiling threads). Exits 0 with
a summary line when --programs or --minutes is reached. Results: bench/RESULTS.md, "Compile soak".
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import sys
import tempfile
import threading
import time

faulthandler.enable(all_threads=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", type=int, default=600, help="stop after this many XLA compiles")
    p.add_argument("--minutes", type=float, default=60.0, help="or after this long")
    p.add_argument("--kinds", default="aot,generate,stream,engine,sharded", help="which workloads, comma-separated")
    p.add_argument("--kernels", choices=["on", "off"], default="on", help="gpt2_jax's FFI kernels (custom calls)")
    p.add_argument("--cache", default="off", help="JAX's persistent compilation cache: off, or a directory ('tmp')")
    p.add_argument("--devices", type=int, default=8, help="XLA CPU devices (the tests use 8); sharded needs 8")
    p.add_argument("--threads", type=int, default=1, help="threads compiling at once (each its own workloads)")
    p.add_argument("--torch", choices=["on", "off"], default="off",
                   help="also run a transformers GPT-2 forward per config (torch in the process, as in the tests)")  # fmt: skip
    p.add_argument("--tiny", choices=["on", "off"], default="off", help="one-layer configs of context <= 64 (fast)")
    p.add_argument("--clear-caches", choices=["on", "off"], default="off", help="jax.clear_caches() per config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", choices=["on", "off"], default="on", help="measure and print the machine first")
    p.add_argument("--segfault-after", type=int, default=0, metavar="N",
                   help="self-test: read address 0 after N programs, to show how a crash is reported")  # fmt: skip
    return p.parse_args(argv)


def set_environment(args: argparse.Namespace) -> None:
    """The suspects that must be chosen before jax (and gpt2_jax) are imported."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices}"])
    os.environ["GPT2_JAX_KERNELS"] = args.kernels


args = parse() if __name__ == "__main__" else None
if args is not None:
    set_environment(args)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from machine import describe  # noqa: E402  (beside this script: python bench/compile_soak.py)

import gpt2_jax  # noqa: E402
from gpt2_jax import GPT2Config, SamplingParams  # noqa: E402
from gpt2_jax.compiling import use_persistent_cache  # noqa: E402
from gpt2_jax.generation import decode_step, prefill  # noqa: E402
from gpt2_jax.generation.batching import prepare  # noqa: E402
from gpt2_jax.generation.generator import start  # noqa: E402
from gpt2_jax.parallel.sharding import make_mesh, shard_params  # noqa: E402
from gpt2_jax.serving import Engine  # noqa: E402


class Counter:
    """XLA compiles, persistent-cache hits and the big programs (over a second of XLA: the decode loops, the
    engine's steps) from every thread. JAX times a cache hit with the same event as a compile, so a hit is
    subtracted: compiles counts only programs XLA really built in this process."""

    def __init__(self) -> None:
        self.events = self.hits = self.big = 0
        self.compile_seconds = 0.0
        self.lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    @property
    def compiles(self) -> int:
        return self.events - self.hits

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self.lock:
                self.events += 1
                self.big += seconds >= 1.0
                self.compile_seconds += seconds

    def _event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            with self.lock:
                self.hits += 1


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def random_config(rng: np.random.Generator, tiny: bool = False) -> GPT2Config:
    """A small GPT-2: 1-3 layers, 2-8 heads of 8-32, vocab 64-700, context 64-256 (heads and F divide 8
    for the sharded workloads when the head count is 8). tiny: one layer, width <= 64, context 32 or 64
    (fast compiles, for the CI-sized run)."""
    heads, head_dim = int(rng.choice([2, 4, 8])), int(rng.choice([8] if tiny else [8, 16, 32]))
    vocab = int(rng.integers(64, 700))
    eos = int(rng.integers(0, vocab)) if rng.random() < 0.7 else None
    context, layers = ([32, 64], 1) if tiny else ([64, 128, 256], int(rng.integers(1, 4)))
    return GPT2Config(vocab_size=vocab, n_positions=int(rng.choice(context)), n_embd=heads * head_dim,
                      n_layer=layers, n_head=heads, eos_token_id=eos)  # fmt: skip


def random_sampling(rng: np.random.Generator, config: GPT2Config, top: bool = True) -> SamplingParams:
    """Random settings, including the ones that add program variants (top_logprobs, bad words, bias)."""
    V = config.vocab_size
    return SamplingParams(
        max_new_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
        top_k=int(rng.choice([0, 5, 40])), top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])),
        repetition_penalty=float(rng.choice([1.0, 1.2])), frequency_penalty=float(rng.choice([0.0, 0.5])),
        logit_bias={int(rng.integers(V)): 3.0} if rng.random() < 0.3 else None,
        bad_words_ids=((int(rng.integers(V)),), (int(rng.integers(V)), int(rng.integers(V)))) if rng.random() < 0.3 else (),
        no_repeat_ngram_size=int(rng.choice([0, 0, 2])), min_new_tokens=int(rng.choice([0, 0, 3])),
        stop_ids=(int(rng.integers(V)),) if rng.random() < 0.3 else (), logprobs=bool(rng.random() < 0.5),
        top_logprobs=int(rng.integers(1, 6)) if top and rng.random() < 0.3 else 0,
    )  # fmt: skip


def prompts(rng: np.random.Generator, config: GPT2Config, rows: int, longest: int) -> list[list[int]]:
    return [rng.integers(0, config.vocab_size, int(rng.integers(1, longest + 1))).tolist() for _ in range(rows)]


# ---- workloads: each compiles the programs of one bucket (or engine) and says what it did ----------------------
def aot(rng, params, config) -> str:
    """decode_step (with and without top logprobs) and prefill, lowered and compiled by hand (as the engine does)."""
    B, P = int(rng.integers(1, 9)), int(rng.integers(1, config.n_positions // 2))
    rows = [SamplingParams(max_new_tokens=int(rng.integers(1, config.n_positions - P)))] * B
    prep = prepare(params, config, prompts(rng, config, B, P), jax.random.key(0), rows)
    batch = prep.batch
    prefill.lower(params, batch.tokens, batch.lengths, batch.keys, config, batch.capacity).compile()
    state = start(params, config, prep)
    r = int(rng.choice([0, 20]))
    decode_step.lower(params, state, prep.rules, config, r).compile()
    return f"aot decode_step B={B} P<={P} r={r} capacity={batch.capacity}"


def generate(rng, params, config) -> str:
    B, P = int(rng.integers(1, 10)), int(rng.integers(1, config.n_positions // 2))
    rows = [random_sampling(rng, config) for _ in range(B)]
    cap = config.n_positions - P
    rows = [s.replace(max_new_tokens=min(s.max_new_tokens, cap)) for s in rows]
    gpt2_jax.generate(
        params, config, prompts(rng, config, B, P), jax.random.key(int(rng.integers(1 << 30))), sampling=rows
    )
    return f"generate B={B} P<={P} N<={max(s.max_new_tokens for s in rows)} top={max(s.top_logprobs for s in rows)}"


def stream(rng, params, config) -> str:
    B, P = int(rng.integers(1, 10)), int(rng.integers(1, config.n_positions // 2))
    rows = [random_sampling(rng, config, top=False).replace(max_new_tokens=3) for _ in range(B)]
    for _ in gpt2_jax.generate_stream(params, config, prompts(rng, config, B, P), jax.random.key(1), sampling=rows):
        pass
    return f"generate_stream B={B} P<={P}"


def engine(rng, params, config) -> str:
    """The serving engine's compile (its own compiler thread builds every bucket) while this thread generates."""
    B, S = int(rng.integers(1, 9)), int(rng.choice([32, 64, 128, config.n_positions]))
    e = Engine(params, config, max_batch=B, max_seq=min(S, config.n_positions))
    keys: list = []
    compiling = threading.Thread(target=lambda: keys.extend(e.programs.compile() or []), name="engine.compile")
    compiling.start()
    other = generate(rng, params, config)  # compiles on this thread meanwhile
    compiling.join()
    return f"Engine(max_batch={B}, max_seq={e.max_seq}).programs.compile() [{len(keys)} programs] + {other}"


def sharded(rng, params, config) -> str:
    model = int(rng.choice([m for m in (1, 2, 4, 8) if config.n_head % m == 0 and len(jax.devices()) % m == 0]))
    mesh = make_mesh(len(jax.devices()) // model, model)
    on_mesh = shard_params(params, config, mesh)
    what = (stream if rng.random() < 0.5 else generate)(rng, on_mesh, config)
    return f"sharded data={mesh.shape['data']} model={model}: {what}"


def torch_forward(rng, config) -> None:
    """The tests' reference side: a random transformers GPT-2 of the same config, one forward (torch's own
    thread pool and its bundled libraries in the same process as XLA's)."""
    import torch  # imported by main() first: transformers' lazy imports are not safe from two threads at once
    import transformers

    hf = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
                                 n_layer=config.n_layer, n_head=config.n_head, bos_token_id=None, eos_token_id=None)  # fmt: skip
    with torch.no_grad():
        transformers.GPT2LMHeadModel(hf).eval()(torch.tensor([prompts(rng, config, 1, 16)[0]]))


WORKLOADS = {"aot": aot, "generate": generate, "stream": stream, "engine": engine, "sharded": sharded}


def worker(name: str, seed: int, kinds: list, counter: Counter, deadline: float, t0: float, out: list) -> None:
    rng = np.random.default_rng(seed)
    while counter.compiles < args.programs and time.monotonic() < deadline:
        if args.clear_caches == "on":
            jax.clear_caches()  # drop every compiled program: what is left of RSS growth is not the jit caches
        config = random_config(rng, args.tiny == "on")
        params = gpt2_jax.init_params(jax.random.key(int(rng.integers(1 << 30))), config)
        if rng.random() < 0.2:
            params = gpt2_jax.cast_params(params, jnp.bfloat16)
        if args.torch == "on":
            torch_forward(rng, config)
        label = f"L{config.n_layer} D{config.n_embd} H{config.n_head} V{config.vocab_size} P{config.n_positions}"
        for _ in range(int(rng.integers(3, 8))):  # several buckets per config
            kind = kinds[int(rng.integers(len(kinds)))]
            if kind == "sharded" and len(jax.devices()) < 8:
                continue
            print(f"[{time.monotonic() - t0:7.1f} s] {name} start {kind} {label}", flush=True)
            what = WORKLOADS[kind](rng, params, config)
            print(f"[{time.monotonic() - t0:7.1f} s] {name} {counter.compiles:5d} programs ({counter.big} big, {counter.hits} cache hits) "
                  f"rss {rss_mib():6.0f} MiB threads {threading.active_count():3d}  {label} {what}", flush=True)  # fmt: skip
            out.append(kind)
            if 0 < args.segfault_after <= counter.compiles:
                ctypes.string_at(0)  # a real SIGSEGV, in this thread, between two compiles
            if counter.compiles >= args.programs or time.monotonic() >= deadline:
                return


def main() -> int:
    where = tempfile.mkdtemp(prefix="soak-cache-") if args.cache == "tmp" else args.cache
    use_persistent_cache(None if args.cache == "off" else where)  # off: a test run's inherited cache too
    if args.torch == "on":
        import torch
        import transformers

        transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=8))
        torch.set_num_threads(torch.get_num_threads())
    if args.machine == "on":
        describe(jax, jnp, threads=args.threads)
    print(f"soak: jax {jax.__version__}, jaxlib {jax.lib.__version__}, {len(jax.devices())} devices, kernels "
          f"{gpt2_jax.kernels.available() or 'off'}, cache {args.cache}, threads {args.threads}, torch {args.torch}, "
          f"tiny {args.tiny}, clear_caches {args.clear_caches}, kinds {args.kinds}, "
          f"seed {args.seed}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}", flush=True)  # fmt: skip
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown --kinds {unknown}; choose from {sorted(WORKLOADS)}")
    counter, t0, rss0 = Counter(), time.monotonic(), rss_mib()
    deadline, done = t0 + 60 * args.minutes, []
    threads = [threading.Thread(target=worker, args=(f"w{i}", args.seed * 1000 + i, kinds, counter, deadline, t0, done))
               for i in range(args.threads)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    by_kind = {k: done.count(k) for k in kinds}
    print(f"survived: {counter.compiles} programs compiled ({counter.big} big, {counter.hits} cache hits) in {seconds:.0f} s "
          f"({counter.compile_seconds:.0f} s in XLA), {len(done)} actions {by_kind}; rss {rss0:.0f} -> {rss_mib():.0f} "
          f"MiB (peak {peak:.0f}), {threading.active_count()} threads", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
