// chain's arithmetic: y[m, n] = sum_k x[m, k] * w[k, n] with w as [K, N] (the KV cache's keys transposed,
// its values as they come), each output ONE fused multiply-add chain in k order:
//   acc = 0; for k = 0 .. K-1: acc = fma(x[m, k], w[k, n], acc)
// Lanes run over outputs n, so no lane is ever summed with another: a tile of MR rows x NV vectors of
// outputs takes one broadcast x value and one w vector per multiply-add, with none of rowdot's lane sums.
// That suits attention, whose dot products are short (64 for the scores): rowdot spent as long summing
// lanes as multiplying there. Any tile shape, vector width (AVX-512 or AVX2), thread split or batch gives
// every output the same chain, so the same bits. (No XLA, no Python here: bench/kernels_harness.cc times it.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "dispatch.h"
#include "rowdot.h"  // Problem, Ends, MaxEnd

namespace chain {

using rowdot::Ends;
using rowdot::Problem;

constexpr int kMR = 6;                // x rows per tile
constexpr int kNV = 4;                // 16-lane vectors of outputs per tile (64 outputs: one head's values)
constexpr int64_t kRowBlock = 48;     // x rows per work item
constexpr int64_t kColBlock = 256;    // outputs per work item

inline __mmask16 Lanes16(int64_t n) { return static_cast<__mmask16>((1u << std::clamp<int64_t>(n, 0, 16)) - 1); }

// Rows x[0 .. MR) (row stride xs) against w (row stride ws) over k in [0, K), outputs [0, nn) of each row
// (nn <= 64; absent lanes load zeros and are not stored), into y (row stride ys). The four accumulator
// arrays are spelled out: an [MR][4] array of vectors makes GCC keep a copy in memory.
template <int MR>
__attribute__((target("avx512f,avx2,fma"))) void Tile512(const float* x, int64_t xs, const float* w, int64_t ws,
                                                         int64_t K, int64_t nn, float* y, int64_t ys, bool more) {
  const __mmask16 m0 = Lanes16(nn), m1 = Lanes16(nn - 16), m2 = Lanes16(nn - 32), m3 = Lanes16(nn - 48);
  __m512 a0[MR], a1[MR], a2[MR], a3[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) a0[i] = a1[i] = a2[i] = a3[i] = _mm512_setzero_ps();
  if (more)  // continue the chains y holds (a paged operand's next block of k): a float32 store and load is exact
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      a0[i] = _mm512_maskz_loadu_ps(m0, y + i * ys), a1[i] = _mm512_maskz_loadu_ps(m1, y + i * ys + 16);
      a2[i] = _mm512_maskz_loadu_ps(m2, y + i * ys + 32), a3[i] = _mm512_maskz_loadu_ps(m3, y + i * ys + 48);
    }
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ws;
    __m512 w0 = _mm512_maskz_loadu_ps(m0, wk), w1 = _mm512_maskz_loadu_ps(m1, wk + 16);
    __m512 w2 = _mm512_maskz_loadu_ps(m2, wk + 32), w3 = _mm512_maskz_loadu_ps(m3, wk + 48);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_set1_ps(x[i * xs + k]);
      a0[i] = _mm512_fmadd_ps(xv, w0, a0[i]);
      a1[i] = _mm512_fmadd_ps(xv, w1, a1[i]);
      a2[i] = _mm512_fmadd_ps(xv, w2, a2[i]);
      a3[i] = _mm512_fmadd_ps(xv, w3, a3[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    _mm512_mask_storeu_ps(y + i * ys, m0, a0[i]);
    _mm512_mask_storeu_ps(y + i * ys + 16, m1, a1[i]);
    _mm512_mask_storeu_ps(y + i * ys + 32, m2, a2[i]);
    _mm512_mask_storeu_ps(y + i * ys + 48, m3, a3[i]);
  }
}

__attribute__((target("avx2"))) inline __m256i Lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The same with 8-lane vectors, 16 outputs at a time (AVX2 has 16 registers): each output's chain is
// unchanged.
template <int MR>
__attribute__((target("avx2,fma"))) void Tile256(const float* x, int64_t xs, const float* w, int64_t ws,
                                                 int64_t K, int64_t nn, float* y, int64_t ys, bool more) {
  for (int64_t n = 0; n < nn; n += 16) {
    const __m256i m0 = Lanes8(nn - n), m1 = Lanes8(nn - n - 8);
    __m256 a0[MR], a1[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    if (more)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        a0[i] = _mm256_maskload_ps(y + i * ys + n, m0), a1[i] = _mm256_maskload_ps(y + i * ys + n + 8, m1);
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * ws + n;
      __m256 w0 = _mm256_maskload_ps(wk, m0), w1 = _mm256_maskload_ps(wk + 8, m1);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        __m256 xv = _mm256_set1_ps(x[i * xs + k]);
        a0[i] = _mm256_fmadd_ps(xv, w0, a0[i]);
        a1[i] = _mm256_fmadd_ps(xv, w1, a1[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      _mm256_maskstore_ps(y + i * ys + n, m0, a0[i]);
      _mm256_maskstore_ps(y + i * ys + n + 8, m1, a1[i]);
    }
  }
}

// A decode step's one query against a layer's keys (mode kOutputs, 1 row): many vectors of outputs per pass
// (AVX-512: up to 16, 256 outputs; AVX2: up to 8, 64 outputs, what its 16 registers hold), so each key row
// [k, n0 .. end) is read contiguously once, not in 16- or 64-output pieces, the accumulators are that many
// independent chains (a 1-row tile of AVX2 runs two, each waiting on the last multiply-add's latency), and the
// rows kPrefetchRows on are prefetched (past the last row: what comes next). The keys' rows lie S floats apart
// (C in a paged block), so each narrow piece would restart the hardware prefetcher. The same chain per
// output, so the same bits.
constexpr int kWideNV = 16;
constexpr int64_t kPrefetchRows = 8;

template <int NV>
__attribute__((target("avx512f,avx2,fma"))) void Wide512(const float* x, const float* w, int64_t ws, int64_t K,
                                                         int64_t nn, float* y) {
  const __mmask16 last = Lanes16(nn - 16 * (NV - 1));
  __m512 a[NV];
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ws;
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * ws + 16 * j), _MM_HINT_T0);
    const __m512 xv = _mm512_set1_ps(x[k]);
#pragma GCC unroll 16
    for (int j = 0; j < NV - 1; ++j) a[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wk + 16 * j), a[j]);
    a[NV - 1] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(last, wk + 16 * (NV - 1)), a[NV - 1]);
  }
