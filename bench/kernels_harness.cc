// The CPU kernels' arithmetic (gpt2_jax/kernels/*.h) without XLA or Python, for two jobs:
//
//   check  every op over random shapes (odd row counts, K's tails, per-row ends) against a plain scalar loop
//          that does the same float operations in the same order, bit for bit. Run once per path
//          (GPT2_JAX_ROWDOT_ISA unset, avx512-vnni, avx512, avx2: dispatch.h): every path equal to the one
//          scalar reference is every path equal to the others. CI builds it with -Werror and runs it under
//          AddressSanitizer and UBSan (bench/kernels_check.sh; tests/test_kernels_dispatch.py runs that script).
//   time   each matmul at 1, 8, 32, 96 and 512 rows (a decode step's few rows, a busy server's step, a
//          prefill) against a gpt2-small MLP weight [3072, 768]: ms per call, the weights' GB/s and GFLOP/s
//          (bench/RESULTS.md keeps the figures).
//
// Build and run from the repository's root, at setup.py's -O3: at -O2 GCC leaves AVX2's Step256 a call with
// its accumulators in memory, so `time` would not time the code the package runs.
//   g++ -std=c++17 -O3 -ffp-contract=off -Wall -I gpt2_jax/kernels bench/kernels_harness.cc -o /tmp/harness -pthread
//   /tmp/harness check [seed]
//   GPT2_JAX_ROWDOT_ISA=avx2 /tmp/harness check
//   /tmp/harness time [threads]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "chain.h"
#include "dispatch.h"
#include "int8_prepare.h"
#include "packed.h"
#include "rowdot.h"
#include "rowwise.h"
#include "softmax.h"

namespace {

std::mt19937_64 rng;
int failures = 0;
std::map<std::string, int> seen;  // the paths the checks went through, with their counts

int64_t Pick(std::initializer_list<int64_t> values) {
  return values.begin()[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
}

std::vector<float> Normal(int64_t n, float sd) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = d(rng);
  return v;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Equal bits; or both zero where a skipped product may have changed a zero's sign (rowdot::Ends).
bool Same(float a, float b, bool zero_sign_free) { return Bits(a) == Bits(b) || (zero_sign_free && a == 0 && b == 0); }

void Expect(bool ok, const char* op, int64_t M, int64_t N, int64_t K, int64_t m, int64_t n, float got, float want) {
  if (ok) return;
  if (++failures <= 20)
    std::printf("FAIL %s M=%lld N=%lld K=%lld at [%lld, %lld]: %.9g (0x%08x), want %.9g (0x%08x)\n", op,
                static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                static_cast<long long>(m), static_cast<long long>(n), got, Bits(got), want, Bits(want));
}

// rowdot's one dot product as plain C++: 16 lanes, lane i taking k = i, i + 16, ... through fused multiply-adds,
// then the fixed tree (i + 8, i + 4, (0 + 2) (1 + 3), 0 + 1).
float DotReference(const float* x, const float* w, int64_t K) {
  float lane[16] = {};
  for (int64_t k = 0; k < K; ++k) lane[k % 16] = std::fma(x[k], w[k], lane[k % 16]);
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = lane[i] + lane[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

std::vector<int32_t> Ends(int64_t M, int64_t limit) {
  std::vector<int32_t> e(static_cast<size_t>(M));
  for (int32_t& v : e) v = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, limit)(rng));
  return e;
}

void CheckRowdot(int64_t M, int64_t N, int64_t K, rowdot::Ends mode) {
  std::vector<float> x = Normal(M * K, 1.0f), w = Normal(N * K, 0.05f), y(static_cast<size_t>(M * N), -1.0f);
  std::vector<int32_t> ends = Ends(M, mode == rowdot::Ends::kOutputs ? N : K);
  if (mode == rowdot::Ends::kInputs)  // the promise in_ends makes: x is zero from its end on
    for (int64_t m = 0; m < M; ++m) std::fill(x.begin() + m * K + ends[m], x.begin() + (m + 1) * K, 0.0f);
  rowdot::Problem p{x.data(), w.data(), y.data(), M, N, K, mode == rowdot::Ends::kNone ? nullptr : ends.data(), mode};
  for (int64_t i = 0; i < rowdot::Items(p); ++i) rowdot::Item(p, rowdot::RowBlocks(p), i);
  seen[std::string("rowdot ") + dispatch::Name(dispatch::Rowdot(M))]++;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const bool out = mode == rowdot::Ends::kOutputs && n >= ends[m];
      const float want = out ? 0.0f : DotReference(&x[m * K], &w[n * K], K);
      Expect(Same(y[m * N + n], want, mode == rowdot::Ends::kInputs), "rowdot", M, N, K, m, n, y[m * N + n], want);
    }
}

void CheckChain(int64_t M, int64_t N, int64_t K, rowdot::Ends mode) {
  std::vector<float> x = Normal(M * K, 1.0f), w = Normal(K * N, 0.05f), y(static_cast<size_t>(M * N), -1.0f);
  std::vector<int32_t> ends = Ends(M, mode == rowdot::Ends::kOutputs ? N : K);
  if (mode == rowdot::Ends::kInputs)
    for (int64_t m = 0; m < M; ++m) std::fill(x.begin() + m * K + ends[m], x.begin() + (m + 1) * K, 0.0f);
  rowdot::Problem p{x.data(), w.data(), y.data(), M, N, K, ends.data(), mode};  // chain always takes ends
  for (int64_t i = 0; i < chain::Items(p); ++i) chain::Item(p, chain::RowBlocks(p), i);
  seen[std::string("chain ") + dispatch::Name(dispatch::Chain(M))]++;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float want = 0.0f;
      if (!(mode == rowdot::Ends::kOutputs && n >= ends[m]))
        for (int64_t k = 0; k < K; ++k) want = std::fma(x[m * K + k], w[k * N + n], want);
      Expect(Same(y[m * N + n], want, mode == rowdot::Ends::kInputs), "chain", M, N, K, m, n, y[m * N + n], want);
    }
}

