"""The server's malloc (gpt2_jax.serving.memory): jemalloc where installed, glibc on request, a clear error when
jemalloc is asked for and missing. Seen from outside: the process's own memory map and its start-up line."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpt2_jax.serving import memory

ROOT = Path(__file__).resolve().parents[1]


def start_up(*flags: str) -> tuple[str, str]:
    """Start `gpt2-jax serve`, read stderr up to its malloc line -> (that line, the process's memory map then)."""
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--port", "0", "--max-batch", "2", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        t0 = time.time()
        while time.time() - t0 < 300:
            line = next((x for x in list(lines) if "gpt2-jax serve: malloc: " in x), None)
            if line is not None:
                return line.strip(), Path(f"/proc/{proc.pid}/maps").read_text()
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.1)
        raise AssertionError("no malloc line in 300 s:\n" + "".join(lines))
    finally:
        proc.kill()
        proc.wait(timeout=60)


@pytest.mark.skipif(memory.find_jemalloc() is None, reason="libjemalloc2 is not installed (.ci/run installs it)")
def test_serve_runs_on_jemalloc_where_installed_and_on_glibc_when_asked():
    line, maps = start_up()
    assert line.endswith("malloc: jemalloc"), line
    assert "libjemalloc" in maps  # the same process (same pid), started again with jemalloc preloaded
    line, maps = start_up("--allocator", "glibc")
    assert line.endswith("malloc: glibc"), line
    assert "libjemalloc" not in maps


def test_asking_for_a_missing_jemalloc_is_an_error_naming_the_package(monkeypatch):
    monkeypatch.setattr(memory, "find_jemalloc", lambda: None)
    monkeypatch.setattr(memory, "active_allocator", lambda: "glibc")
    with pytest.raises(FileNotFoundError, match="libjemalloc2"):
        memory.serve_allocator("jemalloc", {})
    env, line = memory.serve_allocator("auto", {})  # auto falls back to glibc, and says how to get jemalloc
    assert env is None and "glibc" in line and "apt install libjemalloc2" in line
