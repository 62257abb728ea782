"""docs/design/layout.md, the map a new reader opens first, names every module of the package (and every C++
source of the kernels) under its own folder, and names nothing that is gone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpt2_jax"
SOURCES = ("*.py", "*.h", "*.cc")


def sections() -> dict[str, str]:
    """The tree in layout.md's first code block -> {top-level folder ("" for the root): its lines}."""
    text = (ROOT / "docs/design/layout.md").read_text()
    tree = re.search(r"```\n(gpt2_jax/\n.*?)```", text, re.S)
    assert tree, "docs/design/layout.md has no ``` block starting with gpt2_jax/"
    out, folder = {"": ""}, ""
    for line in tree.group(1).splitlines()[1:]:
        m = re.match(r"  (\w+)/", line)  # a top-level folder sits at two spaces
        if m:
            folder = m.group(1)
            out.setdefault(folder, "")
        out[folder] += line + "\n"
    return out


def modules() -> list[Path]:
    files = {p for pattern in SOURCES for p in PACKAGE.rglob(pattern)}
    return sorted(p.relative_to(PACKAGE) for p in files if "__pycache__" not in p.parts and p.name != "__init__.py")


def test_every_module_is_on_the_map():
    where = sections()
    missing = []
    for rel in modules():
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        if not re.search(rf"(?<![\w.]){re.escape(rel.name)}(?![\w])", where.get(folder, "")):
            missing.append(str(rel))
    assert not missing, f"docs/design/layout.md does not name these modules under their folder: {missing}"


def test_the_map_names_nothing_that_is_gone():
    names = {p.name for p in modules()} | {"__init__.py", "__main__.py"} | {p.name for p in ROOT.iterdir()}
    named = set(re.findall(r"[\w]+\.(?:py|h|cc)\b", "".join(sections().values())))
    assert named <= names, f"docs/design/layout.md names files that do not exist: {sorted(named - names)}"


def test_every_folder_is_on_the_map():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(set(sections()) - {""}) == folders
