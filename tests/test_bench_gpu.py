"""bench/gpu.sh --smoke: the GPU bench script runs end to end on the CPU with a tiny model, checks
greedy tokens against transformers, and prints (last) and writes a complete table."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"\d+(?:\.\d+)?"
# | model | phase | batch | gpt2_jax tok/s | gpt2_jax ms | transformers tok/s | ratio | > transformers |
CELLS = [
    r"(decode|decode int8|prefill \d+)",
    r"(\d+)",
    f"({NUMBER})",
    f"({NUMBER})",
    f"({NUMBER})",
    f"({NUMBER})x",
    "(PASS|MISS)",
]
ROW = re.compile(r"^\| tiny \| " + r" \| ".join(CELLS) + r" \|$", re.M)


def test_gpu_bench_smoke_runs_and_prints_the_table(tmp_path):
    # The venv's python first on PATH, so the script's `python3` is the one with the packages.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "OUT": str(tmp_path)}  # fmt: skip
    proc = subprocess.run(["bash", "bench/gpu.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    out = proc.stdout.rstrip()
    table = out[out.rindex("## gpt2_jax vs transformers") :]  # the last table printed, at the very end
    rows = ROW.findall(table)
    assert sorted((phase, int(b)) for phase, b, *_ in rows) == [
        ("decode", 1), ("decode", 2), ("decode int8", 1), ("prefill 128", 2)
    ], table  # fmt: skip
    for _, _, tok_s, ms, hf_tok_s, ratio, _ in rows:
        assert float(tok_s) > 0 and float(ms) > 0 and float(hf_tok_s) > 0 and float(ratio) > 0
    assert re.search(rf"^- bound tiny: .* = {NUMBER} ms/token; B=1 decode {NUMBER} ms/token = {NUMBER}x the bound",
                     table, re.M), table  # fmt: skip
    assert re.search(rf"^- bound tiny int8: .* = {NUMBER}x the bound$", table, re.M), table
    greedy = r"^- greedy tiny B=1 vs transformers: stacked (\d+)/\1, unstacked \1/\1 tokens agree$"
    assert re.search(greedy, table, re.M), table

    assert (tmp_path / "gpu_bench.md").read_text().strip() == table
    data = json.loads((tmp_path / "gpu_bench.json").read_text())
    (model,) = data["models"]
    assert [(d["phase"], d["batch"]) for d in model["decode"]] == [("decode", 1), ("decode", 2), ("decode int8", 1)]
    assert not model["errors"]
    assert model["bound"]["s_per_token"] > 0 and data["meta"]["bandwidth"]["read_bytes_s"] > 0
