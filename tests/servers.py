"""A gpt2-jax server as a test subprocess: `python -m gpt2_jax serve --port 0` on 127.0.0.1, its log kept, stopped
with SIGTERM at the end. Shared by the serving tests."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


class Server:
    """`python -m gpt2_jax serve --port 0` (or `explain`, which also prints the page's URL on stdout) as a
    subprocess; its output lines (stderr merged into stdout) are kept."""

    def __init__(self, cache_dir, args=(), key=None, env=None, command="serve"):
        self.cache_dir, self.proc, self.port, self.lines = cache_dir, None, None, []
        self.args, self.key, self.env, self.command = list(args), key, dict(env or {}), command

    def start(self):
        # The test run's shared cache (tests/run.py) where there is one: servers of several files start the same
        # model with the same widths, so most of their programs are compiled once in the run.
        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(self.cache_dir)
        env = {**os.environ, "GPT2_JAX_COMPILATION_CACHE": cache, **self.env}
        self.port, self.lines, self.ready = None, [], threading.Event()
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "gpt2_jax", self.command, "--port", "0", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line)
            m = re.search(r"gpt2-jax serve: ready on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    def wait(self, timeout=900):
        assert self.ready.wait(timeout), "the server was not ready in time:\n" + "".join(self.lines[-20:])
        assert self.port is not None, "the server exited:\n" + "".join(self.lines[-40:])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "x", max_retries=0, timeout=120)

    def headers(self, extra=None):
        return {**({"authorization": f"Bearer {self.key}"} if self.key else {}), **(extra or {})}

    def get(self, path):
        with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self.headers()), timeout=30) as r:
            return r.status, r.headers, r.read().decode()

    def post(self, path, data: bytes, headers=None):
        headers = self.headers({"content-type": "application/json", **(headers or {})})
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metrics(self):
        out = {}
        for line in self.get("/metrics")[2].splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def log(self):
        return "".join(self.lines)

    def logged(self, pattern, timeout=10):
        """The first match of `pattern` in the log, waiting for it: the server writes its line before the
        response goes out, but this process's reader thread may not have appended it yet."""
        deadline = time.monotonic() + timeout
        while (m := re.search(pattern, self.log())) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return m

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
