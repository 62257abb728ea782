"""The compiled extension and its XLA FFI targets, registered once per process where they can run (the
kernels' calls in gpt2_jax.kernels.ffi and .products ask `registered()`)."""

from __future__ import annotations

import os

import jax

TARGET = "gpt2_jax_rowdot"

try:
    from gpt2_jax.kernels import _cpu
except ImportError:  # built without a compiler: XLA's matmul everywhere
    _cpu = None

# GPT2_JAX_KERNELS=off runs XLA's own kernels even where these are built (to compare the two).
DISABLED = os.environ.get("GPT2_JAX_KERNELS", "").strip().lower() in ("off", "0", "false", "no")
_REGISTERED = False
if _cpu is not None and _cpu.usable() and not DISABLED:
    for _suffix, _handler in (("", _cpu.handler), ("_int8", _cpu.handler_int8), ("_w8a8", _cpu.handler_w8a8),
                              ("_at", _cpu.handler_at), ("_ends", _cpu.handler_ends),
                              ("_at_ends", _cpu.handler_at_ends), ("_chain", _cpu.handler_chain),
                              ("_chain_at", _cpu.handler_chain_at), ("_chain_paged", _cpu.handler_chain_paged),
                              ("_cumsum", _cpu.handler_cumsum), ("_argmax", _cpu.handler_argmax),
                              ("_softmax", _cpu.handler_softmax), ("_packed", _cpu.handler_packed),
                              ("_packed_rows", _cpu.handler_packed_rows)):  # fmt: skip
        jax.ffi.register_ffi_target(TARGET + _suffix, _handler(), platform="cpu")
    _REGISTERED = True


def registered() -> bool:
    """Whether the kernels' FFI targets are registered in this process (XLA's own kernels run where they are not)."""
    return _REGISTERED


def extension():
    """The compiled module gpt2_jax.kernels._cpu, or None where it was not built."""
    return _cpu
