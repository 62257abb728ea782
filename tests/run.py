"""The test suite, one pytest process per test file, two files at a time: python -m tests.run [pytest args].

Why one process per file: a process holds on to every program it compiled (megabytes each), and XLA's CPU
compiler once segfaulted in a long-lived process that had compiled a few hundred programs (bench/RESULTS.md,
"Compile soak", has the history and bench/compile_soak.py the hunt): in a process of its own, a crash fails
one file instead of the whole run.
Why two at a time: most of the suite's time is XLA compiling small programs, which runs on one core,
so two files side by side use the CI machine's two cores (GPT2_JAX_TEST_JOBS=1 runs them one by one).
The longest files start first. Prints each file's result with its wall time and a closing
'N passed, N failed' line; exits non-zero if any file failed.
Why one compilation cache for the run: many files compile the same programs (the same model widths, the servers'
`--max-batch 4 --max-seq 128` on the bundled model, the notebooks' gpt2-small widths), each in its own process.
Every process of the run, test files, their servers and the notebooks' kernels, reads and writes one JAX persistent
compilation cache in a temporary directory (removed at the end; GPT2_JAX_TEST_CACHE=off runs without it). A program
read back is the one XLA compiled, so the same bits. The cache has no size limit: with one, JAX locks the directory
but also scans every entry on each write, which costs minutes over a run's thousands of programs. Without the lock,
a read that catches another process's write half-done fails to decompress, and JAX compiles that program itself.
JAX reports a program read back as compiled too (jax.monitoring's backend_compile event spans the cache lookup),
so the tests that count compiles count the same.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The longest files (seconds on the 2-core CI machine, one at a time), started first so that no long
# file starts last; the rest follow in name order.
LONGEST = ["test_notebooks.py", "test_soak.py", "test_beam.py", "test_rl_loop.py", "test_sharding.py", "test_sampling.py",
           "test_multihost.py", "test_cli.py", "test_serve.py", "test_serve_chat.py", "test_invariance.py", "test_speculative.py",
           "test_train.py", "test_nnx.py", "test_rl_scoring.py", "test_stops_and_constraints.py", "test_hostile.py"]  # fmt: skip


def order(paths: list[Path]) -> list[Path]:
    rank = {name: i for i, name in enumerate(LONGEST)}
    return sorted(paths, key=lambda p: (rank.get(p.name, len(LONGEST)), p.name))


def run_file(path: Path) -> tuple[Path, subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", str(path), *sys.argv[1:]], capture_output=True, text=True
    )
    return path, run, time.perf_counter() - start


def shared_cache(where: str) -> dict[str, str]:
    """The environment that points every JAX process of the run at one persistent compilation cache, every
    program written (JAX's default skips those compiled in under a second)."""
    return {"JAX_COMPILATION_CACHE_DIR": where, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}  # fmt: skip


def main() -> int:
    if os.environ.get("GPT2_JAX_TEST_CACHE", "").lower() in ("off", "0", "false", "no"):
        return run_all()
    with tempfile.TemporaryDirectory(prefix="gpt2_jax-tests-jax-cache-") as where:
        os.environ.update(shared_cache(where))  # the file processes inherit it
        return run_all()


def run_all() -> int:
    totals = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    bad = []
    start = time.perf_counter()
    jobs = int(os.environ.get("GPT2_JAX_TEST_JOBS", "2"))
    with ThreadPoolExecutor(jobs) as pool:
        for path, run, seconds in pool.map(run_file, order(list(Path(__file__).parent.glob("test_*.py")))):
            last = (run.stdout.strip().splitlines() or [""])[-1]
            counts = {what: int(n) for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
            for what, n in counts.items():
                totals["errors" if what.startswith("error") else what] += n
            print(f"{path.name}: {last} [{seconds:.0f} s]", flush=True)
            if run.returncode not in (0, 5):  # 5: every test deselected
                bad.append(path.name)
                crashed = not (counts.get("failed") or any(k.startswith("error") for k in counts))
                totals["errors"] += 1 if crashed else 0
                print(run.stdout[-6000:] + run.stderr[-3000:], flush=True)
    print(f"{totals['passed']} passed, {totals['failed'] + totals['errors']} failed, {totals['skipped']} skipped "
          f"in {time.perf_counter() - start:.0f} s with {jobs} files at a time")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