// int8 and w8a8: the exact integer total of the rounded row and the weight row, then one rounding.
void CheckInt8(int64_t M, int64_t N, int64_t K, bool w8a8) {
  std::vector<float> x = Normal(M * K, 1.0f), scale = Normal(N, 0.01f), y(static_cast<size_t>(M * N), -1.0f);
  std::vector<int8_t> q(static_cast<size_t>(N * K));
  for (int8_t& v : q) v = static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
  std::vector<int32_t> qsum(static_cast<size_t>(N), 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) qsum[n] += q[n * K + k];
  int8::Rows rows;
  const int8::Problem p =
      int8::Prepare(x.data(), q.data(), scale.data(), w8a8 ? qsum.data() : nullptr, y.data(), M, N, K, 2, rows);
  for (int64_t i = 0; i < int8::Items(p); ++i) int8::Item(p, int8::RowBlocks(p), i);
  seen[std::string(w8a8 ? "w8a8 " : "int8 ") + dispatch::Int8Name(M, K, w8a8)]++;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t total = 0;
      for (int64_t k = 0; k < K; ++k) total += int64_t{rows.xq[m * p.Kp + k]} * q[n * K + k];
      const float want = static_cast<float>(static_cast<double>(total) * rows.scale[m] * static_cast<double>(scale[n]));
      Expect(Same(y[m * N + n], want, false), w8a8 ? "w8a8" : "int8", M, N, K, m, n, y[m * N + n], want);
    }
}

// w [N, K] packed as packed.h lays it out: the 15 most common top bytes in the table, the rest escapes.
struct Packed {
  std::vector<uint8_t> data;
  std::vector<int32_t> lut = std::vector<int32_t>(16, 0), esc_off, esc;
  packed::Weights View() const { return {data.data(), lut.data(), esc_off.data(), esc.data()}; }
};

Packed Pack(const std::vector<float>& w, int64_t N, int64_t K) {
  Packed out;
  std::vector<std::pair<int, int>> count(256);
  for (int t = 0; t < 256; ++t) count[t] = {0, t};
  for (float f : w) count[Bits(f) >> 24].first++;
  std::sort(count.rbegin(), count.rend());
  int code_of[256];
  std::fill(code_of, code_of + 256, 15);
  for (int c = 0; c < 15; ++c)
    code_of[count[c].second] = c, out.lut[c] = static_cast<int32_t>(uint32_t(count[c].second) << 24);
  out.data.assign(static_cast<size_t>(N * packed::RowBytes(K)), 0);
  out.esc_off.push_back(0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t b = Bits(w[n * K + k]);
      uint8_t* g = &out.data[n * packed::RowBytes(K) + k / 16 * packed::kGroupBytes];
      const int i = static_cast<int>(k % 16), code = code_of[b >> 24];
      g[3 * i] = b & 0xFF, g[3 * i + 1] = b >> 8 & 0xFF, g[3 * i + 2] = b >> 16 & 0xFF;
      g[48 + i / 2] |= static_cast<uint8_t>(code << (4 * (i % 2)));
      if (code == 15) out.esc.push_back(static_cast<int32_t>(k << 8 | (b >> 24)));
    }
    out.esc_off.push_back(static_cast<int32_t>(out.esc.size()));
  }
  return out;
}

