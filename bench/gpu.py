"""GPU speed of gpt2_jax against transformers (PyTorch), measured in one run on the same random weights.

    bash bench/gpu.sh [--models gpt2,gpt2-xl] [--batches 1,8,64] [--budget-s 390]
    bash bench/gpu.sh --smoke          # tiny model on CPU, float32, checks greedy tokens first

Per model (GPT-2 shapes, random weights): transformers builds a GPT2LMHeadModel with its own
random init, casts it to bfloat16 and saves it with save_pretrained; gpt2_jax.load reads that
directory, so both libraries run the very same bf16 weights on the same GPU.

- Decode: 32-token prompts, greedy. Time per step = (t(N) - t(M)) / (N - M) with N = 128 and
  M = 65 new tokens: the prompt pass, host overhead and the first draw cancel, and because both
  counts round up to the same 128-step bucket, one compile serves both (the decode loop stops at
  max_new_tokens at run time). The N run goes first, untimed (the compile, or transformers'
  warm-up, which covers the M run's shapes too), then each is timed best of --repeats.
  tokens/s = B / time per step. transformers: model.generate with
  max_new_tokens = min_new_tokens = n, the same prompts, the same N and M.
- Layout: batch 1 is decoded with stacked params (leaves [L, ...]) and with the per-layer buffers
  load() gives (both run one lax.scan over the layers); the faster one is used for the rest.
- Prefill: 512-token prompts at batch 1 and 8, the time of one generate call with
  max_new_tokens=1 (the prompt pass plus one draw) in both libraries; tokens/s = B * 512 / time.
- Bandwidth: bytes over the best time of a jnp.sum over a 2 GiB float32 array (a streaming read;
  a copy, a + 1, is reported too). The batch-1 bound is weight bytes / bandwidth per token, with
  the measured read bandwidth and with the datasheet figure (4.8 TB/s for an H200). It leaves out
  the KV cache reads, 1.5-2.5% of the weight bytes at batch 1 with 160 slots.
- Targets, printed as PASS/MISS and never asserted: batch-1 decode within 1.5x of the measured
  bound; gpt2_jax ahead of transformers (ratio > 1) at every batch size.

Ratios are gpt2_jax tokens/s over transformers tokens/s (> 1 means gpt2_jax is faster). Progress
lines carry timestamps so that a cut-off run still says something; a markdown table is printed
last (after every model, complete at the end), and written with a JSON of every number to $OUT/
(gpu_bench.md, gpu_bench.json) when OUT is set. On a GPU a failing step is reported and skipped,
and steps stop starting once --budget-s has passed, so a table always comes out.

--smoke: a 2-layer, 64-wide model in float32 with transformers on the CPU (one thread), decode
batches 1 and 2, prefill batch 2, fewer tokens. Before any timing, the greedy tokens of both
layouts must equal transformers' exactly, else it exits non-zero.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback

T0 = time.perf_counter()  # the --budget-s clock (and the log's) starts before the heavy imports

# Before jax is imported: without this JAX grabs 75% of GPU memory up front, and transformers
# runs in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import best_of  # noqa: E402  bench/timing.py, beside this script

import gpt2_jax  # noqa: E402
from gpt2_jax.config import GPT2Config  # noqa: E402
from gpt2_jax.generation.generator import generate  # noqa: E402
from gpt2_jax.model.params import param_bytes, stack_layers, unstack_layers  # noqa: E402
from gpt2_jax.model.precision import quantize_int8  # noqa: E402

DATASHEET_BYTES_S = {"H200": 4.8e12}  # HBM bandwidth by device name fragment
BOUND_TARGET = 1.5  # batch-1 decode within this factor of the measured bandwidth bound
TINY = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256)  # --smoke; vocab 50257

# Defaults of the GPU run, then the --smoke overrides; --base defaults to new // 2 + 1.
GPU = dict(models="gpt2,gpt2-xl", batches="1,8,64", prompt=32, new=128, prefill=512,
           prefill_batches="1,8", repeats=3, bandwidth_mib=2048)  # fmt: skip
# Each (batch, prompt bucket, step bucket) costs a compile of several seconds on a CPU, hence one
# prefill batch in --smoke.
SMOKE = dict(models="tiny", batches="1,2", prompt=32, new=64, prefill=128,
             prefill_batches="2", repeats=2, bandwidth_mib=64)  # fmt: skip


def log(msg: str) -> None:
    """A progress line: seconds since start and wall-clock time, so a partial run is readable."""
    print(f"[{time.perf_counter() - T0:6.1f}s {datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny float32 model on CPU, correctness check first")
    parser.add_argument("--models", help="comma-separated presets (gpt2, gpt2-medium, ...) or 'tiny'")
    parser.add_argument("--batches", help="decode batch sizes, comma-separated")
    parser.add_argument("--prefill-batches", help="prefill batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, help="decode prompt length")
    parser.add_argument("--new", type=int, help="N: new tokens of the long decode run")
    parser.add_argument(
        "--base",
        type=int,
        help="M: new tokens of the short run (default N // 2 + 1: for a "
        "power-of-two N that is N's step bucket, so one compile serves both)",
    )
    parser.add_argument("--prefill", type=int, help="prefill prompt length")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement (best is kept)")
    parser.add_argument("--bandwidth-mib", type=int, help="size of the array read to measure bandwidth")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=390.0,
        help="no new step starts after this many seconds (the table still prints)",
    )
    parser.add_argument("--datasheet-tbps", type=float, help="HBM bandwidth to quote (default: by device name)")
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else GPU).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.base = args.base or args.new // 2 + 1
    args.models = args.models.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill_batches = [int(b) for b in args.prefill_batches.split(",")]
    if not 0 < args.base < args.new:
        parser.error(f"--base must be in [1, --new); got {args.base} and {args.new}")
    return args


class Steps:
    """Runs each measurement step: none starts past the time budget, and on a GPU a step that
    fails is logged and recorded instead of ending the run (in --smoke every error is fatal)."""

    def __init__(self, budget_s: float, strict: bool):
        self.budget_s, self.strict = budget_s, strict

    def run(self, label: str, fn, errors: list[str]):
        if time.perf_counter() - T0 > self.budget_s:
            log(f"skip {label}: past the {self.budget_s:.0f} s budget")
            errors.append(f"{label}: skipped (budget)")
            return None
        try:
            return fn()
        except Exception as e:
            if self.strict:
                raise
            traceback.print_exc()
            log(f"{label} FAILED: {type(e).__name__}: {e}")
            errors.append(f"{label}: {type(e).__name__}: {e}")
            return None


def timed(fn):
    """(seconds, result) of one call: the first call, compile included."""
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def per_step(run, new: int, base: int, repeats: int) -> float:
    """Seconds per decode step: (t(new) - t(base)) / (new - base), both already warm. Only noise (another
    job on the machine) can make t(new) <= t(base): then both are measured again, with more repeats,
    up to three times, before reporting nothing rather than a negative speed."""
    for attempt in range(3):
        t_new = best_of(lambda: run(new), repeats * (attempt + 1))
        t_base = best_of(lambda: run(base), repeats * (attempt + 1))
        if t_new > t_base:
            return (t_new - t_base) / (new - base)
        log(f"warning: t({new}) = {t_new:.4f} s <= t({base}) = {t_base:.4f} s (noise); measuring again")
    return math.nan


def measure_bandwidth(mib: int, repeats: int = 5, calls: int = 10) -> dict:
    """Device memory bandwidth in bytes/s: a streaming read (jnp.sum) and a copy (a + 1, which
    reads and writes every byte) of a mib-MiB float32 array. Calls are queued back to back and
    synced once, so dispatch overhead hides behind the kernels."""
    x = jnp.ones((mib * 256, 1024), jnp.float32)  # mib MiB: 256 rows of 4 KiB per MiB

    def per_call(f) -> float:
        f(x).block_until_ready()

        def burst():
            for _ in range(calls):
                r = f(x)
            r.block_until_ready()

        return best_of(burst, repeats) / calls

    read = x.nbytes / per_call(jax.jit(jnp.sum))
    copy = 2 * x.nbytes / per_call(jax.jit(lambda a: a + 1.0))
    return {"array_bytes": x.nbytes, "read_bytes_s": read, "copy_bytes_s": copy}


def datasheet_bandwidth(device_kind: str, override_tbps: float | None) -> float | None:
    if override_tbps:
        return override_tbps * 1e12
    return next((bw for name, bw in DATASHEET_BYTES_S.items() if name in device_kind), None)


def model_shape(name: str) -> GPT2Config:
    return TINY if name == "tiny" else GPT2Config.preset(name)


def build_models(shape: GPT2Config, torch, transformers, device: str, dtype: str):
    """A random GPT2LMHeadModel of this shape in dtype on device, and the same weights loaded by
    gpt2_jax from its save_pretrained directory -> (hf_model, stacked params, config)."""
    hf_config = transformers.GPT2Config(
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        n_positions=shape.n_positions,
        vocab_size=shape.vocab_size,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU directly: gpt2-xl's 1.5B draws are slow on a CPU
        model = transformers.GPT2LMHeadModel(hf_config)
    model = model.to(getattr(torch, dtype)).eval()
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        params, config = gpt2_jax.load(path, dtype=dtype)
    assert (config.n_layer, config.n_head, config.n_embd) == (shape.n_layer, shape.n_head, shape.n_embd)
    return model, params, config


def ours(params, config: GPT2Config, prompts: list[list[int]]):
    """n -> greedy tokens [B, n] from gpt2_jax.generation.generator on these prompts."""

    def run(n: int) -> np.ndarray:
        return generate(params, config, prompts, jax.random.key(0), max_new_tokens=n, temperature=0.0,
                        eos_id=None).tokens  # fmt: skip

    return run


def theirs(model, torch, prompts: list[list[int]], device: str):
    """n -> greedy tokens [B, n] from transformers' model.generate on these prompts (exactly n).
    Like gpt2_jax.generate, each call moves the prompts to the device itself."""

    def run(n: int) -> np.ndarray:
        ids = torch.as_tensor(prompts, device=device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)  # fmt: skip
        return out[:, ids.shape[1] :].cpu().numpy()  # .cpu() waits for the GPU

    return run


def agreement(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading greedy tokens two [1, n] runs share."""
    differ = np.flatnonzero(a[0] != b[0])
    return int(differ[0]) if differ.size else a.shape[1]


