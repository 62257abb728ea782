"""Writes that land whole or not at all: a temporary sibling directory renamed into place, and the check
that refuses to overwrite without force (every command that writes goes through these)."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gpt2_jax.errors import CheckpointError


def check_writable_destination(dst: Path, force: bool) -> None:
    """Refuse an existing DST unless force, before any expensive work starts."""
    if dst.exists() and not force:
        raise CheckpointError(f"{dst} already exists; pass --force to overwrite it")


def _shared_tag() -> tuple[bool, str]:
    """(is this the process that touches the file system, a random tag every process agrees on).
    One process: (True, a fresh tag). Several (jax.distributed): process 0 leads, its tag broadcast."""
    import jax

    tag = uuid.uuid4().int % 2**31
    if jax.process_count() == 1:
        return True, f"{tag:08x}"
    from jax.experimental import multihost_utils

    return jax.process_index() == 0, f"{int(multihost_utils.broadcast_one_to_all(np.int32(tag))):08x}"


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def atomic_dir(dst: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces dst in one rename, on any
    failure it is deleted, so dst is either the old content or the complete new one. With several
    processes every one enters and gets the same directory; process 0 creates, renames, deletes."""
    dst = Path(dst).absolute()
    check_writable_destination(dst, force)
    lead, tag = _shared_tag()
    tmp = dst.parent / f".{dst.name}.tmp-{tag}"
    if lead:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _barrier(f"created {tmp}")
    try:
        yield tmp
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(f"written {tmp}")
    if lead and dst.exists():
        old = dst.parent / f".{dst.name}.old-{tag}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    elif lead:
        os.rename(tmp, dst)
    _barrier(f"renamed {tmp}")
