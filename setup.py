"""Builds gpt2_jax's one compiled piece, the batch-invariant matmul kernels (gpt2_jax/kernels/rowdot.cc),
against the XLA FFI headers that jaxlib ships. Everything else is in pyproject.toml. The extension is
optional: without a C++ compiler the install still succeeds and the model runs on XLA's own matmul
(gpt2_jax.kernels.available() says which)."""

import os

from setuptools import Extension, setup


def _xla_include() -> str:
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


setup(
    ext_modules=[
        Extension(
            "gpt2_jax.kernels._rowdot",
            sources=["gpt2_jax/kernels/rowdot.cc"],
            depends=["gpt2_jax/kernels/rowdot.h", "gpt2_jax/kernels/chain.h"],
            include_dirs=[_xla_include()],
            language="c++",
            # -ffp-contract=off: no multiply-add the source does not spell out, so the rounding is the
            # source's. No -march: the AVX-512 and AVX2 paths are chosen at run time.
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
