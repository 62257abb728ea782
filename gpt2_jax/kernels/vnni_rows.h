// rowdot_int8 for a few rows to a few hundred on AVX512-VNNI, lanes over x's rows: the same exact integer
// sums as int8.h, so the same bits, about 1.6x faster than int8.h's tiles at 8 rows (a decode step at B = 8).
//
// Why: int8.h's tiles put k in the lanes, so every output ends in a sum of 16 lanes; at K = 768 that sum
// costs a third as much as the multiply-adds before it. Here every lane is one x row's own total for one
// output column, and nothing is summed across lanes but a row's two byte planes at the very end.
//
// The arithmetic (the AMX split of amx.h, in VNNI's u8 x s8 instruction, vpdpbusd):
//   xq = 256 * hi + lo with hi = xq >> 8 in [-128, 127] and lo = xq & 255 in [0, 255]. vpdpbusd wants its
//   first operand unsigned, so hi goes in as hi + 128, and
//     xq . q = 256 * ((hi + 128) . q - 128 * sum(q)) + lo . q,
//   where sum(q) is the column's own weight sum, taken in the same pass over the same bytes (a 1s vector
//   against 64 weights at a time). Every term is an exact integer in int32 lanes for K <= 65536
//   (|(hi + 128) . q| <= 65536 * 255 * 128 < 2^31), joined in int64: int8.h's total, then its one rounding.
//
// The layout: a group of G rows (G = 8, or 4 for 3-4 rows) is packed once per call into steps of 64 bytes;
// a step covers KS = 32 / G consecutive k, and lane l holds 4 consecutive k of one plane of one row:
//   s = l % S (which 4 of the step's KS), plane = (l / S) / G (hi + 128, then lo), row = (l / S) % G,
// with S = 8 / G. The weights stay as they lie ([N, K], int8): KS bytes of one column are broadcast to
// every lane (for G = 8 folded into vpdpbusd as a memory operand), so one instruction does 4 k of G rows
// for one column, and a tile of 12 columns shares each packed x step. (No XLA, no Python here.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "rowdot.h"  // Problem

namespace vnni_rows {

using rowdot::Problem;

constexpr int64_t kMaxK = 65536;  // the int32 sums' bound (above)
constexpr int kNR = 12;           // columns per tile: 12 sums + 12 weight sums + x + 1s + a spare of 32 registers

inline int Group(int64_t M) { return M <= 4 ? 4 : 8; }
inline int64_t StepK(int G) { return 32 / G; }
// Whether a problem with this K can take these tiles with groups of G rows: whole steps (a broadcast never
// reads past a weight row, so never past the last) and the sums' bound.
inline bool Fits(int64_t K, int G) { return K > 0 && K <= kMaxK && K % StepK(G) == 0; }
inline int64_t GroupBytes(int64_t K, int G) { return K / StepK(G) * 64; }
inline int64_t PackedBytes(int64_t M, int64_t K, int G) { return (M + G - 1) / G * GroupBytes(K, G); }

// xq [M, Kp] (int16) -> [groups][K / KS][16 lanes][4] bytes as above. Rows past M are zero bytes in both
// planes (their sums are dropped). Each row's planes are split with AVX-512, then moved 4 bytes at a time.
__attribute__((target("avx512f,avx512bw"))) inline void Pack(const int16_t* xq, int64_t M, int64_t K, int64_t Kp,
                                                             int G, uint8_t* out) {
  const int S = 8 / G, KS = 32 / G;
  if (M % G != 0) {
    const int64_t tail = M / G * GroupBytes(K, G);
    std::memset(out + tail, 0, PackedBytes(M, K, G) - tail);
  }
  alignas(64) uint8_t h[32], l[32];
  const __m512i low_byte = _mm512_set1_epi16(0xff), bias = _mm512_set1_epi16(128);
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* row = xq + m * Kp;  // readable to Kp, a multiple of 32, zeros past K
    uint8_t* group = out + m / G * GroupBytes(K, G);
    const int r = static_cast<int>(m % G);
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i v = _mm512_loadu_si512(row + k);
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_srai_epi16(v, 8), bias)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
      for (int64_t c = 0; c < 32 && k + c < K; c += 4) {
        const int64_t kk = k + c, s = kk % KS / 4;
        uint8_t* step = group + kk / KS * 64;
        std::memcpy(step + (s + r * S) * 4, h + c, 4), std::memcpy(step + (s + (G + r) * S) * 4, l + c, 4);
      }
    }
  }
}

// KS bytes of a weight row, in every lane.
template <int G>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i Broadcast(const int8_t* w) {
  if constexpr (G == 8) return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(w));
  else return _mm512_set1_epi64(*reinterpret_cast<const int64_t*>(w));
}

// One group (packed px) against kNR weight rows over K -> exact int64 totals[r][j]. `ahead`: bytes to
// prefetch ahead in each weight row (0: none).
template <int G>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void Tile(const uint8_t* px, const int8_t* const* w, int64_t K,
                                                                 int64_t* totals, int64_t ahead) {
  constexpr int KS = 32 / G, S = 8 / G;
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
    for (int t = 0; t < 64; t += KS) {
      const __m512i xv = _mm512_loadu_si512(px + (k + t) / KS * 64);
#pragma GCC unroll 12
      for (int j = 0; j < kNR; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], xv, Broadcast<G>(w[j] + k + t));
    }
  }
  if (k < K) {  // the last K % 64: whole steps (Fits), the weight sums from a masked load
    const __mmask64 mask = ~0ull >> (64 - (K - k));
    for (int j = 0; j < kNR; ++j) wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, _mm512_maskz_loadu_epi8(mask, w[j] + k));
    for (; k < K; k += KS) {
      const __m512i xv = _mm512_loadu_si512(px + k / KS * 64);
      for (int j = 0; j < kNR; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], xv, Broadcast<G>(w[j] + k));
    }
  }
  for (int j = 0; j < kNR; ++j) {
    alignas(64) int32_t lane[16];
    _mm512_store_si512(lane, acc[j]);
    const int64_t sum_q = _mm512_reduce_add_epi32(wsum[j]);  // |sum_q| <= 128 K: no overflow
    for (int r = 0; r < G; ++r) {
      int64_t hi = 0, lo = 0;
      for (int s = 0; s < S; ++s) hi += lane[s + r * S], lo += lane[s + (G + r) * S];
      totals[r * kNR + j] = 256 * (hi - 128 * sum_q) + lo;
    }
  }
}

// Rows [m0, m1) (m0 a multiple of G) x columns [n0, n1) of y: int8.h's Block with these tiles. A short last
// tile repeats its last column (computed the same way, then dropped); the first group of each column tile
// prefetches the weight rows two tiles on.
inline void Block(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int G = p.x_group;
  const int64_t ahead = 2 * kNR * p.K;
  int64_t totals[8 * kNR];
  const int8_t* ws[kNR];
  for (int64_t n = n0; n < n1; n += kNR) {
    const int64_t nn = std::min<int64_t>(kNR, n1 - n);
    for (int j = 0; j < kNR; ++j) ws[j] = p.wq + (n + std::min<int64_t>(j, nn - 1)) * p.K;
    for (int64_t g = m0; g < m1; g += G) {
      const uint8_t* px = p.x_rows + g / G * GroupBytes(p.K, G);
      if (G == 8) Tile<8>(px, ws, p.K, totals, g == m0 ? ahead : 0);
      else Tile<4>(px, ws, p.K, totals, g == m0 ? ahead : 0);
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
