"""Reference models for the tests: randomly initialised transformers GPT-2s and checkpoints of them."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers

torch.set_num_threads(2)


def make_hf_model(
    n_layer: int = 2,
    n_head: int = 3,
    n_embd: int = 48,
    vocab_size: int = 101,
    n_positions: int = 64,
    seed: int = 0,
    zero_biases: bool = False,
    **config_kwargs,
) -> transformers.GPT2LMHeadModel:
    """A GPT2LMHeadModel in eval mode whose every parameter, LayerNorms included, is random."""
    config = transformers.GPT2Config(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab_size,
        n_positions=n_positions,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("lm_head"):
                continue  # tied to wte
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") and zero_biases:
                p.zero_()
            else:
                p.copy_(0.1 * torch.randn_like(p))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    return model


def saved_and_loaded(model: transformers.GPT2LMHeadModel, tmp_path_factory) -> tuple:
    """Save the model with save_pretrained and load it back with gpt2_jax -> (model, params, config)."""
    import gpt2_jax

    path = tmp_path_factory.mktemp("m") / "hf"
    model.save_pretrained(path)
    return model, *gpt2_jax.load(path)


def hf_logits(model: transformers.GPT2LMHeadModel, tokens) -> np.ndarray:
    """float32 logits [B, T, V] of a transformers model."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def exact_logits(model: transformers.GPT2LMHeadModel, tokens) -> np.ndarray:
    """float64 logits [B, T, V] of a copy of a transformers model run in float64: the exact answer.

    The fp32 contract is checked against this, not against transformers' own fp32 logits, because
    fp32 results move from CPU to CPU (each library picks kernels per CPU): on one CI machine ours and
    transformers' fp32 were 1.8e-5 apart, on another 4.5e-7. Which side moved is not known (that
    machine was not ours to probe); the float64 answer is the same everywhere, and failures print both.
    """
    import copy

    with torch.no_grad():
        exact = copy.deepcopy(model).double()
        for layer in exact.transformer.h:  # the upcast path insists on float32; in float64 it is the same math
            layer.attn.reorder_and_upcast_attn = False
        return exact(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def rel_err(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def random_tokens(vocab_size: int, shape=(2, 16), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=shape, dtype=np.int32)


_LINEAR = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def save_nanogpt(model: transformers.GPT2LMHeadModel, path: Path, *, bias: bool = True, compiled: bool = True) -> Path:
    """Write the model's weights as nanoGPT's train.py does: ckpt.pt with model_args, nn.Linear
    weights [out, in], the "_orig_mod." prefix of a torch.compile'd model, mask buffers, tied lm_head."""
    c = model.config
    prefix = "_orig_mod." if compiled else ""
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue
        if not bias and name.endswith(".bias"):
            continue
        t = t.clone()
        if name.endswith(_LINEAR):
            t = t.T.contiguous()
        state[prefix + name] = t
    state[prefix + "lm_head.weight"] = state[prefix + "transformer.wte.weight"]
    for i in range(c.n_layer):  # nanoGPT's non-flash causal mask buffer
        state[f"{prefix}transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(c.n_positions, c.n_positions)).view(
            1, 1, c.n_positions, c.n_positions
        )
    model_args = dict(
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions,
        bias=bias, vocab_size=c.vocab_size, dropout=0.0,
    )  # fmt: skip
    ckpt = {"model": state, "optimizer": {}, "model_args": model_args, "iter_num": 0, "best_val_loss": 1.0,
            "config": {"dataset": "shakespeare"}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def hf_state(
    model: transformers.GPT2LMHeadModel, *, prefix: bool = True, lm_head: bool = False, buffers: bool = False
) -> dict[str, torch.Tensor]:
    """The model's tensors as a .bin state dict: with or without "transformer.", the tied lm_head,
    and the legacy attn.bias / attn.masked_bias buffers that old transformers wrote."""
    c = model.config
    state = {}
    for name, t in model.transformer.state_dict().items():
        state[("transformer." if prefix else "") + name] = t.clone()
    if lm_head:
        state["lm_head.weight"] = state[("transformer." if prefix else "") + "wte.weight"]
    if buffers:
        for i in range(c.n_layer):
            p = ("transformer." if prefix else "") + f"h.{i}.attn."
            state[p + "bias"] = torch.tril(torch.ones(c.n_positions, c.n_positions, dtype=torch.bool))[None, None]
            state[p + "masked_bias"] = torch.tensor(-1e4)
    return state


def save_bin_dir(model: transformers.GPT2LMHeadModel, path: Path, **state_kwargs) -> Path:
    """A HuggingFace directory with config.json + pytorch_model.bin (the legacy layout)."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    torch.save(hf_state(model, **state_kwargs), path / "pytorch_model.bin")
    return path


def save_sharded_bin_dir(model: transformers.GPT2LMHeadModel, path: Path, n_shards: int = 3) -> Path:
    """A HuggingFace directory with pytorch_model.bin.index.json and several .bin shards."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    state = hf_state(model, buffers=True)
    names = list(state)
    weight_map = {}
    for s in range(n_shards):
        shard = f"pytorch_model-{s + 1:05d}-of-{n_shards:05d}.bin"
        part = {n: state[n] for n in names[s::n_shards]}
        torch.save(part, path / shard)
        weight_map.update({n: shard for n in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def prepared_text(root: Path) -> Path:
    """Two small plays of random Shakespeare words in root/text, prepared (gpt2_jax.training.data) into root/prepared."""
    from gpt2_jax.training.data import prepare

    (root / "text").mkdir()
    words = "to be or not to be that is the question whether tis nobler in the mind to suffer".split()
    rng = np.random.default_rng(0)
    for i in range(2):
        (root / "text" / f"play{i}.txt").write_text(" ".join(rng.choice(words, 3000)))
    prepare(root / "text", root / "prepared")
    return root / "prepared"


@contextlib.contextmanager
def bounded(seconds: float = 10.0, headroom: int = 1 << 30) -> Iterator[None]:
    """Run the block with the address space capped at its size now plus headroom, so an unbounded
    allocation fails with MemoryError instead of taking the machine's memory, and fail it if it
    outlasts seconds (measured, not interrupted)."""
    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) << 10
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, hard))
    start = time.perf_counter()
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert time.perf_counter() - start < seconds, f"took {time.perf_counter() - start:.1f} s"
