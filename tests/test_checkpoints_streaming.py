"""Loading and converting stream tensor by tensor: the model is held once, never twice.

The peak memory is measured in a fresh process, minus that process's RSS after its imports, on a
~420 MB model: a second copy of the weights would show as a ratio near 2. The peak is VmHWM, not
getrusage's ru_maxrss: a child's ru_maxrss starts at its parent's RSS when forked (this pytest
process, holding models), which would hide the child's own peak.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch

import gpt2_jax
from gpt2_jax import CheckpointError
from gpt2_jax.cli.convert import main as convert_main
from tests.reference import hf_logits, hf_state, make_hf_model, random_tokens, rel_err, save_bin_dir, save_nanogpt

BIG = dict(n_layer=4, n_head=16, n_embd=1024, vocab_size=50257, n_positions=1024)
MAX_RATIO = 1.25  # peak RSS above the baseline, over the weight bytes

MEASURE = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, torch
import gpt2_jax
from gpt2_jax.checkpoints.conversion import convert
jnp.zeros(1).block_until_ready()  # the backend's own memory belongs to the baseline
status = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
base = status("VmRSS")
if sys.argv[1] == "load":
    params = gpt2_jax.load(sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else None)[0]
    # read every weight once (on the host: np.asarray of a CPU array is a view): a buffer that is its
    # file's pages (a gpt2_jax dir, a nanoGPT ckpt.pt) is only resident once read
    sum(float(np.asarray(x).sum(dtype=np.float32)) for x in jax.tree.leaves(params))
else:
    convert(sys.argv[2], sys.argv[3])
print(json.dumps(dict(base=base, peak=status("VmHWM"))))
"""


