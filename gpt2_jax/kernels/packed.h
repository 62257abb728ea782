// rowdot over float32 weights stored losslessly in 3.5 bytes each (gpt2_jax.model.precision's "float32-packed"):
// the same multiply-adds on the same float32 values as rowdot.h, so the same bits, from 12.5% fewer bytes.
//
// Why: a decode step at B=1 reads every weight once and does one multiply-add with it, so it runs at the memory's
// speed; every fp32 engine reads the same 500 MB of gpt2-small and they finish level (bench/peers.py). A float32's
// top byte (its sign and 7 of its 8 exponent bits) takes few values in trained and random weights alike (N(0, 0.02):
// 15 of them cover all but ~1e-3 of the weights), so each weight keeps its low 3 bytes (mantissa and the exponent's
// last bit) and a 4-bit code for its top byte; the rare top byte outside a matrix's 15 most common is an escape
// listed beside the rows. Rebuilding a float then takes two byte shuffles (AVX-512 VBMI's vpermb).
//
// Layout of a weight w [N, K] (K a multiple of 16), each row K / 16 groups of 56 bytes, rows one after another:
//   bytes 3i .. 3i+2 (i < 16)  float i's bytes 0-2, little-endian
//   bytes 48 .. 55             the codes, a little-endian 64-bit word: float i's in bits 4i .. 4i+3
//   lut [16]                   code c's top byte, shifted into place (t << 24); code 15 is the escape (lut 0)
//   esc, esc_off [N + 1]       row n's escapes, esc[esc_off[n] .. esc_off[n + 1]): k << 8 | t, k ascending
// The float's bits are low | lut[code], with t << 24 in place of lut[code] at an escape.
// (No XLA, no Python here: bench/kernels_harness.cc times it.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "rowdot.h"

namespace packed {

constexpr int64_t kGroup = 16;       // floats per group
constexpr int64_t kGroupBytes = 56;  // their bytes
constexpr int64_t kAhead = 4096;     // bytes ahead of the one-row pass that it prefetches (bench/RESULTS.md)

struct Weights {
  const uint8_t* data;     // [N, K / 16 x 56]
  const int32_t* lut;      // [16]
  const int32_t* esc_off;  // [N + 1]
  const int32_t* esc;      // [esc_off[N]]
};

inline int64_t RowBytes(int64_t K) { return K / kGroup * kGroupBytes; }

// An escape's top byte (e & 0xFF) written into its float.
inline void SetTop(float* f, int32_t e) {
  uint32_t bits;
  std::memcpy(&bits, f, 4);
  bits = (bits & 0x00FFFFFFu) | (static_cast<uint32_t>(e & 0xFF) << 24);
  std::memcpy(f, &bits, 4);
}

// Row n's escapes written into its decoded floats.
inline void Patch(const Weights& w, int64_t n, float* row) {
  for (int32_t i = w.esc_off[n]; i < w.esc_off[n + 1]; ++i) SetTop(row + (w.esc[i] >> 8), w.esc[i]);
}

// The escapes of the group at k written into its floats f [16]: the row's escapes [esc, end) at k ascending, esc
// moved past the group's; -> the next one's k (or K).
inline int64_t PatchGroup(float* f, int64_t k, const int32_t*& esc, const int32_t* end, int64_t K) {
  for (; esc < end && (*esc >> 8) < k + kGroup; ++esc) SetTop(f + ((*esc >> 8) - k), *esc);
  return esc < end ? (*esc >> 8) : K;
}

// ------------------------------------------------------------------------------ AVX-512 (with VBMI's vpermb)

struct Consts512 {
  __m512i spread, select, tops;
};

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline Consts512 Make512(const int32_t* lut) {
  alignas(64) uint8_t spread[64], select[64], tops[64];
  for (int i = 0; i < 16; ++i) {
    // dword i's bytes 0-2 are the group's bytes 3i .. 3i+2 (its byte 3 is zeroed by the mask)
    spread[4 * i] = 3 * i, spread[4 * i + 1] = 3 * i + 1, spread[4 * i + 2] = 3 * i + 2, spread[4 * i + 3] = 0;
    // vpmultishiftqb: dword i's byte 3 takes the 8 bits from bit 4i of the codes (code i, then code i + 1's bits)
    select[4 * i] = select[4 * i + 1] = select[4 * i + 2] = 0, select[4 * i + 3] = static_cast<uint8_t>(4 * i);
  }
  // vpermb reads an index's low 6 bits: code i and 2 bits of code i + 1, so the 16 top bytes repeat 4 times
  for (int j = 0; j < 64; ++j) tops[j] = static_cast<uint8_t>(static_cast<uint32_t>(lut[j % 16]) >> 24);
  return Consts512{_mm512_load_si512(spread), _mm512_load_si512(select), _mm512_load_si512(tops)};
}

// One group's 16 floats (escapes not patched: their top byte is 0): bytes 0-2 of each from the group, byte 3 its
// code's top byte.
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline __m512 Group512(const uint8_t* g, const Consts512& c) {
  const __m512i bytes = _mm512_maskz_loadu_epi8(0x00FFFFFFFFFFFFFFull, g);  // the group's 56 (no read past it)
  const __m512i low = _mm512_maskz_permutexvar_epi8(0x7777777777777777ull, c.spread, bytes);
  long long codes;
  std::memcpy(&codes, g + 48, 8);
  const __m512i at = _mm512_multishift_epi64_epi8(c.select, _mm512_set1_epi64(codes));
  return _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(low, 0x8888888888888888ull, at, c.tops));
}

