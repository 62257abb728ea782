#!/usr/bin/env bash
# The GPU benchmark in one command: gpt2_jax vs transformers decode/prefill speed and the
# memory-bandwidth bound, for gpt2 and gpt2-xl shapes with random weights (bench/gpu.py says how).
#
#   bash bench/gpu.sh                      # on a GPU; about 8 minutes at most (--budget-s)
#   bash bench/gpu.sh --smoke              # tiny float32 model on CPU, checks greedy tokens first
#   bash bench/gpu.sh --models gpt2 --batches 1,8   # any bench/gpu.py option passes through
#
# Needs python3 with jax, torch and transformers. Installs nothing when JAX already sees a GPU
# (the GPU image has no network); on an ordinary machine without GPU jaxlib it installs
# jax[cuda12]. The repository is imported from this checkout via PYTHONPATH, never fetched.
# Writes gpu_bench.md and gpu_bench.json to $OUT when OUT is set.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

smoke=0
for arg in "$@"; do
    case "$arg" in --smoke) smoke=1 ;; esac
done

jax_backend() {
    python3 -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -n 1 || echo none
}

if [ "$smoke" = 0 ]; then
    backend=$(jax_backend)
    echo "jax backend: $backend"
    if [ "$backend" != gpu ]; then
        echo "no GPU backend: installing jax[cuda12]"
        python3 -m pip install --quiet 'jax[cuda12]'
        backend=$(jax_backend)
        if [ "$backend" != gpu ]; then
            echo "jax still reports backend '$backend' after installing jax[cuda12]; is there a GPU?" >&2
            exit 1
        fi
    fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 bench/gpu.py "$@"
