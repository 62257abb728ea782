// The one place that reads the CPU's features and picks every op's path: which instruction set rowdot,
// rowdot_int8 (and its w8a8 form), rowdot_packed, chain, softmax, argmax and cumsum run with for a given
// number of rows. Every kernel asks here, and so does the report (cpu.cc's `paths`, gpt2_jax.kernels.report),
// so what the report says is what runs. Every path of an op gives the same bits (the headers say why), so a
// choice here changes only the speed.
//
// GPT2_JAX_ROWDOT_ISA (read once per process) forces an older path where the CPU has a newer one: avx2
// (every op), avx512 (int8 without VNNI), avx512-vnni (int8 without AMX); either of the last two also keeps
// AVX-512's 1-row tiles on AMD (OneRowOnAvx2). The tests use it to compare the paths bit for bit.
// (No XLA, no Python here: bench/kernels_harness.cc includes it too.)
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace dispatch {

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Vbmi, kAvx512Vnni, kAmx };

inline const char* Name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Vbmi: return "avx512-vbmi";
    case Isa::kAvx512Vnni: return "avx512-vnni";
    case Isa::kAmx: return "amx-int8";
  }
  return "?";
}

// Whether this CPU has AMX's int8 tiles and Linux lets this process use them (the tile state must be
// requested once per process; without it the first tile instruction faults).
inline bool AmxUsable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), int8 = d & (1u << 25);
  if (!tile || !int8) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

// AMD's AVX-512 cores (Zen 4) run a 512-bit operation as two 256-bit halves, so a 1-row tile, which only
// streams its weights, gains nothing from the width, and AVX2's 1-row tiles decode faster there; on Intel
// the AVX-512 tiles are the faster (bench/RESULTS.md). GPT2_JAX_ROWDOT_ISA=avx512... keeps AVX-512.
inline bool OneRowOnAvx2(const char* forced) {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") && (forced == nullptr || std::string(forced).rfind("avx512", 0) != 0);
}

// The features the kernels use, after GPT2_JAX_ROWDOT_ISA.
struct Cpu {
  bool usable = false;        // AVX2 and FMA: what every kernel needs
  Isa f32 = Isa::kAvx2;       // rowdot's and chain's tiles: kAvx512 or kAvx2
  bool one_row_avx2 = false;  // one row takes AVX2's tiles even where f32 is kAvx512 (OneRowOnAvx2)
  bool vbmi = false;          // packed's AVX-512 decoder (VBMI's vpermb, with AVX-512BW and f32's AVX-512)
  Isa int8 = Isa::kAvx2;      // rowdot_int8's best: kAmx, kAvx512Vnni, kAvx512 or kAvx2
  bool amd = false;
  const char* forced = nullptr;  // GPT2_JAX_ROWDOT_ISA, or null
};

inline const Cpu& Here() {
  static const Cpu c = [] {
    __builtin_cpu_init();
    Cpu c;
    const char* env = std::getenv("GPT2_JAX_ROWDOT_ISA");
    const std::string forced = env == nullptr ? "" : env;
    c.forced = env;
    c.usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = __builtin_cpu_supports("avx512f") && forced != "avx2";
    c.f32 = avx512 ? Isa::kAvx512 : Isa::kAvx2;
    const bool bw = avx512 && __builtin_cpu_supports("avx512bw");
    c.vbmi = bw && __builtin_cpu_supports("avx512vbmi");
    if (bw && __builtin_cpu_supports("avx512vnni") && forced != "avx512")
      c.int8 = forced != "avx512-vnni" && AmxUsable() ? Isa::kAmx : Isa::kAvx512Vnni;
    else
      c.int8 = bw ? Isa::kAvx512 : Isa::kAvx2;
    c.one_row_avx2 = OneRowOnAvx2(env);
    c.amd = __builtin_cpu_is("amd");
    return c;
  }();
  return c;
}

// ---------------------------------------------------------------------------------------------- float32

// rowdot's tiles for `rows` x rows: AVX-512's, except one row where OneRowOnAvx2.
inline Isa Rowdot(int64_t rows) { return rows == 1 && Here().one_row_avx2 ? Isa::kAvx2 : Here().f32; }

