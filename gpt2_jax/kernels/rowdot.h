// rowdot's arithmetic: tiles and blocks (no XLA, no Python), so bench/kernels_harness.cc times and
// checks it too. cpu.cc calls it from XLA's FFI; dispatch.h picks its instructions.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "dispatch.h"

namespace rowdot {

constexpr int64_t kRowBlock = 64;  // x rows per work item: a block of x stays in L2 while w streams past
constexpr int64_t kColBlock = 66;  // w rows per work item

// ---------------------------------------------------------------------------------------------- AVX-512

// The 16 lanes of an accumulator summed by one fixed tree (Sum8 is its last three levels).
__attribute__((target("avx2,fma"))) inline float Sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // i + (i + 4)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // (0 + 2), (1 + 3)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));                                       // 0 + 1
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx512f,avx2,fma"))) inline float Sum16(__m512 a) {
  __m256 lo = _mm512_castps512_ps256(a);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  return Sum8(_mm256_add_ps(lo, hi));  // lane i + lane (i + 8), then as Sum8
}

// Eight accumulators summed at once, each by exactly Sum16's tree (the same lanes added in the same
// order): the shuffles only move lanes between registers, so 8 sums cost about half the instructions,
// which matters for short dot products (attention's 64-long scores).
__attribute__((target("avx512f,avx2,fma"))) inline void Sum16x8(const __m512* a, float* out) {
  __m512 c[4], d[2];
  for (int p = 0; p < 4; ++p) {  // lane i + lane (i + 8): a[2p]'s in the low half, a[2p + 1]'s in the high
    __m512 lo = _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44);
    __m512 hi = _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE);
    c[p] = _mm512_add_ps(lo, hi);
  }
  for (int p = 0; p < 2; ++p) {  // i + (i + 4): 128-bit quarter q holds accumulator 4p + q's four
    __m512 lo = _mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0));
    __m512 hi = _mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1));
    d[p] = _mm512_add_ps(lo, hi);
  }
  // (0 + 2), (1 + 3): quarter q holds accumulator q's pair, then accumulator q + 4's
  __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 f = _mm512_add_ps(e, _mm512_shuffle_ps(e, e, _MM_SHUFFLE(2, 3, 0, 1)));  // 0 + 1
  alignas(64) float sums[16];
  _mm512_store_ps(sums, f);
  for (int q = 0; q < 4; ++q) out[q] = sums[4 * q], out[q + 4] = sums[4 * q + 2];
}

// A loaded vector kept in a register. Left alone, GCC folds a load into every multiply-add that uses it
// (a memory operand each), so an 8 x 3 tile issues 25 loads for its 24 multiply-adds and the loads, not the
// multiply-adds, set the pace of cache-resident rows (bench/RESULTS.md). The same multiply-adds in the
// same order: the same bits.
template <class V>
inline void InRegister(V& v) {
  asm("" : "+v"(v));
}

