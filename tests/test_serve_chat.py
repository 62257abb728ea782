"""/v1/chat/completions and the fields the standard tools send, over real HTTP on one server with a chat template
written here: a chat completion is, bit for bit, /v1/completions on the prompt transformers' apply_chat_template
renders from the same messages (tokenized by a HuggingFace tokenizer built from the same ranks), streamed or not,
with n choices and top logprobs; vLLM's extras (ignore_eos, stop_token_ids, max_completion_tokens,
continuous_usage_stats, skip_special_tokens, min_tokens, stop: null) do what vLLM's do; and AIPerf and GuideLLM,
from PyPI and unmodified (tests/load_tools.py), drive both endpoints with zero errors and the token counts asked.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from gpt2_jax import tokenizer  # noqa: E402
from gpt2_jax.checkpoints.hf_tokenizer import write_tokenizer  # noqa: E402
from gpt2_jax.errors import ConfigError  # noqa: E402
from gpt2_jax.serving import chat_template  # noqa: E402
from tests.load_tools import tool  # noqa: E402
from tests.servers import Server  # noqa: E402

MODEL = "shakespeare"
EOT = "<|endoftext|>"
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('roles are system, user and assistant, not ' + message['role']) }}
    {%- endif %}
    {{- message['role'] | upper + ': ' + message['content'] | trim + '\\n' }}
    {%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}
"""
MESSAGES = [{"role": "system", "content": "You speak as Romeo."}, {"role": "user", "content": "Who art thou?"},
            {"role": "assistant", "content": "A lover."}, {"role": "user", "content": "Speak on."}]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The template file and a HuggingFace tokenizer directory (GPT-2's, from the shipped ranks)."""
    d = tmp_path_factory.mktemp("chat")
    (d / "template.jinja").write_text(TEMPLATE)
    (d / "tokenizer").mkdir()
    write_tokenizer(d / "tokenizer", tokenizer(), 128)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    s = Server(tmp_path_factory.mktemp("jax-cache"), ["--max-batch", "4", "--max-queue", "16", "--max-seq", "128",
                                                      "--chat-template", str(files / "template.jinja")])  # fmt: skip
    s.start()
    s.wait()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(files):
    return transformers.PreTrainedTokenizerFast.from_pretrained(files / "tokenizer")


def bits(values):
    return np.asarray(values, np.float32).view(np.uint32).tolist()


def rendered_ids(hf, messages):
    """The reference prompt: transformers renders the template and its tokenizer tokenizes the text."""
    text = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


def chat_logprobs(lp):
    """Chat's logprobs content -> (token strings, logprobs, [[(top token, top logprob)]])."""
    return ([t.token for t in lp.content], [t.logprob for t in lp.content],
            [[(a.token, a.logprob) for a in t.top_logprobs] for t in lp.content])  # fmt: skip


# ---- chat = completions on the rendered prompt ----------------------------------------------------------------
def test_chat_is_a_completion_on_the_rendered_prompt_bit_for_bit(server, hf):
    client = server.client()
    settings = dict(model=MODEL, max_tokens=10, n=2, seed=5, temperature=0.9)
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **settings)
    ids = rendered_ids(hf, MESSAGES)
    assert ids.count(50256) == 2  # the template's bos_token and eos_token are the special token, as HF's are
    done = client.completions.create(prompt=ids, logprobs=3, **settings)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.usage.model_dump() == done.usage.model_dump() and chat.usage.prompt_tokens == len(ids)
    assert len(chat.choices) == 2
    for c, d in zip(sorted(chat.choices, key=lambda c: c.index), sorted(done.choices, key=lambda c: c.index)):
        assert c.message.role == "assistant" and c.message.content == d.text and c.finish_reason == d.finish_reason
        tokens, lps, tops = chat_logprobs(c.logprobs)
        assert tokens == d.logprobs.tokens and bits(lps) == bits(d.logprobs.token_logprobs)
        assert [[t for t, _ in top] for top in tops] == [list(top) for top in d.logprobs.top_logprobs]
        assert [bits([v for _, v in top]) for top in tops] == [
            bits(list(top.values())) for top in d.logprobs.top_logprobs
        ]
        shown = [bytes(t.bytes) for t in c.logprobs.content][: -1 if c.finish_reason == "stop" else None]  # EOS
        assert b"".join(shown).decode("utf-8", "replace") == c.message.content


