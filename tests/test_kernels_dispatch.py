"""The kernels' one dispatch (dispatch.h): what gpt2_jax.kernels.report() and gpt2-jax info say it picks, and
its every path checked in C++ (bench/kernels_check.sh): cpu.cc builds with -Wall -Werror, and every op of
bench/kernels_harness.cc, built under AddressSanitizer and UBSan, gives a plain scalar loop's bits over random
shapes on each instruction-set path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2_jax import kernels
from gpt2_jax.kernels.ffi import int8_isa

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
@pytest.mark.skipif(os.environ.get("GPT2_JAX_KERNELS_CHECKED") == "1", reason="ran as its own CI step (.ci/run)")
@pytest.mark.skipif(kernels.available() is None, reason="the kernels do not run on this machine")
def test_every_kernel_path_gives_the_scalar_bits_under_the_sanitizers():
    run = subprocess.run([str(ROOT / "bench" / "kernels_check.sh")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "cpu.cc builds with -Wall -Werror" in run.stdout
    assert run.stdout.count("every output as the scalar reference") == 4, run.stdout


def test_the_report_names_each_ops_path_at_1_8_and_512_rows():
    report = kernels.report()
    assert report.rows == (1, 8, 512)
    assert set(report.paths) == {"rowdot", "int8", "w8a8", "packed", "chain", "softmax", "argmax", "cumsum"}
    assert all(len(paths) == 3 for paths in report.paths.values())
    text = str(report)
    for op in report.paths:
        assert op in text
    if kernels.available() is None:
        assert set(report.paths["rowdot"]) == {"xla"} and "off" in text
        return
    # The float32 tiles past one row are the instruction set available() names; int8's best is int8_isa()'s.
    assert report.paths["rowdot"][1:] == (kernels.available(),) * 2
    assert report.paths["rowdot"][0] in ("avx2", kernels.available())
    assert report.features["f32"] == kernels.available() and report.features["int8"] == int8_isa()
    assert report.paths["softmax"] == ("avx2",) * 3 and report.paths["cumsum"] == ("scalar",) * 3


def test_the_report_tells_one_row_on_amd_takes_avx2(tmp_path):
    """A B=1 decode on an AMD AVX-512 CPU runs AVX2's 1-row tiles while available() says "avx512": the report,
    read from dispatch.h, says so; forcing AVX-512 (GPT2_JAX_ROWDOT_ISA=avx512) keeps AVX-512 at one row too."""
    if kernels.available() != "avx512" or not kernels.report().features["amd"]:
        pytest.skip("needs an AMD CPU with AVX-512")
    assert kernels.report().paths["rowdot"][0] == "avx2"
    script = "from gpt2_jax import kernels; print(kernels.report().paths['rowdot'][0])"
    env = dict(os.environ, GPT2_JAX_ROWDOT_ISA="avx512", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True, timeout=300
    )
    assert out.stdout.strip() == "avx512"


def test_info_prints_the_version_the_devices_and_the_report(capsys):
    from gpt2_jax.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt2-jax ") and "\ndevices: " in out
    assert str(kernels.report()) in out