// Row n decoded into out [K].
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) inline void Row512(const Weights& w, int64_t n, int64_t K,
                                                                         float* out) {
  const Consts512 c = Make512(w.lut);
  const uint8_t* g = w.data + n * RowBytes(K);
  for (int64_t k = 0; k < K; k += kGroup, g += kGroupBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(g + kAhead), _MM_HINT_T0);
    _mm512_storeu_ps(out + k, Group512(g, c));
  }
  Patch(w, n, out);
}

// x . w[n] for one x row, decoding in registers: rowdot.h's 16 lanes (lane i takes k = i, i + 16, ... through fused
// multiply-adds) and its Sum16 tree, so the bits of its Tile512<1, 3> and Tile256<1, 3>.
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma"))) inline float Dot512(const float* x, const Weights& w,
                                                                                   const Consts512& c, int64_t n,
                                                                                   int64_t K) {
  const uint8_t* g = w.data + n * RowBytes(K);
  const int32_t *esc = w.esc + w.esc_off[n], *end = w.esc + w.esc_off[n + 1];
  int64_t next = esc < end ? (*esc >> 8) : K;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kGroup, g += kGroupBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(g + kAhead), _MM_HINT_T0);
    __m512 v = Group512(g, c);
    if (next < k + kGroup) {  // rare: patch this group's escapes
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      next = PatchGroup(f, k, esc, end, K);
      v = _mm512_load_ps(f);
    }
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), v, acc);
  }
  return rowdot::Sum16(acc);
}

// ------------------------------------------------------------------------------------------------- AVX2

// One group's 16 floats as two 8-float halves (escapes not patched), tops the 16 codes' top bytes. pshufb works
// within 128-bit lanes, so each lane loads the 12 bytes of its 4 floats at their own offset.
__attribute__((target("avx2"))) inline void Group256(const uint8_t* g, __m128i tops, __m256* lo, __m256* hi) {
  const __m256i spread = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,  //
                                          0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 48));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i top = _mm_shuffle_epi8(  // codes 0, 1, ..., 15 (byte b holds 2b low, 2b + 1 high) -> top bytes
      tops, _mm_unpacklo_epi8(_mm_and_si128(codes, nib), _mm_and_si128(_mm_srli_epi16(codes, 4), nib)));
  __m256i out[2];
  for (int h = 0; h < 2; ++h) {
    const uint8_t* p = g + 24 * h;
    const __m256i low = _mm256_shuffle_epi8(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12)), 1),
        spread);
    out[h] = _mm256_or_si256(low, _mm256_slli_epi32(_mm256_cvtepu8_epi32(h == 0 ? top : _mm_srli_si128(top, 8)), 24));
  }
  *lo = _mm256_castsi256_ps(out[0]), *hi = _mm256_castsi256_ps(out[1]);
}

__attribute__((target("avx2"))) inline __m128i Tops(const int32_t* lut) {
  alignas(16) uint8_t b[16];
  for (int c = 0; c < 16; ++c) b[c] = static_cast<uint8_t>(static_cast<uint32_t>(lut[c]) >> 24);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
}

__attribute__((target("avx2"))) inline void Row256(const Weights& w, int64_t n, int64_t K, float* out) {
  const __m128i tops = Tops(w.lut);
  const uint8_t* g = w.data + n * RowBytes(K);
  for (int64_t k = 0; k < K; k += kGroup, g += kGroupBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(g + kAhead), _MM_HINT_T0);
    __m256 lo, hi;
    Group256(g, tops, &lo, &hi);
    _mm256_storeu_ps(out + k, lo), _mm256_storeu_ps(out + k + 8, hi);
  }
  Patch(w, n, out);
}

// x . w[n] for one x row, decoding in registers with AVX2: the 16 lanes as two 8-lane halves, each taking the
// multiply-adds of rowdot.h's Tile256<1, 3>, then its sum (Sum8 of lo + hi), so its bits.
__attribute__((target("avx2,fma"))) inline float Dot256(const float* x, const Weights& w, __m128i tops, int64_t n,
                                                        int64_t K) {
  const uint8_t* g = w.data + n * RowBytes(K);
  const int32_t *esc = w.esc + w.esc_off[n], *end = w.esc + w.esc_off[n + 1];
  int64_t next = esc < end ? (*esc >> 8) : K;
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kGroup, g += kGroupBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(g + kAhead), _MM_HINT_T0);
    __m256 a, b;
    Group256(g, tops, &a, &b);
    if (next < k + kGroup) {  // rare: patch this group's escapes
      alignas(32) float f[16];
      _mm256_store_ps(f, a), _mm256_store_ps(f + 8, b);
      next = PatchGroup(f, k, esc, end, K);
      a = _mm256_load_ps(f), b = _mm256_load_ps(f + 8);
    }
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), a, lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), b, hi);
  }
  return rowdot::Sum8(_mm256_add_ps(lo, hi));
}

