"""nanoGPT checkpoints (ckpt.pt): {"model": state_dict, "model_args": {...}, ...}.

Differences from HuggingFace that matter here:
- nn.Linear stores weights [out, in]; we store [in, out], so they are transposed;
- torch.compile'd models prefix every key with "_orig_mod.";
- the vocab is padded from 50257 to 50304 (a multiple of 64) for speed: the padding rows are
  kept (so shapes match) and marked invalid through GPT2Config.n_valid_tokens;
- GELU is the exact erf form, and `bias=False` models have no Linear or LayerNorm biases.
"""

from __future__ import annotations

from pathlib import Path

from gpt2_jax.checkpoints import torch_files
from gpt2_jax.checkpoints.hf import normalize_keys
from gpt2_jax.checkpoints.lazy import Lazy, transposed
from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError

GPT2_VOCAB = 50257
_LINEARS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


def is_nanogpt(obj: object) -> bool:
    """Does a torch.load result look like a nanoGPT checkpoint?"""
    return isinstance(obj, dict) and "model_args" in obj and "model" in obj


def config_from_args(args: dict, source: str) -> GPT2Config:
    """nanoGPT's model_args -> GPT2Config (exact GELU, the padding rows marked invalid). Values are passed
    on as they are, so GPT2Config rejects a wrong type or range instead of float() or bool() coercing it."""
    if not isinstance(args, dict):
        raise CheckpointError(f"{source}: model_args is a {type(args).__name__}, expected a dict")
    missing = [k for k in _ARGS if k not in args]
    if missing:
        raise CheckpointError(f"{source}: model_args lacks {missing}")
    vocab, dropout = args["vocab_size"], args.get("dropout", 0.0)
    try:
        return GPT2Config(
            vocab_size=vocab, n_positions=args["block_size"], n_embd=args["n_embd"], n_layer=args["n_layer"],
            n_head=args["n_head"], bias=args["bias"], gelu_approximate=False,
            n_valid_tokens=GPT2_VOCAB if isinstance(vocab, int) and vocab == 50304 else None,
            embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout,
        )  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: model_args: {e}") from None


def read_checkpoint(ckpt: dict, path: Path) -> tuple[dict[str, Lazy], GPT2Config]:
    """A torch_load'ed ckpt.pt dict -> (flat lazy tensors in our [in, out] layout, config).
    The Linear weights are read transposed, chunk by chunk, as they are copied into place."""
    config = config_from_args(ckpt["model_args"], str(path))
    state = torch_files.tensors_of(
        ckpt, path, select=lambda c: {k.removeprefix("_orig_mod."): v for k, v in c["model"].items()}
    )
    flat = normalize_keys(state, str(path))
    for name, value in flat.items():
        if name.endswith(_LINEARS):
            if len(value.shape) != 2:
                raise CheckpointError(f"{path}: tensor {name} has shape {value.shape}, expected a 2-D matrix")
            flat[name] = transposed(value)
    return flat, config


def read(path: Path) -> tuple[dict[str, Lazy], GPT2Config]:
    """nanoGPT ckpt.pt -> (flat lazy tensors, config)."""
    ckpt = torch_files.torch_load(path)
    if not is_nanogpt(ckpt):
        raise CheckpointError(f"{path}: not a nanoGPT checkpoint (expected the keys 'model' and 'model_args')")
    return read_checkpoint(ckpt, path)
