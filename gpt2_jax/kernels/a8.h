// rowdot_int8 with x's rows rounded to 8 bits (gpt2_jax.model.precision's "w8a8"): a decode step's few rows on
// AVX512-VNNI, in VNNI's byte instruction, vpdpbusd, which does twice the products of int8.h's vpdpwssd.
//
// Why: at 8 rows int8.h's int16 rows make a decode step compute-bound, not memory-bound: gpt2-small's 49
// matmuls are 31 million vpdpwssd, most of a step at a core's VNNI rate (bench/RESULTS.md). Bytes halve
// that count. The price is the rounding of x: a step of 1/255 of the row's range instead of
// 1/65534 of its largest element (bench/precision.py and bench/peers.py measure the logit error it adds).
//
// The arithmetic is int8.h's on int8::QuantizeRow8's rows (xq, with a zero point z per row that makes
// xq + z a byte): the exact integer total of xq . q, then int8.h's one rounding. vpdpbusd wants its first
// operand unsigned, which xq + z is, so the total is (xq + z) . q - z * qsum, with qsum = sum(q), the weight
// row's own sum (computed once with the weights, gpt2_jax.model.precision). Every term is an exact integer
// in int32 for K <= 65536 (255 * 127 * K < 2^31). Other row counts run int8.h's own paths on the same small
// xq (1-2 rows its int16 tiles; 16 or more vnni_rows.h's lanes over rows, one byte plane of 16 rows; AMX's
// tiles; AVX2): the same exact totals, so the same bits for any number of rows.
// (No XLA, no Python here: bench/kernels_harness.cc times and checks it.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "int8_problem.h"

namespace a8 {

using int8::Problem;

constexpr int64_t kMaxK = dispatch::kMaxK8;  // the int32 totals' bound (above)
constexpr int kMaxRows = dispatch::kA8MaxRows;  // one tile's rows (dispatch::Int8 routes 3 to 8 rows here)
constexpr int64_t kPad = 64;      // packed rows are padded to whole 64-byte steps (against zero weights)

inline int64_t Padded(int64_t K) { return (K + kPad - 1) / kPad * kPad; }

// xq [M, Kq] int16 rows and their zero points -> [M, Padded(K)] bytes xq + zero (zero past K).
__attribute__((target("avx512f,avx512bw"))) inline void Pack(const int16_t* xq, const int32_t* zero, int64_t M,
                                                             int64_t K, int64_t Kq, uint8_t* out) {
  const int64_t Kp = Padded(K);
  for (int64_t m = 0; m < M; ++m) {
    const __m512i bias = _mm512_set1_epi16(static_cast<int16_t>(zero[m]));
    const int16_t* row = xq + m * Kq;  // readable to Kq, a multiple of 32, zeros past K
    uint8_t* to = out + m * Kp;
    int64_t k = 0;
    for (; k + 32 <= Kq; k += 32)  // Kq <= Kp
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + k),
                          _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_loadu_si512(row + k), bias)));
    std::memset(to + k, zero[m], Kp - k);
  }
}

// acc + x . w, kept in its register (see int8.h's DpwssdInPlace: through the intrinsic GCC 12 spilled the
// accumulators of multi-row tiles).
__attribute__((target("avx512f,avx512vnni"))) inline __m512i DpbusdInPlace(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// Eight accumulators' lane sums at once (integer sums: exact in any order), a transposing tree of shuffles and
// adds in place of eight separate reductions, which at K = 768 had cost a third as much as the products: the
// tree of rowdot.h's Sum16x8, on int32 lanes (whose adds are not float adds, hence its own copy).
__attribute__((target("avx512f"))) inline void Sum16x8(const __m512i* a, int32_t* out) {
  __m512i c[4], d[2];
  for (int p = 0; p < 4; ++p)  // 256-bit halves added: a[2p]'s sums in the low half, a[2p + 1]'s in the high
    c[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0x44),
                            _mm512_shuffle_i32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int p = 0; p < 2; ++p)  // 128-bit quarter q: accumulator 4p + q's four partial sums
    d[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(c[2 * p], c[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // within each quarter: d[0]'s two pairs, then d[1]'s, then the pairs added
  const __m512i e = _mm512_add_epi32(_mm512_unpacklo_epi64(d[0], d[1]), _mm512_unpackhi_epi64(d[0], d[1]));
  const __m512i f = _mm512_add_epi32(e, _mm512_shuffle_epi32(e, _MM_PERM_CDAB));
  alignas(64) int32_t sums[16];
  _mm512_store_si512(sums, f);
  for (int q = 0; q < 4; ++q) out[q] = sums[4 * q], out[q + 4] = sums[4 * q + 2];
}

template <int MR, int NR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void Step(const uint8_t* const* x,
                                                                        const int8_t* const* w, int64_t k,
                                                                        int64_t at, __m512i (&acc)[MR][NR],
                                                                        int64_t ahead) {
  __m512i wv[NR];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w[j] + at + ahead), _MM_HINT_T1);
    wv[j] = _mm512_loadu_si512(w[j] + at);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const __m512i xv = _mm512_loadu_si512(x[i] + k);
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) acc[i][j] = DpbusdInPlace(acc[i][j], xv, wv[j]);
  }
}

