"""HuggingFace GPT-2 checkpoints: config.json <-> GPT2Config, and weight files in and out.

HF stores Conv1D weights [in, out], exactly our layout, so reading is renaming and stacking.
`save_pretrained` prefixes keys with "transformer." and the hub's own gpt2 files do not; the
legacy .bin also holds attn.bias / attn.masked_bias mask buffers, which are not parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from gpt2_jax.checkpoints import lazy, torch_files
from gpt2_jax.checkpoints.lazy import Lazy
from gpt2_jax.config import HF_ACTIVATIONS, PRESETS, GPT2Config, shown
from gpt2_jax.errors import CheckpointError, ConfigError
from gpt2_jax.model.checks import layer_count

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Everything a HuggingFace GPT-2 directory holds that write_dir or save_pretrained write (shards included):
# the entries a directory may hold for convert --force to replace it.
FILES = (
    "config.json", "generation_config.json", *WEIGHT_FILES, "model-*-of-*.safetensors", "pytorch_model-*-of-*.bin",
    "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
)  # fmt: skip
_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")


def config_from_hf(d: dict[str, Any], source: str) -> GPT2Config:
    """A transformers GPT2Config dict -> GPT2Config; fields that change the math and that we do
    not implement are rejected, never ignored. reorder_and_upcast_attn needs nothing: it only
    makes PyTorch compute the scores in float32, which attend() always does. Values are passed on as
    they are, so GPT2Config rejects a wrong type or range instead of float() or bool() coercing it."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object, found {type(d).__name__}")
    if d.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"{source}: model_type {shown(d['model_type'])} is not 'gpt2'")
    act = d.get("activation_function", "gelu_new")
    if not isinstance(act, str) or act not in HF_ACTIVATIONS:
        raise ConfigError(
            f"{source}: activation_function {shown(act)} is not supported; supported: {sorted(HF_ACTIVATIONS)}"
        )
    if d.get("add_cross_attention", False):
        raise ConfigError(f"{source}: add_cross_attention=true (encoder-decoder GPT-2) is not supported")
    if d.get("tie_word_embeddings", True) is False:
        raise ConfigError(f"{source}: tie_word_embeddings=false is not supported; GPT-2's unembedding is wte.T")
    if d.get("n_ctx") not in (None, d.get("n_positions")):
        raise ConfigError(f"{source}: n_ctx={shown(d['n_ctx'])} differs from n_positions={shown(d.get('n_positions'))}")
    try:
        return GPT2Config(
            vocab_size=d.get("vocab_size", 50257),
            n_positions=d.get("n_positions", 1024),
            n_embd=d.get("n_embd", 768),
            n_layer=d.get("n_layer", 12),
            n_head=d.get("n_head", 12),
            n_inner=d.get("n_inner"),
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            gelu_approximate=HF_ACTIVATIONS[act],
            scale_attn_weights=d.get("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=d.get("scale_attn_by_inverse_layer_idx", False),
            embd_pdrop=d.get("embd_pdrop", 0.1),
            attn_pdrop=d.get("attn_pdrop", 0.1),
            resid_pdrop=d.get("resid_pdrop", 0.1),
            eos_token_id=_eos(d.get("eos_token_id", 50256)),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _eos(value: Any) -> Any:
    """config.json's eos_token_id: an int, null, or (newer transformers) a list whose first id we use;
    anything else goes on to GPT2Config, which names it."""
    return value[0] if isinstance(value, list) and value else value


def config_to_hf(config: GPT2Config) -> dict[str, Any]:
    """GPT2Config -> a config.json that transformers.GPT2LMHeadModel.from_pretrained reads."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.n_positions, "n_ctx": config.n_positions,
        "n_embd": config.n_embd, "n_layer": config.n_layer, "n_head": config.n_head, "n_inner": config.n_inner,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": "gelu_new" if config.gelu_approximate else "gelu",
        "scale_attn_weights": config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "embd_pdrop": config.embd_pdrop, "attn_pdrop": config.attn_pdrop, "resid_pdrop": config.resid_pdrop,
        "bos_token_id": 50256, "eos_token_id": config.eos_token_id, "tie_word_embeddings": True,
    }  # fmt: skip


def normalize_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Strip the "transformer." prefix, drop mask buffers, and check-then-drop a tied lm_head
    (arrays or lazy tensors: reading both for the check is the only whole-tensor read)."""
    out = {}
    for key, value in raw.items():
        name = key.removeprefix("transformer.")
        if not _BUFFER.match(name):
            out[name] = value
    head = out.pop("lm_head.weight", None)
    if head is not None:
        wte = out.get("wte.weight")
        if wte is None or head.shape != wte.shape or not np.array_equal(head, wte):
            raise CheckpointError(
                f"{source}: lm_head.weight is not tied to wte.weight (untied output embeddings are not supported)"
            )
    return out


def _read_weight_file(path: Path) -> dict[str, Lazy]:
    if path.suffix == ".safetensors":
        return lazy.safetensors_file(path)
    return torch_files.tensors_of(torch_files.torch_load(path), path)


def read_weights(path: Path) -> dict[str, Lazy]:
    """One weight file or a sharded *.index.json -> {raw key: lazy tensor}; nothing is read yet
    but the headers (a truncated or corrupt file is reported here)."""
    if not path.name.endswith(".index.json"):
        return _read_weight_file(path)
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: not a valid shard index ({type(e).__name__}: {e})") from None
    found: dict[str, Lazy] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path.parent / shard
        if not shard_path.exists():
            raise CheckpointError(f"{path}: shard {shard} listed in the index does not exist")
        found.update(_read_weight_file(shard_path))
    return found


def read_config(path: Path) -> GPT2Config:
    """A HuggingFace config.json -> GPT2Config."""
    try:
        d = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # RecursionError: thousands of nested brackets
        raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    return config_from_hf(d, str(path))


def weight_file(path: Path) -> Path:
    """The weight file (or shard index) of a HuggingFace directory."""
    for name in WEIGHT_FILES:
        if (path / name).exists():
            return path / name
    raise CheckpointError(f"{path}: has config.json but none of the weight files {', '.join(WEIGHT_FILES)}")


def read_dir(path: Path) -> tuple[dict[str, Lazy], GPT2Config]:
    """A HuggingFace GPT-2 directory -> (flat lazy tensors, config)."""
    config = read_config(path / "config.json")
    weights = weight_file(path)
    return normalize_keys(read_weights(weights), str(weights)), config


def infer_config(flat: dict[str, np.ndarray], source: str) -> GPT2Config:
    """Work out a GPT2Config from tensor shapes alone (heads: the preset of that width, else K = 64)."""
    for key in ("wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight"):
        if key not in flat:
            raise CheckpointError(f"{source}: missing tensor {key}, cannot infer the model's shape")
        if len(flat[key].shape) != 2:
            raise CheckpointError(f"{source}: tensor {key} has shape {tuple(flat[key].shape)}, expected a matrix")
    V, D = map(int, flat["wte.weight"].shape)
    heads = {c.n_embd: c.n_head for c in PRESETS.values()}.get(D, max(D // 64, 1))
    F = flat["h.0.mlp.c_fc.weight"].shape[1]
    try:
        return GPT2Config(
            vocab_size=V, n_positions=flat["wpe.weight"].shape[0], n_embd=D, n_layer=layer_count(flat, source),
            n_head=heads, n_inner=None if F == 4 * D else F, bias="ln_f.bias" in flat,
        )  # fmt: skip
    except ConfigError as e:
        raise CheckpointError(f"{source}: the shapes give no valid config ({e})") from None


def write_dir(flat: dict[str, np.ndarray], config: GPT2Config, dst: Path) -> None:
    """Write config.json + model.safetensors, as save_pretrained does (biases zero-filled if absent), and for
    GPT-2's vocabulary its tokenizer files and generation_config.json, so that AutoTokenizer, pipeline and
    lm-eval's hf backend open the directory as it is."""
    import safetensors.numpy

    from gpt2_jax.checkpoints.hf_tokenizer import write_generation_config, write_tokenizer
    from gpt2_jax.model.params import flat_shapes
    from gpt2_jax.tokenizer import tokenizer

    out = {}
    for name, shape in flat_shapes(config.replace(bias=True)).items():
        value = flat.get(name)
        out[f"transformer.{name}"] = np.ascontiguousarray(
            value if value is not None else np.zeros(shape, flat["wte.weight"].dtype)
        )
    (dst / "config.json").write_text(json.dumps(config_to_hf(config), indent=2))
    safetensors.numpy.save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    write_generation_config(dst, config.eos_id)
    enc = tokenizer()
    if config.valid_vocab == enc.n_vocab:  # GPT-2's own 50257 tokens (a test model's small vocab has no tokenizer)
        write_tokenizer(dst, enc, config.n_positions)
