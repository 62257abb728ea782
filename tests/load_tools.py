"""AIPerf and GuideLLM, the load generators the serving tests drive the server with, each in a virtual environment
of its own under a cache directory, made once and reused: `python -m tests.load_tools` makes them (.ci/run does,
before the tests), and `tool(name)` makes one on first use.

Why not the dev extra: both pin what the project's environment has newer (aiperf: huggingface_hub 1.x, rich,
pandas, pillow, psutil, pyzmq; guidellm: click, multidict), so installed beside gpt2_jax either would downgrade
packages other tests use. Pinned, since the tests read their output files.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# what each environment installs (torch first, pinned: the CPU build; guidellm depends on torch)
PINNED = {"aiperf": ["aiperf==0.13.0"], "guidellm": ["torch==2.13.0", "guidellm==0.8.1"]}


def root() -> Path:
    return Path(os.environ.get("GPT2_JAX_TOOLS", Path.home() / ".cache" / "gpt2_jax" / "tools"))


def tool(name: str) -> list[str]:
    """The command that runs `name` (its environment's python -m name), the environment made first if missing.
    A half-made environment (no .installed marker) is made again; a lock keeps two processes from racing."""
    version = PINNED[name][-1].split("==")[1]
    home = root() / f"{name}-{version}"
    python = home / "bin" / "python"
    if not (home / ".installed").exists():
        root().mkdir(parents=True, exist_ok=True)
        with open(root() / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (home / ".installed").exists():
                shutil.rmtree(home, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
                out = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PINNED[name]],
                                     capture_output=True, text=True)  # fmt: skip
                if out.returncode != 0:
                    raise RuntimeError(
                        f"pip install {' '.join(PINNED[name])} into {home} failed:\n{out.stderr[-3000:]}"
                    )
                (home / ".installed").write_text(" ".join(PINNED[name]) + "\n")
    return [str(python), "-m", name]


if __name__ == "__main__":  # every environment at once: pip mostly waits on downloads and the disk
    with ThreadPoolExecutor() as pool:
        names = sys.argv[1:] or list(PINNED)
        for name, command in zip(names, pool.map(tool, names)):
            print(f"{name}: {' '.join(command)}", flush=True)
