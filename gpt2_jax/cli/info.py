"""gpt2-jax info: what this install runs on: its version, jax's, the devices, and which path each CPU kernel
takes at 1, 8 and 512 rows (gpt2_jax.kernels.report)."""

from __future__ import annotations

import argparse

import jax

from gpt2_jax import kernels


def version() -> str:
    """gpt2-jax's installed version, with the jax it runs on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        mine = installed("gpt2-jax")
    except PackageNotFoundError:  # run from a source tree that was never installed
        mine = "unknown (not installed)"
    return f"gpt2-jax {mine} (jax {jax.__version__}, jaxlib {installed('jaxlib')})"


def devices() -> str:
    """jax's default backend and its devices, one line."""
    found = jax.devices()
    kinds = sorted({d.device_kind for d in found})
    return f"devices: {jax.default_backend()}, {len(found)} x {', '.join(kinds)}"


def run_info(args: argparse.Namespace) -> int:
    print(version())
    print(devices())
    print(kernels.report())
    return 0
