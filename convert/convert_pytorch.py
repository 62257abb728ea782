#!/usr/bin/env python3
"""Convert a PyTorch GPT-2 checkpoint (HuggingFace or nanoGPT) to gpt2_jax's orbax format, or back.

convert/convert_pytorch.py SRC DST [--dtype float32|bfloat16] [--force] [--to-hf]
(or python convert/convert_pytorch.py ...; gpt2-jax convert takes the same arguments)
"""

from gpt2_jax.cli.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