// MR x rows against NR w rows: out[i * NR + j] = x[i] . w[j]. As it goes, the tile prefetches into L2 the
// floats `ahead` on from each w row j in the mask `ahead_rows` (Block: the next tile's rows; 0: none).
template <int MR, int NR>
__attribute__((target("avx512f,avx2,fma"))) void Tile512(const float* const* x, const float* const* w,
                                                         int64_t K, float* out, int64_t ahead,
                                                         uint32_t ahead_rows) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) {
      if (ahead_rows >> j & 1) _mm_prefetch(reinterpret_cast<const char*>(w[j] + ahead + k), _MM_HINT_T1);
      wv[j] = _mm512_loadu_ps(w[j] + k);
      if (MR > 1) InRegister(wv[j]);  // one row uses each w vector once: a memory operand is best
    }
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_loadu_ps(x[i] + k);
      InRegister(xv);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the last K % 16 products; absent lanes multiply zeros
    __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w[j] + k);
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_maskz_loadu_ps(m, x[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  const __m512* flat = &acc[0][0];  // row-major: flat[i * NR + j] = acc[i][j]
  int g = 0;
  for (; g + 8 <= MR * NR; g += 8) Sum16x8(flat + g, out + g);
  for (; g < MR * NR; ++g) out[g] = Sum16(flat[g]);
}

// ------------------------------------------------------------------------------------------------- AVX2

inline void LoadTail(const float* p, int64_t n, float* buf) {  // n < 16 floats, zero-filled to 16
  for (int64_t l = 0; l < 16; ++l) buf[l] = l < n ? p[l] : 0.0f;
}

// One step of 16 k's: lanes 0-7 and 8-15 of each 16-lane accumulator in lo and hi.
template <int MR, int NR>
__attribute__((target("avx2,fma"))) inline void Step256(const float* const* x, const float* const* w,
                                                        int64_t at, __m256 (&lo)[MR][NR], __m256 (&hi)[MR][NR],
                                                        int64_t ahead, uint32_t ahead_rows) {
  // Lanes 0-7 first, then lanes 8-15, so that besides the 2 x MR x NR accumulators only NR w vectors and one
  // x vector are live: a 2 x 3 tile fits AVX2's 16 registers (12 + 3 + 1), where loading both halves first
  // (6 w, 2 x) spills accumulators to the stack. Each accumulator takes the same multiply-adds in the same
  // order either way.
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) {
    if (ahead_rows >> j & 1) _mm_prefetch(reinterpret_cast<const char*>(w[j] + ahead + at), _MM_HINT_T1);
    wv[j] = _mm256_loadu_ps(w[j] + at);
    if (MR > 1) InRegister(wv[j]);
  }
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x[i] + at);
    for (int j = 0; j < NR; ++j) lo[i][j] = _mm256_fmadd_ps(xv, wv[j], lo[i][j]);
  }
  for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w[j] + at + 8);
  if (MR > 1)
    for (int j = 0; j < NR; ++j) InRegister(wv[j]);
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x[i] + at + 8);
    for (int j = 0; j < NR; ++j) hi[i][j] = _mm256_fmadd_ps(xv, wv[j], hi[i][j]);
  }
}

template <int MR, int NR>
__attribute__((target("avx2,fma"))) void Tile256(const float* const* x, const float* const* w, int64_t K,
                                                 float* out, int64_t ahead, uint32_t ahead_rows) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) lo[i][j] = hi[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) Step256<MR, NR>(x, w, k, lo, hi, ahead, ahead_rows);
  if (k < K) {  // the last K % 16 products, from zero-filled copies
    alignas(64) float xb[MR][16], wb[NR][16];
    const float *xs[MR], *ws[NR];
    for (int i = 0; i < MR; ++i) LoadTail(x[i] + k, K - k, xb[i]), xs[i] = xb[i];
    for (int j = 0; j < NR; ++j) LoadTail(w[j] + k, K - k, wb[j]), ws[j] = wb[j];
    Step256<MR, NR>(xs, ws, 0, lo, hi, 0, 0);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * NR + j] = Sum8(_mm256_add_ps(lo[i][j], hi[i][j]));
}

// ------------------------------------------------------------------------------------- blocks and threads

using TileFn = void (*)(const float* const*, const float* const*, int64_t, float*, int64_t, uint32_t);

struct Kernel {
  dispatch::Isa isa;
  int mr, nr;
  TileFn tiles[9];  // tiles[r]: r x rows (1 <= r <= mr) against nr w rows
};

// Two tile shapes, the same arithmetic per output. A decode step's few rows take one row tile, 8 x 3,
// so each w vector loaded from memory feeds all of them; many rows (a prefill) take 4 x 6 tiles, which
// load fewer vectors per multiply-add. One row (decode at B=1) takes `one`: the few-row tile's, or AVX2's
// where dispatch::Rowdot(1) says so.
struct Kernels {
  Kernel one, few, many;
};

inline const Kernels& Pick() {
  static const Kernels k = [] {
    using dispatch::Isa;
    Kernel avx2{Isa::kAvx2, 2, 3, {nullptr, Tile256<1, 3>, Tile256<2, 3>}};
    if (dispatch::Here().f32 == Isa::kAvx512) {
      Kernel few{Isa::kAvx512, 8, 3, {nullptr, Tile512<1, 3>, Tile512<2, 3>, Tile512<3, 3>, Tile512<4, 3>,
                                      Tile512<5, 3>, Tile512<6, 3>, Tile512<7, 3>, Tile512<8, 3>}};
      return Kernels{dispatch::Rowdot(1) == Isa::kAvx2 ? avx2 : few, few,
                     {Isa::kAvx512, 4, 6, {nullptr, Tile512<1, 6>, Tile512<2, 6>, Tile512<3, 6>, Tile512<4, 6>}}};
    }
    return Kernels{avx2, avx2, avx2};
  }();
  return k;
}

