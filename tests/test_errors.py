"""Bad input: each gives a clear error naming the problem, and no partial output."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

import gpt2_jax
from gpt2_jax import CheckpointError, ConfigError, InputError
from tests.reference import (
    bounded,
    hf_state,
    make_hf_model,
    save_bin_dir,
    save_nanogpt,
    save_sharded_bin_dir,
    saved_and_loaded,
)

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16)


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=1, **SHAPE)


@pytest.fixture()
def hf_dir(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def edit(path: Path, **changes) -> Path:
    """A JSON file with some keys changed."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def write_state(hf_dir: Path, state: dict) -> Path:
    (hf_dir / "model.safetensors").unlink()
    safetensors.torch.save_file(state, hf_dir / "model.safetensors")
    return hf_dir


def test_missing_key(model, hf_dir):
    state = hf_state(model)
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(CheckpointError, match=r"model.safetensors: missing tensor\(s\) h.1.mlp.c_fc.bias"):
        gpt2_jax.load(write_state(hf_dir, state))


def test_unexpected_key(model, hf_dir):
    state = hf_state(model)
    state["transformer.h.0.attn.q_proj.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) h.0.attn.q_proj.weight"):
        gpt2_jax.load(write_state(hf_dir, state))


def test_wrong_shape_names_key_and_both_shapes(model, hf_dir):
    state = hf_state(model)
    state["transformer.h.1.attn.c_attn.weight"] = torch.zeros(96, 32)  # transposed
    with pytest.raises(CheckpointError, match=r"h.1.attn.c_attn.weight has shape \(96, 32\), expected \(32, 96\)"):
        gpt2_jax.load(write_state(hf_dir, state))


# A config field at odds with the tensors (the model's n_layer 2, n_embd 32, vocab 50, n_positions 16, F 128):
# each error names the config's file, the field and value, the weight file and the tensor's shape.
DISAGREEING = [
    ("n_layer", 10**9, r"n_layer=1000000000, but \S+ holds 2 blocks"),
    ("n_embd", 64, r"n_embd=64, but \S+ holds wte\.weight of shape \(50, 32\) \(expected \(50, 64\)\)"),
    ("vocab_size", 60, r"vocab_size=60, but \S+ holds wte\.weight of shape \(50, 32\) \(expected \(60, 32\)\)"),
    ("n_positions", 2048, r"n_positions=2048, but \S+ holds wpe\.weight of shape \(16, 32\)"),
    ("n_inner", 100, r"n_inner=100, but \S+ holds h\.0\.mlp\.c_fc\.weight of shape \(32, 128\) \(expected \(32, 100\)\)"),
]  # fmt: skip


def hf_layout(model, root: Path, layout: str) -> tuple[Path, Path]:
    """(the path to load, its config.json) for each HuggingFace layout."""
    if layout == "bin":
        return save_bin_dir(model, root / "hf"), root / "hf" / "config.json"
    if layout == "sharded":
        return save_sharded_bin_dir(model, root / "hf"), root / "hf" / "config.json"
    model.save_pretrained(root / "hf")
    return root / "hf" / ("model.safetensors" if layout == "file" else ""), root / "hf" / "config.json"


@pytest.mark.parametrize("layout", ["safetensors", "bin", "sharded", "file"])
@pytest.mark.parametrize("field,value,says", DISAGREEING)
def test_config_at_odds_with_the_tensors_is_named_before_sizing(model, tmp_path, layout, field, value, says):
    path, config_json = hf_layout(model, tmp_path, layout)
    edit(config_json, **{field: value})
    with bounded(seconds=10), pytest.raises(CheckpointError, match=re.escape(f"{config_json}: ") + says):
        gpt2_jax.load(path)


@pytest.mark.parametrize("field,value,says", [d if d[0] != "n_positions" else ("block_size", *d[1:])
                                              for d in DISAGREEING if d[0] != "n_inner"])  # fmt: skip
def test_nanogpt_model_args_at_odds_with_the_tensors(model, tmp_path, field, value, says):
    path = save_nanogpt(model, tmp_path / "out" / "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_args"][field] = value
    torch.save(ckpt, path)
    with bounded(seconds=10), pytest.raises(CheckpointError, match=re.escape(f"{path} model_args: ") + says):
        gpt2_jax.load(path.parent)


@pytest.mark.parametrize("field,value,says", [
    ("n_layer", 10**9, r"gpt2_jax\.json: n_layer=1000000000, but \S+/params holds 2 layers"),
    ("n_embd", 64, r"gpt2_jax\.json: n_embd=64, but \S+/params holds wte\.weight of shape \(50, 32\)"),
])  # fmt: skip
def test_native_config_at_odds_with_the_tensors(hf_dir, tmp_path, field, value, says):
    gpt2_jax.convert(hf_dir, tmp_path / "native")
    edit(tmp_path / "native" / "gpt2_jax.json", **{field: value})
    with bounded(seconds=10), pytest.raises(CheckpointError, match=says):
        gpt2_jax.load(tmp_path / "native")


@pytest.mark.parametrize("field,value,allowed", [
    ("layer_norm_epsilon", float("nan"), r"a finite number in \(0, 1\), got nan"),
    ("layer_norm_epsilon", -1e-5, r"a finite number in \(0, 1\), got -1e-05"),
    ("layer_norm_epsilon", 0, r"a finite number in \(0, 1\), got 0"),
    ("n_inner", "128", r"an int in \[1, 2147483647\] or None, got '128'"),
    ("eos_token_id", "49", r"an int or None, got '49'"),
    ("scale_attn_weights", "false", r"true or false, got 'false'"),
    ("attn_pdrop", None, r"a dropout rate, in \[0, 1\), got None"),
])  # fmt: skip
def test_config_json_value_out_of_range_names_file_field_and_range(hf_dir, field, value, allowed):
    edit(hf_dir / "config.json", **{field: value})
    with pytest.raises(
        ConfigError, match=re.escape(f"{hf_dir / 'config.json'}: GPT2Config.{field} must be ") + allowed
    ):
        gpt2_jax.load(hf_dir)