def test_a_streamed_chat_is_the_plain_one(server):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=10, n=2, seed=5, temperature=0.9, logprobs=True,
                    top_logprobs=3)  # fmt: skip
    plain = {c.index: c for c in client.chat.completions.create(**settings).choices}
    got = {i: {"content": "", "roles": [], "finish": [], "tokens": []} for i in plain}
    for chunk in client.chat.completions.create(stream=True, **settings):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            g = got[c.index]
            g["roles"] += [c.delta.role] if c.delta.role else []
            g["content"] += c.delta.content or ""
            g["finish"] += [c.finish_reason] if c.finish_reason else []
            g["tokens"] += c.logprobs.content if c.logprobs else []
    for i, p in plain.items():
        assert got[i]["roles"] == ["assistant"] and got[i]["finish"] == [p.finish_reason]
        assert got[i]["content"] == p.message.content
        assert [(t.token, t.bytes) for t in got[i]["tokens"]] == [(t.token, t.bytes) for t in p.logprobs.content]
        assert bits([t.logprob for t in got[i]["tokens"]]) == bits([t.logprob for t in p.logprobs.content])


def test_content_parts_are_joined_and_the_templates_errors_are_400s(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who art "}, {"type": "text", "text": "thou?"}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, seed=1)
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Who art thou?"}],
                                       max_tokens=4, seed=1)  # fmt: skip
    assert a.choices[0].message.content == b.choices[0].message.content

    def bad(param, **kw):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kw})
        assert e.value.body["param"] == param, e.value.body
        return e.value.body

    body = bad("messages", messages=[{"role": "tool", "content": "x"}])  # the template's raise_exception
    assert "roles are system, user and assistant, not tool" in body["message"] and body["code"] == "chat_template_error"
    assert "text only" in bad("messages", messages=[{"role": "user", "content": [{"type": "image_url", "image_url":
                                                                                    {"url": "x"}}]}])["message"]  # fmt: skip
    assert "needs logprobs" in bad("top_logprobs", top_logprobs=2)["message"]
    assert "unknown field 'foo'" in bad("foo", extra_body={"foo": 1})["message"]
    assert bad("messages", messages=[])
    long = [{"role": "user", "content": "thou art " * 100}]  # over max_seq=128 tokens once rendered: completions' 400
    assert bad("max_tokens", messages=long)["code"] == "context_length_exceeded"
    huge = [{"role": "user", "content": "x" * (128 * 128)}]  # over the characters max_seq tokens can hold
    assert bad("messages", messages=huge)["code"] == "context_length_exceeded"


