"""Beam search against transformers' generate(num_beams=..., do_sample=False): the same hypotheses token for token
and its sequences_scores to 1e-5, over 1-8 beams x the three early_stopping modes x length penalties 0.5, 1 and 2,
EOS reachable and not, on two random checkpoints and the bundled model; the processors as its beam search applies
them. Then bit-level determinism (uint32), settings that never recompile, beam sampling's keys and draws, errors
and the CLI."""

import itertools

import jax
import numpy as np
import pytest
import torch
import transformers

import gpt2_jax
from gpt2_jax import ConfigError, SamplingParams
from gpt2_jax.cli import main
from gpt2_jax.generation import beam_loop, beam_search
from gpt2_jax.generation.scoring import prompt_logprobs
from tests.reference import exact_logits, make_hf_model, saved_and_loaded

torch.set_num_threads(1)  # transformers' tiny-model generate is 4-5x faster on one thread of a busy 2-core machine

TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=101, n_positions=64)
PROMPTS = [[5, 17, 0, 42, 9], [3, 1, 4, 1, 5, 9, 2, 6]]  # ragged: each grid row takes one of them
GRID = list(itertools.product(range(1, 9), (False, True, "never"), (0.5, 1.0, 2.0)))  # num_beams, early, penalty
N = 10


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # Greedy from both prompts walks through several tokens (63 among them, the reachable EOS below).
    return saved_and_loaded(make_hf_model(seed=21, **TINY), tmp_path_factory)


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=26, **TINY), tmp_path_factory)


def hf_hypotheses(model, prompt, n, num_beams, length_penalty, early_stopping, eos, returned, **kw):
    """transformers' hypotheses: [(generated tokens up to the first EOS, sequences_score or None for greedy)]."""
    ids = torch.tensor([prompt])
    eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, num_beams=num_beams,
                         do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping,
                         num_return_sequences=returned, eos_token_id=eos, pad_token_id=eos_ids[0] if eos_ids else 0,
                         return_dict_in_generate=True, output_scores=True, **kw)  # fmt: skip
    hyps = []
    for r, seq in enumerate(out.sequences[:, len(prompt) :].tolist()):
        end = next((i + 1 for i, t in enumerate(seq) if t in eos_ids), len(seq))
        score = None if num_beams == 1 else float(out.sequences_scores[r])  # greedy reports no score
        hyps.append((seq[:end], score))
    return hyps


def assert_same(theirs, result, b, what):
    for r, (tokens, score) in enumerate(theirs):
        m = int(result.lengths[b, r])
        assert result.tokens[b, r, :m].tolist() == tokens, (what, r)
        if score is not None:
            assert abs(result.scores[b, r] - score) <= 1e-5 * max(1.0, abs(score)), (what, r, result.scores[b], score)


def run_grid(model, grid, eos, stop_ids=()):
    """The grid as one batch: row i is grid[i] on PROMPTS[i % 2], every setting traced per row."""
    _, params, config = model
    return beam_search(params, config, [PROMPTS[i % 2] for i in range(len(grid))], num_beams=[g[0] for g in grid],
                       early_stopping=[g[1] for g in grid], length_penalty=[g[2] for g in grid],
                       num_return_sequences=[g[0] for g in grid], max_new_tokens=N, eos_id=eos, stop_ids=stop_ids)  # fmt: skip


EOS = {"tiny": 63, "tiny2": 12}  # tokens both prompts' beams reach


@pytest.fixture(scope="module")
def grids(tiny, tiny2):
    """Every grid cell on both checkpoints, EOS reachable and not: four runs of one compiled program."""
    models = {"tiny": tiny, "tiny2": tiny2}
    return {(m, e): run_grid(models[m], GRID, EOS[m] if e else None) for m in models for e in (None, "reachable")}


