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


def test_the_public_surface_is_small_and_honest():
    """Each folder's __init__ exports what a user calls: at most 120 names in all the __all__s, each one
    there, and no other public name bound by an __init__ (the folders themselves, modules, aside). Internals are
    imported from their modules, so none is exported to satisfy an import rule."""
    import importlib
    import pkgutil
    import types

    import gpt2_jax

    names, unlisted = 0, []
    packages = [gpt2_jax.__name__] + [m.name for m in pkgutil.walk_packages(gpt2_jax.__path__, "gpt2_jax.") if m.ispkg]
    for name in packages:
        if name == "gpt2_jax.nnx":
            continue  # flax: counted below without importing a second time
        pkg = importlib.import_module(name)
        exported = list(getattr(pkg, "__all__", []))
        names += len(exported)
        assert all(hasattr(pkg, n) for n in exported), (name, [n for n in exported if not hasattr(pkg, n)])
        for n, v in vars(pkg).items():
            if not n.startswith("_") and n not in exported and not isinstance(v, types.ModuleType):
                unlisted.append(f"{name}.{n}")
    names += len(importlib.import_module("gpt2_jax.nnx").__all__)
    assert names <= 120, f"{names} exported names"
    assert not unlisted, f"bound in an __init__ but not in its __all__: {unlisted}"