def test_a_template_that_does_not_parse_stops_the_server_naming_its_file(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor")
    out = subprocess.run([sys.executable, "-m", "gpt2_jax", "serve", "--port", "0", "--chat-template", str(bad)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"error: the chat template --chat-template {bad} does not parse: line 2" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_template_comes_from_tokenizer_config_without_the_flag(tmp_path, files):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": TEMPLATE}]}))  # fmt: skip
    found = chat_template.find(None, tmp_path / "model.safetensors")  # beside a checkpoint file too
    assert found is not None and "tokenizer_config.json" in found.origin
    assert found.render(MESSAGES, True, 10_000) == transformers.PreTrainedTokenizerFast.from_pretrained(
        files / "tokenizer").apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
    assert chat_template.find(None, files / "tokenizer") is None  # a tokenizer_config.json without one
    assert chat_template.find(str(files / "template.jinja"), tmp_path).origin.startswith("--chat-template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ConfigError, match="chat_template must be a string"):
        chat_template.find(None, tmp_path)


# ---- the fields the standard tools send ----------------------------------------------------------------------
def completion(server, **kw):
    status, body = server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "ROMEO:", **kw}).encode())
    assert status == 200, body
    return body["choices"][0], body["usage"]


def test_ignore_eos_runs_past_eos_and_stop_token_ids_end_the_row(server):
    """With EOS made likely (logit_bias), a seed whose row stops on EOS: with ignore_eos it runs to max_tokens, its
    first tokens the same bits; <|endoftext|> stays out of the text unless skip_special_tokens is false; a stop
    token id ends the row at its first occurrence, like EOS, and out of the text."""
    enc = tokenizer()
    base = {"max_tokens": 16, "logprobs": 0, "logit_bias": {"50256": 10}}
    for seed in range(8):
        stopped, _ = completion(server, seed=seed, **base)
        ran, _ = completion(server, seed=seed, ignore_eos=True, **base)
        tokens = ran["logprobs"]["tokens"]
        k = len(stopped["logprobs"]["tokens"])
        after = [t for t in tokens[k:] if t != EOT and enc.encode(t) and enc.decode(enc.encode(t)) == t]
        if stopped["finish_reason"] == "stop" and after:
            break
    else:
        pytest.fail("no seed in 0..7 stopped on EOS and sampled another token after it")
    assert stopped["logprobs"]["tokens"][-1] == EOT and EOT not in stopped["text"]
    assert ran["finish_reason"] == "length" and len(tokens) == 16
    assert tokens[:k] == stopped["logprobs"]["tokens"]
    assert bits(ran["logprobs"]["token_logprobs"][:k]) == bits(stopped["logprobs"]["token_logprobs"])
    assert ran["text"] == "".join(t for t in tokens if t != EOT)  # skip_special_tokens: true, the default
    kept, _ = completion(server, seed=seed, ignore_eos=True, skip_special_tokens=False, **base)
    assert kept["text"] == "".join(tokens) and EOT in kept["text"]  # tokens and logprobs unchanged:
    assert kept["logprobs"] == ran["logprobs"]
    stop_id = enc.encode_single_token(after[0].encode())
    cut, _ = completion(server, seed=seed, ignore_eos=True, stop_token_ids=[stop_id], **base)
    j = tokens.index(after[0], k)
    assert cut["finish_reason"] == "stop" and cut["logprobs"]["tokens"] == tokens[: j + 1]
    assert cut["text"] == "".join(t for t in tokens[:j] if t != EOT)


def test_max_completion_tokens_min_tokens_stop_null_and_their_errors(server):
    choice, usage = completion(server, max_completion_tokens=5, ignore_eos=True, stop=None, seed=1)
    assert usage["completion_tokens"] == 5 and choice["finish_reason"] == "length"
    choice, usage = completion(server, max_tokens=5, max_completion_tokens=5, seed=1)
    assert usage["completion_tokens"] <= 5
    # EOS all but certain, held back for min_tokens tokens (as vLLM's): it comes next, and counts
    choice, usage = completion(server, max_tokens=8, min_tokens=3, logit_bias={"50256": 100}, logprobs=0, seed=1)
    tokens = choice["logprobs"]["tokens"]
    assert usage["completion_tokens"] == 4 and EOT not in tokens[:3] and tokens[3] == EOT
    assert choice["finish_reason"] == "stop" and choice["text"] == "".join(tokens[:3])

    def bad(**kw):
        status, body = server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", **kw}).encode())
        assert status == 400, body
        return body["error"]

    err = bad(max_tokens=4, max_completion_tokens=5)
    assert err["param"] == "max_completion_tokens" and "max_tokens=4" in err["message"]
    err = bad(stop_token_ids=[50257])
    assert err["param"] == "stop_token_ids" and "50257" in err["message"]
    err = bad(stop_token_ids=list(range(9)))
    assert err["param"] == "stop_token_ids" and "at most 8" in err["message"]
    assert bad(ignore_eos=True, regex="[a-z]+")["param"] == "ignore_eos"
    assert bad(ignore_eos="yes")["param"] == "ignore_eos"
    assert "unknown field 'frobnicate'" in bad(frobnicate=1)["message"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    for endpoint, body in (("completions", {"prompt": "ROMEO:"}), ("chat.completions", {"messages": MESSAGES})):
        create = getattr(server.client(), endpoint.split(".")[0])
        create = create.completions if endpoint == "chat.completions" else create
        chunks = list(create.create(model=MODEL, max_tokens=6, seed=2, stream=True, **body,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
        used = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and used == sorted(used), used
        assert chunks[-1].choices == [] and used[-1] == chunks[-2].usage.completion_tokens > 0


# ---- the tools ---------------------------------------------------------------------------------------------
REQUESTS, PROMPT, OUTPUT = 4, 16, 8  # a handful of requests of 16 prompt tokens and exactly 8 output tokens


def served(server):
    """Completion requests answered 200 and completion tokens, from /metrics."""
    m = server.metrics()
    return m.get('gpt2_jax_requests_total{status="200"}', 0), m["gpt2_jax_completion_tokens_total"]


def run_tool(cmd, cwd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


@pytest.mark.parametrize("endpoint", ["chat"])  # GuideLLM drives completions (each run is ~25 s of tool start-up)
def test_aiperf_drives_the_server(server, files, tmp_path, endpoint):
    """AIPerf streams REQUESTS requests, two at a time, with max_completion_tokens (max_tokens on completions),
    ignore_eos and, on chat, per-chunk usage (continuous_usage_stats), counting tokens as the server reports them."""
    before = served(server)
    run_tool([*tool("aiperf"), "profile", "--model", MODEL, "--url", server.url, "--endpoint-type", endpoint,
              "--streaming", "--tokenizer", str(files / "tokenizer"), "--request-count", str(REQUESTS),
              "--concurrency", "2", "--prompt-input-tokens-mean", str(PROMPT), "--prompt-input-tokens-stddev", "0",
              "--prompt-output-tokens-mean", str(OUTPUT), "--prompt-output-tokens-stddev", "0", "--extra-inputs",
              "ignore_eos:true", "--use-server-token-count", "--random-seed", "1", "--output-artifact-dir",
              str(tmp_path / "out"), "--no-auto-plot", "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
              *(["--per-chunk-usage"] if endpoint == "chat" else [])],
             tmp_path)  # fmt: skip
    report = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert report["request_count"]["avg"] == REQUESTS and report["request_error_rate"]["avg"] == 0
    assert report["error_summary"] == [] and report["was_cancelled"] is False
    osl = report["output_sequence_length"]
    assert (osl["min"], osl["max"], osl["count"]) == (OUTPUT, OUTPUT, REQUESTS)
    after = served(server)
    assert (after[0] - before[0], after[1] - before[1]) == (REQUESTS, REQUESTS * OUTPUT)


@pytest.mark.parametrize("endpoint", ["/v1/completions"])  # AIPerf drives chat
def test_guidellm_drives_the_server(server, files, tmp_path, endpoint):
    """GuideLLM streams REQUESTS synthetic requests, one at a time, with ignore_eos, stop: null, max_tokens (or
    max_completion_tokens) and continuous_usage_stats."""
    before = served(server)
    run_tool([*tool("guidellm"), "run", "--backend", f"kind=openai_http,target={server.url},model={MODEL},"
              f"request_format={endpoint}", "--profile", "kind=synchronous", "--constraint",
              f"kind=max_requests,count={REQUESTS}", "--data",
              f"kind=synthetic_text,prompt_tokens={PROMPT},output_tokens={OUTPUT}", "--tokenizer",
              f"kind=huggingface_auto,model={files / 'tokenizer'}", "--output",
              f"kind=json,path={tmp_path / 'out.json'}", "--disable-console-interactive"], tmp_path)  # fmt: skip
    [bench] = json.loads((tmp_path / "out.json").read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, totals
    osl = bench["metrics"]["output_token_count"]["successful"]
    assert (osl["min"], osl["max"], osl["count"]) == (OUTPUT, OUTPUT, REQUESTS)
    after = served(server)
    assert (after[0] - before[0], after[1] - before[1]) == (REQUESTS, REQUESTS * OUTPUT)