@pytest.mark.parametrize("eos", [None, "reachable"])
@pytest.mark.parametrize("which", ["tiny", "tiny2"])
def test_greedy_beam_search_equals_transformers_over_the_grid(which, eos, grids, request):
    """1 beam is compared with transformers' greedy search (what its generate runs for num_beams=1)."""
    model, out = request.getfixturevalue(which), grids[which, eos]
    eos = EOS[which] if eos else None
    for i, (k, early, penalty) in enumerate(GRID):
        if which == "tiny" or k % 3 == 1:  # every cell on the first checkpoint; 1, 4 and 7 beams on the second
            assert_same(hf_hypotheses(model[0], PROMPTS[i % 2], N, k, penalty, early, eos, k), out, i, GRID[i])
    ended = (out.lengths < N) & (out.lengths > 0)
    if eos is None:
        assert not ended.any()
    else:  # EOS really was reached, at several lengths and by several beams, from both prompts
        assert ended.sum() > len(GRID) and len(set(out.lengths[ended].tolist())) > 2
        assert ended[0::2].any() and ended[1::2].any()
        assert all(out.tokens[b, r, out.lengths[b, r] - 1] == eos for b, r in zip(*np.nonzero(ended)))


def test_two_stop_tokens_are_transformers_eos_list(tiny):
    grid = [(2, False, 1.0), (3, True, 0.5), (5, "never", 2.0), (8, False, 2.0)]
    out = run_grid(tiny, grid, 63, stop_ids=[77])
    for i, (k, early, penalty) in enumerate(grid):
        assert_same(hf_hypotheses(tiny[0], PROMPTS[i % 2], N, k, penalty, early, [63, 77], k), out, i, grid[i])
    ended = np.nonzero((out.lengths > 0) & (out.lengths < N))
    last = {int(out.tokens[b, r, out.lengths[b, r] - 1]) for b, r in zip(*ended)}
    assert last == {63, 77}  # hypotheses ended on either


PROCESSORS = {  # ours, transformers'
    "repetition_penalty_1.3": (dict(repetition_penalty=1.3), dict(repetition_penalty=1.3)),
    "repetition_penalty_0.8": (dict(repetition_penalty=0.8), dict(repetition_penalty=0.8)),
    "no_repeat_ngram_2": (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
    "bad_words": (dict(bad_words_ids=[[98], [50, 63]]), dict(bad_words_ids=[[98], [50, 63]])),
    "min_new_tokens_5": (dict(min_new_tokens=5), dict(min_new_tokens=5)),
    "logit_bias": (dict(logit_bias={50: 2.0, 98: -3.0}), dict(sequence_bias={(50,): 2.0, (98,): -3.0})),
}
SEARCHES = [(4, False, 1.0), (6, True, 0.5), (3, "never", 2.0)]


def test_processors_apply_as_in_transformers_beam_search(tiny):
    """Each processor on the beams' log-probs, one SamplingParams per row of one batch (after the rows without
    processors, which show that each processor changes the result)."""
    _, params, config = tiny
    cases = [(None, s) for s in SEARCHES] + list(itertools.product(PROCESSORS, SEARCHES))
    rows = [SamplingParams(max_new_tokens=12, eos_id=63, **(PROCESSORS[name][0] if name else {})) for name, _ in cases]
    out = beam_search(params, config, [PROMPTS[0]] * len(cases), num_beams=[s[0] for _, s in cases],
                      early_stopping=[s[1] for _, s in cases], length_penalty=[s[2] for _, s in cases],
                      num_return_sequences=[s[0] for _, s in cases], sampling=rows)  # fmt: skip
    changed = set()
    for i, (name, (k, early, penalty)) in enumerate(cases):
        theirs = hf_hypotheses(tiny[0], PROMPTS[0], 12, k, penalty, early, 63, k, **PROCESSORS.get(name, ({}, {}))[1])
        assert_same(theirs, out, i, (name, k))
        j = SEARCHES.index((k, early, penalty))
        if (out.tokens[i, :k] != out.tokens[j, :k]).any() or (out.scores[i, :k] != out.scores[j, :k]).any():
            changed.add(name)
    assert changed == set(PROCESSORS)


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """The bundled model, float32, and transformers' GPT2LMHeadModel of the same weights."""
    path = gpt2_jax.convert(gpt2_jax.BUNDLED_MODEL, tmp_path_factory.mktemp("b") / "hf", dtype="float32", to_hf=True)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return hf, *gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")


def exact_score(model, prompt, tokens, penalty) -> float:
    """The float64 answer: sum of the tokens' logprobs (a float64 copy of the model) / length ** penalty."""
    logp = torch.log_softmax(torch.as_tensor(exact_logits(model, [prompt + tokens])[0]), dim=-1).numpy()
    return float(logp[np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens)), tokens].sum() / len(tokens) ** penalty)


