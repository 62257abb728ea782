"""Writes (convert, save, data prepare): atomic, --force replaces only the writer's own output, and a
failure leaves the old destination, no temporary directory, and one line naming the path and the reason."""

import errno
import os
import re
from pathlib import Path

import pytest

import gpt2_jax
from gpt2_jax import CheckpointError
from gpt2_jax.cli.convert import main as convert_main
from tests.reference import hf_state, make_hf_model, prepared_text
from tests.test_errors import SHAPE, write_state


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=1, **SHAPE)


@pytest.fixture()
def hf_dir(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_existing_destination_needs_force(hf_dir, tmp_path, capsys):
    dst = tmp_path / "out"
    assert convert_main([str(hf_dir), str(dst)]) == 0
    before = (dst / "gpt2_jax.json").stat().st_mtime_ns
    assert convert_main([str(hf_dir), str(dst)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (dst / "gpt2_jax.json").stat().st_mtime_ns == before
    assert convert_main([str(hf_dir), str(dst), "--force"]) == 0  # a gpt2_jax checkpoint is replaced
    assert convert_main([str(dst), str(hf_dir), "--force", "--to-hf"]) == 0  # and so is a HuggingFace one
    (tmp_path / "empty").mkdir()
    assert convert_main([str(hf_dir), str(tmp_path / "empty"), "--force"]) == 0  # and an empty directory
    gpt2_jax.load(dst), gpt2_jax.load(hf_dir), gpt2_jax.load(tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf", "out"]  # no temporaries left behind


def test_force_refuses_what_is_not_a_checkpoint(hf_dir, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("precious")
    (work / "data").mkdir()
    monkeypatch.chdir(work)
    assert convert_main([str(hf_dir), ".", "--force"]) == 2  # once deleted notes.txt
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {work} holds data, notes.txt, which this command never writes; --force replaces only its own output "
        "or an empty directory: move those away or choose another destination"]  # fmt: skip
    gpt2_jax.convert(hf_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "notes.txt").write_text("precious")  # a checkpoint with something of the user's in it
    (tmp_path / "file").write_text("precious")
    for dst, says in [(tmp_path / "ckpt", "holds notes.txt, which this command never writes"),
                      (tmp_path / "file", "is not a directory; --force replaces only a checkpoint directory")]:  # fmt: skip
        assert convert_main([str(hf_dir), str(dst), "--force", "--to-hf"]) == 2
        assert f"error: {dst} {says}" in capsys.readouterr().err
    assert (work / "notes.txt").read_text() == (tmp_path / "ckpt" / "notes.txt").read_text() == "precious"
    assert (tmp_path / "file").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file", "hf", "work"]


def test_data_prepare_force_replaces_only_prepared_data(tmp_path):
    from gpt2_jax.training.data import prepare

    out = prepared_text(tmp_path)
    prepare(tmp_path / "text", out, force=True)  # prepared data: replaced
    (out / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=r"prepared holds notes\.txt, which this command never writes"):
        prepare(tmp_path / "text", out, force=True)
    assert (out / "notes.txt").read_text() == "precious"


def test_force_on_a_mount_point_is_refused_before_writing(hf_dir, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "mnt"
    dst.mkdir()
    monkeypatch.setattr("os.path.ismount", lambda p: str(p) == str(dst))
    assert convert_main([str(hf_dir), str(dst), "--force"]) == 2
    assert f"error: {dst} is a mount point, which --force cannot replace" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mnt"] and not any(dst.iterdir())


@pytest.mark.parametrize("failing", [1, 2])  # the rename of the old dst away (EBUSY on a mount), or of the new in
def test_busy_rename_leaves_the_old_checkpoint_and_no_temporary(hf_dir, tmp_path, capsys, monkeypatch, failing):
    dst = tmp_path / "out"
    assert convert_main([str(hf_dir), str(dst)]) == 0
    before, _ = sorted(p.relative_to(dst) for p in dst.rglob("*")), capsys.readouterr()
    renames, rename = [], os.rename

    def busy(src, to):  # orbax renames inside the temporary directory too: count only dst's own renames
        if str(dst) in (str(src), str(to)):
            renames.append(src)
            if len(renames) == failing:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        rename(src, to)

    monkeypatch.setattr("gpt2_jax.checkpoints.atomic.os.rename", busy)
    for extra in ([], ["--to-hf"]):
        renames.clear()
        assert convert_main([str(hf_dir), str(dst), "--force", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {dst}: cannot write it: Device or resource busy")
        assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]  # no .tmp-* or .old-* left


def test_read_only_destination_is_a_one_line_error(hf_dir, tmp_path, capsys, monkeypatch):
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.parent == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(Path, "mkdir", read_only)
    for extra in ([], ["--to-hf"]):
        assert convert_main([str(hf_dir), str(tmp_path / "ro" / "out"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.fullmatch(
            re.escape(f"error: {tmp_path / 'ro' / 'out'}: cannot write it: Permission denied (") + r"\S+\.tmp-\w+\)",
            err[0],
        ), err
    assert not any((tmp_path / "ro").iterdir())


def test_failed_conversion_leaves_nothing(model, hf_dir, tmp_path, capsys):
    state = hf_state(model)
    del state["transformer.ln_f.weight"]
    write_state(hf_dir, state)
    for extra in ([], ["--to-hf"]):
        assert convert_main([str(hf_dir), str(tmp_path / "out"), *extra]) == 2
        assert "missing tensor(s) ln_f.weight" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_failure_while_writing_keeps_old_checkpoint(hf_dir, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "out"
    assert convert_main([str(hf_dir), str(dst)]) == 0
    before, _ = sorted(p.relative_to(dst) for p in dst.rglob("*")), capsys.readouterr()

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gpt2_jax.checkpoints.hf.write_dir", boom)
    assert convert_main([str(hf_dir), str(dst), "--force", "--to-hf"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {dst}: cannot write it: No space left on device"]
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