inline const Kernel& For(int64_t rows) {
  return rows == 1 ? Pick().one : rows <= Pick().few.mr ? Pick().few : Pick().many;
}

// What a row's end means (rowdot's `ends`, one int per x row): nothing; outputs n >= end are not needed
// (attention's scores past a query's last visible slot: written as 0, never computed); or x[m, k] == 0
// for k >= end (attention's weights there), so the dot product may stop at the first multiple of 16 at
// or past it. Both leave every computed output's bits as they were: a skipped product adds an exact
// zero to its lane (a zero's sign aside).
enum class Ends { kNone = 0, kOutputs = 1, kInputs = 2 };

struct Problem {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K;
  const int32_t* ends = nullptr;  // [M], or null
  Ends mode = Ends::kNone;
};

inline int64_t MaxEnd(const Problem& p, int64_t m, int64_t mm) {
  int64_t e = 0;
  for (int64_t i = 0; i < mm; ++i) e = std::max<int64_t>(e, p.ends[m + i]);
  return e;
}

// Rows [m0, m1) x columns [n0, n1) of y. A short last tile repeats its last row or column (computed the
// same way, then dropped), so every output goes through the same instructions. The row tiles of each
// column tile prefetch the next column tile's w rows into L2 as they go: the hardware prefetcher alone
// leaves memory idle while a few-row tile computes. Row tile r of R takes the rows j with j % R == r, so
// the prefetches go out spread over the column tile's work, not all in its first row tile, whose bursts
// leave memory idle too (at 8 rows AVX2 runs 4 row tiles). bench/RESULTS.md has the figures.
inline void Block(const Problem& p, const Kernel& kern, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t ahead = kern.nr * p.K;  // floats from a w row to the same k in the next tile's row
  const int64_t R = std::clamp<int64_t>((m1 - m0 + kern.mr - 1) / kern.mr, 1, kern.nr);  // row tiles sharing
  uint32_t ahead_rows[12] = {};  // row tile r's prefetched rows (a bit each), r < R
  for (int j = 0; j < kern.nr; ++j) ahead_rows[j % R] |= 1u << j;
  float out[48];  // mr x nr
  const float* xs[8];
  const float* ws[12];
  for (int64_t n = n0; n < n1; n += kern.nr) {
    int64_t nn = std::min<int64_t>(kern.nr, n1 - n);
    for (int j = 0; j < kern.nr; ++j) ws[j] = p.w + (n + std::min<int64_t>(j, nn - 1)) * p.K;
    for (int64_t m = m0; m < m1; m += kern.mr) {
      int64_t mm = std::min<int64_t>(kern.mr, m1 - m);
      int64_t K = p.K;
      if (p.mode == Ends::kOutputs && n >= MaxEnd(p, m, mm)) {
        for (int i = 0; i < mm; ++i)
          for (int j = 0; j < nn; ++j) p.y[(m + i) * p.N + n + j] = 0.0f;
        continue;
      }
      if (p.mode == Ends::kInputs) K = std::min(K, (MaxEnd(p, m, mm) + 15) / 16 * 16);
      for (int i = 0; i < mm; ++i) xs[i] = p.x + (m + i) * p.K;
      const int64_t r = (m - m0) / kern.mr;
      kern.tiles[mm](xs, ws, K, out, ahead, r < R ? ahead_rows[r] : 0);
      for (int i = 0; i < mm; ++i) {
        int64_t end = p.mode == Ends::kOutputs ? p.ends[m + i] : p.N;  // outputs past a row's end are 0
        for (int j = 0; j < nn; ++j) p.y[(m + i) * p.N + n + j] = n + j < end ? out[i * kern.nr + j] : 0.0f;
      }
    }
  }
}

// Work item i of a problem cut into row_blocks x column blocks.
inline void Item(const Problem& p, int64_t row_blocks, int64_t i) {
  int64_t rb = i % row_blocks, cb = i / row_blocks;
  Block(p, For(p.M), rb * kRowBlock, std::min(p.M, (rb + 1) * kRowBlock), cb * kColBlock,
        std::min(p.N, (cb + 1) * kColBlock));
}

inline int64_t RowBlocks(const Problem& p) { return (p.M + kRowBlock - 1) / kRowBlock; }
inline int64_t Items(const Problem& p) { return RowBlocks(p) * ((p.N + kColBlock - 1) / kColBlock); }

}  // namespace rowdot