#pragma GCC unroll 16
  for (int j = 0; j < NV - 1; ++j) _mm512_storeu_ps(y + 16 * j, a[j]);
  _mm512_mask_storeu_ps(y + 16 * (NV - 1), last, a[NV - 1]);
}

template <int NV>
__attribute__((target("avx2,fma"))) void Wide256(const float* x, const float* w, int64_t ws, int64_t K,
                                                 int64_t nn, float* y) {
  const __m256i last = Lanes8(nn - 8 * (NV - 1));
  __m256 a[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ws;
#pragma GCC unroll 8
    for (int j = 0; j < NV; j += 2) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchRows * ws + 8 * j), _MM_HINT_T0);
    const __m256 xv = _mm256_set1_ps(x[k]);
#pragma GCC unroll 8
    for (int j = 0; j < NV - 1; ++j) a[j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wk + 8 * j), a[j]);
    a[NV - 1] = _mm256_fmadd_ps(xv, _mm256_maskload_ps(wk + 8 * (NV - 1), last), a[NV - 1]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV - 1; ++j) _mm256_storeu_ps(y + 8 * j, a[j]);
  _mm256_maskstore_ps(y + 8 * (NV - 1), last, a[NV - 1]);
}

using WideFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*);

struct Wide {
  const WideFn* fns;  // fns[v]: v vectors (1 <= v <= vectors)
  int lanes, vectors;
  int64_t Pass() const { return int64_t{lanes} * vectors; }  // outputs per pass at most
};

inline const Wide& Wides() {  // dispatch::Chain(1)'s
  static const WideFn avx512[] = {nullptr,      Wide512<1>,  Wide512<2>,  Wide512<3>,  Wide512<4>,  Wide512<5>,
                                  Wide512<6>,   Wide512<7>,  Wide512<8>,  Wide512<9>,  Wide512<10>, Wide512<11>,
                                  Wide512<12>,  Wide512<13>, Wide512<14>, Wide512<15>, Wide512<16>};
  static const WideFn avx2[] = {nullptr, Wide256<1>, Wide256<2>, Wide256<3>, Wide256<4>,
                                Wide256<5>, Wide256<6>, Wide256<7>, Wide256<8>};
  static const Wide picked =
      dispatch::Chain(1) == dispatch::Isa::kAvx512 ? Wide{avx512, 16, kWideNV} : Wide{avx2, 8, 8};
  return picked;
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, bool);

// A paged w: the KV cache as a pool of blocks of C slots, one row's blocks listed by its block table
// (gpt2_jax.model.paged_cache). Keys [K, C] per block are paged along the outputs (slot n lies in block
// table[n / C] at column n % C); values [C, K] along the chains (slot k in block table[k / C], row k % C),
// so a chain runs through one block, keeps its accumulators in y, and goes on in the next: the same
// multiply-adds in the same order as over one contiguous array.
struct Pages {
  const float* base;       // block 0 of this problem's (layer, head)
  const int32_t* table;    // this row's blocks
  int64_t block_stride;    // floats from one block to the next (H x K x C)
  int64_t C, blocks;       // slots per block; blocks in the pool (entries are clamped into it)
  bool keys;               // paged along the outputs (keys) or the chains (values)
  const float* Block(int64_t j) const {
    return base + std::clamp<int64_t>(table[j], 0, blocks - 1) * block_stride;
  }
};