def peak_above_baseline(*args: str) -> int:
    done = subprocess.run([sys.executable, "-c", MEASURE, *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return r["peak"] - r["base"]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ~420 MB fp32 GPT-2 as a HF safetensors dir, a .bin dir, a nanoGPT ckpt.pt and a gpt2_jax dir."""
    root = tmp_path_factory.mktemp("big")
    model = make_hf_model(seed=3, **BIG)
    model.save_pretrained(root / "hf")
    save_bin_dir(model, root / "bin")
    save_nanogpt(model, root / "nano" / "ckpt.pt")
    del model
    assert convert_main([str(root / "hf"), str(root / "jax")]) == 0
    return root, (root / "hf" / "model.safetensors").stat().st_size


@pytest.mark.parametrize("fmt", ["hf", "bin", "nano/ckpt.pt", "jax"])
def test_load_peak_memory_is_the_weights_once(big, fmt):
    root, weights = big
    ratio = peak_above_baseline("load", root / fmt) / weights
    assert ratio <= MAX_RATIO, f"{fmt}: peak RSS above baseline is {ratio:.2f}x the weights"


def test_bfloat16_load_holds_only_the_cast_weights(big):
    root, weights = big
    ratio = peak_above_baseline("load", root / "hf", "bfloat16") / (weights / 2)
    assert ratio <= MAX_RATIO, f"bfloat16 load: peak RSS above baseline is {ratio:.2f}x the bf16 weights"


def test_convert_peak_memory_is_the_weights_once(big, tmp_path):
    root, weights = big
    ratio = peak_above_baseline("convert", root / "hf", tmp_path / "out") / weights
    assert ratio <= MAX_RATIO, f"convert: peak RSS above baseline is {ratio:.2f}x the weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("fmt", ["hf", "jax"])
def test_cast_while_streaming_rounds_as_torch_does(tmp_path, fmt):
    model = make_hf_model(seed=5, n_layer=2, n_head=4, n_embd=64, vocab_size=300, n_positions=32)
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    params, _ = gpt2_jax.load(tmp_path / fmt, dtype="bfloat16")
    full, _ = gpt2_jax.load(tmp_path / fmt)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(full)):
        assert a.dtype == jnp.bfloat16 and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(jnp.bfloat16))
    torch_bf16 = model.transformer.h[1].mlp.c_fc.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(
        np.asarray(params["h"][1]["mlp"]["c_fc"]["weight"], np.float32).T, torch_bf16
    )  # [out, in]


@pytest.mark.parametrize("fmt", ["jax", "nano"])
def test_a_checkpoint_stored_in_the_params_layout_loads_as_its_own_file_pages(tmp_path, fmt):
    """convert writes each leaf as one raw file, and nanoGPT stores every tensor as params hold it
    ([out, in]; c_attn [3D, D] is q | k | v): load maps them (private, copy-on-write) and the params'
    buffers are those pages, with no copy and no memory of their own. Equal to the HF load bit for
    bit, and a jit that donates the params (as the train step does) leaves the files unchanged."""
    model = make_hf_model(seed=11, n_layer=3, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    model.save_pretrained(tmp_path / "hf")
    if fmt == "jax":
        assert convert_main([str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
        files = {p: p.read_bytes() for p in (tmp_path / "jax" / "params").rglob("0*") if p.is_file()}
        assert len(files) == 16, sorted(files)  # one data file per stored leaf: 12 block, wte, wpe, ln_f x2
    else:
        path = save_nanogpt(model, tmp_path / "nano" / "ckpt.pt")
        files = {path: path.read_bytes()}
    params, config = gpt2_jax.load(tmp_path / fmt)
    want, _ = gpt2_jax.load(tmp_path / "hf")
    maps = []  # (start, end, permissions, file) of every file mapping of this process
    for line in open("/proc/self/maps").read().splitlines():
        span, perms, *rest = line.split()
        if len(rest) == 4:
            start, end = (int(x, 16) for x in span.split("-"))
            maps.append((start, end, perms, rest[3]))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
        at = a.unsafe_buffer_pointer()
        home = [(perms, f) for start, end, perms, f in maps if start <= at < end]
        assert len(home) == 1 and home[0][1].startswith(str((tmp_path / fmt).resolve())), (a.shape, home)
        assert home[0][0].endswith("p"), home  # private: writes never reach the file
    doubled = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0)(params)
    np.testing.assert_array_equal(np.asarray(doubled["wte"]), np.asarray(want["wte"]) * 2 + 1)
    assert all(p.read_bytes() == data for p, data in files.items())


def test_a_checkpoint_reads_each_stored_leaf_once(tmp_path, monkeypatch):
    """Where a checkpoint is read rather than mapped (here: cast to bfloat16 on the way), TensorStore
    decodes each stored leaf once. Checkpoints store each block tensor stacked [L, ...] as one chunk;
    per-layer params must come from one read of it (reading it layer by layer decoded the whole chunk
    L times: 236 s for gpt2-xl), and equal the stacked restore's slices bit for bit."""
    from gpt2_jax.checkpoints import native as checkpoint

    model = make_hf_model(seed=4, n_layer=3, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    reads = []
    real = checkpoint._read_shard
    monkeypatch.setattr(checkpoint, "_read_shard", lambda store, *a: reads.append(store.shape) or real(store, *a))
    params, config = gpt2_jax.load(tmp_path / "jax", dtype="bfloat16")
    stored = jax.tree.leaves(gpt2_jax.model.stack_layers(params))
    assert len(reads) == len(stored), f"{len(reads)} reads for {len(stored)} stored leaves"
    stacked, _ = checkpoint.restore(tmp_path / "jax", dtype=jnp.bfloat16, stacked=True)
    for i, layer in enumerate(params["h"]):
        for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(jax.tree.map(lambda x: x[i], stacked["h"]))):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_truncated_orbax_data_is_a_clear_error_and_convert_leaves_nothing(tmp_path):
    model = make_hf_model(seed=6, n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    model.save_pretrained(tmp_path / "hf")
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "jax")]) == 0
    data = max((p for p in (tmp_path / "jax" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"jax/params: cannot restore"):
        gpt2_jax.load(tmp_path / "jax")
    assert convert_main([str(tmp_path / "jax"), str(tmp_path / "out")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "jax"]


def test_a_corrupt_torch_file_is_a_clear_error(tmp_path):
    model = make_hf_model(seed=7, n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    path = save_bin_dir(model, tmp_path / "bin") / "pytorch_model.bin"
    data = bytearray(path.read_bytes())
    data[-200:] = bytes(200)  # the zip's central directory
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot read PyTorch file"):
        gpt2_jax.load(path)


def test_legacy_torch_file_without_zip_still_loads(tmp_path):
    model = make_hf_model(seed=8, n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    path = tmp_path / "legacy.bin"
    torch.save(hf_state(model), path, _use_new_zipfile_serialization=False)  # cannot be memory-mapped
    model.config.to_json_file(tmp_path / "config.json")
    params, config = gpt2_jax.load(path)
    tokens = random_tokens(50, (1, 8))
    assert rel_err(gpt2_jax.forward(params, tokens, config), hf_logits(model, tokens)) <= 1e-5


def test_safetensors_dtype_we_cannot_read_names_the_tensor(tmp_path):
    model = make_hf_model(seed=9, n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16)
    state = hf_state(model)
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"].to(torch.int32)
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor transformer.wpe.weight has dtype I32"):
        gpt2_jax.load(tmp_path / "model.safetensors")


@pytest.mark.parametrize("fmt", ["nano", "bin"])
def test_transposed_and_torch_sources_stream_into_a_mesh(tmp_path, fmt):
    """Each device's shard is read on its own (c_attn's q|k|v split by heads, nanoGPT's transposed
    Linears), and equals the HF safetensors load (parity-tested against transformers)."""
    from gpt2_jax.parallel.sharding import make_mesh, param_shardings

    model = make_hf_model(seed=10, n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16)
    model.save_pretrained(tmp_path / "hf")
    path = save_nanogpt(model, tmp_path / "ckpt.pt") if fmt == "nano" else save_bin_dir(model, tmp_path / "bin")
    want, config = gpt2_jax.load(tmp_path / "hf")
    mesh = make_mesh(2, 4)
    sharded, _ = gpt2_jax.load(path, mesh=mesh)
    for a, b, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(want),
                              jax.tree.leaves(param_shardings(want, config, mesh))):  # fmt: skip
        assert a.sharding == sharding
        assert all(s.data.shape == sharding.shard_shape(a.shape) for s in a.addressable_shards)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
