"""gpt2-jax generate: load a model, generate (optionally streamed, sampled, constrained, speculative), print."""

from __future__ import annotations

import argparse
import io
import secrets
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gpt2_jax.checkpoints import BUNDLED_MODEL
from gpt2_jax.cli import train as cli_train
from gpt2_jax.errors import GPT2JaxError


def _constraint(args: argparse.Namespace):
    """--regex / --choice / --json-schema -> a gpt2_jax.sampling.constraints object, or None."""
    from gpt2_jax.sampling import constraints

    if args.regex is not None:
        return constraints.regex(args.regex)
    if args.choice:
        return constraints.choice(args.choice)
    if args.json_schema:
        path = Path(args.json_schema)
        if not path.is_file():
            raise GPT2JaxError(f"--json-schema {path}: no such file")
        return constraints.json_schema(path.read_text())
    return None


def sampling_params(args: argparse.Namespace):
    """The sampling flags as the one SamplingParams every row uses (SamplingParams checks them)."""
    from gpt2_jax import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        min_new_tokens=args.min_new_tokens, stop=args.stop or (), constraint=_constraint(args), logprobs=True,
        top_logprobs=args.top_logprobs,
    )  # fmt: skip


def _show_top_logprobs(enc, completion, out) -> None:
    print("--- top logprobs (raw distribution) ---", file=out)
    for tok, lp, top in zip(completion.tokens, completion.logprobs, completion.top_logprobs):
        alts = ", ".join(f"{enc.decode([t])!r} {v:.3f}" for t, v in top.items())
        print(f"{enc.decode([tok])!r:>16} {lp:8.3f} | {alts}", file=out)


