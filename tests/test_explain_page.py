"""The explainer page (gpt2_jax/interp/static/explain.html) in a real browser (Debian's chromium through
Playwright): saved as one standalone file and opened with no server, and served by `gpt2-jax explain` at
/explain, where it asks POST /v1/explain for the view on screen. Every number checked is one the page
displays (a data-* attribute, 9 significant digits, which round-trip float32), compared bit for bit with the
library's own: run_with_cache, the logit lens, the sampling filters, generate. The page may ask nothing of
any host but the one that served it.

One browser serves the module; the served tests share one server per model: the bundled one, then a random
12-layer checkpoint of gpt2-small's widths.
"""

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("playwright")

import gpt2_jax
from gpt2_jax.interp import decode_array
from tests.reference import make_hf_model
from tests.servers import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

PROMPT = "ROMEO: What light through yonder"
SETTINGS = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
SEED = 5
WAIT = 180_000  # ms: the first request of a view compiles its program on a slow runner
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]  # fmt: skip
HANGUL = re.compile("[\uac00-\ud7a3]")


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def shown(values):
    """The page's 9-digit strings -> float32 (9 digits round-trip, "-Infinity" included)."""
    return np.array([float(v) for v in values], np.float32)


@pytest.fixture(scope="module")
def model():
    return gpt2_jax.load(gpt2_jax.BUNDLED_MODEL, dtype="float32")  # what the server computes with on a CPU


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module", params=["bundled", "gpt2-small widths"])
def served(request, tmp_path_factory, model):
    """`gpt2-jax explain` on the bundled model, then on a random 12-layer gpt2-small-width checkpoint (12 heads
    of 64, D = 768) saved with save_pretrained -> (server, (params, config) as the server computes them)."""
    pytest.importorskip("fastapi")
    checkpoint, loaded = [], model
    if request.param != "bundled":
        path = tmp_path_factory.mktemp("gpt2-small-widths")
        make_hf_model(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=256, seed=2).save_pretrained(
            path
        )
        checkpoint, loaded = ["--model", str(path)], gpt2_jax.load(path, dtype="float32")
    s = Server(tmp_path_factory.mktemp("jax-cache"), [*checkpoint, "--max-batch", "2", "--max-seq", "128"],
               command="explain")  # fmt: skip
    s.start()
    s.wait()
    # `gpt2-jax explain` is `serve` that also tells the user where to point a browser (the line after "ready on")
    want, deadline = f"the explainer: {s.url}/explain\n", time.monotonic() + 30
    while want not in s.lines and time.monotonic() < deadline:
        time.sleep(0.1)
    assert want in s.lines, "".join(s.lines[-20:])
    yield s, loaded
    s.stop()


class Page:
    """A browser tab whose every request is checked: those to `allowed` go through, any other is aborted and
    kept in `others`; the bodies of POST /v1/explain are kept in `asked`."""

    def __init__(self, browser, allowed):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.requests, self.others, self.asked = [], [], []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.route("**/*", self._route)
        self.allowed = allowed

    def _route(self, route):
        req = route.request
        if not req.url.startswith(self.allowed):
            self.others.append(req.url)
            return route.abort()
        if req.url.endswith("/v1/explain"):
            self.asked.append(json.loads(req.post_data))
        route.continue_()

    def settle(self):
        """Waits for the page's last fetch and drawing to end: 'ready', or 'error' with #error saying why."""
        self.page.wait_for_function(
            "['ready', 'error'].includes(document.getElementById('status').dataset.state)", timeout=WAIT
        )
        return self.page.get_attribute("#status", "data-state")

    def do(self, action, *args):
        getattr(self.page, action)(*args)
        return self.settle()

    def view(self, name):
        assert self.do("click", f"nav button[data-view={name}]") == "ready", self.page.inner_text("#error")

    def data(self, selector):
        return self.page.eval_on_selector_all(selector, "els => els.map(e => ({...e.dataset}))")

    def text(self, selector):
        return self.page.inner_text(selector)

    def words(self):
        """Every explanation paragraph on screen."""
        return self.page.eval_on_selector_all("main .explain", "els => els.map(e => e.textContent)")


