// rowdot_int8 on AMX's tile unit (Intel Sapphire Rapids and later): the same exact integer sums as int8.h,
// so the same bits, for problems of many rows (a prefill, a large batch: dispatch::Int8 decides).
//
// One tile multiply (TDPBSSD) has a long fixed latency whatever its dependences, so a tile of 16 x rows pays
// off only when most of it is real rows: from 16 rows on the tiles beat VNNI, below it VNNI, which streams
// the weights, is faster (bench/RESULTS.md).
//
// AMX multiplies bytes, not int16, so each int16 activation is split exactly into a signed high byte and
// an unsigned low byte, xq = 256 * hi + lo (hi = xq >> 8 in [-128, 127], lo = xq & 255), and
//   xq . q = 256 * (hi . q) + (lo . q),
// two byte dot products (TDPBSSD: signed x signed, TDPBSUD: signed x unsigned), each in int32 lanes that
// cannot overflow for K <= 65536 (|lo . q| <= 65536 * 255 * 128 < 2^31), joined in int64. The total is the
// integer int8.h sums, exactly, so the final rounding (one, in double, as int8.h's) gives identical bits:
// AMX changes how fast an output is computed, never what it is.
//
// The layout: the weights q [N, K] are AMX's A operand as they lie (16 rows of N, 64 bytes of K per tile,
// the row stride K); x is the B operand, each group of 16 rows packed once per call into [K / 4, 16 x 4]
// bytes (4 consecutive k of each row side by side), so the output tile is [16 columns of y, 16 rows of x].
// Two column tiles share each x tile; 8 tile registers hold 2 weight tiles, the 2 x tiles and 4 sums.
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "dispatch.h"
#include "int8_problem.h"

