"""GPT-2 as a Flax NNX module: gpt2_jax's params and pure functions behind an nnx.Module.

module.py  GPT2LMHead (build, from_pretrained, from_params, params(); calls that are forward, generate,
           run_with_cache) and save(dst, nnx.state(model), config)
tree.py    the params pytree as modules (Block, Attention, MLP, Linear, LayerNorm), each leaf an nnx.Param
           holding the pytree's own array; params_of(state) goes back

    from flax import nnx
    from gpt2_jax.nnx import GPT2LMHead
    model = GPT2LMHead.from_pretrained(gpt2_jax.BUNDLED_MODEL, dtype="float32", rngs=nnx.Rngs(0))
    nnx.display(model)
    opt = nnx.Optimizer(model, gpt2_jax.make_optimizer(gpt2_jax.Hyper(lr=1e-3)), wrt=nnx.Param)

A layer above generation, training, interp and checkpoints: nothing below imports it, so `import gpt2_jax`
does not import flax until gpt2_jax.nnx is used.
"""

from gpt2_jax.nnx.module import GPT2LMHead, save
from gpt2_jax.nnx.tree import Linear, params_of

__all__ = ["GPT2LMHead", "Linear", "params_of", "save"]
