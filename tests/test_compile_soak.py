"""A process that compiles ~60 decode programs survives (bench/compile_soak.py, in a subprocess so that a
segfault is a failed test, not a dead runner), and the harness reports a segfault when there is one."""

import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def soak(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/compile_soak.py", "--machine", "off", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_sixty_programs_through_the_engine_and_by_hand_in_one_process():
    # decode_step/prefill lowered by hand and the engine's compile (its compiler thread, while this one generates),
    # on random one-layer configs and buckets, with the tests' 8 devices and the FFI kernels on: seed 4 is three
    # aot buckets and an Engine(max_batch=2, max_seq=64), 65 programs (~40 s of CPU). The long runs that found no
    # segfault in 200-1000 programs are in bench/RESULTS.md, "Compile soak".
    proc = soak("--programs", "60", "--kinds", "aot,engine", "--tiny", "on", "--seed", "4")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert re.search(
        r"^soak: jax .*, 8 devices, kernels \w+, cache off, threads 1, .*kinds aot,engine", proc.stdout, re.M
    )
    survived = re.search(r"^survived: (\d+) programs compiled \(\d+ big, 0 cache hits\) in \d+ s", proc.stdout, re.M)
    assert survived and int(survived[1]) >= 60, proc.stdout[-4000:]
    assert re.search(r"Engine\(max_batch=\d, max_seq=\d+\)\.programs\.compile\(\) \[\d+ programs\]", proc.stdout)
    assert re.search(r"aot decode_step B=\d", proc.stdout)


def test_a_segfault_between_compiles_is_reported_with_the_workload_and_the_python_stack():
    # What the soak is for: a crash must kill the process loudly (SIGSEGV, not exit 0) and say where it was.
    proc = soak("--programs", "1000", "--kinds", "aot", "--tiny", "on", "--segfault-after", "1", timeout=120)
    assert proc.returncode == -signal.SIGSEGV, f"exit {proc.returncode}\n{proc.stdout[-2000:]}"
    assert "survived" not in proc.stdout
    assert re.search(r"^\[ *[\d.]+ s\] w0 +\d+ programs .* aot decode_step B=\d", proc.stdout, re.M)
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert re.search(r'File ".*compile_soak\.py", line \d+ in worker', proc.stderr), proc.stderr[-3000:]