def test_the_bundled_model_equals_transformers(bundled):
    """The same hypotheses; the scores within 1e-5 of the float64 answer. transformers' own float32 beam scores
    sit ~3e-5 from it on this trained model on an AVX-512 host and up to ~2e-4 on an AVX2-only one (its batched
    cached steps round each logprob off, by how much depends on torch's kernels; its full forward and one-row
    cached decode do not), so against them the bound is 5e-4: loose for their rounding, tight enough for a
    different score (another length penalty, other tokens counted)."""
    hf, params, config = bundled
    enc = gpt2_jax.tokenizer()
    prompts = [enc.encode("ROMEO:"), enc.encode("First Citizen:\nBefore we proceed any further, hear me")]
    newline = enc.encode("\n")[0]  # reachable: the model ends lines often; None: no EOS at all
    cases = [(2, False, 1.0, newline), (4, True, 2.0, newline), (8, "never", 0.5, newline), (5, False, 1.0, None)]
    out = beam_search(params, config, [prompts[i % 2] for i in range(len(cases))], num_beams=[c[0] for c in cases],
                      early_stopping=[c[1] for c in cases], length_penalty=[c[2] for c in cases],
                      num_return_sequences=[c[0] for c in cases],
                      sampling=[SamplingParams(max_new_tokens=16, eos_id=c[3]) for c in cases])  # fmt: skip
    for i, (k, early, penalty, eos) in enumerate(cases):
        theirs = hf_hypotheses(hf, prompts[i % 2], 16, k, penalty, early, eos, k)
        assert_same([(tokens, None) for tokens, _ in theirs], out, i, cases[i])
        for r, (tokens, score) in enumerate(theirs):
            exact = exact_score(hf, prompts[i % 2], tokens, penalty)
            assert abs(out.scores[i, r] - exact) <= 1e-5 * max(1.0, abs(exact)), (cases[i], r)
            assert abs(out.scores[i, r] - score) <= 5e-4 * max(1.0, abs(score)), (cases[i], r)
    assert (out.lengths[:3] < 16).any()


def test_scores_and_logprobs_are_the_tokens_logprobs_bit_for_bit(tiny, grids):
    """Each hypothesis' logprobs are what scoring.prompt_logprobs (a full forward) gives its tokens, bit for bit,
    and its score is their float32 sum in order over length ** length_penalty."""
    _, params, config = tiny
    out = grids["tiny", "reachable"]
    for i in (GRID.index((4, False, 2.0)), GRID.index((3, "never", 0.5)), GRID.index((8, True, 1.0))):
        for r in range(GRID[i][0]):
            m, prompt = int(out.lengths[i, r]), PROMPTS[i % 2]
            row = prompt + out.tokens[i, r, :m].tolist()
            ref = np.asarray(prompt_logprobs(params, config, [row]).logprobs[0][len(prompt) :], np.float32)
            assert (bits(out.logprobs[i, r, :m]) == bits(ref)).all()
            total = np.float32(0)
            for x in ref:
                total = np.float32(total + x)
            assert bits(out.scores[i, r]) == bits(total / np.float32(float(m) ** GRID[i][2]))


# gpt2's widths (12 heads of 64, the full vocab), two layers, as tests/test_invariance.py.
SMALL = dict(n_layer=2, n_head=12, n_embd=768, vocab_size=50257, n_positions=256)
SMALL_PROMPTS = [[464, 3290, 318, 257], [50256], [40, 588, 262, 3797, 11, 290, 314, 588, 262, 3290, 13, 632, 318],
                 [1212, 1110, 318, 922, 780, 2187, 11, 523]]  # fmt: skip
BEAMS, SAMPLED = [3, 4, 2, 4], [False, True, False, True]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return saved_and_loaded(make_hf_model(seed=5, **SMALL), tmp_path_factory)


def small_run(params, config, prompts, keys, beams, sampled):
    return beam_search(params, config, prompts, keys, num_beams=beams, num_return_sequences=beams, do_sample=sampled,
                       max_new_tokens=12, eos_id=None, temperature=0.9, top_k=40)  # fmt: skip


