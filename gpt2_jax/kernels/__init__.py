"""Compiled kernels: float32 matmuls whose every output rounds the same way for any row count.

    rowdot(x [..., M, I], w [..., N, I]) -> [..., M, N] = x @ w.T  (w as checkpoints hold it, [out, in];
                                                               w 2-D or with x's leading dims)
    chain(x [..., M, I], w [..., I, N])  -> [..., M, N] = x @ w    (attention: keys transposed, values)

Why: XLA's CPU matmul chooses its kernel, and so its rounding, by shape: one row, a few rows and many
rows each round differently. A token's logits would then change with its batch, and a decode step
(M = B rows) would not reproduce a forward over the same sequence (M = B x T rows). Both kernels (C++:
the arithmetic in rowdot.h and chain.h, called from cpu.cc through XLA's FFI on XLA's own threads)
compute each output by the same instructions whatever M is:
  rowdot  one dot product: 16 lane-wise accumulators in k order, then one fixed tree over the lanes. It
          streams [out, in] weights at close to the memory's speed for a decode step's few rows.
  rowdot_int8  x @ w.T with w int8 and a float32 scale per output (gpt2_jax.model.precision's int8): x's
          rows rounded to int16, the dot products summed exactly in integers (VNNI where present, and
          AMX's int8 tiles for 16 rows or more where the CPU has them: a prefill, a large batch), one
          rounding at the end; bits independent of the batch and of the instruction set by construction.
          On VNNI without AMX, 16 rows or more (a prefill) run with lanes over x's rows instead of over
          k, so no output ends in a sum of lanes (vnni_rows.h). Given each weight row's sum (qsum: its
          w8a8), x's rows are rounded to bytes with a zero point instead, and VNNI multiplies them at
          twice the rate (a8.h's tiles for 3 to 8 rows, one byte plane in vnni_rows.h from 16); other
          paths take the same rows as int16.
  chain   one fused multiply-add chain in k order, lanes over outputs, no lane sums: fast for
          attention's short dot products (64 for the scores), where rowdot's lane sums cost as much as
          its multiply-adds.

  rowdot_packed  rowdot over float32 weights packed losslessly in 3.5 bytes each (packed.h, packed.py:
          gpt2_jax.model.precision's float32-packed): each weight's low 3 bytes and a 4-bit code for its top
          byte; rebuilt in registers, then rowdot's own multiply-adds, so rowdot's bits from 12.5% fewer bytes.

`softmax` is attention's softmax over blocked scores, its sum added block by block (softmax.h).
`cumsum` is the sampler's prefix sum, accumulated in float64 as torch's is; `argmax` its greedy token.

Both matmuls can skip work a row does not need without changing anything it does need (attention's causal
corner): `out_ends` / `in_ends`, one int32 per row (see rowdot). An Entry (one layer of the stacked KV
cache) is read where it lies, and so is a Paged operand (one layer of the paged cache, its blocks found through
each row's block table: chain_paged in cpu.cc).

Where they do not apply, they are XLA's matmul: on GPU/TPU, inside a mesh (see layers.matmul) and where
the extension was not built (no C++ compiler at install time) or the CPU lacks AVX2/FMA. `available()`
says which. Gradients are XLA's matmuls: gradients are compared to a tolerance, never bitwise across
batch shapes.

  ffi.py        rowdot / chain / softmax / cumsum / argmax as jax functions; products.py: the matmuls'
                dispatch, Entry / Paged operands and their custom VJPs; registry.py: the FFI targets registered
  invariance.py what else keeps a row's bits batch-independent on XLA's CPU backend (row padding)
  packed.py     Packed weights: pack, unpack, rowdot_packed, packed_rows
  report.py     report(): which path each op takes at 1, 8 and 512 rows here, from dispatch.h itself
  cpu.cc        the Python module and FFI handlers; dispatch.h picks every op's path from the CPU's features;
                the arithmetic is rowdot.h, chain.h, softmax.h, int8.h (its problem in int8_problem.h), a8.h,
                vnni_rows.h, amx.h and packed.h

GPT2_JAX_ROWDOT_ISA (read once per process) forces an older instruction set where the CPU has a newer one:
avx2 (every op), avx512 (int8 without VNNI), avx512-vnni (int8 without AMX); either of the last two
also keeps AVX-512's 1-row tiles on AMD, which otherwise take AVX2's (dispatch.h, OneRowOnAvx2). The tests use it
to check that every path gives the same bits; report() says what runs (available() and int8_isa() name the
float32 and int8 instruction sets).
"""

from gpt2_jax.kernels.ffi import available, why_unavailable
from gpt2_jax.kernels.report import report

__all__ = ["available", "report", "why_unavailable"]
