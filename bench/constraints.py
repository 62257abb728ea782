"""Constrained decoding costs: compiling a regex, a choice and JSON schemas to tables; one step's mask + advance.

    python bench/constraints.py [--calls 300] [--vocab-size 50257]

Per constraint: validation (construction, outlines-core index over 256 single bytes), the outlines
Index over GPT-2's vocabulary alone, compile_constraint cold (Index + tables) and cached (lru hit),
the automaton's states Q and token classes C, its bytes, and the padded tables' bucket and bytes at
B=8. The step is jit(allowed + advance) on device-resident tables, median of --calls calls, each
waited for with block_until_ready, at B=1 and B=8 (every row under the constraint).
build_report() returns the rows as dicts for other benches to fold in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
BIG_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b", "c"]},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
CASES = {
    "regex": lambda C: C.regex("[0-9]{3}-[A-Z][a-z]+"),
    "choice": lambda C: C.choice(["yes", "no", "maybe so", "no way"]),
    "json_schema": lambda C: C.json_schema(SCHEMA),
    "json_schema_big": lambda C: C.json_schema(BIG_SCHEMA),
}


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _step_seconds(jax, jnp, C, tables, eos_id: int, calls: int) -> float:
    """Median seconds of one jitted allowed + advance over device-resident tables."""

    from gpt2_jax.sampling.constraints.tables import advance, allowed

    @jax.jit
    def step(tables, state, token):
        return allowed(tables, state, eos_id), advance(tables, state, token)

    tables = jax.device_put(tables)
    state = jnp.asarray(tables.start)
    first = jnp.argmax(allowed(tables, state, None), axis=1).astype(jnp.int32)  # an allowed token per row
    jax.block_until_ready(step(tables, state, first))  # compile
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(step(tables, state, first))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_report(calls: int = 300, vocab_size: int = 50257) -> list[dict]:
    """One dict per constraint: build times (seconds), sizes (states, classes, bytes), step times (seconds)."""
    import jax
    import jax.numpy as jnp
    from outlines_core import Index

    from gpt2_jax.sampling import constraints as C
    from gpt2_jax.sampling.constraints import spec
    from gpt2_jax.sampling.constraints.automaton import GPT2_EOS, gpt2_vocabulary
    from gpt2_jax.sampling.constraints.tables import bucket, nbytes, pack

    gpt2_vocabulary.cache_clear()
    vocab_s = _seconds(gpt2_vocabulary)
    rows = []
    for name, make in CASES.items():
        spec.regex_problem.cache_clear()
        validate_s = _seconds(lambda: make(C))
        c = make(C)
        index_s = _seconds(lambda: Index(c.source, gpt2_vocabulary()))
        C.compile_constraint.cache_clear()
        cold_s = _seconds(lambda: C.compile_constraint(c, vocab_size))
        cached_s = _seconds(lambda: C.compile_constraint(c, vocab_size))
        auto = C.compile_constraint(c, vocab_size)
        packed = pack([auto] * 8, vocab_size)
        rows.append(
            dict(
                constraint=name,
                source_chars=len(c.source),
                vocabulary_s=vocab_s,
                validate_s=validate_s,
                index_s=index_s,
                compile_cold_s=cold_s,
                compile_cached_s=cached_s,
                states=auto.next_state.shape[0],
                classes=auto.next_state.shape[1],
                automaton_bytes=sum(a.nbytes for a in auto[:3]),
                bucket_b8=bucket(packed),
                tables_bytes_b8=nbytes(packed),
                step_b1_s=_step_seconds(jax, jnp, C, pack([auto], vocab_size), GPT2_EOS, calls),
                step_b8_s=_step_seconds(jax, jnp, C, packed, GPT2_EOS, calls),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="step calls per median")
    parser.add_argument("--vocab-size", type=int, default=50257)
    args = parser.parse_args()
    from importlib.metadata import version

    import jax
    import outlines_core  # noqa: F401

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, outlines-core {version('outlines-core')}, "
          f"python {sys.version.split()[0]}")  # fmt: skip
    rows = build_report(args.calls, args.vocab_size)
    print(f"GPT-2 outlines Vocabulary build (once per process): {rows[0]['vocabulary_s'] * 1e3:.0f} ms")
    head = ("constraint", "validate", "index", "cold", "cached", "Q", "C", "auto KiB", "bucket B=8", "tables KiB",
            "step B=1", "step B=8")  # fmt: skip
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        print(
            f"{r['constraint']} | {r['validate_s'] * 1e3:.1f} ms | {r['index_s'] * 1e3:.1f} ms | "
            f"{r['compile_cold_s'] * 1e3:.1f} ms | {r['compile_cached_s'] * 1e6:.1f} us | {r['states']} | "
            f"{r['classes']} | {r['automaton_bytes'] / 1024:.0f} | {'x'.join(map(str, r['bucket_b8']))} | "
            f"{r['tables_bytes_b8'] / 1024:.0f} | {r['step_b1_s'] * 1e6:.0f} us | {r['step_b8_s'] * 1e6:.0f} us"
        )
    print("validate: construction (index over 256 single bytes); index: outlines Index over GPT-2 alone; "
          "cold: compile_constraint = Index + tables; cached: its lru hit; bucket: padded G x Q x C; "
          "step: jit(allowed + advance), median")  # fmt: skip


if __name__ == "__main__":
    main()