def test_a_prompts_beams_are_the_same_bits_alone_in_a_batch_and_with_a_larger_cache(small):
    """Each prompt alone (its own beam bucket: 2 or 4 rows, a 128-slot cache) and in a batch of five whose fifth
    prompt is 120 tokens with 8 beams (8-row buckets, a 256-slot cache): the same tokens, beams and bits."""
    _, params, config = small
    keys = jax.random.split(jax.random.key(11), 5)
    long = list(range(1000, 1120))
    batch = small_run(params, config, [*SMALL_PROMPTS, long], keys, [*BEAMS, 8], [*SAMPLED, False])
    for b, prompt in enumerate(SMALL_PROMPTS):
        k = BEAMS[b]
        alone = small_run(params, config, [prompt], keys[b][None], [k], [SAMPLED[b]])
        np.testing.assert_array_equal(alone.tokens[0, :k], batch.tokens[b, :k])
        np.testing.assert_array_equal(alone.beam_indices[0, :k], batch.beam_indices[b, :k])
        np.testing.assert_array_equal(bits(alone.scores[0, :k]), bits(batch.scores[b, :k]))
        np.testing.assert_array_equal(bits(alone.logprobs[0, :k]), bits(batch.logprobs[b, :k]))
    # the sampled prompts really sampled: another key, other beams
    other = small_run(params, config, SMALL_PROMPTS[1:2], jax.random.key(12)[None], [4], [True])
    assert (other.tokens[0] != batch.tokens[1, :4]).any()


def test_num_beams_and_length_penalty_do_not_recompile_within_a_bucket(tiny):
    _, params, config = tiny
    run = lambda **kw: beam_search(params, config, [PROMPTS[0]], jax.random.key(0), max_new_tokens=N, eos_id=63, **kw)
    a = run(num_beams=3)
    before = beam_loop.search._cache_size()
    b = run(num_beams=4, length_penalty=2.0, early_stopping="never", num_return_sequences=4)
    c = run(num_beams=3, length_penalty=0.5, early_stopping=True, do_sample=True, repetition_penalty=1.2)
    assert beam_loop.search._cache_size() == before
    assert (a.tokens[0, 0] != c.tokens[0, 0]).any() and b.lengths.shape == (1, 4)
    run(num_beams=5)  # the next bucket (8 rows) is a new program: the counter does count
    assert beam_loop.search._cache_size() == before + 1


def test_beam_sampling_is_keyed_and_draws_from_the_warped_distribution(tiny):
    _, params, config = tiny
    run = lambda key, **kw: beam_search(params, config, [PROMPTS[0]], key, num_beams=4, num_return_sequences=4,
                                        do_sample=True, max_new_tokens=N, eos_id=None, **kw)  # fmt: skip
    a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert (a.tokens != c.tokens).any()
    seeded = beam_search(params, config, [PROMPTS[0]], num_beams=4, do_sample=True, max_new_tokens=N, eos_id=None,
                         seed=7)  # fmt: skip
    assert seeded.lengths[0, 0] == N
    # One beam, one token: Gumbel-top-1 is a draw from softmax(warped log-probs), which next_token_probs gives.
    rows, kw = 4000, dict(temperature=0.7, top_k=20)
    one = beam_search(params, config, [PROMPTS[0]] * rows, jax.random.key(3), num_beams=1, do_sample=True,
                      max_new_tokens=1, eos_id=None, **kw)  # fmt: skip
    logits = gpt2_jax.forward(params, [PROMPTS[0]], config)[:, -1]
    target = np.asarray(gpt2_jax.sampling.next_token_probs(logits, top_p=1.0, **kw))[0]
    freq = np.bincount(one.tokens[:, 0, 0], minlength=config.vocab_size) / rows
    assert np.abs(freq - target).max() < 0.03 and freq[target == 0].sum() == 0


def test_a_constraint_holds_for_every_beam(bundled):
    _, params, config = bundled
    enc = gpt2_jax.tokenizer()
    options = [" My lord", " Nobody", " A friend of yours"]
    out = beam_search(params, config, [enc.encode("ROMEO:\nWho goes there?\nJULIET:")], num_beams=4,
                      num_return_sequences=4, max_new_tokens=8, constraint=gpt2_jax.constraints.choice(options))  # fmt: skip
    for r in range(4):
        tokens = out.tokens[0, r, : out.lengths[0, r]].tolist()
        text = enc.decode([t for t in tokens if t != config.eos_id])
        assert text in options if out.finish_reason[0][r] == "stop" else any(o.startswith(text) for o in options)
    assert "stop" in out.finish_reason[0]


