// The sampler's row-wise kernels, argmax's and cumsum's rows (cpu.cc calls them from XLA's FFI): one row at a
// time, so a row's answer never depends on its batch. (No XLA, no Python here: bench/kernels_harness.cc
// checks them.)
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "softmax.h"  // RowMax

namespace rowwise {

// The position of the first maximum of x[0 .. n), or of the first NaN where there is one: jnp.argmax's answer.
// Two vector passes (the largest value and whether a NaN is there, softmax::RowMax; then the first position
// holding it) over a row that stays in cache; comparisons only, so any instruction set gives the same answer.
__attribute__((target("avx2"))) inline int32_t FirstMax(const float* x, int64_t n) {
  bool nan;
  const float best = softmax::RowMax(x, n, &nan);
  int64_t i = 0;
  const __m256 want = _mm256_set1_ps(best);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
    if (hit != 0) return static_cast<int32_t>(i + __builtin_ctz(hit));
  }
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == best) return static_cast<int32_t>(i);
  return 0;  // unreachable for n > 0
}

// y[i] = the float32 nearest the float64 running sum of x[0 .. i]: torch's CPU cumsum of float32, which
// accumulates in float64, in one sequential pass.
inline void CumSum(const float* x, float* y, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    acc += static_cast<double>(x[i]);
    y[i] = static_cast<float>(acc);
  }
}

}  // namespace rowwise