def check_greedy(tokens: dict[str, np.ndarray], hf_tokens: np.ndarray | None, smoke: bool, result: dict) -> None:
    """Greedy tokens of both layouts against transformers'. --smoke (float32): must be equal, else
    exit non-zero. GPU (bf16 on both sides, rounding differs): how long they agree, for the record."""
    n = hf_tokens.shape[1] if hf_tokens is not None else None
    shared = {layout: agreement(t, hf_tokens) for layout, t in tokens.items()} if n else {}
    result["greedy_agreement"] = {"tokens": n, **shared}
    if n:
        log("greedy B=1 vs transformers: " + ", ".join(f"{k} agrees on {v}/{n} tokens" for k, v in shared.items()))
    if smoke and (not n or any(v != n for v in shared.values())):
        for layout, t in tokens.items():
            print(f"  gpt2_jax {layout}: {t[0].tolist()}", file=sys.stderr)
        print(f"  transformers: {None if hf_tokens is None else hf_tokens[0].tolist()}", file=sys.stderr)
        raise SystemExit(f"smoke check FAILED: greedy tokens differ from transformers' ({shared})")


class ModelBench:
    """The measurements of one model, each filling self.result as it goes. gpt2_jax and
    transformers parts run as separate steps, so a transformers failure keeps gpt2_jax's numbers."""

    def __init__(self, name: str, args, steps: Steps, env: dict, config: GPT2Config, hf_model):
        self.name, self.args, self.steps, self.env = name, args, steps, env
        self.config, self.hf_model = config, hf_model
        self.result = {"model": name, "decode": [], "prefill": [], "errors": []}

    def attempt(self, label: str, fn):
        return self.steps.run(f"{self.name}: {label}", fn, self.result["errors"])

    def prompts(self, batch: int, length: int, seed: int) -> list[list[int]]:
        return np.random.default_rng(seed).integers(0, self.config.valid_vocab, (batch, length)).tolist()

    def theirs(self, prompts):
        return theirs(self.hf_model, self.env["torch"], prompts, self.env["torch_device"])

    def hf_per_step(self, prompts) -> float:
        run = self.theirs(prompts)
        run(self.args.new)  # warm up: cuBLAS handles, this batch's shapes
        return per_step(run, self.args.new, self.args.base, self.args.repeats)

    def hf_prefill(self, prompts) -> float:
        run = self.theirs(prompts)
        run(1)  # warm up
        return best_of(lambda: run(1), self.args.repeats)

    def decode_batch1(self, layouts: dict) -> str:
        """Batch-1 decode in both layouts and in transformers; returns the faster layout's name."""
        args = self.args
        prompts = self.prompts(1, args.prompt, seed=1)
        runs = {name: ours(p, self.config, prompts) for name, p in layouts.items()}
        first, tokens = {}, {}
        for name, run in runs.items():  # compile + warm each layout, keeping its tokens for the check
            first[name], tokens[name] = timed(lambda: run(args.new))
            log(f"{self.name}: first call B=1 {name} (compile + {args.new} tokens): {first[name]:.1f} s")
        hf = self.theirs(prompts)
        hf_tokens = self.attempt("transformers B=1 warm-up", lambda: hf(args.new))
        check_greedy(tokens, hf_tokens, args.smoke, self.result)

        step_s = {name: per_step(run, args.new, args.base, args.repeats) for name, run in runs.items()}
        chosen = min(step_s, key=lambda k: (math.isnan(step_s[k]), step_s[k]))
        self.result["layout"] = {**{f"{k}_s_per_step": v for k, v in step_s.items()}, "chosen": chosen}
        log(f"{self.name}: layout B=1 " + ", ".join(f"{k} {v * 1e3:.3f} ms/step" for k, v in step_s.items())
            + f" -> {chosen}")  # fmt: skip
        hf_step = None
        if hf_tokens is not None:
            hf_step = self.attempt("transformers decode B=1", lambda: per_step(hf, args.new, args.base, args.repeats))
        self.add_decode_row(1, step_s[chosen], first[chosen], hf_step)
        return chosen

    def decode(self, params, batch: int) -> None:
        prompts = self.prompts(batch, self.args.prompt, seed=batch)
        run = ours(params, self.config, prompts)
        first, _ = timed(lambda: run(self.args.new))
        step = per_step(run, self.args.new, self.args.base, self.args.repeats)
        hf_step = self.attempt(f"transformers decode B={batch}", lambda: self.hf_per_step(prompts))
        self.add_decode_row(batch, step, first, hf_step)

    def decode_int8(self, params, chosen: str) -> None:
        """Batch-1 decode with int8 weight-only blocks (gpt2_jax.model.precision), against the same
        transformers bf16 run: the bytes per token drop, so the bound does too."""
        q = quantize_int8(params)
        q = unstack_layers(q) if chosen == "unstacked" else stack_layers(q)
        self.result["int8_weight_bytes"] = param_bytes(q)
        prompts = self.prompts(1, self.args.prompt, seed=1)
        run = ours(q, self.config, prompts)
        first, _ = timed(lambda: run(self.args.new))
        step = per_step(run, self.args.new, self.args.base, self.args.repeats)
        hf = next((d["hf_s_per_step"] for d in self.result["decode"] if d["batch"] == 1), None)
        self.add_decode_row(1, step, first, hf, phase="decode int8")

    def add_decode_row(
        self, batch: int, step: float, first: float, hf_step: float | None, phase: str = "decode"
    ) -> None:
        hf_step = math.nan if hf_step is None else hf_step
        row = {"batch": batch, "phase": phase, "s_per_step": step, "tok_s": batch / step, "first_call_s": first,
               "hf_s_per_step": hf_step, "hf_tok_s": batch / hf_step, "ratio": hf_step / step}  # fmt: skip
        self.result["decode"].append(row)
        log(f"{self.name}: {phase} B={batch} gpt2_jax {step * 1e3:.3f} ms/step ({row['tok_s']:.1f} tok/s, first call "
            f"{first:.1f} s) | transformers {hf_step * 1e3:.3f} ms/step ({row['hf_tok_s']:.1f} tok/s) | "
            f"ratio {row['ratio']:.2f}x")  # fmt: skip

    def prefill(self, params, batch: int) -> None:
        """One generate call with max_new_tokens=1 (the prompt pass plus one draw), both libraries."""
        args = self.args
        prompts = self.prompts(batch, args.prefill, seed=100 + batch)
        run = ours(params, self.config, prompts)
        first, _ = timed(lambda: run(1))
        t = best_of(lambda: run(1), args.repeats)
        hf_t = self.attempt(f"transformers prefill B={batch}", lambda: self.hf_prefill(prompts))
        hf_t = math.nan if hf_t is None else hf_t
        tokens = batch * args.prefill
        row = {"batch": batch, "prompt": args.prefill, "s": t, "tok_s": tokens / t, "first_call_s": first,
               "hf_s": hf_t, "hf_tok_s": tokens / hf_t, "ratio": hf_t / t}  # fmt: skip
        self.result["prefill"].append(row)
        log(f"{self.name}: prefill {args.prefill} B={batch} gpt2_jax {t * 1e3:.2f} ms ({row['tok_s']:.0f} tok/s, "
            f"first call {first:.1f} s) | transformers {hf_t * 1e3:.2f} ms ({row['hf_tok_s']:.0f} tok/s) | "
            f"ratio {row['ratio']:.2f}x")  # fmt: skip

    def run_all(self, params) -> None:
        """Batch 1 picks the layout; the other batch sizes and prefill use it."""
        layouts = {
            "stacked": self.attempt("stack layers", lambda: stack_layers(params)),
            "unstacked": unstack_layers(params),
        }
        layouts = {name: p for name, p in layouts.items() if p is not None}
        del params
        chosen = self.attempt("decode B=1", lambda: self.decode_batch1(layouts))
        params = layouts[chosen] if chosen else layouts.get("unstacked", layouts["stacked"])
        layouts.clear()  # frees the slower layout's device buffers
        for batch in self.args.batches:
            if batch != 1:
                self.attempt(f"decode B={batch}", lambda: self.decode(params, batch))
        for batch in self.args.prefill_batches:
            self.attempt(f"prefill B={batch}", lambda: self.prefill(params, batch))
        self.attempt("decode int8 B=1", lambda: self.decode_int8(params, chosen or "unstacked"))


