"""Every notebook runs top to bottom in a real Jupyter kernel, draws the figures it should, and is stored
without outputs; the shell commands 05 prints parse with the CLI's own argument parsers."""

import shlex
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from gpt2_jax.cli import convert
from gpt2_jax.cli.parser import build_parser

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# image/png outputs each must show: one per plotting cell (a backend switched off draws none).
FIGURES = {"01_architecture": 1, "02_mlp_and_gelu": 2, "03_attention_and_kv_cache": 4, "04_sampling": 2,
           "05_convert_and_generate": 1, "06_training": 1, "07_logits_processors": 7,
           "08_determinism": 3, "09_inside_gpt2": 6, "10_speculative_decoding": 1, "11_rl": 2, "12_flax_nnx": 2,
           "13_beam_search": 3}  # fmt: skip
EXPLAINED = {"01_architecture", "02_mlp_and_gelu", "03_attention_and_kv_cache", "04_sampling"}  # the page inline


def test_there_are_notebooks():
    assert [p.stem for p in NOTEBOOKS][: len(FIGURES)] == list(FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} has stored output"


def printed_commands(nb) -> list[list[str]]:
    """The shell commands a notebook prints ("$ ..." lines), split as a shell would."""
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream")  # fmt: skip
    return [shlex.split(line[2:]) for line in text.splitlines() if line.startswith("$ ")]


def check_parses(argv: list[str]) -> None:
    """argv as pasted into a shell: gpt2-jax ... or python convert/convert_pytorch.py ..."""
    if argv[0] == "gpt2-jax":
        build_parser().parse_args(argv[1:])  # argparse exits (SystemExit) on anything it cannot parse
    else:
        assert argv[0] == "python" and argv[1].endswith("convert/convert_pytorch.py"), argv
        convert.build_parser().parse_args(argv[2:])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) == FIGURES.get(path.stem, len(figures)), f"{path.name} drew {len(figures)} figures"
    pages = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    pages = [p for p in pages if "<iframe srcdoc=" in p and "/v1/explain" in p and "&quot;tokens&quot;:" in p]
    assert len(pages) == (path.stem in EXPLAINED), f"{path.name} shows the explainer {len(pages)} times"
    if path.stem == "05_convert_and_generate":
        commands = printed_commands(nb)
        assert [argv[:2] for argv in commands] == [["python", str(path.parents[1] / "convert" / "convert_pytorch.py")],
                                                   ["gpt2-jax", "generate"]]  # fmt: skip
        for argv in commands:
            check_parses(argv)
        stderr = [o["text"] for o in outputs if o.output_type == "stream" and o.name == "stderr"]
        assert not stderr, stderr  # no progress bars or IProgress warnings
