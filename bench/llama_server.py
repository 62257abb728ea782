"""bench/serve_peers.py's llama-server: built once from the llama.cpp that the pinned llama-cpp-python sdist
vendors (the same llama.cpp bench/peers.py's llama.cpp rows run), cached under
~/.cache/gpt2_jax/llama-server/<version>/, reused when its binary is there. Imported from beside it;
`python bench/llama_server.py` builds (or finds) it and prints its version.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # pyproject's peers extra: llama-cpp-python==0.3.36


class BuildError(RuntimeError):
    """A step of llama-server's build failed; the message names the step, its command and its log's tail."""


def cache_dir(version: str = VERSION) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "gpt2_jax" / "llama-server" / version


def _run(step: str, cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run one build step with its output appended to `log`; a failure raises BuildError with the log's tail."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        code = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise BuildError(f"llama-server build: {step} failed (exit {code}): {' '.join(cmd)}\nlog {log}:\n{tail}")


def _source(cache: Path, version: str, log: Path) -> Path:
    """The sdist's vendored llama.cpp, downloaded and unpacked into the cache once."""
    src = cache / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # the sdist, not a wheel; --no-binary names only it, so that its build backend's own dependencies
        # (needed to read its metadata) come as wheels rather than being built from source too
        _run("pip download", [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python",
                              "--no-deps", "--dest", tmp, f"llama-cpp-python=={version}"], log)  # fmt: skip
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise BuildError(f"llama-server build: expected one llama_cpp_python sdist in {tmp}, found {sdists}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(cache / "src", filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise BuildError(f"llama-server build: the sdist has no vendor/llama.cpp/CMakeLists.txt at {src}")
    return src


def _flags(src: Path) -> list[str]:
    """The cmake options: no web UI, no OpenSSL, native ISA, Release; LLAMA_CURL=OFF where it is still an option
    (later versions list it as deprecated, and warn when it is given)."""
    flags = ["-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF"]  # fmt: skip
    if re.search(r"option\(\s*LLAMA_CURL\b", (src / "CMakeLists.txt").read_text(errors="replace")):
        flags.append("-DLLAMA_CURL=OFF")
    return flags


def build(version: str = VERSION, jobs: int = 2) -> Path:
    """The llama-server binary: the cached one, or built from the sdist (minutes). Raises BuildError."""
    cache = cache_dir(version)
    binary = cache / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"llama-server build needs {tool!r} on PATH (and a C++17 compiler)")
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "build.log"
    src = _source(cache, version, log)
    out = cache / "build"
    _run("cmake configure", ["cmake", "-S", str(src), "-B", str(out), *_flags(src)], log)
    _run("cmake build", ["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)], log)
    built = out / "bin" / "llama-server"
    if not built.exists():
        raise BuildError(f"llama-server build: cmake finished but {built} is missing (log {log})")
    shutil.copy2(built, binary.with_suffix(".tmp"))
    binary.with_suffix(".tmp").rename(binary)  # whole or absent: an interrupted copy is never reused
    return binary


def version_line(binary: Path) -> str:
    """llama-server --version's lines (its build number and commit, compiler, target), joined."""
    p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line.strip() for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return "; ".join(line for line in lines if line.startswith(("version", "built"))) or "; ".join(lines[-2:])


if __name__ == "__main__":
    path = build()
    print(path)
    print(version_line(path))
