// rowdot_int8 for 16 rows or more on AVX512-VNNI without AMX (a prefill, a large batch), lanes over x's
// rows: the same exact integer sums as int8.h, so the same bits, faster than int8.h's 4 x 6 tiles.
//
// Why: int8.h's tiles put k in the lanes, so every output ends in a sum of 16 lanes; at K = 768 that sum
// costs a third as much as the multiply-adds before it. Here every lane is one x row's own total for one
// output column, and nothing is summed across lanes but a row's two byte planes at the very end.
//
// From 16 rows on it is faster than int8.h's tiles with the weights streamed; with fewer rows it is faster
// only on weights that stay in cache, so a decode step's few rows stay on int8.h's tiles, which read the
// weights in longer runs (bench/RESULTS.md).
//
// The arithmetic (the AMX split of amx.h, in VNNI's u8 x s8 instruction, vpdpbusd):
//   xq = 256 * hi + lo with hi = xq >> 8 in [-128, 127] and lo = xq & 255 in [0, 255]. vpdpbusd wants its
//   first operand unsigned, so hi goes in as hi + 128, and
//     xq . q = 256 * ((hi + 128) . q - 128 * sum(q)) + lo . q,
//   where sum(q) is the column's own weight sum, taken in the same pass over the same bytes (a 1s vector
//   against 64 weights at a time). Every term is an exact integer in int32 lanes for K <= 65536
//   (|(hi + 128) . q| <= 65536 * 255 * 128 < 2^31), joined in int64: int8.h's total, then its one rounding.
//
// w8a8's 8-bit rows (a8.h) need no low plane: xq + z (its zero point) is one byte, so a group holds 16 rows,
// one per lane, and the total is lane[r] - z * sum(q); one instruction does twice the rows.
//
// The layout: a group of 8 rows is packed once per call into steps of 64 bytes, one step per 4 consecutive
// k: lane r holds row r's 4 bytes of hi + 128, lane 8 + r its 4 bytes of lo. The weights stay as they lie
// ([N, K], int8): 4 bytes of one column are broadcast to every lane (folded into vpdpbusd as a memory
// operand), so one instruction does 4 k of 8 rows for one column, and a tile of 12 columns shares each
// packed x step. (No XLA, no Python here: bench/kernels_harness.cc times and checks it.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "int8_problem.h"

namespace vnni_rows {

using int8::Problem;

constexpr int64_t kMaxK = dispatch::kMaxK8;  // the int32 sums' bound (above)
constexpr int kNR = 12;           // columns per tile: 12 sums + 12 weight sums + x + 1s + a spare of 32 registers
constexpr int kG = 8;             // x rows per group (int16 rows: two planes)
constexpr int kG8 = 16;           // w8a8's 8-bit rows per group (one plane)

// Rows per group: 16 for w8a8's 8-bit rows (the problem carries the weight rows' sums), else 8.
inline int64_t Group(const Problem& p) { return p.qsum != nullptr ? kG8 : kG; }

// Whether a problem with this K can take these tiles: whole steps of 4 k (a broadcast never reads past a
// weight row, so never past the last) and the sums' bound.
inline int64_t GroupBytes(int64_t K) { return K / 4 * 64; }
inline int64_t PackedBytes(int64_t M, int64_t K, int64_t G = kG) { return (M + G - 1) / G * GroupBytes(K); }

// xq [M, Kp] (int16) -> [groups][K / 4][16 lanes][4] bytes as above. Rows past M are zero bytes in both
// planes (their sums are dropped). Each row's planes are split with AVX-512, then moved 4 bytes at a time.
__attribute__((target("avx512f,avx512bw"))) inline void Pack(const int16_t* xq, int64_t M, int64_t K, int64_t Kp,
                                                             uint8_t* out) {
  if (M % kG != 0) {
    const int64_t tail = M / kG * GroupBytes(K);
    std::memset(out + tail, 0, PackedBytes(M, K) - tail);
  }
  alignas(64) uint8_t h[32], l[32];
  const __m512i low_byte = _mm512_set1_epi16(0xff), bias = _mm512_set1_epi16(128);
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* row = xq + m * Kp;  // readable to Kp, a multiple of 32, zeros past K
    uint8_t* group = out + m / kG * GroupBytes(K);
    const int r = static_cast<int>(m % kG);
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = _mm512_loadu_si512(row + k);
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_srai_epi16(v, 8), bias)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
      for (int64_t c = 0; c < 32 && k + c < K; c += 4) {
        uint8_t* step = group + (k + c) / 4 * 64;
        std::memcpy(step + r * 4, h + c, 4), std::memcpy(step + (kG + r) * 4, l + c, 4);
      }
    }
  }
}

