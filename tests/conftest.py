"""Every test process runs JAX on the CPU with 8 devices, so the sharding tests build real meshes
(8x1, 1x8, 2x4, 4x2) on any machine, a GPU box included (JAX_PLATFORMS set beforehand wins).

XLA reads these once, when JAX first initialises its backends, so they are set here, before any
test module imports jax. Computations that are not sharded still run on device 0 alone.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# gpt2-jax's CLI keeps JAX's compiled programs in ~/.cache by default; tests that call main() do not: they use
# the test run's shared cache where tests/run.py made one, else none.
os.environ.setdefault("GPT2_JAX_COMPILATION_CACHE", os.environ.get("JAX_COMPILATION_CACHE_DIR") or "off")