def test_the_steps_trace_the_running_beams(tiny):
    _, params, config = tiny
    out = beam_search(params, config, [PROMPTS[0]], num_beams=3, max_new_tokens=N, eos_id=None)
    steps = out.steps
    assert steps.count[0] == N and (steps.tokens[0, :, 3:] == -1).all()
    # the best final hypothesis is running beam 0 of the last step, followed back through its parents
    j, path = 0, []
    for t in range(N - 1, -1, -1):
        path.append(int(steps.tokens[0, t, j]))
        j = int(steps.parents[0, t, j])
    assert path[::-1] == out.tokens[0, 0].tolist()
    assert steps.parents[0, 0, :3].tolist() == [0, 0, 0]  # the first step extends beam 0 only (the others at -1e9)


@pytest.mark.parametrize("kw, message", [
    (dict(num_beams=0), "num_beams must be an int in [1, 64], got 0"),
    (dict(num_beams=2.5), "num_beams must be an int in [1, 64], got 2.5"),
    (dict(num_beams=[2, 65]), "num_beams[1] must be an int in [1, 64], got 65"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences must be an int in [1, num_beams=2], got 3"),
    (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be False, True or 'never'"),
    (dict(num_beams=2, do_sample="yes"), "do_sample must be True or False"),
    (dict(num_beams=[2, 2, 2]), "num_beams given per prompt must have one entry per prompt (2), got 3"),
    (dict(num_beams=2, stop=["\n"]), "beam_search takes stop_ids, not stop strings"),
    (dict(num_beams=2, top_logprobs=2), "not top_logprobs"),
    (dict(num_beams=2, do_sample=True, temperature=0.0), "do_sample=True needs a temperature > 0"),
    (dict(num_beams=2, do_sample=True), "beam sampling (do_sample=True) needs a key"),
    (dict(num_beams=2, max_new_tokens=60), "exceed the context n_positions=64"),
])  # fmt: skip
def test_bad_settings_are_config_errors(tiny, kw, message):
    _, params, config = tiny
    with pytest.raises(gpt2_jax.GPT2JaxError) as e:
        beam_search(params, config, PROMPTS, **kw)
    assert message in str(e.value)
    assert isinstance(e.value, ConfigError) or "n_positions" in message


def test_cli_num_beams_prints_the_libraries_hypotheses(bundled, capsys):
    _, params, config = bundled
    argv = ["generate", "--prompt", "ROMEO:", "--max-new-tokens", "12", "--no-repeat-ngram-size", "2"]
    assert main([*argv, "--num-beams", "3", "--num-return-sequences", "2", "--length-penalty", "1.5"]) == 0
    out = capsys.readouterr().out
    enc = gpt2_jax.tokenizer()
    # the CLI computes in float32 on a CPU (the server's default too), so the reference does
    ref = beam_search(gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")[0], config, [enc.encode("ROMEO:")], num_beams=3,
                      num_return_sequences=2, length_penalty=1.5, max_new_tokens=12, no_repeat_ngram_size=2)  # fmt: skip
    for r in range(2):
        tokens = [t for t in ref.tokens[0, r, : ref.lengths[0, r]].tolist() if t != config.eos_id]
        assert f"--- beam {r + 1}: score {ref.scores[0, r]:.4f}" in out and "ROMEO:" + enc.decode(tokens) + "\n" in out
    assert main([*argv, "--length-penalty", "2"]) == 2
    assert "--length-penalty needs --num-beams" in capsys.readouterr().err
    assert main([*argv, "--num-beams", "2", "--stream"]) == 2
    assert "--num-beams does not take --stream" in capsys.readouterr().err
    assert main([*argv, "--num-beams", "1000000"]) == 2  # beam_search's check, not a cache sized for 2**20 rows
    assert "num_beams must be an int in [1, 64], got 1000000" in capsys.readouterr().err