void CheckPacked(int64_t M, int64_t N, int64_t K) {
  std::vector<float> x = Normal(M * K, 1.0f), w = Normal(N * K, 0.02f), y(static_cast<size_t>(M * N), -1.0f);
  for (int64_t i = 0; i < N * K; i += 37) w[i] *= 1e4f;  // escapes: top bytes outside the 15 common ones
  const Packed pw = Pack(w, N, K);
  rowdot::Problem p{x.data(), nullptr, y.data(), M, N, K};
  for (int64_t i = 0; i < rowdot::Items(p); ++i) packed::Item(p, pw.View(), rowdot::RowBlocks(p), i);
  seen[std::string("packed ") + dispatch::Name(dispatch::PackedDecoder(M))]++;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const float want = DotReference(&x[m * K], &w[n * K], K);
      Expect(Same(y[m * N + n], want, false), "packed", M, N, K, m, n, y[m * N + n], want);
    }
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    packed::Row(pw.View(), n, K, row.data());
    for (int64_t k = 0; k < K; ++k)
      Expect(Same(row[k], w[n * K + k], false), "packed_rows", 1, N, K, n, k, row[k], w[n * K + k]);
  }
}

// softmax's polynomial exp is its own, so a tolerance here; argmax and cumsum bit for bit.
void CheckRowwise(int64_t blocks, int64_t C) {
  const int64_t len = blocks * C;
  std::vector<float> s = Normal(len, 3.0f), w(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; i += 5) s[i] = -1e9f;  // masked slots
  softmax::Row(s.data(), w.data(), blocks, C);
  double top = -1e30, total = 0;
  for (float v : s) top = std::max<double>(top, v);
  for (float v : s) total += std::exp(v - top);
  for (int64_t i = 0; i < len; ++i) {
    const double want = std::exp(s[i] - top) / total;
    Expect(std::fabs(w[i] - want) <= 1e-6 + 1e-5 * want, "softmax", blocks, C, 0, 0, i, w[i], static_cast<float>(want));
  }
  if (len % 3 == 1) s[len / 2] = NAN;
  int32_t first = 0;
  bool nan = std::isnan(s[0]);
  for (int64_t i = 1; i < len && !nan; ++i)
    if (std::isnan(s[i]))
      first = static_cast<int32_t>(i), nan = true;
    else if (s[i] > s[first])
      first = static_cast<int32_t>(i);
  const int32_t got = rowwise::FirstMax(s.data(), len);
  Expect(got == first, "argmax", 1, len, 0, 0, 0, static_cast<float>(got), static_cast<float>(first));
  std::vector<float> c(static_cast<size_t>(len));
  rowwise::CumSum(w.data(), c.data(), len);
  double acc = 0;
  for (int64_t i = 0; i < len; ++i) {
    acc += w[i];
    Expect(Same(c[i], static_cast<float>(acc), false), "cumsum", 1, len, 0, 0, i, c[i], static_cast<float>(acc));
  }
  seen["softmax, argmax, cumsum"]++;
}

int Check(uint64_t seed) {
  rng.seed(seed);
  const rowdot::Ends modes[] = {rowdot::Ends::kNone, rowdot::Ends::kOutputs, rowdot::Ends::kInputs};
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t M = trial % 4 == 0 ? 1 : Pick({2, 3, 5, 7, 8, 9, 13, 16, 17, 31, 64, 65, 130});  // 1: decode at B=1
    const int64_t N = Pick({1, 2, 5, 17, 66, 67, 130, 200});
    const int64_t K = Pick({1, 3, 15, 16, 17, 31, 33, 64, 100, 128, 768, 4100});
    CheckRowdot(M, N, K, modes[trial % 3]);
    CheckChain(M, N, std::min<int64_t>(K, 300), modes[(trial + 1) % 3]);
    CheckInt8(M, N, K, false);
    CheckInt8(M, N, K, true);
    CheckPacked(M, N, (K + 15) / 16 * 16);
    CheckRowwise(Pick({1, 2, 3, 7}), 8 * Pick({1, 2, 3, 8}));
  }
  CheckInt8(3, 5, 8200, false);  // past int8's 4096 and 8192-k flushes into int64
  CheckRowdot(1, 3, 1, rowdot::Ends::kNone);
  const char* forced = dispatch::Here().forced;
  std::printf("check (GPT2_JAX_ROWDOT_ISA=%s, seed %llu): %s\n", forced == nullptr ? "" : forced,
              static_cast<unsigned long long>(seed), failures == 0 ? "every output as the scalar reference" : "FAILED");
  for (const auto& [path, n] : seen) std::printf("  %-28s %d problems\n", path.c_str(), n);
  return failures == 0 ? 0 : 1;
}

