"""Load and convert time and peak memory of gpt2_jax on random gpt2-large / gpt2-xl checkpoints.

    python bench/load.py [--sizes gpt2-large,gpt2-xl] [--cache DIR] [--threads 2] [--repeats 1]

Builds once, under --cache, a random checkpoint per size: a HuggingFace directory (save_pretrained,
safetensors) and a nanoGPT ckpt.pt of the same weights. Then measures, each in a fresh process
(warm page cache: every file is read once before it is timed):
- convert (HF dir -> gpt2_jax dir);
- gpt2_jax.load of the HF dir, the converted dir and the ckpt.pt;
- the converted dir's and the ckpt.pt's loads followed by a sum over every weight: those loads map
  the files (their tensors are stored as params hold them), so the pages are read on first use, and
  these are the rows to set beside the peer's;
- generate (load + 4 tokens, for its peak memory);
- the peer: transformers' from_pretrained plus a first forward pass (its lazy mmap pays for the
  reads there);
- the floor under a loader that copies into a new layout (HF's [in, out] -> [out, in]): allocating
  and populating the weights' bytes of fresh memory, with no reads. In a VM the host backs fresh
  pages on first touch, which can cost more than the copies.
Peak RSS is the process's VmHWM; the baseline is its RSS after its imports. Prints the machine, the
weight bytes and every ratio against the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from timing import peak_rss, rss_now  # bench/timing.py, beside this script

SIZES = {"gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280), "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}
TARGETS = dict(load_s=8.0, convert_s=20.0, rss_ratio=1.25, peer_ratio=1.5)  # gpt2-xl, warm cache


def child(kind: str, path: str, out: str | None) -> dict:
    """One measurement, in this (fresh) process: seconds and peak RSS of `kind` on `path`."""
    import jax
    import numpy as np

    import gpt2_jax
    from gpt2_jax.checkpoints.conversion import convert

    if kind == "peer":
        import torch
        import transformers
    base = rss_now()
    t = time.perf_counter()
    if kind == "load":
        jax.block_until_ready(gpt2_jax.load(path)[0])
    elif kind == "load+read":  # a load that maps the files reads them on first use: pay that here
        params = jax.block_until_ready(gpt2_jax.load(path)[0])
        sum(float(np.asarray(leaf).sum(dtype=np.float32)) for leaf in jax.tree.leaves(params))  # a view on CPU
    elif kind == "fresh":  # the floor under any loader that must write a new layout: memory to hold it
        from gpt2_jax.checkpoints.host_buffers import _allocate

        left, held = (Path(path) / "model.safetensors").stat().st_size, []
        while left > 0:  # gpt2-xl's largest block tensor at a time, allocated as the loaders allocate
            held.append(_allocate((min(left, 40_960_000) // 4,), np.dtype(np.float32)))
            left -= held[-1].nbytes
    elif kind == "convert":
        convert(path, out, force=True)
    elif kind == "generate":
        params, config = gpt2_jax.load(path)
        jax.block_until_ready(gpt2_jax.generate(params, config, [[1, 2, 3, 4]], jax.random.key(0), max_new_tokens=4))
    elif kind == "peer":
        model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]))
    return dict(seconds=time.perf_counter() - t, peak=peak_rss(), base=base)


def run_child(kind: str, path: Path, out: Path | None = None, threads: int = 2, repeats: int = 1) -> dict:
    """`repeats` fresh processes: the shortest time (the machine is shared), the largest peak."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    cmd = [sys.executable, __file__, "--child", kind, str(path)] + ([str(out)] if out else [])
    runs = []
    for _ in range(repeats):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{kind} {path} failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "peak": max(r["peak"] for r in runs)}


def build_hf(dst: Path, shape: dict) -> None:
    import torch
    import transformers

    from gpt2_jax.checkpoints.atomic import atomic_dir

    torch.manual_seed(0)
    with atomic_dir(dst) as tmp:
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).save_pretrained(tmp)