// MR packed rows against NR weight rows over K -> out[i * NR + j] = (xq[i] + z[i]) . q[j], exact in int32.
template <int MR, int NR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void Tile(const uint8_t* const* x, const int8_t* const* w,
                                                                 int64_t K, int32_t* out, int64_t ahead) {
  __m512i acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) Step<MR, NR>(x, w, k, k, acc, ahead);
  if (k < K) {  // the last K % 64 weights from zero-filled copies (x's padding times 0 adds nothing)
    alignas(64) int8_t tail[NR][64];
    const int8_t* ws[NR];
    int8::ZeroFilledTail(w, k, K, tail, ws);
    Step<MR, NR>(x, ws, k, 0, acc, 0);
  }
  const __m512i* flat = &acc[0][0];
  int t = 0;
  for (; t + 8 <= MR * NR; t += 8) Sum16x8(flat + t, out + t);
  for (; t < MR * NR; ++t) out[t] = _mm512_reduce_add_epi32(flat[t]);
}

using TileFn = void (*)(const uint8_t* const*, const int8_t* const*, int64_t, int32_t*, int64_t);

constexpr int kNR = 3;         // weight rows per tile
constexpr int64_t kAhead = 2;  // tiles on that a tile prefetches the weight rows of

// 3 to 8 rows (dispatch::Int8) in one 8 x 3 tile, so each weight vector loaded feeds every row, prefetching
// the weight rows two tiles on, the best distance tried (bench/RESULTS.md). One or two rows stay on int8.h's
// tiles: memory-bound, they are as fast or faster there.
inline TileFn TileFor(int64_t rows) {
  static const TileFn tiles[kMaxRows + 1] = {nullptr,    nullptr,    nullptr,    Tile<3, kNR>, Tile<4, kNR>,
                                             Tile<5, kNR>, Tile<6, kNR>, Tile<7, kNR>, Tile<8, kNR>};
  return tiles[rows];
}

// Rows [m0, m1) (at most kMaxRows: one tile) x columns [n0, n1) of y, from p.x_a8 (Pack's rows), p.x_zero and
// p.qsum. A short last tile repeats its last column (computed the same way, then dropped). y is int8.h's one
// rounding of the exact total.
inline void Block(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t rows = m1 - m0, ahead = kAhead * kNR * p.K, Kp = Padded(p.K);
  const TileFn tile = TileFor(rows);
  int32_t out[kMaxRows * kNR];
  const uint8_t* xs[kMaxRows];
  const int8_t* ws[kNR];
  for (int i = 0; i < rows; ++i) xs[i] = p.x_a8 + (m0 + i) * Kp;
  for (int64_t n = n0; n < n1; n += kNR) {
    const int64_t nn = std::min<int64_t>(kNR, n1 - n);
    for (int j = 0; j < kNR; ++j) ws[j] = p.wq + (n + std::min<int64_t>(j, nn - 1)) * p.K;
    tile(xs, ws, p.K, out, ahead);
    for (int i = 0; i < rows; ++i) {
      const double sx = p.x_scale[m0 + i];
      for (int j = 0; j < nn; ++j) {
        const int64_t total = static_cast<int64_t>(out[i * kNR + j]) -
                              static_cast<int64_t>(p.x_zero[m0 + i]) * static_cast<int64_t>(p.qsum[n + j]);
        p.y[(m0 + i) * p.N + n + j] =
            static_cast<float>(static_cast<double>(total) * sx * static_cast<double>(p.w_scale[n + j]));
      }
    }
  }
}

}  // namespace a8