def matrix(cells, n):
    """#head-stage's cells -> [n, n] float32 from their displayed values."""
    out = np.zeros((n, n), np.float32)
    for c in cells:
        out[int(c["i"]), int(c["j"])] = shown([c["value"]])[0]
    return out


def test_the_saved_page_works_offline(model, browser, tmp_path):
    """explain(...).save(): one file, no server. Its tokens are the tokenizer's, a head's every stage cell is
    the embedded data's bits, and the Korean words swap in and out while the numbers stay."""
    params, config = model
    ex = gpt2_jax.interp.explain(params, config, PROMPT, seed=3, steps=2, temperature=0.8, top_k=40, top_p=0.9)
    url = Path(ex.save(tmp_path / "page.html")).as_uri()
    p = Page(browser, url)
    p.page.goto(url)
    assert p.settle() == "ready", p.text("#error")
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    assert [(int(t["id"]), int(t["pos"])) for t in p.data("#tokens .tok")] == [(t, i) for i, t in enumerate(ids)]
    assert p.page.is_visible("#saved-note") and "gpt2-jax explain" in p.text("#saved-note")
    assert p.page.is_disabled("#run") and p.page.is_disabled("#temperature")

    p.view("layer")
    last = config.n_layer - 1
    assert p.do("select_option", "#layer", str(last)) == "ready"
    assert p.do("click", "#heads .head[data-head='2']") == "ready"
    T = len(ids)
    for stage in ("raw", "masked", "softmax"):
        assert p.do("click", f"#head-stages button[data-stage={stage}]") == "ready"
        assert p.page.get_attribute("#head-stage", "data-head") == "2"
        want = decode_array(ex.data["layers"][last][f"stage_{stage}"])[2]
        assert np.array_equal(bits(matrix(p.data("#head-stage td"), T)), bits(want)), stage
    assert want[0, 1] == 0  # the masked score's weight: exactly 0
    p.page.hover("#head-stage td[data-i='4'][data-j='1']")
    value = p.page.get_attribute("#head-stage td[data-i='4'][data-j='1']", "data-value")
    assert p.text("#readout") == f"blocks.{last}.stage_softmax[2,4,1] = {value}"
    pre = decode_array(ex.data["layers"][last]["mlp_pre"])
    strip = p.data("#mlp-pre .cell")
    assert [int(c["t"]) for c in strip] == [T - 1] * 64 and [int(c["f"]) for c in strip] == list(range(64))
    assert np.array_equal(bits(shown([c["value"] for c in strip])), bits(pre[T - 1, :64]))

    english = p.words()
    numbers = [c["value"] for c in p.data("[data-value]")]
    assert p.do("click", "#lang") == "ready"
    korean = p.words()
    assert (
        all(HANGUL.search(k) for k in korean)
        and len(korean) == len(english) > 5
        and p.page.get_attribute("html", "lang") == "ko"
    )
    assert [c["value"] for c in p.data("[data-value]")] == numbers
    assert p.do("click", "#lang") == "ready"
    assert p.words() == english and not HANGUL.search(p.text("main"))

    for view in ("embedding", "output", "sampling", "lens", "dropout", "steps"):
        p.view(view)  # every view draws from the embedded data alone
    assert [int(r["token"]) for r in p.data("#kv .kvrow")] == ex.data["steps"]["tokens"]
    assert all(u == url for u in p.requests) and not p.others, p.requests
    p.page.close()


