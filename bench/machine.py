"""What every bench prints first: the machine (CPU model, AVX-512/AMX, threads), its measured read
bandwidth and matmul FLOP/s, and which path each kernel takes there (gpt2_jax.kernels.report), so that a
speed number never travels without the machine and the code paths it came from.
(Imported from beside the bench scripts: python bench/<script>.py.)"""

from __future__ import annotations

import os
import platform

from timing import best_of


def cpu() -> dict:
    """CPU model, the AVX-512 / AMX flags present, and the cores this process may use."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    amx = sorted(f for f in flags if f.startswith("amx"))
    return {"model": model, "avx512": avx512, "amx": amx, "cores": len(os.sched_getaffinity(0))}


def read_bandwidth(jax, jnp, mib: int = 512) -> float:
    """Bytes/s of a streaming read through XLA: a sum over a `mib` MiB float32 array, best of 5."""
    x = jnp.ones((mib, 256, 1024), jnp.float32)
    total = jax.jit(lambda a: a.sum())
    total(x).block_until_ready()
    return x.nbytes / best_of(lambda: total(x).block_until_ready(), 5)


def matmul_flops(jax, jnp) -> float:
    """FLOP/s of XLA's float32 matmul at prefill-like sizes: [512, 768] x [3072, 768].T, best of 5."""
    a, b = jnp.ones((512, 768), jnp.float32), jnp.ones((3072, 768), jnp.float32)
    f = jax.jit(lambda a, b: a @ b.T)
    f(a, b).block_until_ready()
    return 2 * 512 * 768 * 3072 / best_of(lambda: f(a, b).block_until_ready(), 5)


def describe(jax, jnp, threads: int) -> dict:
    """Measure, print and return the machine line, then the kernels' report (under "kernels": each op's paths)."""
    from gpt2_jax import kernels

    info = cpu()
    info.update(threads=threads, bandwidth=read_bandwidth(jax, jnp), flops=matmul_flops(jax, jnp))
    print(
        f"machine: {info['model']}, {info['cores']} cores, {threads} threads; "
        f"AVX-512: {' '.join(info['avx512']) or 'no'}; AMX: {' '.join(info['amx']) or 'no'}"
    )
    print(
        f"measured: read bandwidth {info['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
        f"{info['flops'] / 1e9:.0f} GFLOP/s (jax {jax.__version__}, {jax.devices()[0].platform})",
        flush=True,
    )
    report = kernels.report()
    info["kernels"] = report.paths
    print(report, flush=True)
    return info
