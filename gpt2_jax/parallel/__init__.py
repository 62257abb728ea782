"""Many devices and many hosts: meshes, how params are split over them, multi-process runs.

sharding.py     the ("data", "model") mesh, partition specs, shard_params (the activations' logical
                axes are gpt2_jax.model.axes)
distributed.py  several processes: jax.distributed.initialize, then one global mesh
"""

from gpt2_jax.parallel.distributed import initialize, is_main
from gpt2_jax.parallel.sharding import make_mesh, shard_params

__all__ = ["initialize", "is_main", "make_mesh", "shard_params"]