def test_the_served_page_shows_run_with_caches_bits(served, browser):
    """Type a prompt: the tokens are the tokenizer's; a head's pattern, an MLP pre-activation window and
    every logit-lens cell are run_with_cache's bits; a layer is asked for only when paged to."""
    server, (params, config) = served
    p = Page(browser, server.url + "/")
    p.page.goto(server.url + "/explain")
    assert p.settle() == "ready", p.text("#error")
    p.page.fill("#prompt", PROMPT)
    assert p.do("click", "#run") == "ready", p.text("#error")
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    T = len(ids)
    assert [int(t["id"]) for t in p.data("#tokens .tok")] == ids
    assert [int(t["pos"]) for t in p.data("#tokens .tok")] == list(range(T))
    _, cache = gpt2_jax.run_with_cache(params, np.array([ids]), config)

    p.view("layer")
    assert p.do("select_option", "#layer", "2") == "ready"
    assert [b.get("layer") for b in p.asked if b["view"] == "layer"] == [0, 2]
    assert p.do("click", "#heads .head[data-head='1']") == "ready"
    # The layer view sends one head's stages: opening head 1 asks for it.
    assert [(b.get("layer"), b.get("head")) for b in p.asked if b["view"] == "layer"] == [(0, 0), (2, 0), (2, 1)]
    assert p.do("click", "#head-stages button[data-stage=softmax]") == "ready"
    pattern = matrix(p.data("#head-stage td"), T)
    assert np.array_equal(bits(pattern), bits(cache["blocks.2.attn.hook_pattern"][0, 1]))
    assert p.do("click", "#head-stages button[data-stage=masked]") == "ready"
    scores = matrix(p.data("#head-stage td"), T)
    assert np.array_equal(bits(scores), bits(cache["blocks.2.attn.hook_attn_scores"][0, 1]))
    assert p.do("select_option", "#mlp-token", "3") == "ready"
    assert p.do("select_option", "#mlp-from", "64") == "ready"
    strip = p.data("#mlp-pre .cell")
    assert [(int(c["t"]), int(c["f"])) for c in strip] == [(3, f) for f in range(64, 128)]
    want = cache["blocks.2.mlp.hook_pre"][0, 3, 64:128]
    assert np.array_equal(bits(shown([c["value"] for c in strip])), bits(want))

    p.view("lens")
    import jax

    resid = gpt2_jax.interp.accumulated_resid(cache, config)[:, 0]  # [L + 1, T, D]
    lens = p.data("#lens td")
    assert len(lens) == (config.n_layer + 1) * T
    for depth in range(config.n_layer + 1):
        probs = np.asarray(jax.nn.softmax(gpt2_jax.interp.logit_lens(params, resid[depth], config), axis=-1))
        row = sorted((c for c in lens if int(c["depth"]) == depth), key=lambda c: int(c["pos"]))
        assert [int(c["id"]) for c in row] == probs.argmax(-1).tolist(), depth
        assert np.array_equal(bits(shown([c["value"] for c in row])), bits(probs.max(-1))), depth
    target = int(p.page.get_attribute("#dla", "data-target"))  # the drawn token, attributed by head
    heads = gpt2_jax.interp.head_attribution(params, cache, config, target)
    cells = p.data("#dla-heads td.head")
    assert len(cells) == config.n_layer * config.n_head
    got = np.zeros((config.n_layer, config.n_head), np.float32)
    for c in cells:
        got[int(c["layer"]), int(c["head"])] = float(c["value"])
    assert np.array_equal(bits(got), bits(heads.heads[0]))
    assert not p.others, p.others
    p.page.close()