def bandwidth_bound(result: dict, bandwidth: dict | None) -> None:
    """Batch-1 decode against weight bytes / bandwidth (every weight is read once per token)."""
    row = next((r for r in result["decode"] if r["batch"] == 1 and r["phase"] == "decode"), None)
    if not bandwidth or row is None:
        return
    bound = result["weight_bytes"] / bandwidth["read_bytes_s"]
    sheet = bandwidth["datasheet_bytes_s"]
    result["bound"] = {
        "s_per_token": bound, "ratio": row["s_per_step"] / bound,
        "datasheet_s_per_token": result["weight_bytes"] / sheet if sheet else None,
        "datasheet_ratio": row["s_per_step"] * sheet / result["weight_bytes"] if sheet else None,
    }  # fmt: skip
    int8 = next((r for r in result["decode"] if r["phase"] == "decode int8"), None)
    if int8 is not None:
        result["int8_bound"] = {
            "s_per_token": result["int8_weight_bytes"] / bandwidth["read_bytes_s"],
            "ratio": int8["s_per_step"] * bandwidth["read_bytes_s"] / result["int8_weight_bytes"],
        }


def bench_model(name: str, args, steps: Steps, env: dict, bandwidth: dict | None) -> dict:
    """Build one model in both libraries, measure everything, free it; returns its result dict."""
    errors: list[str] = []
    built = steps.run(
        f"{name}: build",
        lambda: build_models(model_shape(name), env["torch"], env["transformers"], env["torch_device"], env["dtype"]),
        errors,
    )
    if built is None:
        return {"model": name, "decode": [], "prefill": [], "errors": errors}
    model, params, config = built
    bench = ModelBench(name, args, steps, env, config, model)
    result = bench.result
    result.update(config=config.to_dict(), weight_bytes=param_bytes(params), dtype=env["dtype"])
    log(
        f"{name}: built ({result['weight_bytes'] / 1e6:.0f} MB of {env['dtype']} weights, "
        f"{config.n_layer} layers, {config.n_head} heads, width {config.n_embd})"
    )
    bench.run_all(params)
    bandwidth_bound(result, bandwidth)
    del bench, model, params
    gc.collect()  # the next model starts with this one's host and device memory freed
    if env["torch_device"] == "cuda":
        env["torch"].cuda.empty_cache()
    return result


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}{suffix}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def table(meta: dict, results: list[dict]) -> str:
    """The markdown summary: header lines, one row per (model, phase, batch), then per-model lines."""
    bw = meta.get("bandwidth")
    lines = [
        f"## gpt2_jax vs transformers: {meta['date']}",
        f"device: {meta['device']} ({meta['backend']}) | jax {meta['jax']} | torch {meta['torch']} | "
        f"transformers {meta['transformers']} | {meta['dtype']} random weights",
    ]
    if bw:
        lines.append(
            f"bandwidth: read {bw['read_bytes_s'] / 1e12:.3f} TB/s measured (jnp.sum over "
            f"{bw['array_bytes'] / 2**30:.2f} GiB), copy {bw['copy_bytes_s'] / 1e12:.3f} TB/s, datasheet "
            f"{fmt(bw['datasheet_bytes_s'] and bw['datasheet_bytes_s'] / 1e12, '.2f', ' TB/s')}"
        )
    a = meta["args"]
    lines += [
        f"decode: greedy, {a['prompt']}-token prompts, ms/step = (t({a['new']} new) - t({a['base']} new)) / "
        f"{a['new'] - a['base']}; prefill: one generate call, 1 new token; ratio = gpt2_jax tok/s / transformers "
        f"tok/s; best of {a['repeats']}",
        "",
        "| model | phase | batch | gpt2_jax tok/s | gpt2_jax ms | transformers tok/s | ratio | > transformers |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for d in r["decode"]:
            ok = d["ratio"] > 1 if math.isfinite(d["ratio"]) else None
            lines.append(f"| {r['model']} | {d['phase']} | {d['batch']} | {fmt(d['tok_s'], '.1f')} | "
                         f"{fmt(d['s_per_step'] * 1e3, '.3f')} | {fmt(d['hf_tok_s'], '.1f')} | "
                         f"{fmt(d['ratio'], '.2f', 'x')} | {verdict(ok)} |")  # fmt: skip
        for p in r["prefill"]:
            ok = p["ratio"] > 1 if math.isfinite(p["ratio"]) else None
            lines.append(f"| {r['model']} | prefill {p['prompt']} | {p['batch']} | {fmt(p['tok_s'], '.0f')} | "
                         f"{fmt(p['s'] * 1e3, '.2f')} | {fmt(p['hf_tok_s'], '.0f')} | "
                         f"{fmt(p['ratio'], '.2f', 'x')} | {verdict(ok)} |")  # fmt: skip
    lines.append("")
    for r in results:
        lines += model_lines(r)
    lines += [f"- error {e}" for e in meta["errors"]]
    if any(r["decode"] for r in results):
        faster = [d["ratio"] > 1 for r in results for d in r["decode"] if math.isfinite(d["ratio"])]
        lines.append(f"- target ahead of transformers at every decode batch size: "
                     f"{verdict(all(faster) if faster else None)}")  # fmt: skip
    return "\n".join(lines)


def model_lines(r: dict) -> list[str]:
    """Layout choice, bandwidth bound, greedy agreement and errors of one model, as bullet lines."""
    out = []
    lay = r.get("layout")
    if lay:
        times = [f"{k.removesuffix('_s_per_step')} {fmt(v * 1e3, '.3f')} ms/step" for k, v in lay.items()
                 if k.endswith("_s_per_step")]  # fmt: skip
        out.append(f"- layout {r['model']} B=1: {', '.join(times)} -> {lay['chosen']}")
    b = r.get("bound")
    if b:
        ms = b["s_per_token"] * 1e3
        measured = next(d for d in r["decode"] if d["batch"] == 1 and d["phase"] == "decode")["s_per_step"] * 1e3
        sheet = (f" (datasheet bandwidth: {b['datasheet_s_per_token'] * 1e3:.3f} ms, {b['datasheet_ratio']:.2f}x)"
                 if b["datasheet_s_per_token"] else "")  # fmt: skip
        ok = b["ratio"] <= BOUND_TARGET if math.isfinite(b["ratio"]) else None
        out.append(f"- bound {r['model']}: {r['weight_bytes'] / 1e9:.3f} GB weights / measured bandwidth = "
                   f"{ms:.3f} ms/token; B=1 decode {fmt(measured, '.3f')} ms/token = {fmt(b['ratio'], '.2f')}x "
                   f"the bound{sheet}; target <= {BOUND_TARGET}x: {verdict(ok)}")  # fmt: skip
    b8 = r.get("int8_bound")
    if b8:
        out.append(
            f"- bound {r['model']} int8: {r['int8_weight_bytes'] / 1e9:.3f} GB weights / measured bandwidth = "
            f"{b8['s_per_token'] * 1e3:.3f} ms/token; int8 B=1 decode = {fmt(b8['ratio'], '.2f')}x the bound"
        )
    g = r.get("greedy_agreement")
    if g and g["tokens"]:
        note = " (bf16 rounding differs: informational)" if r["dtype"] == "bfloat16" else ""
        out.append(f"- greedy {r['model']} B=1 vs transformers: "
                   + ", ".join(f"{k} {v}/{g['tokens']}" for k, v in g.items() if k != "tokens")
                   + f" tokens agree{note}")  # fmt: skip
    out += [f"- error {e}" for e in r["errors"]]
    return out


def write_outputs(markdown: str, data: dict) -> None:
    """$OUT/gpu_bench.md and $OUT/gpu_bench.json, when OUT is set."""
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_bench.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(finite(data), f, indent=2)


def finite(x):
    """NaN and infinities (a missing measurement) -> None, so the JSON is strict."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def runtime(args) -> dict:
    """Backend, torch and the device both libraries use. JAX's backend starts first, so its CUDA
    libraries load before torch's (JAX checks their versions; torch does not)."""
    backend = jax.default_backend()
    if not args.smoke and backend != "gpu":
        raise SystemExit(f"JAX's backend is {backend!r}, not gpu: run bench/gpu.sh on a GPU, or pass --smoke")
    if args.smoke:
        # float32 tokens must equal transformers' exactly; GPUs would otherwise use reduced precision.
        jax.config.update("jax_default_matmul_precision", "highest")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's shard bar would clutter the log
    torch_device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)  # a 64-wide model gains nothing from more, and XLA needs the cores too
    if torch_device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device; transformers cannot run on the GPU")
    return {"torch": torch, "transformers": transformers, "torch_device": torch_device,
            "dtype": "float32" if args.smoke else "bfloat16", "backend": backend}  # fmt: skip


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = runtime(args)
    device = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": getattr(device, "device_kind", device.platform), "backend": env["backend"],
        "jax": jax.__version__, "torch": env["torch"].__version__, "transformers": env["transformers"].__version__,
        "dtype": env["dtype"], "args": dict(vars(args)),
    }  # fmt: skip
    log(
        f"{meta['device']}: jax {meta['jax']}, torch {meta['torch']}, transformers {meta['transformers']}; "
        f"models {args.models}, batches {args.batches}, N={args.new}, M={args.base}, budget {args.budget_s:.0f} s"
    )
    steps = Steps(args.budget_s, strict=args.smoke)
    meta_errors: list[str] = []
    bandwidth = steps.run("bandwidth", lambda: measure_bandwidth(args.bandwidth_mib), meta_errors)
    if bandwidth:
        bandwidth["datasheet_bytes_s"] = datasheet_bandwidth(meta["device"], args.datasheet_tbps)
        meta["bandwidth"] = bandwidth
        log(
            f"bandwidth: read {bandwidth['read_bytes_s'] / 1e9:.1f} GB/s, "
            f"copy {bandwidth['copy_bytes_s'] / 1e9:.1f} GB/s"
        )
    meta["errors"] = meta_errors

    results = []
    for name in args.models:
        results.append(bench_model(name, args, steps, env, bandwidth))
        markdown = table(meta, results)
        write_outputs(markdown, {"meta": meta, "models": results})
        print("\n" + markdown, flush=True)  # after every model; the last one, printed last, is complete


if __name__ == "__main__":
    main(sys.argv[1:])