// ------------------------------------------------------------------------------------------------- time

template <class F>
void Threads(int threads, int64_t items, const F& item) {
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < items;) item(i);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

template <class F>
double BestMs(const F& call) {
  double best = 1e30;
  for (int r = 0; r < 7; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int Time(int threads) {
  const int64_t N = 3072, K = 768;
  std::vector<float> w = Normal(N * K, 0.02f), scale = Normal(N, 0.01f), wt(static_cast<size_t>(K * N));
  std::vector<int8_t> q(static_cast<size_t>(N * K), 3);
  std::vector<int32_t> qsum(static_cast<size_t>(N), 3 * K);
  const Packed pw = Pack(w, N, K);
  std::printf("time: w [%lld, %lld], %d threads, best of 7; GB/s of the weights, GFLOP/s\n", static_cast<long long>(N),
              static_cast<long long>(K), threads);
  for (int64_t M : {1, 8, 32, 96, 512}) {
    std::vector<float> x = Normal(M * K, 1.0f), y(static_cast<size_t>(M * N));
    std::vector<int32_t> ends(static_cast<size_t>(M), static_cast<int32_t>(N));
    const double flop = 2.0 * M * N * K;
    auto line = [&](const std::string& op, double bytes, double ms) {
      std::printf("  %-8s %3lld rows  %-22s %8.3f ms  %6.1f GB/s  %6.1f GFLOP/s\n", op.c_str(),
                  static_cast<long long>(M),
                  op == "rowdot"   ? dispatch::Name(dispatch::Rowdot(M))
                  : op == "chain"  ? dispatch::Name(dispatch::Chain(M))
                  : op == "packed" ? dispatch::Name(dispatch::PackedDecoder(M))
                                   : dispatch::Int8Name(M, K, op == "w8a8").c_str(),
                  ms, bytes / ms / 1e6, flop / ms / 1e6);
    };
    rowdot::Problem p{x.data(), w.data(), y.data(), M, N, K};
    const int64_t rb = rowdot::RowBlocks(p);
    line("rowdot", 4.0 * N * K,
         BestMs([&] { Threads(threads, rowdot::Items(p), [&](int64_t i) { rowdot::Item(p, rb, i); }); }));
    line("packed", double(pw.data.size()),
         BestMs([&] { Threads(threads, rowdot::Items(p), [&](int64_t i) { packed::Item(p, pw.View(), rb, i); }); }));
    for (bool w8a8 : {false, true}) {
      line(w8a8 ? "w8a8" : "int8", double(N * K), BestMs([&] {
             int8::Rows rows;
             const int8::Problem ip = int8::Prepare(x.data(), q.data(), scale.data(), w8a8 ? qsum.data() : nullptr,
                                                    y.data(), M, N, K, threads, rows);
             Threads(threads, int8::Items(ip), [&](int64_t i) { int8::Item(ip, int8::RowBlocks(ip), i); });
           }));
    }
    rowdot::Problem c{x.data(), wt.data(), y.data(), M, N, K, ends.data(), rowdot::Ends::kNone};
    const int64_t cb = chain::RowBlocks(c);
    line("chain", 4.0 * N * K,
         BestMs([&] { Threads(threads, chain::Items(c), [&](int64_t i) { chain::Item(c, cb, i); }); }));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string job = argc > 1 ? argv[1] : "";
  if (!dispatch::Here().usable) {
    std::printf("this CPU lacks AVX2 and FMA: the kernels do not run here\n");
    return 0;
  }
  if (job == "check") return Check(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  if (job == "time")
    return Time(argc > 2 ? std::atoi(argv[2]) : static_cast<int>(std::thread::hardware_concurrency()));
  std::fprintf(stderr, "usage: %s check [seed] | time [threads]\n", argv[0]);
  return 2;
}
