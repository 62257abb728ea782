"""A run directory's plumbing, shared by gpt2-jax train and gpt2-jax rl: the --out checks made before anything
is written, the orbax CheckpointManager under out/checkpoints, history.json written atomically, the progress bar."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

from gpt2_jax.errors import GPT2JaxError


def check_writable(out: Path) -> None:
    """Fail, creating nothing, unless out is (or can be created as) a writable directory."""
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise GPT2JaxError(f"--out {out} is not writable ({probe} is not a directory)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise GPT2JaxError(f"--out {out} is not writable (permission denied on {probe})")


def make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GPT2JaxError(f"--out {out} is not writable ({e.strerror})") from None


def checkpoint_manager(out: Path):
    """The orbax CheckpointManager of out/checkpoints (the two latest kept)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(out.absolute() / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2))


def write_json(path: Path, obj: Any) -> None:
    """Atomically, from process 0 only (every process holds the same history)."""
    if jax.process_index() != 0:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def progress_bar(start: int, total: int, enabled: bool):
    from tqdm import tqdm

    enabled = enabled and jax.process_index() == 0
    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)
