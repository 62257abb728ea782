// rowdot_int8's arithmetic: y[m, n] = x[m] . w[n] with w int8 (gpt2_jax.model.precision: w ~= q * scale[n])
// and x float32, every output exact up to one final rounding, so its bits depend on nothing but its row
// and its weight row.
//
//   1. x's row m is rounded to int16 with one scale per row: xq = nearest(x * (32767 / max|x[m]|)),
//      computed in double, so |xq| <= 32767 (a relative step of 1/65534 of the row's largest element;
//      the weights' int8 step is 258x coarser).
//   2. xq . q is summed exactly in integers: int32 lanes (vpdpwssd where the CPU has AVX512-VNNI,
//      vpmaddwd + vpaddd otherwise, AVX-512 or AVX2), flushed into int64 totals before any lane can
//      overflow; with 16 rows or more on a CPU with AMX, its byte tiles (amx.h), and on VNNI without
//      them, lanes over rows (vnni_rows.h). Integer sums are exact, so no order, tile shape,
//      thread split, batch or instruction set changes them: the AVX2, AVX-512, VNNI and AMX paths give the
//      same bits by construction.
//   3. y = (float)((double)total * x_scale[m] * w_scale[n]), one rounding to float32.
//
// Why integers rather than converting each q to float32 and running rowdot's multiply-adds: that takes
// 3 instructions per 16 weights (widen, convert, fma) against 2 per 32 here (widen, vpdpwssd); a decode
// step's few rows make the float form compute-bound, under the memory's speed (bench/RESULTS.md).
// (No XLA, no Python here: bench/kernels_harness.cc times and checks it.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "a8.h"
#include "amx.h"
#include "dispatch.h"
#include "int8_problem.h"
#include "vnni_rows.h"

namespace int8 {

constexpr int64_t kRowBlock = 64;  // x rows per work item
constexpr int64_t kColBlock = 72;  // w rows per work item (a multiple of every tile's nr)
constexpr int64_t kAmxColBlock = 128;  // with AMX: 4 of its 32-column steps
constexpr int64_t kPad = 32;       // xq rows are zero-padded to a multiple of this

inline int64_t Padded(int64_t K) { return (K + kPad - 1) / kPad * kPad; }

// A row's range with 0 in it: *lo = min(min x, 0), *hi = max(max x, 0); false where the row holds a NaN.
// One pass for both roundings below (max |x| is max(hi, -lo)).
__attribute__((target("avx2,fma"))) inline bool RowRange(const float* x, int64_t K, float* lo, float* hi) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(x + k);
    low = _mm256_min_ps(low, v), high = _mm256_max_ps(high, v);
    odd = _mm256_or_ps(odd, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN
  }
  alignas(32) float l8[8], h8[8], o8[8];
  _mm256_store_ps(l8, low), _mm256_store_ps(h8, high), _mm256_store_ps(o8, odd);
  *lo = 0.0f, *hi = 0.0f;
  bool nan = false;
  for (int l = 0; l < 8; ++l) *lo = std::min(*lo, l8[l]), *hi = std::max(*hi, h8[l]), nan |= o8[l] != 0.0f;
  for (; k < K; ++k) *lo = std::min(*lo, x[k]), *hi = std::max(*hi, x[k]), nan |= std::isnan(x[k]);
  return !nan;
}

// One row of x -> xq [Kp] (zeros past K) and its scale: max|x| / 32767; 0 for a zero row; NaN for a row
// holding a NaN or an infinity (its outputs are then NaN, never a plausible number).
__attribute__((target("avx2,fma"))) inline void QuantizeRow(const float* x, int64_t K, int64_t Kp, int16_t* xq,
                                                            float* scale) {
  float lo, hi;
  const bool bad = !RowRange(x, K, &lo, &hi);
  const float amax = std::max(hi, -lo);
  if (bad || !std::isfinite(amax) || amax == 0.0f) {
    std::fill(xq, xq + Kp, int16_t{0});
    *scale = amax == 0.0f && !bad ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const double inv = 32767.0 / static_cast<double>(amax);
  const __m256d vinv = _mm256_set1_pd(inv);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {  // x * inv in double, rounded to nearest (even), as std::nearbyint
    __m128i lo = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k)), vinv));
    __m128i hi = _mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + k + 4)), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm_packs_epi32(lo, hi));
  }
  for (; k < K; ++k) xq[k] = static_cast<int16_t>(std::nearbyint(static_cast<double>(x[k]) * inv));
  std::fill(xq + K, xq + Kp, int16_t{0});
  *scale = amax / 32767.0f;
}

