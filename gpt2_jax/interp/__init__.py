"""Look inside GPT-2: capture and edit any activation under TransformerLens's hook names.

run_with_cache(params, tokens, config, names=None) -> (logits, {name: activation})
run_with_hooks(params, tokens, config, hooks={name: fn}) -> logits (differentiable, vmappable)
hooks({name: fn}) -> Hooks: the hashable form that model.forward_cached (generation) takes
hook_names(config): every name, in forward order
logit_lens, accumulated_resid, direct_logit_attribution (and head_attribution, by head), activation_patching:
  tools on top
explain_data(params, config, prompt, view): one view of a prompt's real internals, floats lossless (the explainer's data)
explain(params, config, prompt, ...) -> Explanation: every view, shown inline in Jupyter or saved as one offline page
explain_page_html(data=None): the explainer page (`gpt2-jax serve` serves it at /explain)
"""

from gpt2_jax.interp.explain_page import Explanation, explain, explain_data
from gpt2_jax.interp.explain_views import decode_array
from gpt2_jax.interp.hooks import Hooks, hook_names, hooks
from gpt2_jax.interp.lens import accumulated_resid, direct_logit_attribution, head_attribution, logit_lens
from gpt2_jax.interp.patching import activation_patching
from gpt2_jax.interp.run import run_with_cache, run_with_hooks

__all__ = [
    "Explanation",
    "Hooks",
    "accumulated_resid",
    "activation_patching",
    "decode_array",
    "direct_logit_attribution",
    "explain",
    "explain_data",
    "head_attribution",
    "hook_names",
    "hooks",
    "logit_lens",
    "run_with_cache",
    "run_with_hooks",
]
