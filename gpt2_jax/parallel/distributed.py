"""Several hosts (processes): jax.distributed.initialize, then one global mesh over every process's devices.

Every process runs the same program (the same command, the same prompts, keys and data) with its own
process id; jax.distributed.initialize connects them through the coordinator (process 0's address).
After that jax.devices() lists the devices of all processes, a mesh spans them, and each process holds
and computes only its own devices' shards. Results made whole with sharding.replicate (generate's
tokens) can be read on every process; print them on process 0 only.

    # host 0                                                # host 1
    gpt2-jax generate --model M --mesh data=2,model=8 \\      gpt2-jax generate --model M --mesh data=2,model=8 \\
      --coordinator host0:1234 --num-processes 2 \\             --coordinator host0:1234 --num-processes 2 \\
      --process-id 0                                           --process-id 1

`gpt2-jax train` takes the same three flags; its --out must be on a file system every host sees
(each process writes its own shards of each checkpoint). Under SLURM, Open MPI or on Cloud TPU,
initialize() with no arguments lets JAX find all three itself.
"""

from __future__ import annotations

import jax

from gpt2_jax.errors import ConfigError


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """Join the other processes (call first, before any other JAX call). On CPU the collectives go
    over gloo (TCP), so several processes on one machine can stand in for several hosts."""
    given = [a is not None for a in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError("multi-process runs need all of --coordinator HOST:PORT, --num-processes N "
                          "and --process-id I (or none of them, where JAX detects the cluster itself)")  # fmt: skip
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} is outside [0, --num-processes {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)


def is_main() -> bool:
    """True on the process that prints and writes files (process 0)."""
    return jax.process_index() == 0