// One query row m's outputs [n0, n1) through Wides(), zeros past its end; over pages (keys), a pass stays
// within one block.
inline void WideRow(const Problem& p, int64_t m, int64_t n0, int64_t n1, const Pages* pages) {
  const Wide& wide = Wides();
  float* y = p.y + m * p.N;
  const int64_t end = std::clamp<int64_t>(p.ends[m], n0, n1);
  for (int64_t n = n0; n < end;) {
    int64_t nn = std::min<int64_t>(wide.Pass(), end - n);
    const float* w = p.w + n;
    int64_t ws = p.N;
    if (pages != nullptr) {
      nn = std::min<int64_t>(nn, pages->C - n % pages->C);
      w = pages->Block(n / pages->C) + n % pages->C;
      ws = pages->C;
    }
    wide.fns[(nn + wide.lanes - 1) / wide.lanes](p.x + m * p.K, w, ws, p.K, nn, y + n);
    n += nn;
  }
  std::fill(y + end, y + n1, 0.0f);
}

inline const TileFn* Tiles() {  // Tiles()[r]: r rows (1 <= r <= kMR), dispatch::Chain's
  static const TileFn avx512[] = {nullptr, Tile512<1>, Tile512<2>, Tile512<3>, Tile512<4>, Tile512<5>, Tile512<6>};
  static const TileFn avx2[] = {nullptr, Tile256<1>, Tile256<2>, Tile256<3>, Tile256<4>, Tile256<5>, Tile256<6>};
  static const TileFn* picked = dispatch::Chain(kMR) == dispatch::Isa::kAvx512 ? avx512 : avx2;
  return picked;
}

// Rows [m0, m1) x outputs [n0, n1) of y, column tiles outside (a w panel stays in L1 across row tiles).
// Ends (see rowdot::Ends): kOutputs skips a tile past every row's end and zeroes outputs past each row's
// own; kInputs stops a tile's chains at its rows' largest end (later products are exact zeros).
// With pages, w is read through them (p.w unused): keys' output tiles never straddle a block (C is a
// multiple of a tile's 64 outputs), values' chains go block by block.
inline void Block(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Pages* pages = nullptr) {
  const TileFn* tiles = Tiles();
  if (p.M == 1 && p.mode == Ends::kOutputs && (pages == nullptr || pages->keys))
    return WideRow(p, m0, n0, n1, pages);
  for (int64_t n = n0; n < n1; n += 16 * kNV) {
    int64_t nn = std::min<int64_t>(16 * kNV, n1 - n);
    for (int64_t m = m0; m < m1; m += kMR) {
      int64_t mm = std::min<int64_t>(kMR, m1 - m);
      float* y = p.y + m * p.N + n;
      int64_t K = p.K;
      if (p.mode == Ends::kOutputs && n >= rowdot::MaxEnd(p, m, mm)) {
        for (int i = 0; i < mm; ++i) std::fill(y + i * p.N, y + i * p.N + nn, 0.0f);
        continue;
      }
      if (p.mode == Ends::kInputs) K = std::min<int64_t>(K, rowdot::MaxEnd(p, m, mm));
      if (pages == nullptr) {
        tiles[mm](p.x + m * p.K, p.K, p.w + n, p.N, K, nn, y, p.N, false);
      } else if (pages->keys) {
        tiles[mm](p.x + m * p.K, p.K, pages->Block(n / pages->C) + n % pages->C, pages->C, K, nn, y, p.N, false);
      } else {
        int64_t k0 = 0;
        do {  // at least once: K = 0 stores zeros
          int64_t kk = std::min<int64_t>(pages->C, K - k0);
          tiles[mm](p.x + m * p.K + k0, p.K, pages->Block(k0 / pages->C) + n, p.N, kk, nn, y, p.N, k0 > 0);
          k0 += pages->C;
        } while (k0 < K);
      }
      if (p.mode == Ends::kOutputs)
        for (int i = 0; i < mm; ++i) {
          int64_t end = std::clamp<int64_t>(p.ends[m + i] - n, 0, nn);
          std::fill(y + i * p.N + end, y + i * p.N + nn, 0.0f);
        }
    }
  }
}

inline int64_t RowBlocks(const Problem& p) { return (p.M + kRowBlock - 1) / kRowBlock; }
inline int64_t Items(const Problem& p) { return chain::RowBlocks(p) * ((p.N + kColBlock - 1) / kColBlock); }

inline void Item(const Problem& p, int64_t row_blocks, int64_t i, const Pages* pages = nullptr) {
  int64_t rb = i % row_blocks, cb = i / row_blocks;
  chain::Block(p, rb * kRowBlock, std::min(p.M, (rb + 1) * kRowBlock), cb * kColBlock, std::min(p.N, (cb + 1) * kColBlock),
               pages);
}

}  // namespace chain
