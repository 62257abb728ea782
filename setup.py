"""Builds gpt2_jax's one compiled piece, the batch-invariant CPU kernels (gpt2_jax/kernels/cpu.cc: rowdot,
chain, softmax, cumsum and argmax), against the XLA FFI headers of the jax in the build environment (jax.ffi.include_dir();
pyproject.toml pins that jax to the range the package runs with). Everything else is in pyproject.toml. The extension is
optional: without a C++ compiler the install still succeeds and the model runs on XLA's own matmul
(gpt2_jax.kernels.available() says which)."""

from setuptools import Extension, setup


def _xla_include() -> str:
    import jax

    return jax.ffi.include_dir()


setup(
    ext_modules=[
        Extension(
            "gpt2_jax.kernels._cpu",
            sources=["gpt2_jax/kernels/cpu.cc"],
            depends=[
                "gpt2_jax/kernels/dispatch.h",
                "gpt2_jax/kernels/rowdot.h",
                "gpt2_jax/kernels/chain.h",
                "gpt2_jax/kernels/int8.h",
                "gpt2_jax/kernels/int8_problem.h",
                "gpt2_jax/kernels/int8_prepare.h",
                "gpt2_jax/kernels/packed.h",
                "gpt2_jax/kernels/a8.h",
                "gpt2_jax/kernels/amx.h",
                "gpt2_jax/kernels/vnni_rows.h",
                "gpt2_jax/kernels/softmax.h",
                "gpt2_jax/kernels/rowwise.h",
            ],
            include_dirs=[_xla_include()],
            language="c++",
            # -ffp-contract=off: no multiply-add the source does not spell out, so the rounding is the
            # source's. No -march: the AVX-512 and AVX2 paths are chosen at run time.
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