// chain's tiles (and, at one row, its wide pass over a query's keys): AVX-512's wherever rowdot's many-row
// tiles are, at any row count.
inline Isa Chain(int64_t) { return Here().f32; }

// rowdot_packed's decoder. One row decodes in registers beside rowdot's 1-row arithmetic, so it follows
// Rowdot(1); more rows decode into a buffer that rowdot's own tiles (Rowdot(rows)) then read.
inline Isa PackedDecoder(int64_t rows) {
  const bool wide = Here().vbmi && (rows > 1 || Rowdot(1) == Isa::kAvx512);
  return wide ? Isa::kAvx512Vbmi : Isa::kAvx2;
}

// ------------------------------------------------------------------------------------------------- int8

constexpr int64_t kMaxK8 = 65536;  // a8.h's, vnni_rows.h's and amx.h's int32 sums stay exact up to this K
constexpr int64_t kAmxMinRows = 16;  // fewer x rows than a tile's 16 stay off AMX and vnni_rows.h
constexpr int64_t kA8MinRows = 3;    // a8.h's byte tiles: 3 to 8 rows (fewer are memory-bound on any tile)
constexpr int64_t kA8MaxRows = 8;

// Which K each tile takes: AMX's a multiple of its 64-byte width (no tile reads past a row), vnni_rows.h's
// a multiple of its 4-byte steps; all within the int32 sums' bound.
inline bool AmxFits(int64_t K) { return K % 64 == 0 && K > 0 && K <= kMaxK8; }
inline bool RowsFits(int64_t K) { return K > 0 && K <= kMaxK8 && K % 4 == 0; }
inline bool A8Fits(int64_t K) { return K > 0 && K <= kMaxK8; }

// rowdot_int8's own tiles (int8.h) for `rows` rows: the CPU's best below AMX, AVX2's 1 x 8 at one row where
// OneRowOnAvx2.
inline Isa Int8Tiles(int64_t rows) {
  const Isa best = Here().int8 == Isa::kAmx ? Isa::kAvx512Vnni : Here().int8;
  return rows == 1 && Here().one_row_avx2 && best != Isa::kAvx2 ? Isa::kAvx2 : best;
}

// Where a rowdot_int8 problem of `rows` rows and K runs (w8a8: its rows rounded to bytes). AMX's tiles hold 16
// rows, so fewer are mostly padding there; VNNI's lanes over rows (vnni_rows.h) take 16 or more where AMX
// does not; a8.h's byte tiles take w8a8's 3 to 8 rows; the rest int8.h's own tiles. The exact integer sums
// are the same on each, so the bits are too.
enum class Int8Route { kTiles, kA8, kRows, kAmx };

inline Int8Route Int8(int64_t rows, int64_t K, bool w8a8) {
  const Cpu& c = Here();
  if (c.int8 == Isa::kAmx && AmxFits(K) && rows >= kAmxMinRows) return Int8Route::kAmx;
  const bool vnni = c.int8 == Isa::kAmx || c.int8 == Isa::kAvx512Vnni;
  if (vnni && rows >= kAmxMinRows && RowsFits(K)) return Int8Route::kRows;
  if (w8a8 && vnni && rows >= kA8MinRows && rows <= kA8MaxRows && A8Fits(K)) return Int8Route::kA8;
  return Int8Route::kTiles;
}

// The path's name in the report.
inline std::string Int8Name(int64_t rows, int64_t K, bool w8a8) {
  switch (Int8(rows, K, w8a8)) {
    case Int8Route::kAmx: return "amx-int8";
    case Int8Route::kRows: return "avx512-vnni-rows";
    case Int8Route::kA8: return "avx512-vnni-bytes";
    case Int8Route::kTiles: break;
  }
  return Name(Int8Tiles(rows));
}

// ------------------------------------------------------------------------------------------- row-wise

// softmax and argmax: one 8-lane AVX2 program on every CPU (their bits then need no second path);
// cumsum: one sequential float64 pass per row.
inline Isa Softmax(int64_t) { return Isa::kAvx2; }
inline Isa ArgMax(int64_t) { return Isa::kAvx2; }
inline Isa CumSum(int64_t) { return Isa::kScalar; }

}  // namespace dispatch
