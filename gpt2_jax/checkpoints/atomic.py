"""Writes that land whole or not at all: a temporary sibling directory renamed into place, and the check
that refuses to overwrite without force (every command that writes goes through these)."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gpt2_jax.errors import CheckpointError
from gpt2_jax.model.checks import listing


def check_writable_destination(dst: Path, force: bool, replaces: tuple[str, ...] = ()) -> None:
    """Refuse an existing DST unless force, before any expensive work starts. With force, refuse it
    still unless it is an empty directory or one holding only entries that match replaces (the fnmatch
    patterns of what the writer itself writes): --force replaces a checkpoint, never a folder of other
    things. A mount point cannot be renamed away, so it is refused by name before anything is written."""
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise CheckpointError(f"{dst} already exists; pass --force to overwrite it")
    if os.path.ismount(dst):
        raise CheckpointError(f"{dst} is a mount point, which --force cannot replace; write to a directory inside it")
    if dst.is_symlink() or not dst.is_dir():
        raise CheckpointError(f"{dst} is not a directory; --force replaces only a checkpoint directory")
    try:
        unknown = sorted(e.name for e in dst.iterdir() if not any(fnmatch.fnmatchcase(e.name, p) for p in replaces))
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot list it ({e.strerror or e})") from None
    if unknown:
        raise CheckpointError(f"{dst} holds {listing(unknown)}, which this command never writes; --force replaces "
                              "only its own output or an empty directory: move those away or choose another destination")  # fmt: skip


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
def atomic_dir(dst: Path, force: bool = False, replaces: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces dst in one rename, on any
    failure it is deleted, so dst is either the old content or the complete new one. An OSError
    (a read-only or full disk, a busy directory) becomes a CheckpointError naming dst and the reason.
    With several processes every one enters and gets the same directory; process 0 creates, renames,
    deletes. force and replaces: see check_writable_destination."""
    dst = Path(dst).absolute()
    check_writable_destination(dst, force, replaces)
    lead, tag = _shared_tag()
    tmp = dst.parent / f".{dst.name}.tmp-{tag}"
    try:
        if lead:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        _barrier(f"created {tmp}")
        yield tmp
        _barrier(f"written {tmp}")
        if lead:
            _swap(tmp, dst, dst.parent / f".{dst.name}.old-{tag}")
        _barrier(f"renamed {tmp}")
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(dst) else ""
        raise CheckpointError(f"{dst}: cannot write it: {e.strerror or e}{where}") from e
    finally:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful swap


def _swap(tmp: Path, dst: Path, old: Path) -> None:
    """Rename tmp to dst, an existing dst first moved aside to old and deleted after; if the second
    rename fails, old goes back, so dst is never left missing."""
    if not dst.exists():
        os.rename(tmp, dst)
        return
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except OSError:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
