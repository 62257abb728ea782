"""bench/serve_peers.py's servers: the checkpoint and GGUFs, llama-server's binary, and each server started on a
free 127.0.0.1 port, pinned to the bench's server cores, waited for, and stopped (SIGTERM, then SIGKILL) however
the bench ends. Imported from beside it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_CONCURRENCY, PER_REQUEST = 32, 384  # 256 prompt + 128 new tokens
MODEL = "gpt2-random"


@dataclass
class Setup:
    """What every server start shares: the files, the binary, the cores, and the builds' lines."""

    work: Path
    llama: Path | None
    server_cores: list[int]
    client_cores: list[int]
    llama_threads: int | None = None
    llama_flags: set[str] = field(default_factory=set)
    builds: dict[str, str] = field(default_factory=dict)

    @classmethod
    def prepare(cls, work: Path, args, server_cores: list[int], client_cores: list[int], pairs: list[dict]) -> Setup:
        from peers_convert import checkpoint, gguf_model

        llama = None
        if "llama-server" in args.engines:
            from llama_server import build, version_line

            llama = Path(args.llama_server) if args.llama_server else build()
        setup = cls(work, llama, server_cores, client_cores, args.llama_threads)
        t = time.perf_counter()
        checkpoint(work / "ckpt")
        if llama is not None:
            for q8 in sorted({p["llama-server"] == "q8_0" for p in pairs}):
                gguf_model(work / "ckpt", work, q8)
            setup.llama_flags = _flags(llama)
            setup.builds["llama-server"] = f"{version_line(llama)} ({llama})"
        print(f"random gpt2-small checkpoint and GGUFs in {time.perf_counter() - t:.0f} s", flush=True)
        setup.builds["gpt2_jax"] = _gpt2_jax_line()
        return setup


def _flags(binary: Path) -> set[str]:
    """The long flags this llama-server's --help lists."""
    p = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return {w.rstrip(",") for w in (p.stdout + p.stderr).split() if w.startswith("--")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url_port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Server:
    """One server process: its own session (a Ctrl-C reaches the bench, which stops it), its output in a log."""

    def __init__(self, cmd: list[str], port: int, log: Path, cores: list[int], describe: str, env: dict | None = None):
        self.port, self.log, self.cmd = port, log, cmd
        self.url, self.model, self.eos_field = f"http://127.0.0.1:{port}", MODEL, "logit_bias"
        self.describe = describe + f"; cores {cores}"
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)  # this thread's cores, which the child inherits (no fork-time hook in a
        try:  # process with JAX's threads)
            with open(log, "w") as f:
                self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        finally:
            os.sched_setaffinity(0, mine)

    def tail(self, lines: int = 25) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def wait(self, ready, timeout: float) -> None:
        """Until ready() holds; a server that exits or takes over `timeout` s raises, with its log's tail."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited ({self.proc.returncode}); its log:\n{self.tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                if ready():
                    return
            time.sleep(0.5)
        raise RuntimeError(f"server not ready in {timeout:.0f} s: {' '.join(self.cmd)}\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)  # llama-server waits for its open streams: not for long
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def start_llama(setup: Setup, quant: str):
    """llama-server on the f32 or q8_0 GGUF: --threads for generation and batches, 32 slots of 512 positions."""
    assert setup.llama is not None
    port = free_port()
    gguf = setup.work / f"gpt2-{quant}.gguf"
    t = str(setup.llama_threads or len(setup.server_cores))
    cmd = [str(setup.llama), "-m", str(gguf), "-t", t, "-tb", t, "-np", str(MAX_CONCURRENCY),
           "-c", str(MAX_CONCURRENCY * 512), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL]  # fmt: skip
    cmd += [f for f in ("--no-webui",) if f in setup.llama_flags]
    server = Server(cmd, port, setup.work / f"llama-server-{quant}.log", setup.server_cores, " ".join(cmd[1:]))
    try:
        server.wait(lambda: get(port, "/health")[0] == 200, 300)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def start_gpt2_jax(setup: Setup, dtype: str):
    """gpt2-jax serve: 32 rows, max_seq 384, KV blocks for 32 requests of 384 tokens; ready once /health says no
    program is left compiling, so no compile lands inside a timed level."""
    from gpt2_jax.model.attention import KEY_BLOCK

    port = free_port()
    blocks = MAX_CONCURRENCY * -(-PER_REQUEST // KEY_BLOCK) + 1  # and the null block
    cmd = [sys.executable, "-m", "gpt2_jax", "serve", "--model", str(setup.work / "ckpt"), "--model-name", MODEL,
           "--dtype", dtype, "--port", str(port), "--max-batch", str(MAX_CONCURRENCY), "--max-queue", "256",
           "--max-seq", str(PER_REQUEST), "--num-blocks", str(blocks), "--no-playground", "--shutdown-timeout", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_root()), os.environ.get("PYTHONPATH")]))}
    server = Server(cmd, port, setup.work / f"gpt2_jax-{dtype}.log", setup.server_cores, " ".join(cmd[3:]), env)

    def ready() -> bool:
        status, data = get(port, "/health")
        return status == 200 and not json.loads(data)["compiling"]

    try:
        server.wait(ready, 900)
        server.eos_field = _eos_field(port)
        yield server
    finally:
        server.stop()


def _root() -> Path:
    """The checkout this bench belongs to: its gpt2_jax is the one served."""
    return Path(__file__).resolve().parent.parent


def _gpt2_jax_line() -> str:
    """The served checkout: gpt2_jax's version, its commit (and whether its tree differs from it), its path."""
    from importlib.metadata import version

    git = ["git", "-C", str(_root())]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    state = f"commit {commit}" + (" with local changes" if dirty.stdout.strip() else "") if commit else "no git"
    return f"gpt2-jax {version('gpt2-jax')}, {state} ({_root()})"


def _eos_field(port: int) -> str:
    """`ignore_eos` where this gpt2_jax accepts it, else "logit_bias" (a -100 bias on EOS)."""
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return "ignore_eos" if resp.status == 200 else "logit_bias"
    finally:
        conn.close()