// w8a8's xq [M, Kp] (int16) and zero points -> [groups of 16][K / 4][16 lanes][4] bytes of xq + zero. Rows past
// M are zero bytes (their sums are dropped).
__attribute__((target("avx512f,avx512bw"))) inline void Pack8(const int16_t* xq, const int32_t* zero, int64_t M,
                                                              int64_t K, int64_t Kp, uint8_t* out) {
  if (M % kG8 != 0) {
    const int64_t tail = M / kG8 * GroupBytes(K);
    std::memset(out + tail, 0, PackedBytes(M, K, kG8) - tail);
  }
  alignas(64) uint8_t b[32];
  for (int64_t m = 0; m < M; ++m) {
    const __m512i bias = _mm512_set1_epi16(static_cast<int16_t>(zero[m]));
    const int16_t* row = xq + m * Kp;  // readable to Kp, a multiple of 32, zeros past K
    uint8_t* group = out + m / kG8 * GroupBytes(K);
    const int r = static_cast<int>(m % kG8);
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i u = _mm512_add_epi16(_mm512_loadu_si512(row + k), bias);  // xq + zero, a byte
      _mm256_store_si256(reinterpret_cast<__m256i*>(b), _mm512_cvtepi16_epi8(u));
      for (int64_t c = 0; c < 32 && k + c < K; c += 4) std::memcpy(group + (k + c) / 4 * 64 + r * 4, b + c, 4);
    }
  }
}

// 4 bytes of a weight row, in every lane.
__attribute__((target("avx512f"))) inline __m512i Broadcast(const int8_t* w) {
  int32_t v;
  std::memcpy(&v, w, 4);
  return _mm512_set1_epi32(v);
}

// One group (packed px) against kNR weight rows over K -> exact int64 totals[r][j] (G rows: 8, two planes;
// 16, w8a8's one plane, its rows' zero points in zero[16]). `ahead`: bytes to prefetch ahead in each weight row
// (0: none).
template <int G>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void Tile(const uint8_t* px, const int8_t* const* w,
                                                                        int64_t K, int64_t* totals, int64_t ahead,
                                                                        const int32_t* zero) {
  __m512i acc[kNR], wsum[kNR];
#pragma GCC unroll 12
  for (int j = 0; j < kNR; ++j) acc[j] = wsum[j] = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 12
    for (int j = 0; j < kNR; ++j) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w[j] + k + ahead), _MM_HINT_T1);
      wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, _mm512_loadu_si512(w[j] + k));
    }
#pragma GCC unroll 16
    for (int t = 0; t < 64; t += 4) {
      const __m512i xv = _mm512_loadu_si512(px + (k + t) * 16);
#pragma GCC unroll 12
      for (int j = 0; j < kNR; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], xv, Broadcast(w[j] + k + t));
    }
  }
  if (k < K) {  // the last K % 64: whole steps (dispatch::RowsFits), the weight sums from a masked load
    const __mmask64 mask = ~0ull >> (64 - (K - k));
    for (int j = 0; j < kNR; ++j) wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, _mm512_maskz_loadu_epi8(mask, w[j] + k));
    for (; k < K; k += 4) {
      const __m512i xv = _mm512_loadu_si512(px + k * 16);
      for (int j = 0; j < kNR; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], xv, Broadcast(w[j] + k));
    }
  }
  for (int j = 0; j < kNR; ++j) {
    alignas(64) int32_t lane[16];
    _mm512_store_si512(lane, acc[j]);
    const int64_t sum_q = _mm512_reduce_add_epi32(wsum[j]);  // |sum_q| <= 128 K: no overflow
    if constexpr (G == kG8) {
      for (int r = 0; r < kG8; ++r) totals[r * kNR + j] = lane[r] - zero[r] * sum_q;
    } else {
      for (int r = 0; r < kG; ++r) totals[r * kNR + j] = 256 * (lane[r] - 128 * sum_q) + lane[kG + r];
    }
  }
}

// Rows [m0, m1) (m0 a multiple of the group) x columns [n0, n1) of y: int8.h's Block with these tiles. A short
// last tile repeats its last column (computed the same way, then dropped); the first group of each column tile
// prefetches the weight rows two tiles on.
inline void Block(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t ahead = 2 * kNR * p.K, G = Group(p);
  int64_t totals[kG8 * kNR];
  const int8_t* ws[kNR];
  for (int64_t n = n0; n < n1; n += kNR) {
    const int64_t nn = std::min<int64_t>(kNR, n1 - n);
    for (int j = 0; j < kNR; ++j) ws[j] = p.wq + (n + std::min<int64_t>(j, nn - 1)) * p.K;
    for (int64_t g = m0; g < m1; g += G) {
      const uint8_t* px = p.x_rows + g / G * GroupBytes(p.K);
      int32_t zero[kG8] = {};  // w8a8's zero points, 0 for rows past m1
      if (p.x_zero != nullptr) std::copy(p.x_zero + g, p.x_zero + std::min<int64_t>(g + G, m1), zero);
      (G == kG8 ? Tile<kG8> : Tile<kG>)(px, ws, p.K, totals, g == m0 ? ahead : 0, zero);
      for (int64_t i = 0; i < std::min<int64_t>(G, m1 - g); ++i) {
        const double sx = p.x_scale[g + i];
        for (int64_t j = 0; j < nn; ++j)
          p.y[(g + i) * p.N + n + j] =
              static_cast<float>(static_cast<double>(totals[i * kNR + j]) * sx * static_cast<double>(p.w_scale[n + j]));
      }
    }
  }
}

}  // namespace vnni_rows
