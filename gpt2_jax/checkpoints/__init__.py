"""Weights in and out: every checkpoint format gpt2_jax reads, its own orbax format, conversion, hub ids.

loading.py      load(path): the format detected from the path -> (params, config)
hf.py           HuggingFace directories and weight files (config.json, safetensors, .bin), and writing them
nanogpt.py      nanoGPT's ckpt.pt
native.py       gpt2_jax's own checkpoint: gpt2_jax.json + orbax params, mapped back at disk speed
conversion.py   convert(src, dst): any readable checkpoint -> gpt2_jax or HuggingFace, atomically
hub.py          --model resolution: a path, a hub id (downloaded once, cached converted), the bundled model
lazy.py, torch_files.py   tensors read lazily from mapped safetensors / PyTorch files
streaming.py, host_buffers.py   lazy tensors -> params on device(s) in bounded memory
atomic.py       writes that land whole or not at all
"""

from gpt2_jax.checkpoints.conversion import convert
from gpt2_jax.checkpoints.hub import BUNDLED_MODEL, resolve_model
from gpt2_jax.checkpoints.loading import FORMATS, load

__all__ = ["BUNDLED_MODEL", "FORMATS", "convert", "load", "resolve_model"]