def build_nanogpt(hf_dir: Path, dst: Path, shape: dict) -> None:
    """The HF weights as nanoGPT's train.py saves them: Linear weights [out, in], tied lm_head."""
    import torch
    from safetensors import safe_open

    from gpt2_jax.checkpoints.atomic import atomic_dir

    linears = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        state = {k: (f.get_tensor(k).T.contiguous() if k.endswith(linears) else f.get_tensor(k)) for k in f.keys()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    args = dict(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"], block_size=1024,
                bias=True, vocab_size=50257, dropout=0.0)  # fmt: skip
    with atomic_dir(dst) as tmp:
        torch.save({"model": state, "model_args": args, "iter_num": 0, "best_val_loss": 0.0}, tmp / "ckpt.pt")


def build(cache: Path, size: str) -> Path:
    """cache/size/{hf,nanogpt} once (each in its own process, so this one stays small)."""
    root = cache / size
    for name in ("hf", "nanogpt"):
        if not (root / name).is_dir():
            print(f"building {root / name} ...", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, __file__, "--build", name, str(root), size], check=True)
    return root


def machine(threads: int) -> str:
    import jax
    import jax.numpy as jnp
    from machine import cpu, read_bandwidth  # bench/machine.py, beside this script

    info = cpu()
    flags = " ".join(info["avx512"] + info["amx"]) or "no AVX-512/AMX"
    return (f"{info['model']}, {info['cores']} cores ({threads} threads used by torch), flags: {flags}, "
            f"read bandwidth {read_bandwidth(jax, jnp) / 1e9:.1f} GB/s (jnp.sum over 512 MiB)")  # fmt: skip


def warm(path: Path) -> None:
    """Read every file under path once, so each measurement sees a warm page cache."""
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def measure(root: Path, threads: int, repeats: int) -> list[tuple[str, dict]]:
    hf, nano, converted = root / "hf", root / "nanogpt" / "ckpt.pt", root / "gpt2_jax"
    for p in (hf, nano):
        warm(p)
    rows = [("convert HF dir -> gpt2_jax", run_child("convert", hf, converted, threads, repeats))]
    warm(converted)
    for name, kind, path in [("load HF dir (safetensors)", "load", hf), ("load gpt2_jax dir (orbax)", "load", converted),
                             ("load gpt2_jax dir + read every weight once", "load+read", converted),
                             ("load nanoGPT ckpt.pt", "load", nano),
                             ("load nanoGPT ckpt.pt + read every weight once", "load+read", nano), ("generate (load + 4 tokens)", "generate", hf),
                             ("peer: transformers from_pretrained + forward", "peer", hf),
                             ("floor for a copying load: populate the weights' bytes of fresh memory", "fresh", hf)]:  # fmt: skip
        rows.append((name, run_child(kind, path, threads=threads, repeats=repeats)))
    return rows


def report(size: str, rows: list[tuple[str, dict]], weights: int) -> None:
    peer = next(r["seconds"] for name, r in rows if name.startswith("peer"))
    print(f"\n{size}: {weights / 1e9:.2f} GB of fp32 weights")
    print("| operation | time | peak RSS | peak / weights | (peak - baseline) / weights | time / peer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['seconds']:.1f} s | {r['peak'] / 1e9:.2f} GB | {r['peak'] / weights:.2f}x | "
              f"{(r['peak'] - r['base']) / weights:.2f}x | {r['seconds'] / peer:.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "gpt2_jax" / "bench-load")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per measurement (best time)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], (args.child[2:] or [None])[0])))
        return
    if args.build:
        what, root, size = args.build
        root = Path(root)
        build_hf(root / "hf", SIZES[size]) if what == "hf" else build_nanogpt(
            root / "hf", root / "nanogpt", SIZES[size]
        )
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    print(time.strftime("%Y-%m-%d"), machine(args.threads))
    for size in sizes:
        root = build(args.cache, size)
        weights = (root / "hf" / "model.safetensors").stat().st_size
        report(size, measure(root, args.threads, args.repeats), weights)
    print(f"\ntargets (gpt2-xl): load <= {TARGETS['load_s']} s, convert <= {TARGETS['convert_s']} s, "
          f"peak <= {TARGETS['rss_ratio']}x weights, load <= {TARGETS['peer_ratio']}x the peer")  # fmt: skip


if __name__ == "__main__":
    main()
