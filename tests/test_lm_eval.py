"""lm-evaluation-harness against the server (its local-completions model) gives, item for item, the
loglikelihoods of its own hf backend on the same weights (the bundled model exported with convert --to-hf):
a multiple-choice task and a perplexity task shipped in tests/data/lm_eval. The server scores prompts with
the decode step's arithmetic in float32, so what differs is float32 rounding summed over an item's tokens."""

import os

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from gpt2_jax import BUNDLED_MODEL  # noqa: E402
from gpt2_jax.cli.convert import main as convert_main  # noqa: E402
from tests.servers import Server  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "lm_eval")
TASKS = {
    "gpt2jax_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                  "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n",
    "gpt2jax_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                   "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}  # fmt: skip
FILES = {"gpt2jax_mc": "mc.jsonl", "gpt2jax_ppl": "ppl.jsonl"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    export = root / "hf"
    assert convert_main([str(BUNDLED_MODEL), str(export), "--to-hf", "--dtype", "float32"]) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():  # the data files' absolute paths go into each task's yaml
        path = os.path.join(DATA, FILES[name])
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
        (tasks / f"{name}.yaml").write_text(head + body)
    server = Server(root / "jax-cache", ["--max-seq", "256"])
    server.start()
    server.wait()
    yield export, tasks, server
    server.stop()


def run(model: str, args: str, tasks):
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=list(TASKS), batch_size=1, device="cpu",
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=True)  # fmt: skip
    return {t: np.array([[r[0] if isinstance(r, tuple | list) else r for r in s["filtered_resps"]]
                         for s in out["samples"][t]], np.float64) for t in TASKS}, out["results"]  # fmt: skip


def test_lm_eval_through_the_server_equals_its_hf_backend(setup, monkeypatch):
    export, tasks, server = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours, ours_results = run("local-completions", f"base_url={server.url}/v1/completions,model=shakespeare,"
                             f"tokenizer={export},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", tasks)  # fmt: skip
    theirs, theirs_results = run("hf", f"pretrained={export},dtype=float32", tasks)
    for task in TASKS:
        assert ours[task].shape == theirs[task].shape and ours[task].size > 0
        worst = np.abs(ours[task] - theirs[task]).max()
        print(f"{task}: {ours[task].size} loglikelihoods, largest difference {worst:.2e}")
        assert worst <= 1e-3, (task, ours[task], theirs[task])
    assert ours_results["gpt2jax_mc"]["acc,none"] == theirs_results["gpt2jax_mc"]["acc,none"]
    ppl = ours_results["gpt2jax_ppl"]["word_perplexity,none"], theirs_results["gpt2jax_ppl"]["word_perplexity,none"]
    assert abs(ppl[0] - ppl[1]) / ppl[1] < 1e-4, ppl