// y[n] = x . w[n] for n in [n0, n1), one x row, each weight row decoded in registers.
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma"))) inline void OneRow512(const float* x, const Weights& w,
                                                                                     int64_t n0, int64_t n1, int64_t K,
                                                                                     float* y) {
  const Consts512 c = Make512(w.lut);
  for (int64_t n = n0; n < n1; ++n) y[n] = Dot512(x, w, c, n, K);
}

__attribute__((target("avx2,fma"))) inline void OneRow256(const float* x, const Weights& w, int64_t n0, int64_t n1,
                                                          int64_t K, float* y) {
  const __m128i tops = Tops(w.lut);
  for (int64_t n = n0; n < n1; ++n) y[n] = Dot256(x, w, tops, n, K);
}

// ------------------------------------------------------------------------------------- blocks and threads

inline void Row(const Weights& w, int64_t n, int64_t K, float* out) {
  if (dispatch::PackedDecoder(2) == dispatch::Isa::kAvx512Vbmi)
    Row512(w, n, K, out);
  else
    Row256(w, n, K, out);
}

// Rows [m0, m1) x columns [n0, n1) of y = x . w.T. One x row: each weight row decoded in registers (OneRow512 or
// OneRow256: one stream, which the hardware and kAhead prefetch linearly; 1 x 3 tiles read slower). Otherwise
// each tile's nr weight rows are decoded into a buffer that rowdot's own tiles then read for every x row. Either
// way rowdot's arithmetic, so rowdot's bits at every row count. (Decoding in registers for 2-8 rows, each vector
// feeding every row, is slower than the buffer: on AMD's AVX-512, which runs a 512-bit operation as two halves,
// decoding a vector costs about as much as 8 rows' multiply-adds with it, so at B=8 either form spends more on
// decoding than its 12.5% fewer bytes save; see precision.py.) dispatch::PackedDecoder picks the decoder.
inline void Block(const rowdot::Problem& p, const Weights& w, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t K = p.K;
  float out[48];
  const float* xs[8];
  if (p.M == 1) {
    // AVX-512 where rowdot's own 1-row tiles are AVX-512's; where those are AVX2's (dispatch::OneRowOnAvx2),
    // the 256-bit decoder streams faster too.
    static const bool wide = dispatch::PackedDecoder(1) == dispatch::Isa::kAvx512Vbmi;
    if (wide)
      OneRow512(p.x, w, n0, n1, K, p.y);
    else
      OneRow256(p.x, w, n0, n1, K, p.y);
    return;
  }
  const rowdot::Kernel& kern = rowdot::For(p.M);
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(kern.nr * K));
  const float* ws[12];
  for (int64_t n = n0; n < n1; n += kern.nr) {
    const int64_t nn = std::min<int64_t>(kern.nr, n1 - n);
    for (int j = 0; j < kern.nr; ++j) {
      if (j < nn) Row(w, n + j, K, buf.data() + j * K);
      ws[j] = buf.data() + std::min<int64_t>(j, nn - 1) * K;  // a short tile repeats its last row, as rowdot's
    }
    // The next tile's rows on their way to L2 while the tiles below compute (the memory idles otherwise).
    const uint8_t* ahead = w.data + std::min(n + kern.nr, p.N - 1) * RowBytes(K);
    const int64_t span = std::min<int64_t>(kern.nr, std::max<int64_t>(p.N - n - kern.nr, 1)) * RowBytes(K);
    for (int64_t b = 0; b < span; b += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T1);
    for (int64_t m = m0; m < m1; m += kern.mr) {
      const int64_t mm = std::min<int64_t>(kern.mr, m1 - m);
      for (int i = 0; i < mm; ++i) xs[i] = p.x + (m + i) * K;
      kern.tiles[mm](xs, ws, K, out, 0, 0);
      for (int i = 0; i < mm; ++i)
        for (int j = 0; j < nn; ++j) p.y[(m + i) * p.N + n + j] = out[i * kern.nr + j];
    }
  }
}

inline void Item(const rowdot::Problem& p, const Weights& w, int64_t row_blocks, int64_t i) {
  const int64_t rb = i % row_blocks, cb = i / row_blocks;
  Block(p, w, rb * rowdot::kRowBlock, std::min(p.M, (rb + 1) * rowdot::kRowBlock), cb * rowdot::kColBlock,
        std::min(p.N, (cb + 1) * rowdot::kColBlock));
}

}  // namespace packed