// 4 floats -> nearest(x * inv) + z clamped to a byte, minus z (QuantizeRow8).
__attribute__((target("avx2,fma"))) inline __m128i Byte4(const float* at, __m256d inv, __m128i z) {
  const __m128i u = _mm_add_epi32(_mm256_cvtpd_epi32(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(at)), inv)), z);
  return _mm_sub_epi32(_mm_min_epi32(_mm_max_epi32(u, _mm_setzero_si128()), _mm_set1_epi32(255)), z);
}

// w8a8 (a8.h): one row of x -> xq [Kp] (zeros past K), its scale s and zero point z, over the row's range with
// 0 in it (lo = min(min x, 0), hi = max(max x, 0), in double): s = (hi - lo) / 255, z = nearest(-lo / s) in
// [0, 255], and xq = clamp(nearest(x / s) + z, 0, 255) - z, so x ~= s * xq and xq + z is one byte. The range,
// not max |x|, sets the step: a GELU's output (min -0.17) gets twice the resolution of a symmetric rounding.
// A row with no range (all zero): scale 0; a NaN or an infinity: NaN.
__attribute__((target("avx2,fma"))) inline void QuantizeRow8(const float* x, int64_t K, int64_t Kp, int16_t* xq,
                                                             float* scale, int32_t* zero) {
  float lo, hi;
  const bool bad = !RowRange(x, K, &lo, &hi);
  const double range = static_cast<double>(hi) - static_cast<double>(lo);
  *zero = 0;
  if (bad || !std::isfinite(range) || range == 0.0) {
    std::fill(xq, xq + Kp, int16_t{0});
    *scale = range == 0.0 && !bad ? 0.0f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const double inv = 255.0 / range;
  const int32_t z = static_cast<int32_t>(std::nearbyint(-static_cast<double>(lo) * inv));
  const __m256d vinv = _mm256_set1_pd(inv);
  const __m128i vz = _mm_set1_epi32(z);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k),
                     _mm_packs_epi32(Byte4(x + k, vinv, vz), Byte4(x + k + 4, vinv, vz)));
  for (; k < K; ++k) {
    const double u = std::nearbyint(static_cast<double>(x[k]) * inv) + z;
    xq[k] = static_cast<int16_t>(std::min(255.0, std::max(0.0, u)) - z);
  }
  std::fill(xq + K, xq + Kp, int16_t{0});
  *scale = static_cast<float>(range / 255.0);
  *zero = z;
}

// ---------------------------------------------------------------------------------------------- tiles
// MR rows of xq against NR rows of q over K (xq rows readable to Padded(K)) -> exact int64 dot products.

__attribute__((target("avx512f"))) inline int64_t Sum512(__m512i a) {
  __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a));
  __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

