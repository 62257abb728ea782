"""The README's main command, run twice with a fresh JAX compilation cache: the first run compiles and fills
the cache, the second reads it back. Prints each run's wall time to its first generated token, its total wall
time and the compile time the CLI reports, and this machine's CPU.

    python bench/cli_startup.py [--max-new-tokens 100]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} x {len(names)}" if names else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def run(cache: str, max_new_tokens: int) -> tuple[float, float, float]:
    """(seconds to the first generated character, seconds in all, compile seconds the CLI reports)."""
    cmd = [sys.executable, "-m", "gpt2_jax", "generate", "--prompt", "ROMEO:", "--stream", "--seed", "0",
           "--max-new-tokens", str(max_new_tokens)]  # fmt: skip
    env = {**os.environ, "GPT2_JAX_COMPILATION_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seen, first = b"", None
    while True:
        byte = proc.stdout.read(1)
        if not byte:
            break
        seen += byte
        if first is None and len(seen) > len(b"ROMEO:"):
            first = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    total = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"command failed: {err.strip()}")
    compile_s = float(re.search(r"compile ([\d.]+) s", err).group(1))
    return first if first is not None else total, total, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}; python {platform.python_version()}")
    print(f"command: gpt2-jax generate --prompt ROMEO: --stream --seed 0 --max-new-tokens {args.max_new_tokens}")
    with tempfile.TemporaryDirectory() as cache:
        for name in ("first run (empty cache)", "second run (cache filled)"):
            first, total, compile_s = run(cache, args.max_new_tokens)
            print(f"{name:26s} first token after {first:5.2f} s, done after {total:5.2f} s, compile {compile_s:5.2f} s")


if __name__ == "__main__":
    main()
