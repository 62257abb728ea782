"""The explainer as one call: explain_data answers one view (what `gpt2-jax serve`'s POST /v1/explain
returns), and explain(params, config, prompt) gathers every view into an Explanation, which shows the page
(gpt2_jax/interp/static/explain.html) inline in Jupyter with its data embedded, or saves it as one
standalone offline HTML file.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from importlib import resources
from typing import Any

from gpt2_jax.config import GPT2Config
from gpt2_jax.errors import InputError
from gpt2_jax.interp import explain_views as views
from gpt2_jax.interp.explain_sampling import checked, sampling_view, steps_view

VIEWS = ("tokens", "embedding", "layer", "output", "sampling", "steps", "lens", "dla", "dropout")
MAX_STEPS = 64  # draws one request may ask for (each runs the prompt again)
DATA_MARK = "/*EXPLAIN_DATA*/null"  # where the page's embedded data goes


def _seed(seed: Any) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise InputError(f"seed must be an int in [0, 2**32), got {seed!r}")
    return seed


def explain_data(params, config: GPT2Config, prompt: Any, view: str, *, layer: Any = 0, head: Any = 0, outputs: Any = (),
                 settings: dict | None = None, seed: Any = 0, steps: Any = 1) -> dict:  # fmt: skip
    """One view of the prompt (text or ids) followed by `outputs` (ids drawn so far): "tokens", "embedding",
    "layer" (block `layer`, the stages of head `head`, every head's when None), "output", "sampling" (the stages and the draw), "steps" (`steps` draws),
    "lens", "dla" (of the token sampling draws), "dropout" (training mode on block `layer`)."""
    if view not in VIEWS:
        raise InputError(f"unknown view {view!r}; views: {', '.join(VIEWS)}")
    prompt = views.prompt_ids(prompt, config)
    outputs = list(outputs or [])
    ids = views.prompt_ids(prompt + outputs, config)
    settings, seed = dict(settings or {}), _seed(seed)
    checked(settings)
    layer = views.check_layer(layer, config) if view in ("layer", "dropout") else 0
    if view == "tokens":
        shape = {k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}
        return {**views.tokens_view(ids), "prompt_len": len(prompt), "config": shape}
    if view == "sampling":
        return sampling_view(params, config, prompt, outputs, settings, seed)
    if view == "steps":
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
            raise InputError(f"steps must be an int in [1, {MAX_STEPS}], got {steps!r}")
        return steps_view(params, config, prompt, outputs, steps, settings, seed)
    if view == "dropout":
        return views.dropout_view(params, config, ids, layer, seed)
    out = views.run(params, config, ids, layer)
    if view == "embedding":
        return views.embedding_view(out)
    if view == "layer":
        return views.layer_view(out, layer, views.check_head(head, config))
    if view == "output":
        return views.output_view(params, out, config)
    if view == "lens":
        return views.lens_view(params, out, config)
    target = sampling_view(params, config, prompt, outputs, settings, seed)["token"]
    return views.dla_view(params, out, config, target)


def page_html(data: dict | None = None) -> str:
    """The explainer page; with data (every view, as Explanation holds it) embedded, it needs no server."""
    page = resources.files("gpt2_jax.interp").joinpath("static/explain.html").read_text()
    if data is None:
        return page
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return page.replace(DATA_MARK, blob, 1)


class Explanation:
    """Every view of one prompt (`data`), shown inline in Jupyter and saved as one offline HTML page."""

    def __init__(self, data: dict):
        self.data = data

    def html(self) -> str:
        return page_html(self.data)

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:820px;'
                f'border:1px solid #ccc" sandbox="allow-scripts"></iframe>')  # fmt: skip

    def save(self, path: str | os.PathLike, force: bool = False) -> str:
        """Write the standalone page to `path` atomically (a temporary file, then a link or a rename);
        an existing file is refused unless force=True."""
        path = os.fspath(path)
        if os.path.exists(path) and not force:
            raise InputError(f"{path} exists; pass force=True to overwrite it")
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".explain-", suffix=".html")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.html())
            if force:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if the file appeared meanwhile: never a silent overwrite
        except FileExistsError:
            raise InputError(f"{path} exists; pass force=True to overwrite it") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path


def explain(params, config: GPT2Config, prompt: Any, *, seed: int = 0, steps: int = 4, model: str = "model",
            view: str = "tokens", **settings: Any) -> Explanation:  # fmt: skip
    """Every view of `prompt` (all L blocks, the sampling stages with `settings` (SamplingParams' names),
    `steps` seeded draws, the lens, DLA and dropout of block 0) -> an Explanation: display it in Jupyter,
    or .save("page.html") for a page that works offline. `view` is the one the page opens on."""
    if view not in VIEWS:
        raise InputError(f"unknown view {view!r}; views: {', '.join(VIEWS)}")
    kw = dict(settings=settings, seed=seed)
    one = lambda view, **more: explain_data(params, config, prompt, view, **kw, **more)
    data = {"model": model, "n_layer": config.n_layer, "n_head": config.n_head, "settings": settings, "seed": seed,
            "open": view,
            "tokens": one("tokens"), "embedding": one("embedding"),
            "layers": [one("layer", layer=l, head=None) for l in range(config.n_layer)], "output": one("output"),
            "sampling": one("sampling"), "steps": one("steps", steps=steps) if steps else None,
            "lens": one("lens"), "dla": one("dla"), "dropout": one("dropout", layer=0)}  # fmt: skip
    return Explanation(data)
