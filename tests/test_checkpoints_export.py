"""A HuggingFace export opens in transformers as it is: AutoTokenizer (fast and slow) tokenizes exactly as
gpt2_jax's tokenizer, pipeline("text-generation") generates gpt2_jax's greedy text, and generation_config.json
carries the EOS."""

import json

import jax
import pytest

import gpt2_jax
from gpt2_jax.cli.convert import main as convert_main

TEXTS = [
    "Hello world",
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "  leading spaces and\ttabs\n\n  ",
    "naïve café — 你好 🤖 émoji",
    "<|endoftext|>Once upon a time<|endoftext|>",
    "1234567 +-*/ 3.14e-10 0xDEADBEEF",
    "It's we'll they're I'd y'all",
    " " * 7 + "x" + "\n" * 3,
]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    assert convert_main([str(gpt2_jax.BUNDLED_MODEL), str(out), "--to-hf", "--dtype", "float32"]) == 0
    return out


def test_the_export_holds_the_tokenizer_files(export):
    names = {p.name for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"} <= names  # fmt: skip
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 50256
    merges = (export / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[0] == "#version: 0.2" and len(merges) == 1 + 50000 and merges[1] == "Ġ t"  # GPT-2's first merge


@pytest.mark.parametrize("fast", [True, False])
def test_auto_tokenizer_tokenizes_as_gpt2_jax(export, fast):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(export, use_fast=fast)
    enc = gpt2_jax.tokenizer()
    for text in TEXTS:
        ids = enc.encode(text, allowed_special={"<|endoftext|>"})
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids) == text
    assert hf.eos_token_id == 50256 and hf.eos_token == "<|endoftext|>"


def test_pipeline_generates_gpt2_jax_greedy_text(export):
    from transformers import pipeline

    generator = pipeline("text-generation", model=str(export), device="cpu")
    prompt = "ROMEO:\nWhat light"
    theirs = generator(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    params, config = gpt2_jax.load(export)
    ours = gpt2_jax.complete(params, config, prompt, jax.random.key(0), max_new_tokens=12, temperature=0.0)[0]
    assert theirs == prompt + ours.text