// acc + x . w by VNNI's vpdpwssd as inline assembly, so each accumulator stays in its register. Through the
// intrinsic, GCC 12 keeps a copy of every accumulator of a tile with more than one row on the stack and stores
// it after each instruction, which slows the 8 x 3 tile (3 to 8 rows) by half (bench/RESULTS.md). The same
// instruction, so the same bits.
__attribute__((target("avx512f,avx512vnni"))) inline __m512i DpwssdInPlace(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// A lane gets 2 products of at most 32767 x 127 per 32 k, so 8192 k stay below 2^31. The body twice: with
// VNNI's vpdpwssd, and with vpmaddwd + vpaddd under a target without VNNI (so the compiler cannot fuse
// them into the instruction a CPU without VNNI lacks).
#define GPT2_JAX_INT8_TILE512(NAME, TARGET, MADD)                                                              \
  template <int MR, int NR>                                                                                  \
  __attribute__((target(TARGET))) inline void NAME##Step(const int16_t* const* x, const int8_t* const* w,     \
                                                         int64_t k, int64_t at, __m512i (&acc)[MR][NR],      \
                                                         int64_t ahead) {                                    \
    __m512i wv[NR];                                                                                          \
    _Pragma("GCC unroll 12") for (int j = 0; j < NR; ++j) {                                                  \
      if (ahead && (at & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[j] + at + ahead), _MM_HINT_T1); \
      wv[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + at)));         \
    }                                                                                                        \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i) {                                                   \
      __m512i xv = _mm512_loadu_si512(x[i] + k);                                                             \
      _Pragma("GCC unroll 12") for (int j = 0; j < NR; ++j) acc[i][j] = MADD(acc[i][j], xv, wv[j]);          \
    }                                                                                                        \
  }                                                                                                          \
  template <int MR, int NR>                                                                                  \
  __attribute__((target(TARGET))) void NAME(const int16_t* const* x, const int8_t* const* w, int64_t K,       \
                                            int64_t* out, int64_t ahead) {                                   \
    int64_t total[MR][NR] = {};                                                                              \
    for (int64_t k0 = 0; k0 < K; k0 += 8192) {                                                               \
      const int64_t k1 = std::min<int64_t>(K, k0 + 8192);                                                    \
      __m512i acc[MR][NR];                                                                                   \
      _Pragma("GCC unroll 8") for (int i = 0; i < MR; ++i)                                                   \
        _Pragma("GCC unroll 12") for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();            \
      int64_t k = k0;                                                                                        \
      for (; k + 32 <= k1; k += 32) NAME##Step<MR, NR>(x, w, k, k, acc, ahead);                              \
      if (k < k1) { /* the last K % 32 weights, from zero-filled copies (x is zero there too) */             \
        alignas(64) int8_t tail[NR][32];                                                                     \
        const int8_t* ws[NR];                                                                                \
        ZeroFilledTail(w, k, k1, tail, ws);                                                          \
        NAME##Step<MR, NR>(x, ws, k, 0, acc, 0);                                                             \
      }                                                                                                      \
      for (int i = 0; i < MR; ++i)                                                                           \
        for (int j = 0; j < NR; ++j) total[i][j] += Sum512(acc[i][j]);                                       \
    }                                                                                                        \
    for (int i = 0; i < MR; ++i)                                                                             \
      for (int j = 0; j < NR; ++j) out[i * NR + j] = total[i][j];                                            \
  }

#define GPT2_JAX_VNNI(acc, x, w) DpwssdInPlace(acc, x, w)
#define GPT2_JAX_MADD(acc, x, w) _mm512_add_epi32(acc, _mm512_madd_epi16(x, w))
GPT2_JAX_INT8_TILE512(TileVnni, "avx512f,avx512bw,avx512vnni", GPT2_JAX_VNNI)
GPT2_JAX_INT8_TILE512(Tile512, "avx512f,avx512bw", GPT2_JAX_MADD)
#undef GPT2_JAX_VNNI
#undef GPT2_JAX_MADD
#undef GPT2_JAX_INT8_TILE512

__attribute__((target("avx2"))) inline int64_t Sum256(__m256i a) {
  __m256i s = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(a)),
                               _mm256_cvtepi32_epi64(_mm256_extracti128_si256(a, 1)));
  alignas(32) int64_t v[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), s);
  return v[0] + v[1] + v[2] + v[3];
}

// A lane gets 2 products per 16 k, so 4096 k stay below 2^31.
template <int MR, int NR>
__attribute__((target("avx2"))) inline void Step256(const int16_t* const* x, const int8_t* const* w, int64_t k,
                                                    int64_t at, __m256i (&acc)[MR][NR], int64_t ahead) {
  __m256i wv[NR];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) {
    if (ahead && (at & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[j] + at + ahead), _MM_HINT_T1);
    wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + at)));
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i] + k));
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));
  }
}

