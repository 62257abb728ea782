"""Loader fuzzing: corrupted config.json values, safetensors headers and nanoGPT model_args.

Each corrupted checkpoint must either load (a harmless change) or raise a gpt2_jax error whose
message names a file of the checkpoint; within a few seconds and a bounded address space (see
tests.reference.bounded), and without writing anything. Examples are derandomized, so CI sees the
same ones on every run.
"""

import contextlib
import copy
import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gpt2_jax
from gpt2_jax import GPT2JaxError
from tests.reference import bounded, make_hf_model, save_nanogpt

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=16)
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip

# Values a careless or hostile file may hold: wrong types, out of range, huge, NaN, the model's own sizes +- 1.
SIZES = [2, 16, 32, 100, 128]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 10**9, 2**31, 2**63, 10**30]),
    st.sampled_from([s + d for s in SIZES for d in (-1, 0, 1)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.lists(st.integers(-5, 200), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
CONFIG_KEYS = ["n_layer", "n_embd", "n_head", "n_positions", "n_ctx", "vocab_size", "n_inner", "layer_norm_epsilon",
               "activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "embd_pdrop",
               "attn_pdrop", "resid_pdrop", "eos_token_id", "model_type", "add_cross_attention",
               "tie_word_embeddings"]  # fmt: skip
MODEL_ARGS = ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout"]
DELETE = object()  # a key removed instead of set


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """An HF directory and a nanoGPT out_dir of one tiny model, each loaded once (JAX set up outside the limit)."""
    root = tmp_path_factory.mktemp("fuzz")
    model = make_hf_model(seed=3, **SHAPE)
    model.save_pretrained(root / "hf")
    save_nanogpt(model, root / "nano" / "ckpt.pt")
    for path in (root / "hf", root / "nano"):
        gpt2_jax.load(path)
    return root


@contextlib.contextmanager
def copy_of(src: Path):
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(shutil.copytree(src, Path(tmp) / src.name))


def files(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def loads_or_names_a_file(path: Path, root: Path) -> None:
    """gpt2_jax.load(path) loads, or raises a gpt2_jax error naming a file under root; in under 5 s, within
    768 MiB more address space, writing nothing under root."""
    before = files(root)
    with bounded(seconds=5, headroom=768 << 20):
        try:
            gpt2_jax.load(path)
            event("loaded")
        except GPT2JaxError as e:
            event(type(e).__name__)  # pytest --hypothesis-show-statistics shows how the examples ended
            assert str(root) in str(e), f"the message names no file of the checkpoint: {e}"
    assert files(root) == before


@FUZZ
@given(changes=st.dictionaries(st.sampled_from([*CONFIG_KEYS, "extra"]), st.one_of(st.just(DELETE), VALUES),
                               min_size=1, max_size=3))  # fmt: skip
def test_corrupt_config_values(bases, changes):
    with copy_of(bases / "hf") as hf:
        config = json.loads((hf / "config.json").read_text())
        for key, value in changes.items():
            config.pop(key, None) if value is DELETE else config.__setitem__(key, value)
        (hf / "config.json").write_text(json.dumps(config))  # NaN and Infinity too, as Python writes them
        loads_or_names_a_file(hf, hf)


@FUZZ
@given(data=st.binary(max_size=200), cut=st.integers(0, 2000), keep=st.booleans())
def test_corrupt_config_file(bases, data, cut, keep):
    with copy_of(bases / "hf") as hf:
        text = (hf / "config.json").read_bytes()
        (hf / "config.json").write_bytes(text[:cut] + data if keep else data or b"[" * 100000)
        loads_or_names_a_file(hf, hf)


def header_of(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def mutate_header(header: dict, draw) -> dict | bytes:
    """One corruption of a safetensors header, drawn: a field of one tensor, its name, or the JSON itself."""
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["dtype", "shape", "offsets", "name", "json", "drop"]))
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = draw(st.one_of(st.sampled_from(["F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3",
                                                         "f32", ""]), VALUES))  # fmt: skip
    elif kind == "shape":
        entry["shape"] = draw(st.one_of(st.lists(st.one_of(st.integers(-3, 200), st.sampled_from([2**40, 2**64])),
                                                 max_size=4), VALUES))  # fmt: skip
    elif kind == "offsets":
        entry["data_offsets"] = draw(st.one_of(st.lists(st.integers(-(2**65), 2**65), max_size=3), VALUES))
    elif kind == "name":
        header[draw(st.sampled_from(["h.99999999999999999999.ln_1.weight", "h.7.ln_1.weight", "h.1.mlp.c_fc.weight",
                                     "lm_head.weight", "h.x.ln_1.weight"]))] = header.pop(name)  # fmt: skip
    elif kind == "drop":
        del header[name]
    else:
        text = json.dumps(header).encode()
        at = draw(st.integers(0, len(text) - 1))
        return text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at + 1 :]
    return header


@FUZZ
@given(data=st.data())
def test_corrupt_safetensors_header(bases, data):
    with copy_of(bases / "hf") as hf:
        path = hf / "model.safetensors"
        header, body = header_of(path)
        mutated = mutate_header(header, data.draw)
        text = mutated if isinstance(mutated, bytes) else json.dumps(mutated).encode()
        length = data.draw(st.one_of(st.just(len(text)), st.integers(0, 2**64 - 1)), label="header length")
        path.write_bytes(struct.pack("<Q", length) + text + body)
        loads_or_names_a_file(data.draw(st.sampled_from([hf, path]), label="load"), hf)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from([*MODEL_ARGS, "extra"]), st.one_of(st.just(DELETE), VALUES),
                               min_size=1, max_size=3))  # fmt: skip
def test_corrupt_nanogpt_model_args(bases, changes):
    ckpt = torch.load(bases / "nano" / "ckpt.pt", weights_only=True)
    args = copy.deepcopy(ckpt["model_args"])
    for key, value in changes.items():
        args.pop(key, None) if value is DELETE else args.__setitem__(key, value)
    with copy_of(bases / "nano") as nano:
        torch.save({**ckpt, "model_args": args}, nano / "ckpt.pt")
        loads_or_names_a_file(nano, nano)
