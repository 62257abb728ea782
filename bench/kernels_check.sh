#!/usr/bin/env bash
# The kernels under the compiler's and the sanitizers' eyes (a CI step, .ci/run; tests/test_kernels_dispatch.py
# runs it too): cpu.cc built once with -Wall -Werror, then bench/kernels_harness.cc's check, built with -Werror
# under AddressSanitizer and UBSan, once per instruction-set path (dispatch.h's GPT2_JAX_ROWDOT_ISA; forcing a
# path this CPU lacks runs its best instead). Needs g++ and the jax the package builds against.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX="${CXX:-g++}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# GCC 12 and older warn of an uninitialized __Y inside their own AVX-512 intrinsics (_mm512_undefined_*, GCC bug
# 105593); those two warnings are off there, and only there.
flags=(-std=c++17 -ffp-contract=off -Wall -Werror)
if [ "$("$CXX" -dumpversion | cut -d. -f1)" -le 12 ]; then
    flags+=(-Wno-uninitialized -Wno-maybe-uninitialized)
fi

xla="$(python -c 'import jax; print(jax.ffi.include_dir())')"
py="$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
"$CXX" "${flags[@]}" -O2 -fPIC -isystem "$xla" -isystem "$py" -c gpt2_jax/kernels/cpu.cc -o "$out/cpu.o"
echo "kernels: cpu.cc builds with -Wall -Werror"

"$CXX" "${flags[@]}" -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
    -I gpt2_jax/kernels bench/kernels_harness.cc -o "$out/harness" -pthread
for isa in "" avx512-vnni avx512 avx2; do
    GPT2_JAX_ROWDOT_ISA="$isa" "$out/harness" check "${1:-1}"
done
