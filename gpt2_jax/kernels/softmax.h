// Attention's softmax over one query's blocked scores, each row s[0 .. N x C) (N blocks of C slots, masked
// slots holding a large negative number): w = e / total, e = exp(s - max(s)), total = the blocks' sums added
// in block order, each block's sum 8 lanes (slot i in lane i % 8) then one fixed tree. A row's weights depend
// on its scores alone: no batch, no row count, no padding to a size where XLA's reductions change path
// (gpt2_jax.kernels.invariance), and slots past the last key (exp = exact 0) change no sum, so no cache
// capacity either. One 8-lane AVX2 program on every CPU, so AVX-512 hosts give the same bits.
// exp: Cephes' expf (a degree-6 polynomial on a reduced argument, <= 1 ulp from the true value here), 0 below
// -87.3 (no denormals), NaN kept.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace softmax {

__attribute__((target("avx2,fma"))) inline __m256 Exp(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q), tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.37f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_andnot_ps(tiny, y);
  return _mm256_blendv_ps(y, x, nan);
}

__attribute__((target("avx2,fma"))) inline float Lanes(__m256 v) {  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

// The largest value of x[0 .. n) that is not NaN (-inf if none), and whether a NaN is there (*nan):
// comparisons only, so the same on any instruction set. Also the greedy token's first pass (cpu.cc, FirstMax).
__attribute__((target("avx2"))) inline float RowMax(const float* x, int64_t n, bool* nan) {
  __m256 top = _mm256_set1_ps(-__builtin_inff()), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(v, top);  // a NaN v gives top back: NaNs are tracked apart
    odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, top);
  float best = t[0];
  for (int l = 1; l < 8; ++l) best = std::max(best, t[l]);
  *nan = _mm256_movemask_ps(odd) != 0;
  for (; i < n; ++i) *nan |= std::isnan(x[i]), best = std::isnan(x[i]) ? best : std::max(best, x[i]);
  return best;
}

// One row: s, w [n * c] (c a multiple of 8).
__attribute__((target("avx2,fma"))) inline void Row(const float* s, float* w, int64_t n, int64_t c) {
  const int64_t len = n * c;
  bool nan;
  const float top = RowMax(s, len, &nan);
  const __m256 m = _mm256_set1_ps(nan ? __builtin_nanf("") : top);  // a NaN anywhere: every weight NaN
  float total = 0.0f;
  for (int64_t b = 0; b < n; ++b) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = b * c; i < (b + 1) * c; i += 8) {
      const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
      _mm256_storeu_ps(w + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    total = b == 0 ? Lanes(acc) : total + Lanes(acc);
  }
  const __m256 d = _mm256_set1_ps(total);
  for (int64_t i = 0; i < len; i += 8) _mm256_storeu_ps(w + i, _mm256_div_ps(_mm256_loadu_ps(w + i), d));
}

}  // namespace softmax