def test_untied_lm_head(model, hf_dir):
    state = hf_state(model, lm_head=True)
    state["lm_head.weight"] = state["lm_head.weight"].clone() + 1
    with pytest.raises(CheckpointError, match=r"lm_head\.weight is not tied to wte\.weight"):
        gpt2_jax.load(write_state(hf_dir, state))


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_truncated_file(model, tmp_path, kind):
    if kind == "safetensors":
        path = tmp_path / "model.safetensors"
        safetensors.torch.save_file(hf_state(model), path)
    else:
        path = save_bin_dir(model, tmp_path / "hf") / "pytorch_model.bin"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{path.name}: cannot read"):
        gpt2_jax.load(path)


def test_unknown_format(tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"weights\.txt: unknown checkpoint format"):
        gpt2_jax.load(tmp_path / "weights.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: unknown checkpoint format"):
        gpt2_jax.load(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="nope: no such file or directory"):
        gpt2_jax.load(tmp_path / "nope")


def test_torch_file_that_is_not_a_state_dict(tmp_path):
    torch.save([1, 2, 3], tmp_path / "x.pt")
    with pytest.raises(CheckpointError, match="expected a state dict of tensors"):
        gpt2_jax.load(tmp_path / "x.pt")


@pytest.mark.parametrize("field,value,message", [
    ("activation_function", "relu", "activation_function 'relu' is not supported"),
    ("add_cross_attention", True, "add_cross_attention"),
    ("tie_word_embeddings", False, "tie_word_embeddings=false"),
    ("model_type", "gpt_neo", "model_type 'gpt_neo'"),
])  # fmt: skip
def test_unsupported_config_field(hf_dir, field, value, message):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg[field] = value
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"config.json: {message}"):
        gpt2_jax.load(hf_dir)


def test_weight_files_missing(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has config\.json but none of the weight files"):
        gpt2_jax.load(hf_dir)


def test_cli_error_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "convert" / "convert_pytorch.py"), str(tmp_path / "nope"),
                          str(tmp_path / "dst")], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such file or directory"]


@pytest.fixture(scope="module")
def loaded(model, tmp_path_factory):
    return saved_and_loaded(model, tmp_path_factory)[1:]


@pytest.mark.parametrize("bad", [50, -1, 10**6])
def test_token_outside_vocab(loaded, bad):
    params, config = loaded
    tokens = np.zeros((2, 5), np.int32)
    tokens[1, 3] = bad
    with pytest.raises(InputError, match=rf"token id {bad} at \[1, 3\] is outside the vocab \[0, 50\)"):
        gpt2_jax.forward(params, tokens, config)


def test_sequence_longer_than_context(loaded):
    params, config = loaded
    with pytest.raises(InputError, match="sequence of 17 tokens is longer than the context n_positions=16"):
        gpt2_jax.forward(params, np.zeros((1, 17), np.int32), config)


def test_tokens_wrong_rank_or_dtype(loaded):
    params, config = loaded
    with pytest.raises(InputError, match=r"integer array \[B, T\]"):
        gpt2_jax.forward(params, np.zeros(5, np.int32), config)
    with pytest.raises(InputError, match=r"integer array \[B, T\]"):
        gpt2_jax.forward(params, np.zeros((1, 5), np.float32), config)


def test_bad_id_inside_jit_is_nan_not_plausible(loaded):
    import jax

    params, config = loaded
    # Inside a jit the ids are not known, so nothing can raise: the bad row becomes NaN instead.
    logits = jax.jit(lambda t: gpt2_jax.forward(params, t, config))(np.array([[1, 2, 99], [1, 2, 3]], np.int32))
    assert np.isnan(np.asarray(logits[0])).all() and np.isfinite(np.asarray(logits[1])).all()


def test_bad_dtype_argument(hf_dir):
    with pytest.raises(ConfigError, match="dtype 'float16' is not supported"):
        gpt2_jax.load(hf_dir, dtype="float16")


def test_checkpoint_in_the_old_layout_or_with_a_missing_tensor_says_so(hf_dir, tmp_path):
    from gpt2_jax.checkpoints import native as checkpoint

    params, config = gpt2_jax.load(hf_dir)
    params = gpt2_jax.model.stack_layers(params)
    old = {**params, "h": {**params["h"], "attn": {**params["h"]["attn"], "c_attn": {
        "weight": params["h"]["attn"]["c_attn"]["weight"].transpose(0, 3, 1, 2),  # gpt2_jax 0.2's [L, in, 3, out]
        "bias": params["h"]["attn"]["c_attn"]["bias"]}}}}  # fmt: skip
    checkpoint.save(tmp_path / "old", old, config)
    with pytest.raises(CheckpointError, match=r"old/params: h\.attn\.c_attn\.weight has shape \(2, 32, 3, 32\), "
                                              r"expected \(2, 3, 32, 32\) \(a layout older than gpt2_jax 0\.3: convert "
                                              r"the source checkpoint again\)"):  # fmt: skip
        gpt2_jax.load(tmp_path / "old")
    checkpoint.save(tmp_path / "no_ln_f", {k: v for k, v in params.items() if k != "ln_f"}, config)
    with pytest.raises(CheckpointError, match=r"missing ln_f\.bias, ln_f\.weight for the 2-layer config"):
        gpt2_jax.load(tmp_path / "no_ln_f")