template <int MR, int NR>
__attribute__((target("avx2"))) void Tile256(const int16_t* const* x, const int8_t* const* w, int64_t K, int64_t* out,
                                             int64_t ahead) {
  int64_t total[MR][NR] = {};
  for (int64_t k0 = 0; k0 < K; k0 += 4096) {
    const int64_t k1 = std::min<int64_t>(K, k0 + 4096);
    __m256i acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) Step256<MR, NR>(x, w, k, k, acc, ahead);
    if (k < k1) {
      alignas(32) int8_t tail[NR][16];
      const int8_t* ws[NR];
      ZeroFilledTail(w, k, k1, tail, ws);
      Step256<MR, NR>(x, ws, k, 0, acc, 0);
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) total[i][j] += Sum256(acc[i][j]);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * NR + j] = total[i][j];
}

// ------------------------------------------------------------------------------------- blocks and threads

using TileFn = void (*)(const int16_t* const*, const int8_t* const*, int64_t, int64_t*, int64_t);

struct Kernel {
  int mr, nr;
  TileFn tiles[9];  // tiles[r]: r xq rows (1 <= r <= mr) against nr q rows
  int ahead = 2;    // how many tiles on the first row tile prefetches the q rows of (see Block)
};

// One or two rows (decode at B = 1, 2) take 2 x 8 tiles: many q rows share each x load and the fixed cost
// of a tile; up to 8 rows one 8 x 3 tile, so each q vector loaded feeds every row; more take 4 x 6.
// The 8-column tiles prefetch the q rows one tile on, the others two (bench/RESULTS.md).
struct Kernels {
  Kernel one, few, many;
};

#define GPT2_JAX_INT8_KERNELS(T)                                                                         \
  Kernels {                                                                                              \
    {2, 8, {nullptr, T<1, 8>, T<2, 8>}, 1},                                                              \
        {8, 3, {nullptr, T<1, 3>, T<2, 3>, T<3, 3>, T<4, 3>, T<5, 3>, T<6, 3>, T<7, 3>, T<8, 3>}},       \
        {4, 6, {nullptr, T<1, 6>, T<2, 6>, T<3, 6>, T<4, 6>}}                                            \
  }

// The tiles of dispatch::Int8Tiles: VNNI's, AVX-512's or AVX2's, with AVX2's 1 x 8 tile for one row where
// it says so (the same integer sums).
inline const Kernels& Pick() {
  static const Kernels k = [] {
    using dispatch::Isa;
    const Isa isa = dispatch::Int8Tiles(2);
    Kernels k = isa == Isa::kAvx512Vnni ? GPT2_JAX_INT8_KERNELS(TileVnni)
                : isa == Isa::kAvx512   ? GPT2_JAX_INT8_KERNELS(Tile512)
                                        : Kernels{{1, 8, {nullptr, Tile256<1, 8>}, 1},
                                                  {2, 4, {nullptr, Tile256<1, 4>, Tile256<2, 4>}},
                                                  {2, 4, {nullptr, Tile256<1, 4>, Tile256<2, 4>}}};
    if (isa != Isa::kAvx2 && dispatch::Int8Tiles(1) == Isa::kAvx2) k.one.tiles[1] = Tile256<1, 8>;
    return k;
  }();
  return k;
}

inline const Kernel& For(int64_t rows) {
  const Kernels& k = Pick();
  return rows <= k.one.mr ? k.one : rows <= k.few.mr ? k.few : k.many;
}