def test_the_served_sampling_stages_and_steps_are_the_librarys(served, browser):
    """Composed settings (temperature, top-k, top-p, min-p and a repetition penalty at once): each stage's kept
    count and top probabilities are the library's filters; N steps and Step give generate's tokens."""
    from gpt2_jax.sampling import next_token_probs, process_logits

    server, (params, config) = served
    ids = gpt2_jax.tokenizer().encode(PROMPT)
    p = Page(browser, server.url + "/")
    p.page.goto(server.url + "/explain")
    assert p.settle() == "ready", p.text("#error")
    p.page.fill("#prompt", PROMPT)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "logit_bias"):
        p.page.fill(f"#{name}", str(SETTINGS.get(name, "")))
    p.page.fill("#seed", str(SEED))
    assert p.do("click", "#run") == "ready", p.text("#error")
    p.view("sampling")
    assert p.asked[-1]["settings"] == SETTINGS and p.asked[-1]["seed"] == SEED

    logits = gpt2_jax.forward(params, np.array([ids]), config)[:, -1]
    processed = process_logits(logits, prompts=[ids], eos_id=config.eos_id, repetition_penalty=1.3)
    off = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    order = ("temperature", "top_k", "top_p", "min_p")
    stages = p.data("#stages .stage")
    assert [s["stage"] for s in stages] == ["raw", "processors", *order]
    for k, stage in enumerate(stages):
        on = order[: max(0, k - 1)]  # the warpers up to this stage, in generate's order
        w = {**off, **{name: SETTINGS[name] for name in on}}
        probs = np.asarray(next_token_probs(logits if k == 0 else processed, n_valid=config.valid_vocab, **w))[0]
        assert int(stage["kept"]) == int((probs > 0).sum()), stage["stage"]
        q = probs[probs > 0].astype(np.float64)
        assert float(stage["entropy"]) == pytest.approx(-(q * np.log(q)).sum(), rel=1e-9, abs=1e-12)
        bars = p.data(f"#stages .stage[data-stage={stage['stage']}] .bar")
        top = np.lexsort((np.arange(probs.size), -probs))[: len(bars)]
        assert [int(b["id"]) for b in bars] == top.tolist(), stage["stage"]
        assert np.array_equal(bits(shown([b["p"] for b in bars])), bits(probs[top])), stage["stage"]
    kept = [int(s["kept"]) for s in stages]
    assert kept[:3] == [config.vocab_size] * 3 and kept[3] == 50 and kept[3] >= kept[4] >= kept[5] >= 1

    want = gpt2_jax.generate(params, config, [ids], seed=SEED, max_new_tokens=5, **SETTINGS).tokens[0].tolist()
    assert int(p.page.get_attribute("#draw", "data-token")) == want[0]
    p.view("steps")
    p.page.fill("#steps-n", "4")
    assert p.do("click", "#steps-run") == "ready", p.text("#error")
    rows = p.data("#kv .kvrow")
    assert [int(r["token"]) for r in rows] == want[:4]
    assert rows[0]["reused"] == "0" and rows[0]["new"] == ",".join(map(str, range(len(ids))))
    assert [int(r["reused"]) for r in rows[1:]] == [len(ids), len(ids) + 1, len(ids) + 2]
    assert p.do("click", "#step") == "ready", p.text("#error")  # appends the drawn token, asks again from there
    assert [int(t["id"]) for t in p.data("#tokens .tok")] == ids + want[:1]
    assert [int(r["token"]) for r in p.data("#kv .kvrow")] == want[1:5]
    assert not p.others, p.others
    p.page.close()


def test_bad_input_gets_a_clear_message_and_a_400(served, browser):
    """An empty prompt, a prompt over the context and an unknown layer: the endpoint answers 400 and the page
    shows its message in #error; a good run afterwards clears it."""
    server, _ = served
    p = Page(browser, server.url + "/")
    statuses = []
    p.page.on("response", lambda r: statuses.append(r.status) if r.url.endswith("/v1/explain") else None)
    p.page.goto(server.url + "/explain")
    assert p.settle() == "ready", p.text("#error")
    for prompt, words in (("", "empty"), ("O " * 300, "context")):
        p.page.fill("#prompt", prompt)
        assert p.do("click", "#run") == "error"
        status, body = server.post("/v1/explain", json.dumps({"prompt": prompt, "view": "tokens"}).encode())
        assert status == 400 and statuses[-1] == 400 and words in body["error"]["message"], body
        assert p.text("#error") == body["error"]["message"]
    p.page.fill("#prompt", "ROMEO:")
    assert p.do("click", "#run") == "ready" and p.text("#error") == ""
    status, body = server.post("/v1/explain", json.dumps({"prompt": "ROMEO:", "view": "layer", "layer": 99}).encode())
    assert status == 400 and "unknown layer" in body["error"]["message"], body
    p.page.evaluate("explainer.state.view = 'layer'; explainer.state.layer = 99; explainer.show()")
    assert p.settle() == "error" and statuses[-1] == 400
    assert p.text("#error") == body["error"]["message"]
    assert not p.others, p.others
    p.page.close()
