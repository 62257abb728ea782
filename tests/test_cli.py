"""The gpt2-jax command line: generate (plain, streamed, stdin, samples), hub ids, convert, one-line errors,
seeds, --help defaults, the persistent compilation cache."""

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import gpt2_jax
from gpt2_jax.checkpoints import hub
from gpt2_jax.cli import main
from gpt2_jax.cli.parser import build_parser, compile_cache_dir
from gpt2_jax.generation.generator import generate
from tests.reference import make_hf_model

SUMMARY = re.compile(
    r"^gpt2-jax: \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\), compile [\d.]+ s, KV cache [\d.]+ [KM]iB, "
    r"(seed \d+(; --seed \d+ reproduces this)?|greedy \(no seed needed\))$"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # The real GPT-2 vocab, so the tokenizer's ids are valid; otherwise tiny.
    model = make_hf_model(seed=17, n_layer=1, n_head=2, n_embd=32, vocab_size=50257, n_positions=64)
    path = tmp_path_factory.mktemp("cli") / "hf"
    model.save_pretrained(path)
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_prompt_plus_the_library_tokens(hf_dir, capsys):
    code, out, err = run(capsys, "generate", "--model", str(hf_dir), "--prompt", "Hello world", "--max-new-tokens",
                         "12", "--seed", "3", "--top-k", "40")  # fmt: skip
    assert code == 0
    params, config = gpt2_jax.load(hf_dir)
    enc = gpt2_jax.tokenizer()
    ref = generate(params, config, [enc.encode("Hello world")], jax.random.key(3), max_new_tokens=12, top_k=40)
    tokens = [t for t in ref.tokens[0, : ref.lengths[0]].tolist() if t != 50256]
    assert out == "Hello world" + enc.decode(tokens) + "\n"
    assert SUMMARY.match(err.strip()), err


def test_stream_prints_the_same_text(hf_dir, capsys):
    args = ["generate", "--model", str(hf_dir), "--prompt", "ROMEO:", "--max-new-tokens", "15", "--seed", "5"]
    _, plain, _ = run(capsys, *args)
    code, streamed, err = run(capsys, *args, "--stream")
    assert code == 0 and streamed == plain
    assert SUMMARY.match(err.strip()), err


def test_prompt_from_stdin_and_samples(hf_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    code, out, err = run(capsys, "generate", "--model", str(hf_dir), "--num-samples", "3", "--max-new-tokens", "6")
    assert code == 0
    samples = re.split(r"--- sample \d ---\n", out)[1:]
    assert len(samples) == 3 and all(s.startswith("Once upon a time") for s in samples)
    assert len(set(samples)) == 3  # one key, folded per row: different samples


@pytest.mark.parametrize("argv,message", [
    (["--top-p", "2"], "error: top_p must be a number in (0, 1]"),
    (["--temperature", "-1"], "error: temperature must be a finite number >= 0"),
    (["--max-new-tokens", "100"], "exceed the context n_positions=64"),
    (["--num-samples", "2", "--stream"], "error: --stream prints one sample"),
    (["--top-logprobs", "21"], "top_logprobs must be an int in [0, 20]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["--regex", "("], "invalid regex '(': outlines-core says"),
    (["--json-schema", "/nonexistent/s.json"], "--json-schema /nonexistent/s.json: no such file"),
    (["--stream", "--top-logprobs", "2"], "use it without --stream"),
    (["--prompt-lookup", "--speculate", "0"], "num_speculative_tokens must be an int in [1, 16], got 0"),
])  # fmt: skip
def test_bad_arguments_are_one_line(hf_dir, capsys, argv, message):
    code, out, err = run(capsys, "generate", "--model", str(hf_dir), "--prompt", "hi", "--max-new-tokens", "10", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_hub_id_is_downloaded_once_and_cached_converted(hf_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2_JAX_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(hub, "_download", lambda repo: calls.append(repo) or hf_dir)
    for _ in range(2):
        code, out, _ = run(
            capsys, "generate", "--model", "someone/tiny-gpt2", "--prompt", "hi", "--max-new-tokens", "3"
        )
        assert code == 0 and out.startswith("hi")
    assert calls == ["someone/tiny-gpt2"]
    assert (tmp_path / "cache" / "someone--tiny-gpt2" / "gpt2_jax.json").is_file()


def test_hub_id_offline_says_what_to_do(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "generate", "--model", "gpt2-not-cached", "--prompt", "hi")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "could not be downloaded" in err and "--model /path/to/that/dir" in err


def test_convert_subcommand(hf_dir, capsys, tmp_path):
    code, _, err = run(capsys, "convert", str(hf_dir), str(tmp_path / "out"), "--dtype", "bfloat16")
    assert code == 0 and "wrote gpt2_jax checkpoint" in err
    params, _ = gpt2_jax.load(tmp_path / "out")
    assert params["wte"].dtype == np.dtype("bfloat16") or str(params["wte"].dtype) == "bfloat16"


@pytest.mark.parametrize("argv", [[], ["convert"]])
def test_convert_help_names_no_repository_path(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    text = capsys.readouterr().out
    assert "convert" in text and not re.search(r"[\w/]+\.py\b", text), text  # an installed package has no convert/


def test_python_dash_m_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpt2_jax", "generate", "--model", str(tmp_path / "missing"),
                          "--prompt", "x"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing'}: no such file or directory "
                                               "(and not a HuggingFace hub id)"]  # fmt: skip


def test_bundled_model_is_the_offline_default(capsys, monkeypatch):
    from gpt2_jax import BUNDLED_MODEL

    size = sum(f.stat().st_size for f in BUNDLED_MODEL.rglob("*") if f.is_file())
    assert size <= 16 * 2**20, f"bundled model is {size} bytes"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = run(capsys, "generate", "--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature", "0")
    assert code == 0 and out.startswith("ROMEO:") and len(out) > len("ROMEO:") + 20
    assert SUMMARY.match(err.strip()), err
    params, config = gpt2_jax.load(BUNDLED_MODEL)
    assert config.vocab_size == 50257 and params["wte"].dtype == jax.numpy.bfloat16


def test_no_seed_draws_one_and_prints_how_to_reproduce(hf_dir, capsys):
    args = ["generate", "--model", str(hf_dir), "--prompt", "Hello", "--max-new-tokens", "10"]
    code, drawn, err = run(capsys, *args)
    seed = re.search(r"seed (\d+); --seed (\d+) reproduces this$", err.strip())
    assert code == 0 and seed and seed.group(1) == seed.group(2), err
    code, again, err = run(capsys, *args, "--seed", seed.group(1))
    assert code == 0 and again == drawn
    assert err.strip().endswith(f"seed {seed.group(1)}")  # given, so nothing to add


def test_greedy_runs_need_no_seed(hf_dir, capsys):
    """temperature 0 (and beam search without --do-sample) draws nothing: the summary says so instead of
    offering a --seed that changes nothing."""
    for extra in (["--temperature", "0"], ["--num-beams", "2"]):
        code, _, err = run(capsys, "generate", "--model", str(hf_dir), "--prompt", "Hello", "--max-new-tokens", "4",
                           *extra)  # fmt: skip
        assert code == 0 and err.strip().endswith("greedy (no seed needed)"), err
        assert "reproduces this" not in err


def readme_block(heading: str) -> list[str]:
    """The command lines of the first bash block under a README heading."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = text.split(f"## {heading}\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_commands_install_and_create_what_they_use(tmp_path):
    """The first command installs the serve extra the Serve section's command needs, and the RL section creates
    the prompts file its command reads, with prompts as the rl command parses them."""
    from gpt2_jax.cli.rl import read_prompts

    install = readme_block("Install and run")[0]
    assert re.search(r"pip install -e '\.\[[^]]*\bserve\b", install), install
    assert readme_block("Serve")[0].startswith("gpt2-jax serve")
    create, command = readme_block("Reinforcement learning")
    subprocess.run(["bash", "-c", create], cwd=tmp_path, check=True)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert read_prompts(str(tmp_path / args.prompts)) == ["ROMEO:\n", "JULIET:\n", "KING HENRY.\n", "First Citizen:\n"]


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpt2-jax {version('gpt2-jax')} (jax {jax.__version__}, jaxlib " \
        f"{version('jaxlib')})"  # fmt: skip


@pytest.mark.parametrize("argv,option,default", [
    (["generate"], "--max-new-tokens", "100"),
    (["generate"], "--top-p", "1.0"),
    (["train"], "--block-size", "256"),
    (["train"], "--lr", "0.0006"),
    (["data", "prepare"], "--val-fraction", "0.1"),
    (["convert"], "--dtype", "keep"),
])  # fmt: skip
def test_help_shows_defaults(capsys, monkeypatch, argv, option, default):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    entries = re.split(r"\n  (?=-)", capsys.readouterr().out)  # one per option, its help wrapped onto more lines
    entry = " ".join(next(e for e in entries if e.startswith(option + " ")).split())
    assert entry.endswith(f"(default: {default})"), entry


def test_compile_cache_dir(tmp_path):
    assert compile_cache_dir({}) == Path.home() / ".cache" / "gpt2_jax" / "jax-cache"  # on by default
    assert compile_cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/gpt2_jax/jax-cache")
    assert compile_cache_dir({"GPT2_JAX_COMPILATION_CACHE": str(tmp_path)}) == tmp_path
    for off in ("off", "0", "OFF"):
        assert compile_cache_dir({"GPT2_JAX_COMPILATION_CACHE": off}) is None
    assert compile_cache_dir({"GPT2_JAX_COMPILATION_CACHE": str(tmp_path)}, disabled=True) is None


def test_cli_fills_the_compilation_cache_unless_told_not_to(hf_dir, tmp_path):
    def generate(*extra, cache, **env_extra):
        env = {**os.environ, "GPT2_JAX_COMPILATION_CACHE": str(cache), **env_extra}
        out = subprocess.run([sys.executable, "-m", "gpt2_jax", "generate", "--model", str(hf_dir), "--prompt", "hi",
                              "--max-new-tokens", "4", "--seed", "1", "--stream", *extra], capture_output=True,
                             text=True, env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    first = generate(cache=tmp_path / "jc")
    assert len(list((tmp_path / "jc").iterdir())) >= 2  # prefill and the decode step, at least
    assert generate(cache=tmp_path / "jc") == first  # the second run reads them back
    generate("--no-compile-cache", cache=tmp_path / "unused", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"))
    assert not (tmp_path / "unused").exists()
    assert not (tmp_path / "jax").exists() or not list((tmp_path / "jax").iterdir())  # off means JAX's own too


def test_processor_flags_match_the_library(hf_dir, capsys):
    argv = ["generate", "--model", str(hf_dir), "--prompt", "ROMEO:", "--max-new-tokens", "30", "--seed", "4",
            "--repetition-penalty", "1.3", "--frequency-penalty", "0.5", "--presence-penalty", "0.2", "--min-p", "0.01",
            "--no-repeat-ngram-size", "2", "--min-new-tokens", "3"]  # fmt: skip
    code, out, _ = run(capsys, *argv)
    params, config = gpt2_jax.load(hf_dir)
    ref = gpt2_jax.complete(params, config, "ROMEO:", jax.random.key(4), max_new_tokens=30, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.2, min_p=0.01, no_repeat_ngram_size=2,
                            min_new_tokens=3)[0]  # fmt: skip
    assert code == 0 and out == "ROMEO:" + ref.text + "\n"
    # The flags reach the processors: greedy on this random model loops, and the penalties and the n-gram ban break
    # the loop. (Sampled at temperature 1 its distribution is so flat that they seldom move the race's winner: the
    # sampled text above came out the same without them.)
    _, plain, _ = run(capsys, "generate", "--model", str(hf_dir), "--prompt", "ROMEO:", "--max-new-tokens", "30",
                      "--temperature", "0")  # fmt: skip
    _, flagged, _ = run(capsys, *argv, "--temperature", "0")
    greedy = gpt2_jax.complete(params, config, "ROMEO:", jax.random.key(4), max_new_tokens=30, temperature=0.0,
                               repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, min_p=0.01,
                               no_repeat_ngram_size=2, min_new_tokens=3)[0]  # fmt: skip
    assert flagged == "ROMEO:" + greedy.text + "\n" and plain != flagged


def test_stop_flag_cuts_the_text_streamed_or_not(hf_dir, capsys):
    base = ["generate", "--model", str(hf_dir), "--prompt", "ROMEO:", "--max-new-tokens", "30", "--seed", "6"]
    _, plain, _ = run(capsys, *base)
    generated = plain[len("ROMEO:") : -1]
    # two letters from the middle of the text (argparse reads a leading "-" as a flag)
    stop = next(generated[i : i + 2] for i in range(8, len(generated)) if generated[i : i + 2].isalnum())
    expected = "ROMEO:" + generated[: generated.index(stop)] + "\n"
    for extra in ([], ["--stream"]):
        code, out, _ = run(capsys, *base, "--stop", stop, "--stop", "\u2603never", *extra)
        assert code == 0 and out == expected, extra


def test_constraint_and_top_logprobs_flags(hf_dir, capsys, tmp_path):
    base = ["generate", "--model", str(hf_dir), "--prompt", "Answer:", "--max-new-tokens", "24", "--seed", "1"]
    code, out, _ = run(capsys, *base, "--num-samples", "4", "--choice", " yes", "--choice", " no")
    samples = re.split(r"--- sample \d ---\n", out)[1:]
    assert code == 0 and sorted(set(samples)) <= ["Answer: no\n", "Answer: yes\n"] and len(samples) == 4
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}')
    code, out, _ = run(capsys, *base, "--json-schema", str(schema))
    import json

    assert code == 0 and isinstance(json.loads(out[len("Answer:") :])["ok"], bool)
    code, out, _ = run(capsys, *base, "--regex", "[0-9]{3}", "--top-logprobs", "3")
    text, table = out.split("--- top logprobs (raw distribution) ---\n")
    assert code == 0 and re.fullmatch(r"Answer:[0-9]{3}\n", text)
    rows = table.strip().splitlines()  # one per token: the digits, then EOS
    assert len(rows) >= 2 and rows[-1].strip().startswith("'<|endoftext|>'")
    assert all(len(re.findall(r" -?\d+\.\d{3}", r.split(" | ")[1])) == 3 for r in rows)


def test_speculative_flags_give_the_same_text(hf_dir, capsys):
    argv = ["generate", "--model", str(hf_dir), "--prompt", "to be or not to be, to be", "--max-new-tokens", "20",
            "--seed", "5", "--temperature", "0.8"]  # fmt: skip
    _, plain, _ = run(capsys, *argv)
    for extra in (["--prompt-lookup", "--speculate", "3"], ["--draft", str(hf_dir), "--speculate", "2"]):
        code, out, _ = run(capsys, *argv, *extra)
        assert code == 0 and out == plain
    code, out, _ = run(capsys, *argv, "--prompt-lookup", "--stream")
    assert code == 0 and out == plain
