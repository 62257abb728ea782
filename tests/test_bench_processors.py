"""bench/processors.py --smoke: the per-step processor/constraint bench runs end to end on a tiny model and
prints the machine, every row (with its ratio to plain and its verdict) and the constraints' mask builds."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"\d+(?:\.\d+)?"
ROWS = {  # row name (a regex) -> what follows its ratio
    r"plain \(T=1, top-k 0\)": r"reference; bound .*x of bound",
    r"greedy": r"\(no target\)",
    r"repetition_penalty 1\.2": "penalty",
    r"frequency 0\.5 \+ presence 0\.5": "penalty",
    r"logit_bias \(10 entries\)": "penalty",
    r"no_repeat_ngram_size 3": "penalty",
    r"bad_words_ids \(20 words\)": "penalty",
    r"min_new_tokens \d+ \(EOS banned\)": "penalty",
    r"min_p 0\.05": "penalty",
    r"all of the above together": "penalty",
    r"constraint regex": "constraint",
    r"constraint choice": "constraint",
    r"constraint json_schema": "constraint",
    r"top_logprobs 5": "penalty",
    r"plain, generate's loop": (
        rf"reference; bound .*x of bound; {NUMBER}x decode_step's plain "
        rf"\(best {NUMBER}x; not paired\)"
    ),
    r"stop strings \['\\n\\n'\] \(chunked\)": "penalty",
}
VERDICT = {"penalty": r"target <= 1\.10x: (PASS|MISS)", "constraint": r"target <= 1\.25x: (PASS|MISS)"}


def test_processors_bench_smoke_prints_every_row():
    proc = subprocess.run([sys.executable, "bench/processors.py", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = proc.stdout
    assert re.search(r"^machine: .*, \d+ cores, \d+ threads; AVX-512: .*; AMX: ", out, re.M), out
    assert re.search(rf"^measured: read bandwidth {NUMBER} GB/s, float32 matmul {NUMBER} GFLOP/s", out, re.M), out
    for name, tail in ROWS.items():
        tail = VERDICT.get(tail, tail)
        # name, ms/step median (best), ratio to plain (quartiles; none for a reference), verdict
        row = (rf"^  B=1 {name} +({NUMBER}) \( *({NUMBER})\) ms/step \| +({NUMBER})x plain "
               rf"(?:\({NUMBER}-{NUMBER}\))? *\| {tail}$")  # fmt: skip
        found = re.findall(row, out, re.M)
        assert len(found) == 1, f"row {name!r} missing or repeated:\n{out}"
        assert all(float(x) > 0 for x in found[0][:3])
    for constraint in ("regex", "choice", "json_schema", "json_schema_big"):
        assert re.search(rf"^  mask build {constraint} +cold +{NUMBER} ms \| cached +{NUMBER} us \| Q=\d+ C=\d+ "
                         rf"bucket \d+x\d+x\d+ \| allowed\+advance B=1 \d+ us, B=8 \d+ us", out, re.M), out  # fmt: skip
