"""Decode speed of gpt2_jax against the CPU engines people pick for GPT-2 (transformers, ONNX Runtime, OpenVINO,
llama.cpp, CTranslate2), fp32 and int8, in one run on one random checkpoint, against each row's bound.

    pip install -e '.[peers]' && python bench/peers.py [--repeats 3] [--threads N] [--only gpt2_jax,onnxruntime]

A random gpt2-small GPT2LMHeadModel (every parameter random) is saved with save_pretrained into a temp dir, and
every peer converts it there offline (bench/peers_convert.py); the temp dir is removed at the end. Each engine
runs in its own worker process (a peer that is missing, fails to convert or crashes is a "skipped: <reason>"
row; the bench goes on), pinned to the same cores and thread count, and the workers take turns within each
repeat as best_of_each does (bench/timing.py), best of each kept. Greedy, 32-token prompts, no EOS stopping
anywhere; per step = (t(129 new) - t(1 new)) / 128, so the prefill cancels. Each worker times its own calls.
Prefill: t(one 512-token prompt, 1 new) at B=1 (`--prefill 0` skips it), its bound the float32 matmul FLOP/s
bench/machine.py measures (2 x parameters x tokens FLOPs; int8 engines can pass it, fp32 ones hardly).

Bound of a row: the bytes it must read per decode step (its matmul weights at its own precision, 4 bytes
for fp32, 3.5 for fp32-packed (gpt2_jax's float32-packed: float32's values, lossless), 1 for int8 and w8a8,
34/32 for q8_0; the fp32 biases and LayerNorms; the KV cache at S = 32 + 128, fp32 but llama.cpp q8_0's f16)
over the read bandwidth measured by bench/machine.py; "of bound" is measured / bound. Agreement: each
row's greedy tokens (129 new) against transformers'; for fp32 peers they should be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

PROMPT, NEW = 32, 128
ROWS = [  # label, engine, precision, bytes per matmul weight, bytes per KV cache element, extra env
    ("gpt2_jax", "gpt2_jax", "fp32", 4.0, 4, {}),
    ("gpt2_jax", "gpt2_jax", "fp32-packed", 3.5, 4, {}),  # float32's values and bits, 3.5 bytes a weight
    ("gpt2_jax", "gpt2_jax", "int8", 1.0, 4, {}),
    ("gpt2_jax", "gpt2_jax", "w8a8", 1.0, 4, {}),  # int8's weights, 8-bit matmul inputs
    # on a CPU with AMX, int8 as it runs without AMX's tiles (VNNI alone)
    ("gpt2_jax, forced avx512-vnni", "gpt2_jax", "int8", 1.0, 4, {"GPT2_JAX_ROWDOT_ISA": "avx512-vnni"}),
    ("gpt2_jax, forced avx2 kernels", "gpt2_jax", "fp32", 4.0, 4, {"GPT2_JAX_ROWDOT_ISA": "avx2"}),
    ("gpt2_jax, forced avx2 kernels", "gpt2_jax", "fp32-packed", 3.5, 4, {"GPT2_JAX_ROWDOT_ISA": "avx2"}),
    ("gpt2_jax, forced avx2 kernels", "gpt2_jax", "int8", 1.0, 4, {"GPT2_JAX_ROWDOT_ISA": "avx2"}),
    ("gpt2_jax, forced avx2 kernels", "gpt2_jax", "w8a8", 1.0, 4, {"GPT2_JAX_ROWDOT_ISA": "avx2"}),
    ("transformers (PyTorch eager)", "transformers", "fp32", 4.0, 4, {}),
    ("ONNX Runtime", "onnxruntime", "fp32", 4.0, 4, {}),
    ("ONNX Runtime", "onnxruntime", "int8", 1.0, 4, {}),
    ("OpenVINO", "openvino", "fp32", 4.0, 4, {}),
    ("OpenVINO + nncf", "openvino", "int8", 1.0, 4, {}),
    ("llama.cpp", "llama.cpp", "f32", 4.0, 4, {}),
    ("llama.cpp", "llama.cpp", "q8_0", 34 / 32, 2, {}),  # its KV cache f16, llama.cpp's default
    # without llama.cpp's repacked (AMX) weight buffers, whose q8_0 decode segfaulted on a Xeon with AMX
    ("llama.cpp, no extra buffers", "llama.cpp", "q8_0", 34 / 32, 2, {"GPT2_JAX_PEERS_LLAMA_EXTRA_BUFTS": "0"}),
    ("CTranslate2", "ctranslate2", "float32", 4.0, 4, {}),
    ("CTranslate2", "ctranslate2", "int8", 1.0, 4, {}),
]


def prompts(B: int, T: int = PROMPT):
    return np.random.default_rng(0).integers(0, 50256, (8, T))[:B]


def worker(engine: str, precision: str, work: Path, threads: int) -> None:
    """Set the engine up, answer "ready", then time `B n` requests from stdin: {"s": seconds, "tokens": [...]}."""
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not into the answers
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from peers_convert import ENGINES

        gen, info, logits = ENGINES[engine](work / "ckpt", work, threads, precision)
        answer.write(json.dumps({"ready": info}) + "\n")
    except Exception as e:  # the reason goes back as the row
        traceback.print_exc()
        answer.write(json.dumps({"skip": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:200]}) + "\n")  # fmt: skip
        return
    answer.flush()
    for line in sys.stdin:
        if line.startswith("logits "):  # the logits after each of the first B prompts, into a file
            out = work / f"logits-{os.getpid()}.npy"
            np.save(out, np.asarray(logits(prompts(int(line.split()[1]))), np.float32))
            answer.write(json.dumps({"path": str(out)}) + "\n")
            answer.flush()
            continue
        B, n, T = map(int, line.split())
        p = prompts(B, T)
        t = time.perf_counter()
        tokens = gen(p, n)
        s = time.perf_counter() - t
        answer.write(json.dumps({"s": s, "tokens": tokens.tolist()}) + "\n")
        answer.flush()


class Worker:
    def __init__(self, row, work: Path, threads: int, timeout: float):
        self.label, self.engine, self.precision, self.bpw, self.kvb, env = row
        self.name = f"{self.label} {self.precision}"
        self.log = work / f"log-{len(list(work.glob('log-*')))}.txt"
        cmd = [sys.executable, __file__, "--worker", self.engine, self.precision, str(work), str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, env={**os.environ, **env})  # fmt: skip
        self.skip, self.info = None, ""
        reply = self.read(timeout)
        if reply is not None:
            self.skip, self.info = reply.get("skip"), reply.get("ready", "")

    def read(self, timeout: float):
        line = None
        if select.select([self.proc.stdout], [], [], timeout)[0]:
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
        self.proc.kill()
        tail = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()][-1:] or [""]
        self.skip = f"worker died (exit {self.proc.wait()}): {tail[0][:160]}" if line == "" else "timed out"
        return None

    def run(self, B: int, n: int, timeout: float, T: int = PROMPT):
        if self.skip:
            return None
        self.proc.stdin.write(f"{B} {n} {T}\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def logits(self, B: int, timeout: float):
        if self.skip:
            return None
        self.proc.stdin.write(f"logits {B}\n")
        self.proc.stdin.flush()
        reply = self.read(timeout)
        return None if reply is None else np.load(reply["path"])

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill row (0: none)")
    parser.add_argument("--only", default="", help="comma-separated engines (gpt2_jax, transformers, ...)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a worker may take for one answer")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    os.sched_setaffinity(0, cores)  # every worker inherits the same cores
    os.environ.update(OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    import jax
    import jax.numpy as jnp
    from machine import describe

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load}, OMP_WAIT_POLICY {wait}")
    machine = describe(jax, jnp, args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still removes its temp dir
    work = Path(tempfile.mkdtemp(prefix="gpt2_jax_peers_"))
    # the libraries' dotfiles (OpenVINO's and ONNX Runtime's telemetry ids, compile caches) go there too
    os.environ.update(HOME=str(work / "home"), XDG_CACHE_HOME=str(work / "home" / ".cache"), HF_HUB_OFFLINE="1")
    workers = []
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from peers_convert import checkpoint

        checkpoint(work / "ckpt")
        c = json.loads((work / "ckpt" / "config.json").read_text())
        L, D, V = c["n_layer"], c["n_embd"], c["vocab_size"]
        matmul = L * 12 * D * D + V * D  # qkv, attention out, MLP in and out, the tied head
        other = L * 13 * D + 2 * D  # biases and LayerNorms, fp32
        rows = [r for r in ROWS if not args.only or r[1] in args.only.split(",")]
        for row in rows:  # conversions one at a time, each with the whole machine
            t = time.perf_counter()
            workers.append(Worker(row, work, args.threads, args.timeout))
            w = workers[-1]
            print(
                f"{w.name}: {'skipped: ' + w.skip if w.skip else w.info} ({time.perf_counter() - t:.0f} s)", flush=True
            )
        results = {}
        errors = logit_errors(workers, args.timeout)
        for B in map(int, args.batches.split(",")):
            live = [w for w in workers if not w.skip]
            tokens, best = {}, {}
            for w in live:  # warm-up (compiles) at both lengths; the long one's tokens for agreement
                w.run(B, 1, args.timeout)
                reply = w.run(B, NEW + 1, args.timeout)
                if reply:
                    tokens[w] = np.array(reply["tokens"])
            for _ in range(args.repeats):
                for w in live:
                    for n in (NEW + 1, 1):
                        time.sleep(0.2)  # the last engine's OpenMP threads stop spinning before the next starts
                        reply = w.run(B, n, args.timeout)
                        if reply:
                            best[w, n] = min(best.get((w, n), np.inf), reply["s"])
            ref = next((tokens.get(w) for w in live if w.engine == "transformers"), None)
            for w in workers:
                if w.skip or (w, 1) not in best or (w, NEW + 1) not in best:
                    continue
                step = (best[w, NEW + 1] - best[w, 1]) / NEW
                kv = 2 * L * B * (PROMPT + NEW) * D * w.kvb
                bound = (matmul * w.bpw + other * 4 + kv) / machine["bandwidth"]
                agree = ""
                if ref is not None and w in tokens:
                    same, first = tokens[w] == ref, (tokens[w] != ref).any(0).argmax()
                    agree = f"{same.sum()}/{same.size}" + ("" if same.all() else f" (first differs at step {first})")
                results[w, B] = dict(step=step, bound=bound, agree=agree)
                print(f"B={B} {w.name:40s} {step * 1e3:7.1f} ms/step | bound {bound * 1e3:5.1f} ms, "
                      f"{step / bound:4.2f}x of bound | tokens equal to transformers' {agree}", flush=True)  # fmt: skip
        prefill = prefill_times(workers, args, 2 * (matmul + other) * args.prefill / machine["flops"])
        table(workers, results, args.batches, errors, prefill)
    finally:
        for w in workers:
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def prefill_times(workers, args, bound: float) -> dict:
    """Best of --repeats of t(one --prefill-token prompt, 1 new) at B=1, workers in turns: {worker: seconds}."""
    if not args.prefill:
        return {}
    live, best = [w for w in workers if not w.skip], {}
    for w in live:
        w.run(1, 1, args.timeout, args.prefill)  # warm-up: compiles, first-touch allocations
    for _ in range(args.repeats):
        for w in live:
            time.sleep(0.2)
            reply = w.run(1, 1, args.timeout, args.prefill)
            if reply:
                best[w] = min(best.get(w, np.inf), reply["s"])
    for w, s in best.items():
        print(f"prefill {args.prefill} + 1 new, B=1, {w.name:40s} {s * 1e3:7.1f} ms | FLOP bound {bound * 1e3:5.1f} ms, "
              f"{s / bound:4.2f}x of bound", flush=True)  # fmt: skip
    return {w: (s, bound) for w, s in best.items()}


def logit_errors(workers, timeout: float) -> dict:
    """Each row's logits after the 8 prompts against the fp32 reference's (transformers', else gpt2_jax fp32's):
    max |dlogit| / max |logit| and mean |dlogit| / mean |logit|, and top-1 agreement."""
    got = {w: w.logits(8, timeout) for w in workers if not w.skip}
    ref = next((got[w] for w in got if w.engine == "transformers" and got[w] is not None), None)
    if ref is None:
        ref = next(
            (got[w] for w in got if w.engine == "gpt2_jax" and w.precision == "fp32" and got[w] is not None), None
        )
    if ref is None:
        return {}
    ref = ref.astype(np.float64)
    out = {}
    for w, x in got.items():
        if x is None or x.shape != ref.shape:
            continue
        d = np.abs(x - ref)
        out[w] = (f"{d.max() / np.abs(ref).max():.2e} / {d.mean() / np.abs(ref).mean():.2e} / "
                  f"{(x.argmax(-1) == ref.argmax(-1)).mean():.0%}")  # fmt: skip
        print(f"{w.name:40s} logit error vs fp32 (max rel / mean rel / top-1): {out[w]}", flush=True)
    return out


def table(workers, results, batches: str, errors: dict, prefill: dict) -> None:
    Bs = list(map(int, batches.split(",")))
    mine = next((w for w in workers if w.label == "gpt2_jax"), None)
    ours = {B: results.get((mine, B), {}).get("step") for B in Bs}
    head = " | ".join(f"B={B} ms/step (of bound) | B={B} vs gpt2_jax" for B in Bs)
    head += " | prefill ms (of FLOP bound) | prefill vs gpt2_jax" if prefill else ""
    print(f"\n| engine | weights | {head} | tokens equal to transformers' (B={', B='.join(map(str, Bs))}) | "
          "logit error vs fp32: max rel / mean rel / top-1 |")  # fmt: skip
    print("| --- | --- |" + " --- | --- |" * (len(Bs) + bool(prefill)) + " --- | --- |")
    for w in workers:
        if w.skip:
            print(f"| {w.label} | {w.precision} | skipped: {w.skip} |")
            continue
        cells, agree = [], []
        for B in Bs:
            r = results.get((w, B))
            if not r:
                cells += ["failed", ""]
                continue
            ratio = f"{r['step'] / ours[B]:.2f}x" if ours.get(B) and w is not mine else ""
            cells += [f"{r['step'] * 1e3:.1f} ({r['step'] / r['bound']:.2f}x)", ratio]
            agree.append(r["agree"] or "-")
        if prefill:  # against gpt2_jax's first row (fp32), as the decode columns
            s, bound = prefill.get(w, (None, None))
            base = prefill.get(mine, (None,))[0]
            ratio = f"{s / base:.2f}x" if s and base and w is not mine else ""
            cells += [f"{s * 1e3:.1f} ({s / bound:.2f}x)" if s else "failed", ratio]
        print(f"| {w.label} | {w.precision} | {' | '.join(cells)} | {'; '.join(agree)} | {errors.get(w, '-')} |")
    print("(vs gpt2_jax: the row's ms/step over gpt2_jax's; above 1.00x gpt2_jax is faster)")
    for w in workers:
        if not w.skip:
            print(f"  {w.name}: {w.info}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, precision, work, threads = sys.argv[2:6]
        os.environ["OMP_NUM_THREADS"] = threads
        worker(engine, precision, Path(work), int(threads))
    else:
        t0 = time.perf_counter()
        main()
        print(f"(bench took {time.perf_counter() - t0:.0f} s)")
