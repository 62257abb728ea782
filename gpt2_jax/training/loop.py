"""The training loop behind `gpt2-jax train`: keyed batches, periodic eval, orbax checkpoints, bit-exact resume.

out/ holds checkpoints/ (orbax CheckpointManager: step, params, optimizer state), history.json (every
step's loss, every eval's val loss), model/ (the final gpt2_jax checkpoint, loadable by generate) and
loss.png. The batch and dropout keys of step s are fold_in(key, s), so a run resumed from step s
computes exactly the losses the uninterrupted run did.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gpt2_jax.checkpoints import native
from gpt2_jax.config import PRESETS, GPT2Config
from gpt2_jax.errors import CheckpointError, ConfigError, GPT2JaxError
from gpt2_jax.model.params import Params, init_params, stack_layers
from gpt2_jax.parallel.sharding import onto_mesh, shard_params
from gpt2_jax.training.data import TokenData
from gpt2_jax.training.run_dir import check_writable, checkpoint_manager, make_dir, progress_bar, write_json
from gpt2_jax.training.step import Hyper, TrainState, eval_loss, init_state, make_optimizer, make_train_step


def parse_config(spec: str) -> GPT2Config:
    """A preset name, a JSON file of GPT2Config fields, or inline JSON."""
    if spec in PRESETS:
        return GPT2Config.preset(spec)
    text = spec if spec.lstrip().startswith("{") else None
    if text is None and Path(spec).is_file():
        text = Path(spec).read_text()
    try:
        fields = json.loads(text or "")
    except ValueError:
        raise ConfigError(
            f"--config {spec!r} is neither a preset ({', '.join(PRESETS)}), a JSON file, nor JSON"
        ) from None
    return GPT2Config.from_dict(fields)


def initial_params(init: str, config: GPT2Config | None, key: jax.Array) -> tuple[Params, GPT2Config]:
    """--init scratch (needs --config) or a checkpoint path (whose config must match --config, if given)."""
    if init == "scratch":
        if config is None:
            raise ConfigError("--init scratch needs --config (a preset name or JSON)")
        return init_params(key, config, stacked=True), config  # training steps the stacked form
    from gpt2_jax.checkpoints.loading import load

    params, found = load(init, dtype="float32")
    if config is not None and config != found:
        diff = {
            f: (getattr(config, f), getattr(found, f))
            for f in config.to_dict()
            if getattr(config, f) != getattr(found, f)
        }
        raise ConfigError(f"--config does not match --init {init}: {diff} (--config value, checkpoint value)")
    return stack_layers(params), found


def train(
    data: str,
    out: str,
    *,
    config: GPT2Config | None,
    init: str,
    hyper: Hyper,
    batch_size: int,
    block_size: int,
    accum: int = 1,
    seed: int = 0,
    eval_every: int = 100,
    eval_batches: int = 8,
    ckpt_every: int = 200,
    resume: bool = False,
    progress: bool = True,
    mesh: Any = None,
    remat: bool = False,
    dropout: float | None = None,
) -> dict[str, Any]:
    """Train and return the history {"loss": [...], "val": [[step, loss], ...]}. With a mesh
    (gpt2_jax.parallel.sharding.make_mesh) params and optimizer state are sharded and each step is data-
    and tensor-parallel; checkpoints are written shard by shard and restored into the same layout.
    With several processes (gpt2_jax.parallel.distributed) every one runs this with the same arguments, on
    one shared file system; process 0 writes history.json and loss.png. remat: recompute each block's
    activations in the backward instead of keeping them (less memory, more time). dropout: set the
    embd/attn/resid rates of the config (--config's or, fine-tuning, the checkpoint's)."""
    out_dir = Path(out)
    # Everything that can be wrong with the arguments is checked before anything is written.
    check_writable(out_dir)
    tokens = TokenData(data)
    key = jax.random.key(seed)
    params, config = initial_params(init, config, jax.random.fold_in(key, 0))
    if dropout is not None:  # after the --config / checkpoint comparison, which it must not fail
        config = config.replace(embd_pdrop=dropout, attn_pdrop=dropout, resid_pdrop=dropout)
    if block_size > config.n_positions:
        raise ConfigError(f"--block-size {block_size} exceeds the model's context n_positions={config.n_positions}")
    tokens.check_block_size(block_size)
    created = not out_dir.exists()
    make_dir(out_dir)
    try:
        return _run(out_dir, tokens, key, params, config, hyper, batch_size, block_size, accum, eval_every,
                    eval_batches, ckpt_every, resume, progress, mesh, remat)  # fmt: skip
    except BaseException:
        if created and jax.process_index() == 0 and not any((out_dir / "checkpoints").glob("[0-9]*")):
            shutil.rmtree(out_dir, ignore_errors=True)  # nothing worth keeping (no checkpoint to resume from)
        raise


def _run(
    out_dir: Path,
    tokens: TokenData,
    key: jax.Array,
    params: Params,
    config: GPT2Config,
    hyper: Hyper,
    batch_size: int,
    block_size: int,
    accum: int,
    eval_every: int,
    eval_batches: int,
    ckpt_every: int,
    resume: bool,
    progress: bool,
    mesh: Any,
    remat: bool,
) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    if mesh is not None:
        params = shard_params(params, config, mesh)  # AdamW's moments inherit this layout
    optimizer = make_optimizer(hyper)
    step_fn = make_train_step(config, optimizer, remat=remat)
    state = init_state(params, optimizer)
    if mesh is not None:
        state = onto_mesh(state, mesh)  # counters too: a resumed state must come back on the mesh
    manager = checkpoint_manager(out_dir)
    history: dict[str, Any] = {"loss": [], "val": [], "unigram_val": tokens.unigram_loss()}
    if resume and manager.latest_step() is not None:
        state = _restored(manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state)), out_dir)
        saved = json.loads((out_dir / "history.json").read_text())
        done = int(state.step)
        history = {**saved, "loss": saved["loss"][:done], "val": [v for v in saved["val"] if v[0] <= done]}
    elif manager.latest_step() is not None:
        raise GPT2JaxError(f"{out_dir} already holds checkpoints; pass --resume to continue, or use a new --out")

    data_key, drop_key, eval_key = (jax.random.fold_in(key, i) for i in (1, 2, 3))
    val_batches = np.stack(
        [tokens.batch("val", jax.random.fold_in(eval_key, i), batch_size, block_size) for i in range(eval_batches)]
    )  # fixed: every eval scores the same windows

    def batch_of(s: int) -> np.ndarray:  # [accum, B, T+1]: step s's micro-batches
        return np.stack([tokens.batch("train", jax.random.fold_in(jax.random.fold_in(data_key, s), a), batch_size,
                                      block_size) for a in range(accum)])  # fmt: skip

    bar = progress_bar(int(state.step), hyper.steps, progress)
    rate = RecentRate()
    start = int(state.step)
    batch = batch_of(start) if start < hyper.steps else None
    t0 = time.perf_counter()
    for s in range(start, hyper.steps):
        if batch is None:  # made ahead for every step the loop runs
            raise GPT2JaxError(f"training step {s} has no batch")
        state, metrics = step_fn(state, batch, jax.random.fold_in(drop_key, s))  # returns before the step ends
        n_tokens = batch.size - batch.shape[0] * batch.shape[1]
        batch = batch_of(s + 1) if s + 1 < hyper.steps else None  # the host's work overlaps the step's
        history["loss"].append(float(metrics["loss"]))  # waits for the step
        t1 = time.perf_counter()
        rate.add(t1 - t0, n_tokens)  # from the end of the previous step (or its eval/checkpoint) to this one's
        done = s + 1
        evaluate, save = (done % every == 0 or done == hyper.steps for every in (eval_every, ckpt_every))
        if evaluate:
            history["val"].append([done, eval_loss(state.params, val_batches, config)])
        if save:
            manager.save(done, args=ocp.args.StandardSave(state))  # with several processes: each its shards
            manager.wait_until_finished()
            write_json(out_dir / "history.json", history)
        bar.update(1)
        bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", val=f"{history['val'][-1][1]:.3f}" if history["val"] else "-",
                        tok_s=f"{rate.rate():.0f}", first_step=f"{rate.first_s:.1f}s")  # fmt: skip
        t0 = time.perf_counter() if evaluate or save else t1  # an eval or a checkpoint is not the next step's time
    history["first_step_s"], history["tokens_per_s"] = rate.first_s, rate.rate()
    bar.close()
    native.save(out_dir / "model", state.params, config, force=True)
    write_json(out_dir / "history.json", history)
    if jax.process_index() == 0:
        plot_history(history, out_dir / "loss.png")
    return history


class RecentRate:
    """Training tokens/s over the last `window` steps, excluding the first step (which compiles; its time,
    compile included, is first_s). Eval and checkpoint time are not steps, so they are not counted."""

    def __init__(self, window: int = 20):
        self.first_s, self.steps = 0.0, collections.deque(maxlen=window)

    def add(self, seconds: float, n_tokens: int) -> None:
        if self.first_s == 0.0:
            self.first_s = seconds
        else:
            self.steps.append((seconds, n_tokens))

    def rate(self) -> float:
        seconds = sum(t for t, _ in self.steps)
        return sum(n for _, n in self.steps) / seconds if seconds > 0 else 0.0


def _restored(restored: Any, out_dir: Path) -> TrainState:
    """orbax's restore of a TrainState: it gives back the structure it was handed."""
    if not isinstance(restored, TrainState):
        raise CheckpointError(
            f"{out_dir}: the latest checkpoint restored as a {type(restored).__name__}, not a TrainState"
        )
    return restored


def plot_history(history: dict[str, Any], path: Path) -> None:
    """Training loss per step, val loss per eval, and the unigram baseline, as a PNG."""
    from matplotlib.figure import Figure  # a Figure of its own: no pyplot, the caller's backend is untouched

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(np.arange(1, len(history["loss"]) + 1), history["loss"], label="train loss", alpha=0.7)
    if history["val"]:
        steps, vals = zip(*history["val"])
        ax.plot(steps, vals, "o-", label="val loss")
    ax.axhline(history["unigram_val"], color="gray", ls="--", label="unigram baseline (val)")
    ax.set_title("GPT-2 training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