namespace amx {

using int8::Problem;

constexpr int64_t kMaxK = dispatch::kMaxK8;  // the int32 sums' bound (above)
constexpr int64_t kGroup = 16;    // x rows per tile
constexpr int64_t kCols = 32;     // y columns per step: two 16-column tiles

// Bytes of one packed x: ceil(M / 16) groups of [K / 4, 64] bytes, for hi and again for lo.
inline int64_t PackedBytes(int64_t M, int64_t K) { return (M + kGroup - 1) / kGroup * K * kGroup; }

// xq [M, Kp] (int16) -> hi and lo, each [groups, K / 4, 16, 4] bytes: element (m, k) at group m / 16, row
// k / 4, column (m % 16) * 4 + k % 4. Rows past M are zero, so their sums are zero and dropped. The bytes
// of 32 k at a time are split with AVX-512, then moved 4 at a time to their places in the tiles' layout.
__attribute__((target("avx512f,avx512bw"))) inline void Pack(const int16_t* xq, int64_t M, int64_t K, int64_t Kp,
                                                             int8_t* hi, uint8_t* lo) {
  const int64_t bytes = PackedBytes(M, K);
  if (M % kGroup != 0) {  // only the last group's missing rows need zeros; the rest is all written below
    const int64_t tail = M / kGroup * K * kGroup;
    std::memset(hi + tail, 0, bytes - tail), std::memset(lo + tail, 0, bytes - tail);
  }
  alignas(64) uint8_t h[32], l[32];
  const __m512i low_byte = _mm512_set1_epi16(0xff);
  for (int64_t m = 0; m < M; ++m) {
    const int16_t* row = xq + m * Kp;
    const int64_t base = m / kGroup * K * kGroup + m % kGroup * 4;
    for (int64_t k = 0; k < K; k += 32) {  // K is a multiple of 64 (dispatch::AmxFits)
      const __m512i v = _mm512_loadu_si512(row + k);
      _mm256_store_si256(reinterpret_cast<__m256i*>(h), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
      for (int c = 0; c < 8; ++c) {
        const int64_t at = base + (k / 4 + c) * (kGroup * 4);
        std::memcpy(hi + at, h + 4 * c, 4), std::memcpy(lo + at, l + 4 * c, 4);
      }
    }
  }
}

// One group's sums -> y rows [g, g + rows), columns [n, n + 32): total = 256 * hi + lo in int64, then
// int8.h's rounding, (float)((double)total * x_scale * w_scale), the same three IEEE operations in the same
// order (so the same bits), 8 x rows at a time in double lanes.
__attribute__((target("avx512f,avx512dq"))) inline void Finish(const Problem& p, const int32_t (*sums)[16][16],
                                                               int64_t g, int64_t rows, int64_t n) {
  alignas(64) double sx[16] = {};
  for (int64_t i = 0; i < rows; ++i) sx[i] = p.x_scale[g + i];
  alignas(64) float out[32][16];  // [y column][x row]
  for (int j = 0; j < 32; ++j) {
    const int t = j / 16 * 2, c = j % 16;
    const __m512d ws = _mm512_set1_pd(static_cast<double>(p.w_scale[n + j]));
    for (int h = 0; h < 16; h += 8) {
      const __m512i hi = _mm512_cvtepi32_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(&sums[t][c][h])));
      const __m512i lo = _mm512_cvtepi32_epi64(_mm256_load_si256(reinterpret_cast<const __m256i*>(&sums[t + 1][c][h])));
      const __m512d total = _mm512_cvtepi64_pd(_mm512_add_epi64(_mm512_slli_epi64(hi, 8), lo));
      const __m512d y = _mm512_mul_pd(_mm512_mul_pd(total, _mm512_load_pd(sx + h)), ws);
      _mm256_store_ps(&out[j][h], _mm512_cvtpd_ps(y));
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    float* y = p.y + (g + i) * p.N + n;
    for (int j = 0; j < 32; ++j) y[j] = out[j][i];
  }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows [m0, m1) (m0 a multiple of 16) x columns [n0, n0 + 32 * steps) of y, on the tiles.
// Tiles: 0, 1 the weights (columns n..n+15, n+16..n+31), 2 hi, 3 lo, 4..7 the sums (hi, lo per column tile).
__attribute__((target("amx-tile,amx-int8"))) inline void Block(const Problem& p, int64_t m0, int64_t m1, int64_t n0,
                                                               int64_t steps, int64_t ahead_steps) {
  // Configured and released on every call (no slower than once per thread): another library on
  // this thread (oneDNN in PyTorch) may configure the tiles its own way or release them in between.
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  const int64_t K = p.K;
  alignas(64) int32_t sums[4][16][16];  // [tile][y column][x row]
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t n = n0 + s * kCols;
    const int8_t* w0 = p.wq + n * K;
    const int8_t* w1 = w0 + 16 * K;
    for (int64_t g = m0; g < m1; g += kGroup) {
      const int8_t* hi = p.x_hi + g / kGroup * K * kGroup;
      const uint8_t* lo = p.x_lo + g / kGroup * K * kGroup;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      const bool fetch = g == m0 && s + 1 < steps + ahead_steps;
      for (int64_t k = 0; k < K; k += 64) {
        if (fetch)  // the next step's weights, at the same k, into L2: the tiles' loads alone leave memory idle
          for (int r = 0; r < 32; ++r) _mm_prefetch(reinterpret_cast<const char*>(w0 + (32 + r) * K + k), _MM_HINT_T1);
        _tile_loadd(0, w0 + k, K);
        _tile_loadd(1, w1 + k, K);
        _tile_loadd(2, hi + k * kGroup, 64);
        _tile_loadd(3, lo + k * kGroup, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbsud(5, 0, 3);
        _tile_dpbssd(6, 1, 2);
        _tile_dpbsud(7, 1, 3);
      }
      _tile_stored(4, sums[0], 64);
      _tile_stored(5, sums[1], 64);
      _tile_stored(6, sums[2], 64);
      _tile_stored(7, sums[3], 64);
      Finish(p, sums, g, std::min<int64_t>(kGroup, m1 - g), n);
    }
  }
  _tile_release();
}

}  // namespace amx
