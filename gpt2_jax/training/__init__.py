"""Learning the weights: the loss, the train step, the loop behind gpt2-jax train, and token data.

step.py       loss_fn, Hyper, make_optimizer (AdamW, warmup + cosine, clipping), make_train_step
loss_head.py  the unembedding and cross-entropy fused, a chunk of tokens at a time
loop.py       train(): keyed batches, eval, orbax checkpoints, bit-exact resume, history and plot
data.py       text -> uint16 memmaps, served as keyed random windows
"""

from gpt2_jax.training.data import TokenData
from gpt2_jax.training.loop import train
from gpt2_jax.training.step import Hyper, TrainState, eval_loss, init_state, loss_fn, make_optimizer, make_train_step

__all__ = [
    "Hyper",
    "TokenData",
    "TrainState",
    "eval_loss",
    "init_state",
    "loss_fn",
    "make_optimizer",
    "make_train_step",
    "train",
]