class TextStream:
    """Prints the decoded text of a growing token list, holding back an incomplete UTF-8 character and
    any tail that could still become a stop string; the text ends just before a stop string."""

    def __init__(self, enc, out=None, stops=()):
        self.enc, self.out, self.tokens, self.shown, self.stops = enc, out or sys.stdout, [], 0, list(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.stopped = False

    def add(self, token: int) -> None:
        self.tokens.append(token)
        self._show(final=False)

    def _show(self, final: bool) -> None:
        text = self.enc.decode(self.tokens)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(text)
        elif text.endswith("\ufffd"):
            return
        else:
            end = len(text) - self.hold
        if end > self.shown and not (self.stopped and self.shown >= end):
            self.out.write(text[self.shown : end])
            self.out.flush()
            self.shown = end

    def close(self) -> None:
        if not self.stopped:
            self._show(final=True)


def _greedy(args: argparse.Namespace) -> bool:
    """Whether the run draws nothing: temperature 0, or beam search without --do-sample."""
    return not args.do_sample if args.num_beams is not None else args.temperature == 0


def _summary(n_tokens: int, seconds: float, compile_s: float, cache_bytes: int, args: argparse.Namespace) -> None:
    rate = n_tokens / seconds if seconds > 0 else float("inf")
    size = f"{cache_bytes / 2**20:.1f} MiB" if cache_bytes >= 2**20 else f"{cache_bytes / 2**10:.1f} KiB"
    if _greedy(args):
        seed = "greedy (no seed needed)"
    else:
        seed = f"seed {args.seed}; --seed {args.seed} reproduces this" if args.seed_drawn else f"seed {args.seed}"
    print(f"gpt2-jax: {n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tokens/s), compile {compile_s:.2f} s, "
          f"KV cache {size}, {seed}", file=sys.stderr)  # fmt: skip


def load_model(args: argparse.Namespace, mesh):
    """--model (default: the bundled one) in --dtype, on --mesh. generate and serve share this, and so their
    default: float32 on a CPU, whatever the checkpoint stores (exact, and fast there), so one --seed gives one
    text from either; elsewhere the stored dtype. args.dtype is set to what was chosen."""
    import jax

    from gpt2_jax import load
    from gpt2_jax.checkpoints import resolve_model
    from gpt2_jax.model import precision
    from gpt2_jax.parallel import shard_params

    if args.dtype is None and jax.default_backend() == "cpu":
        args.dtype = "float32"
    if args.model is None and not BUNDLED_MODEL.is_dir():
        raise GPT2JaxError(f"no --model given and the bundled model {BUNDLED_MODEL} is missing")
    params, config = load(resolve_model(args.model) if args.model else BUNDLED_MODEL, dtype=args.dtype, mesh=mesh,
                          progress=True)  # fmt: skip
    if args.dtype in ("int8", "w8a8") and not precision.is_int8(params):  # load() quantizes; this is for safety
        params = precision.with_precision(params, args.dtype)
        params = shard_params(params, config, mesh) if mesh else params  # the scales' layout too
    return params, config


def _draft_option(args: argparse.Namespace, mesh) -> dict:
    """--draft / --prompt-lookup / --speculate -> generate's draft options (none without the first two)."""
    if args.prompt_lookup:
        return dict(draft="prompt_lookup", num_speculative_tokens=args.speculate)
    if args.draft is None:
        return {}
    return dict(draft=load_draft(args, mesh), num_speculative_tokens=args.speculate)


def load_draft(args: argparse.Namespace, mesh) -> tuple:
    """--draft's model, in --dtype unless that is an int8 mode (the draft stays in its stored precision)."""
    from gpt2_jax import load
    from gpt2_jax.checkpoints import resolve_model

    return load(
        resolve_model(args.draft),
        dtype=None if args.dtype in ("int8", "w8a8") else args.dtype,
        mesh=mesh,
        progress=True,
    )


def _check_beam_flags(args: argparse.Namespace) -> None:
    """The flags beam search cannot take with --num-beams, and the beam flags that need it."""
    if args.num_beams is None:
        beam_only = [f for f, on in (("--num-return-sequences", args.num_return_sequences != 1),
                                     ("--length-penalty", args.length_penalty != 1.0),
                                     ("--early-stopping", args.early_stopping != "false"),
                                     ("--do-sample", args.do_sample)) if on]  # fmt: skip
        if beam_only:
            raise GPT2JaxError(f"{', '.join(beam_only)} {'needs' if len(beam_only) == 1 else 'need'} --num-beams")
        return
    clash = [f for f, on in (("--stream", args.stream), ("--num-samples", args.num_samples != 1),
                             ("--stop", bool(args.stop)), ("--top-logprobs", bool(args.top_logprobs)),
                             ("--draft", args.draft is not None), ("--prompt-lookup", args.prompt_lookup),
                             ("--mesh", bool(args.mesh))) if on]  # fmt: skip
    if clash:
        raise GPT2JaxError(f"--num-beams does not take {', '.join(clash)} (use --num-return-sequences for more texts)")


def _run_beams(args: argparse.Namespace, params, config, prompt: str, ids: list[int], out, key) -> int:
    """gpt2-jax generate --num-beams: print the --num-return-sequences best hypotheses, best first; returns
    the tokens printed."""
    from gpt2_jax import beam_search

    early = {"false": False, "true": True, "never": "never"}[args.early_stopping]
    result = beam_search(params, config, [ids], key, num_beams=args.num_beams,
                         num_return_sequences=args.num_return_sequences, length_penalty=args.length_penalty,
                         early_stopping=early, do_sample=args.do_sample, sampling=sampling_params(args))  # fmt: skip
    enc, n = _encoding(), 0
    for r in range(args.num_return_sequences):
        m = int(result.lengths[0, r])
        tokens = result.tokens[0, r, :m].tolist()
        n += m
        if tokens and tokens[-1] == config.eos_id:
            tokens = tokens[:-1]  # the text ends at EOS, as complete() cuts it
        if args.num_return_sequences > 1:
            print(f"--- beam {r + 1}: score {result.scores[0, r]:.4f}, {m} tokens, {result.finish_reason[0][r]} ---",
                  file=out)  # fmt: skip
        print(prompt + enc.decode(tokens), file=out)
    return n


def _encoding():
    from gpt2_jax.tokenizer import tokenizer

    return tokenizer()


def run_generate(args: argparse.Namespace) -> int:
    from gpt2_jax import complete, generate_stream
    from gpt2_jax.compiling import CompileTimer
    from gpt2_jax.generation.batching import cache_capacity
    from gpt2_jax.model.kv_cache import cache_bytes
    from gpt2_jax.model.params import float_dtype
    from gpt2_jax.parallel import is_main
    from gpt2_jax.parallel.sharding import parse_mesh
    from gpt2_jax.tokenizer import EOT, tokenizer

    if args.num_samples < 1:
        raise GPT2JaxError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.stream and args.num_samples != 1:
        raise GPT2JaxError("--stream prints one sample; use --num-samples 1")
    _check_beam_flags(args)
    joined = cli_train.join(args)
    out = _own_stdout() if joined else sys.stdout  # before the first collective, which prints from C++
    args.seed_drawn = args.seed is None
    if args.seed_drawn:  # a fresh seed each run, printed so the run can be repeated
        args.seed = secrets.randbelow(1_000_000)
        if joined:  # every process must sample with process 0's seed
            from jax.experimental.multihost_utils import broadcast_one_to_all

            args.seed = int(broadcast_one_to_all(np.int32(args.seed)))
    mesh = parse_mesh(args.mesh) if args.mesh else None
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    enc = tokenizer()
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]  # an empty prompt starts from <|endoftext|>
    params, config = load_model(args, mesh)
    kw = _draft_option(args, mesh)
    prompts = [ids] * args.num_samples
    if args.stream and args.top_logprobs:
        raise GPT2JaxError("--top-logprobs prints a table after the text; use it without --stream")
    kw["sampling"] = sampling_params(args)
    # beams: a power-of-two bucket of rows (a num_beams out of range is beam_search's ConfigError, not a huge cache)
    rows = args.num_samples if args.num_beams is None else 1 << (min(max(args.num_beams, 1), 64) - 1).bit_length()
    cache = cache_bytes(config, rows, cache_capacity(len(ids), args.max_new_tokens, config), float_dtype(params))
    out = out if is_main() else io.StringIO()  # every process computes; process 0 prints
    key = jax.random.key(args.seed)
    with CompileTimer() as compiling:
        t0 = time.perf_counter()
        if args.num_beams is not None:
            n = _run_beams(args, params, config, prompt, ids, out, key)
        elif args.stream:
            text, n = TextStream(enc, out, args.stop or ()), 0
            out.write(prompt)
            for tokens, live in generate_stream(params, config, prompts, key, **kw):
                if not live[0]:
                    break
                n += 1
                if int(tokens[0]) == config.eos_id:
                    break
                text.add(int(tokens[0]))
            text.close()
            out.write("\n")
        else:
            results = complete(params, config, [prompt] * args.num_samples, key, **kw)
            for b, result in enumerate(results):
                if args.num_samples > 1:
                    print(f"--- sample {b + 1} ---", file=out)
                print(prompt + result.text, file=out)
                if args.top_logprobs:
                    _show_top_logprobs(enc, result, out)
            n = sum(len(r.tokens) for r in results)
        out.flush()
        seconds = time.perf_counter() - t0
    if is_main():
        _summary(n, seconds - compiling.seconds, compiling.seconds, cache, args)
    return 0


def _own_stdout():
    """The generated text's own handle on stdout; file descriptor 1 then points at stderr, because the
    gloo collectives print progress lines ("[Gloo] Rank 0 is connected ...") to it from C++."""
    import os

    sys.stdout.flush()
    text = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return text
