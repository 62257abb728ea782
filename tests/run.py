"""The test suite, one pytest process per test file: python -m tests.run [pytest args].

Why: in a single process that has compiled a few hundred programs, XLA's CPU compiler has twice
segfaulted while compiling a decode program that compiles fine in a fresh process (not yet
root-caused, see README "Test"). Each file in its own process keeps that state small. Prints each
file's result with its wall time and a closing 'N passed, N failed' line; exits non-zero if any file failed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

totals = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
bad = []
for path in sorted(Path(__file__).parent.glob("test_*.py")):
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(path), *sys.argv[1:]], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = (run.stdout.strip().splitlines() or [""])[-1]
    counts = {what: int(n) for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    for what, n in counts.items():
        totals["errors" if what.startswith("error") else what] += n
    print(f"{path.name}: {last} [{seconds:.0f} s]", flush=True)
    if run.returncode not in (0, 5):  # 5: every test deselected
        bad.append(path.name)
        totals["errors"] += 0 if counts.get("failed") or any(k.startswith("error") for k in counts) else 1  # a crash
        print(run.stdout[-6000:] + run.stderr[-3000:], flush=True)
print(f"{totals['passed']} passed, {totals['failed'] + totals['errors']} failed, {totals['skipped']} skipped")
sys.exit(1 if bad else 0)
