"""Look inside GPT-2: capture and edit any activation under TransformerLens's hook names.

run_with_cache(params, tokens, config, names=None) -> (logits, {name: activation})
run_with_hooks(params, tokens, config, hooks={name: fn}) -> logits (differentiable, vmappable)
hooks({name: fn}) -> Hooks: the hashable form that model.forward_cached (generation) takes
hook_names(config): every name, in forward order
logit_lens, accumulated_resid, direct_logit_attribution, activation_patching: tools on top
"""

from gpt2_jax.interp.hooks import BLOCK_POINTS, Hooks, hook_names, hooks
from gpt2_jax.interp.lens import Attribution, accumulated_resid, direct_logit_attribution, dla_names, logit_lens
from gpt2_jax.interp.patching import Patching, activation_patching
from gpt2_jax.interp.run import run_with_cache, run_with_hooks, traced

__all__ = [
    "BLOCK_POINTS",
    "Attribution",
    "Hooks",
    "Patching",
    "accumulated_resid",
    "activation_patching",
    "direct_logit_attribution",
    "dla_names",
    "hook_names",
    "hooks",
    "logit_lens",
    "run_with_cache",
    "run_with_hooks",
    "traced",
]  # fmt: skip