// Rows [m0, m1) x columns [n0, n1) of y. A short last tile repeats its last row or column (computed the
// same way, then dropped). The first row tile of each column tile prefetches the q rows kern.ahead tiles on.
inline void Block(const Problem& p, const Kernel& kern, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t ahead = kern.ahead * kern.nr * p.K;  // bytes from a q row to the same k `ahead` tiles on
  int64_t out[48];
  const int16_t* xs[8];
  const int8_t* ws[12];
  for (int64_t n = n0; n < n1; n += kern.nr) {
    int64_t nn = std::min<int64_t>(kern.nr, n1 - n);
    for (int j = 0; j < kern.nr; ++j) ws[j] = p.wq + (n + std::min<int64_t>(j, nn - 1)) * p.K;
    for (int64_t m = m0; m < m1; m += kern.mr) {
      int64_t mm = std::min<int64_t>(kern.mr, m1 - m);
      for (int i = 0; i < mm; ++i) xs[i] = p.xq + (m + i) * p.Kp;
      kern.tiles[mm](xs, ws, p.K, out, m == m0 ? ahead : 0);
      for (int i = 0; i < mm; ++i) {
        const double sx = p.x_scale[m + i];
        for (int j = 0; j < nn; ++j)
          p.y[(m + i) * p.N + n + j] =
              static_cast<float>(static_cast<double>(out[i * kern.nr + j]) * sx * static_cast<double>(p.w_scale[n + j]));
      }
    }
  }
}

// Where the problem runs (dispatch::Int8), each path's x packed for it by cpu.cc: AMX's tiles, vnni_rows.h's
// lanes over rows, a8.h's byte tiles, or the tiles above. The bits are the same either way, so which one a
// call takes never shows in its output.
inline dispatch::Int8Route Route(const Problem& p) { return dispatch::Int8(p.M, p.K, p.qsum != nullptr); }
inline bool OnAmx(const Problem& p) { return Route(p) == dispatch::Int8Route::kAmx; }
inline bool OnRows(const Problem& p) { return Route(p) == dispatch::Int8Route::kRows; }
inline bool OnA8(const Problem& p) { return Route(p) == dispatch::Int8Route::kA8; }

// Weight rows per work item for a decode step's few rows (up to 8, int8.h's own tiles): 4 runs per thread,
// each of whole 24-row groups (a multiple of every tile's nr) and at least kColBlock. A longer contiguous run of q
// keeps the hardware prefetcher streaming where 72-row runs (55 KB at K = 768) keep restarting it
// (bench/RESULTS.md); 16 runs per problem gain less. More rows keep kColBlock, which bounds the x block and q
// panel a work item holds in cache.
inline int64_t DecodeColumns(const Problem& p, int64_t threads) {
  if (p.M > 8) return 0;
  const int64_t runs = 4 * std::max<int64_t>(threads, 1);
  return std::max<int64_t>(kColBlock, ((p.N + runs - 1) / runs + 23) / 24 * 24);
}

inline int64_t ColBlock(const Problem& p) {
  return p.x_hi != nullptr ? kAmxColBlock : p.cols > 0 ? p.cols : kColBlock;
}
inline int64_t RowBlocks(const Problem& p) { return (p.M + kRowBlock - 1) / kRowBlock; }
inline int64_t Items(const Problem& p) { return int8::RowBlocks(p) * ((p.N + ColBlock(p) - 1) / ColBlock(p)); }

inline void Item(const Problem& p, int64_t row_blocks, int64_t i) {
  const int64_t rb = i % row_blocks, cb = i / row_blocks, cols = ColBlock(p);
  const int64_t m0 = rb * kRowBlock, m1 = std::min(p.M, m0 + kRowBlock);
  int64_t n0 = cb * cols;
  const int64_t n1 = std::min(p.N, n0 + cols);
  if (p.x_hi != nullptr) {
    const int64_t steps = (n1 - n0) / amx::kCols;
    amx::Block(p, m0, m1, n0, steps, n1 < p.N ? 1 : 0);
    n0 += steps * amx::kCols;
  }
  if (p.x_rows != nullptr) return vnni_rows::Block(p, m0, m1, n0, n1);
  if (p.x_a8 != nullptr) return a8::Block(p, m0, m1, n0, n1);
  if (n0 < n1) Block(p, For(p.M), m0, m1, n0, n1);
}

}  // namespace int8
