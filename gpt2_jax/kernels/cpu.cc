// rowdot: y[m, n] = sum_k x[m, k] * w[n, k] in float32, each output rounded the same way for any M.
//
// Why a kernel of our own: XLA's CPU matmul picks a different kernel (and so a different rounding) for
// one row, for a few rows and for many, so a token's logits would depend on its batch. Here every output
// is one dot product computed by the same instructions wherever it sits: 16 lane-wise accumulators, lane
// i taking the products k = i, i + 16, ... in order through fused multiply-adds, then the 16 lanes summed
// by one fixed tree. Tiling (a few x rows against a few w rows, so each loaded vector feeds several
// accumulators), the split across threads and the batch size change which outputs are computed together,
// never how one is computed. The AVX2 path holds the 16 lanes in two 8-lane registers and rounds exactly
// like the AVX-512 one.
//
// The layout is XLA's FFI: x [..., M, K], w [..., N, K] (the weights as checkpoints hold them, [out, in]),
// y [..., M, N]; leading dims of x and w are equal or one of them is 1 (vmap's "expand_dims").

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "chain.h"
#include "dispatch.h"
#include "int8.h"
#include "int8_prepare.h"
#include "packed.h"
#include "rowdot.h"
#include "rowwise.h"
#include "softmax.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using rowdot::Problem;

// Items [0, n), item(i) each, shared out to XLA's own intra-op threads and this one; returns once every item
// is done. The caller waits only for items some thread has claimed, so a task the pool starts late finds
// nothing left (the counters are shared so they outlive the call; it never calls item then).
template <typename F>
void Parallel(ffi::ThreadPool& pool, int64_t n, const F& item) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto c = std::make_shared<Counters>();
  auto work = [c, n, &item] {
    for (int64_t i; (i = c->next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      item(i);
      c->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (c->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// `batch` problems of the same shape, problem b at x + b * x_step, w + b * w_step, y + b * M * N
// (and ends + b * M when x_step is not 0).
struct Batch {
  Problem p;  // problem 0
  bool chain;  // chain's arithmetic (w [K, N]) instead of rowdot's (w [N, K])
  int64_t batch, x_step, w_step;
  int64_t row_blocks, per_problem;
  // A paged w (chain only): problem b is row b / heads, head b % heads; its pages start at
  // pages.base + (b % heads) * head_stride, its table at pages.table + (b / heads) * table_stride.
  bool paged = false;
  chain::Pages pages{};
  int64_t heads = 1, head_stride = 0, table_stride = 0;
};

// Work item i of the batch's list (every problem's items, problem by problem).
void Item(const Batch& s, int64_t i) {
  int64_t b = i / s.per_problem;
  Problem p = s.p;
  p.x += b * s.x_step, p.w += b * s.w_step, p.y += b * p.M * p.N;
  if (p.ends != nullptr && s.x_step != 0) p.ends += b * p.M;
  if (s.paged) {
    chain::Pages pages = s.pages;
    pages.base += (b % s.heads) * s.head_stride, pages.table += (b / s.heads) * s.table_stride;
    chain::Item(p, s.row_blocks, i % s.per_problem, &pages);
  } else if (s.chain)
    chain::Item(p, s.row_blocks, i % s.per_problem);
  else
    rowdot::Item(p, s.row_blocks, i % s.per_problem);
}

// Every problem's work items in one list, shared by XLA's own intra-op threads and this one (Parallel).
void Run(ffi::ThreadPool& pool, const Problem& p, int64_t batch, int64_t x_step, int64_t w_step, bool chain,
         const Batch* paged = nullptr) {
  if (p.M == 0 || p.N == 0 || batch == 0) return;
  Batch s = paged != nullptr ? *paged : Batch{};
  s.p = p, s.chain = chain, s.batch = batch, s.x_step = x_step, s.w_step = w_step;
  s.row_blocks = chain ? chain::RowBlocks(p) : rowdot::RowBlocks(p);
  s.per_problem = chain ? chain::Items(p) : rowdot::Items(p);
  Parallel(pool, batch * s.per_problem, [&s](int64_t i) { Item(s, i); });
}

int64_t Product(const int64_t* dims, size_t n) {
  int64_t p = 1;
  for (size_t d = 0; d < n; ++d) p *= dims[d];
  return p;
}

// y = x . w over the last axis of x; x dims xd (rank xn >= 2), w dims wd (rank wn >= 2): [..., N, K], or
// [..., K, N] for chain; ends (x's dims but the last, or null) as `mode` says (see rowdot::Ends).
ffi::Error Multiply(ffi::ThreadPool& pool, const float* xp, const int64_t* xd, size_t xn, const float* wp,
                    const int64_t* wd, size_t wn, float* yp, const int32_t* ends = nullptr,
                    rowdot::Ends mode = rowdot::Ends::kNone, bool chain = false) {
  if (xn < 2 || wn < 2 || xd[xn - 1] != wd[wn - (chain ? 2 : 1)])
    return ffi::Error::InvalidArgument(chain ? "chain: x [..., M, K] and w [..., K, N] must share K"
                                             : "rowdot: x [..., M, K] and w [..., N, K] must share K");
  int64_t K = xd[xn - 1], M = xd[xn - 2], N = wd[wn - (chain ? 1 : 2)];
  int64_t xb = Product(xd, xn - 2), wb = Product(wd, wn - 2);
  Problem p{xp, wp, yp, M, N, K, ends, ends == nullptr ? rowdot::Ends::kNone : mode};
  if (wb == 1) {  // one weight for every batch entry: all of x's rows in one problem
    p.M = xb * M;
    Run(pool, p, 1, 0, 0, chain);
  } else if (xb == wb || xb == 1) {
    Run(pool, p, wb, xb == 1 ? 0 : M * K, N * K, chain);
  } else {
    return ffi::Error::InvalidArgument("rowdot: leading dims of x and w must match or be 1");
  }
  return ffi::Error::Success();
}

ffi::Error RowDotImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  return Multiply(pool, x.typed_data(), xd.begin(), xd.size(), w.typed_data(), wd.begin(), wd.size(),
                  y->typed_data());
}

// rowdot with int8 weights: x [..., M, K] float32, w [..., N, K] int8 and scale [..., N] float32 (w's
// leading dims all 1: one weight for every row) -> y [..., M, N], y[m, n] = x[m] . (w[n] * scale[n]) by
// int8.h's exact integer sums. x's rows are rounded here, once, before the work is shared out: to int16
// (rowdot_int8), or to bytes with a zero point with qsum [N] (w's row sums) given (rowdot_w8a8, a8.h), and
// packed for their path (int8_prepare.h).
ffi::Error Quantized(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& w,
                     ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::S32>* qsum, float* y) {
  const char* name = qsum == nullptr ? "rowdot_int8" : "rowdot_w8a8";
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 2 || wd.size() < 2 || xd[xd.size() - 1] != wd[wd.size() - 1])
    return ffi::Error::InvalidArgument(std::string(name) + ": x [..., M, K] and w [N, K] must share K");
  int64_t K = xd[xd.size() - 1], N = wd[wd.size() - 2], M = Product(xd.begin(), xd.size() - 1);
  if (Product(wd.begin(), wd.size() - 2) != 1 || static_cast<int64_t>(scale.element_count()) != N ||
      (qsum != nullptr && static_cast<int64_t>(qsum->element_count()) != N))
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": w must be [N, K] (one weight for every row), scale [N] and qsum [N]");
  if (qsum != nullptr && K > a8::kMaxK)
    return ffi::Error::InvalidArgument("rowdot_w8a8: K must be at most 65536 (its int32 sums' bound)");
  int8::Rows rows;
  const int8::Problem p = int8::Prepare(x.typed_data(), w.typed_data(), scale.typed_data(),
                                        qsum == nullptr ? nullptr : qsum->typed_data(), y, M, N, K,
                                        pool.num_threads(), rows);
  if (M == 0 || N == 0) return ffi::Error::Success();
  const int64_t rb = int8::RowBlocks(p);
  Parallel(pool, int8::Items(p), [&](int64_t i) { int8::Item(p, rb, i); });
  return ffi::Error::Success();
}

ffi::Error RowDotInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  return Quantized(pool, x, w, scale, nullptr, y->typed_data());
}

ffi::Error RowDotW8A8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> qsum, ffi::ResultBuffer<ffi::F32> y) {
  return Quantized(pool, x, w, scale, &qsum, y->typed_data());
}

// rowdot over float32 weights packed losslessly (packed.h): x [..., M, K], w uint8 [N, K / 16 x 56], lut [16],
// esc_off [N + 1], esc [E] -> y [..., M, N], bit for bit rowdot's y over the unpacked weights.
ffi::Error RowDotPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                            ffi::Buffer<ffi::S32> lut, ffi::Buffer<ffi::S32> esc_off, ffi::Buffer<ffi::S32> esc,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() < 2 || wd.size() < 2 || xd[xd.size() - 1] % packed::kGroup != 0 ||
      wd[wd.size() - 1] != packed::RowBytes(xd[xd.size() - 1]) || Product(wd.begin(), wd.size() - 2) != 1)
    return ffi::Error::InvalidArgument("rowdot_packed: x [..., M, K] (K a multiple of 16) and w [N, K / 16 x 56]");
  const int64_t N = wd[wd.size() - 2], K = xd[xd.size() - 1], M = Product(xd.begin(), xd.size() - 1);
  if (lut.element_count() != 16 || static_cast<int64_t>(esc_off.element_count()) != N + 1 ||
      esc_off.typed_data()[N] > static_cast<int64_t>(esc.element_count()))
    return ffi::Error::InvalidArgument("rowdot_packed: lut [16], esc_off [N + 1] and esc [esc_off[N]]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  Problem p{x.typed_data(), nullptr, y->typed_data(), M, N, K};
  const packed::Weights pw{w.typed_data(), lut.typed_data(), esc_off.typed_data(), esc.typed_data()};
  const int64_t rb = rowdot::RowBlocks(p);
  Parallel(pool, rowdot::Items(p), [&](int64_t i) { packed::Item(p, pw, rb, i); });
  return ffi::Error::Success();
}

// Rows ids [n] of a packed w (above) -> y [n, K] float32 (the tied embedding's rows); an id outside [0, N) gives NaNs.
ffi::Error PackedRowsImpl(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::S32> lut, ffi::Buffer<ffi::S32> esc_off,
                          ffi::Buffer<ffi::S32> esc, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() < 2 || yd.size() < 1 || Product(wd.begin(), wd.size() - 2) != 1)
    return ffi::Error::InvalidArgument("packed_rows: w [N, K / 16 x 56]");
  const int64_t N = wd[wd.size() - 2], K = yd[yd.size() - 1], n = static_cast<int64_t>(ids.element_count());
  if (K % packed::kGroup != 0 || wd[wd.size() - 1] != packed::RowBytes(K) ||
      static_cast<int64_t>(esc_off.element_count()) != N + 1 || lut.element_count() != 16)
    return ffi::Error::InvalidArgument("packed_rows: w [N, K / 16 x 56], lut [16], esc_off [N + 1] -> y [n, K]");
  const packed::Weights pw{w.typed_data(), lut.typed_data(), esc_off.typed_data(), esc.typed_data()};
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids.typed_data()[i];
    float* row = y->typed_data() + i * K;
    if (id < 0 || id >= N)
      std::fill(row, row + K, std::numeric_limits<float>::quiet_NaN());
    else
      packed::Row(pw, id, K, row);
  }
  return ffi::Error::Success();
}

// Entry `index` of a stacked [L, ...] w (a layer of the KV cache), read where it lies: slicing it out
// first would copy it. The index is clamped into [0, L), as XLA's slicing does. -> the entry's data; its
// dims are sd[1:].
ffi::Error StackedEntry(ffi::Buffer<ffi::F32>& stacked, ffi::Buffer<ffi::S32>& index, const float** w) {
  auto sd = stacked.dimensions();
  if (sd.size() < 3) return ffi::Error::InvalidArgument("rowdot_at: stacked must be [L, ..., N, K]");
  int64_t L = sd[0], i = std::clamp<int64_t>(index.typed_data()[0], 0, L - 1);
  *w = stacked.typed_data() + i * Product(sd.begin() + 1, sd.size() - 1);
  return ffi::Error::Success();
}

// rowdot with w such an entry.
ffi::Error RowDotAtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> stacked,
                        ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), sd = stacked.dimensions();
  const float* w;
  if (auto e = StackedEntry(stacked, index, &w); e.failure()) return e;
  return Multiply(pool, x.typed_data(), xd.begin(), xd.size(), w, sd.begin() + 1, sd.size() - 1,
                  y->typed_data());
}

// The two above with ends [..., M] (x's dims but the last) and what they mean, mode (rowdot::Ends).
ffi::Error CheckEnds(ffi::AnyBuffer::Dimensions xd, ffi::Buffer<ffi::S32>& ends, int32_t mode) {
  auto ed = ends.dimensions();
  if (mode < 0 || mode > 2) return ffi::Error::InvalidArgument("rowdot: mode must be 0, 1 or 2");
  if (ed.size() + 1 != xd.size() || !std::equal(ed.begin(), ed.end(), xd.begin()))
    return ffi::Error::InvalidArgument("rowdot: ends must have x's dims but the last");
  return ffi::Error::Success();
}

template <bool kChain>
ffi::Error EndsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::Buffer<ffi::S32> ends, ffi::ResultBuffer<ffi::F32> y, int32_t mode) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (auto e = CheckEnds(xd, ends, mode); e.failure()) return e;
  return Multiply(pool, x.typed_data(), xd.begin(), xd.size(), w.typed_data(), wd.begin(), wd.size(),
                  y->typed_data(), ends.typed_data(), static_cast<rowdot::Ends>(mode), kChain);
}

template <bool kChain>
ffi::Error AtEndsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> stacked,
                      ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> ends, ffi::ResultBuffer<ffi::F32> y,
                      int32_t mode) {
  auto xd = x.dimensions(), sd = stacked.dimensions();
  const float* w;
  if (auto e = CheckEnds(xd, ends, mode); e.failure()) return e;
  if (auto e = StackedEntry(stacked, index, &w); e.failure()) return e;
  return Multiply(pool, x.typed_data(), xd.begin(), xd.size(), w, sd.begin() + 1, sd.size() - 1,
                  y->typed_data(), ends.typed_data(), static_cast<rowdot::Ends>(mode), kChain);
}

// chain over a paged w: x [B, H, T, I], pool [L, NB, H, a, b] (blocks of keys [K, C] or values [C, K]),
// layer [], table [B, M] (row b's blocks in slot order), ends [B, H, T] -> y [B, H, T, M x C] (keys: x . the
// row's keys, I = K) or [B, H, T, K] (values: I = M x C). Reads every block where it lies in the pool.
ffi::Error ChainPagedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> blocks,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> ends,
                          ffi::ResultBuffer<ffi::F32> y, int32_t mode, int32_t keys) {
  auto xd = x.dimensions(), pd = blocks.dimensions(), td = table.dimensions();
  if (auto e = CheckEnds(xd, ends, mode); e.failure()) return e;
  if (xd.size() != 4 || pd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("chain_paged: x [B, H, T, I], pool [L, N, H, a, b] and table [B, M]");
  int64_t B = xd[0], H = xd[1], T = xd[2], I = xd[3], L = pd[0], NB = pd[1], M = td[1];
  int64_t C = keys ? pd[4] : pd[3], K = keys ? pd[3] : pd[4];
  if (td[0] != B || pd[2] != H || NB < 1 || C % 64 != 0)
    return ffi::Error::InvalidArgument("chain_paged: table rows, heads or block size (a multiple of 64) disagree");
  if (I != (keys ? K : M * C))
    return ffi::Error::InvalidArgument("chain_paged: x's last dim must be K (keys) or M x C (values)");
  Batch paged;
  paged.paged = true;
  int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  paged.pages = chain::Pages{blocks.typed_data() + l * NB * H * K * C, table.typed_data(), H * K * C, C, NB,
                             keys != 0};
  paged.heads = H, paged.head_stride = K * C, paged.table_stride = M;
  Problem p{x.typed_data(), nullptr, y->typed_data(), T, keys ? M * C : K, I, ends.typed_data(),
            static_cast<rowdot::Ends>(mode)};
  Run(pool, p, B * H, T * I, 0, true, &paged);
  return ffi::Error::Success();
}

// y[..., i] = the float32 nearest the float64 running sum of x[..., 0 .. i]: torch's CPU cumsum of float32,
// which accumulates in float64. One sequential pass per row, so a row's sums never depend on its batch.
// (The sampler's prefix sums: XLA has no sequential scan, and the log-depth one it builds instead takes
// seconds to compile for a 50k-token vocabulary.)
ffi::Error CumSumImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  auto d = x.dimensions();
  if (d.size() < 1) return ffi::Error::InvalidArgument("cumsum: x must have at least one axis");
  int64_t n = d[d.size() - 1], rows = n == 0 ? 0 : static_cast<int64_t>(x.element_count()) / n;
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) rowwise::CumSum(in + r * n, out + r * n, n);
  return ffi::Error::Success();
}

// y[...] = rowwise::FirstMax(x[..., :]) per row (the sampler's greedy token): one pass instead of XLA's reduction, its
// broadcast of the maximum written out, and a comparison and a second reduction.
ffi::Error ArgMaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> y) {
  auto d = x.dimensions();
  if (d.size() < 1 || d[d.size() - 1] == 0) return ffi::Error::InvalidArgument("argmax: x needs a non-empty last axis");
  const int64_t n = d[d.size() - 1], rows = static_cast<int64_t>(x.element_count()) / n;
  for (int64_t r = 0; r < rows; ++r) y->typed_data()[r] = rowwise::FirstMax(x.typed_data() + r * n, n);
  return ffi::Error::Success();
}

// Attention's softmax (softmax.h) over scores [..., N, C] (C a multiple of 8) -> weights of the same shape, rows
// shared out to the pool's threads in chunks of 64.
ffi::Error SoftmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> w) {
  auto d = s.dimensions();
  if (d.size() < 2 || d[d.size() - 1] % 8 != 0)
    return ffi::Error::InvalidArgument("softmax: scores [..., N, C] with C a multiple of 8");
  const int64_t n = d[d.size() - 2], c = d[d.size() - 1], len = n * c;
  const int64_t rows = len == 0 ? 0 : static_cast<int64_t>(s.element_count()) / len;
  const float* in = s.typed_data();
  float* out = w->typed_data();
  Parallel(pool, (rows + 63) / 64, [=](int64_t i) {
    for (int64_t r = i * 64; r < std::min(rows, (i + 1) * 64); ++r) softmax::Row(in + r * len, out + r * len, n, c);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxCumSum, CumSumImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxSoftmax, SoftmaxImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxArgMax, ArgMaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

// The bindings, one per signature: x, w (or stacked and index), [ends and mode] -> y.
static auto DotBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>();
}

static auto AtBinding() { return DotBinding().Arg<ffi::Buffer<ffi::S32>>(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDot, RowDotImpl, DotBinding().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotInt8, RowDotInt8Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotW8A8, RowDotW8A8Impl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotPacked, RowDotPackedImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxPackedRows, PackedRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotAt, RowDotAtImpl, AtBinding().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotEnds, EndsImpl<false>,
                              DotBinding().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("mode"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxChain, EndsImpl<true>,
                              DotBinding().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("mode"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxRowDotAtEnds, AtEndsImpl<false>,
                              AtBinding().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("mode"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxChainAt, AtEndsImpl<true>,
                              AtBinding().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("mode"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GPT2JaxChainPaged, ChainPagedImpl,
                              AtBinding().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Attr<int32_t>("mode").Attr<int32_t>("keys"));

// ------------------------------------------------------------------------------------------------ Python

// A handler as a capsule for jax.ffi.register_ffi_target.
template <XLA_FFI_Handler* kHandler>
PyObject* Capsule(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(kHandler), nullptr, nullptr);
}

static PyObject* Isa(PyObject*, PyObject*) { return PyUnicode_FromString(dispatch::Name(dispatch::Here().f32)); }

static PyObject* IsaInt8(PyObject*, PyObject*) { return PyUnicode_FromString(dispatch::Name(dispatch::Here().int8)); }

static PyObject* Usable(PyObject*, PyObject*) { return PyBool_FromLong(dispatch::Here().usable); }

// Every op's path at `rows` rows (and K, the reduction length, which decides int8's AMX and VNNI paths), as
// dispatch.h picks it for the kernels: {op: path}.
static PyObject* Paths(PyObject*, PyObject* args) {
  long long rows, K;
  if (!PyArg_ParseTuple(args, "LL", &rows, &K)) return nullptr;
  if (rows < 1 || K < 1) {
    PyErr_SetString(PyExc_ValueError, "paths: rows and K must be at least 1");
    return nullptr;
  }
  const std::string packed = std::string(dispatch::Name(dispatch::PackedDecoder(rows))) +
                             (rows == 1 ? "" : std::string(" + ") + dispatch::Name(dispatch::Rowdot(rows)));
  const std::string int8 = dispatch::Int8Name(rows, K, false), w8a8 = dispatch::Int8Name(rows, K, true);
  return Py_BuildValue("{ssssssssssssssss}", "rowdot", dispatch::Name(dispatch::Rowdot(rows)), "int8", int8.c_str(),
                       "w8a8", w8a8.c_str(), "packed", packed.c_str(), "chain", dispatch::Name(dispatch::Chain(rows)),
                       "softmax", dispatch::Name(dispatch::Softmax(rows)), "argmax",
                       dispatch::Name(dispatch::ArgMax(rows)), "cumsum", dispatch::Name(dispatch::CumSum(rows)));
}

// The features dispatch.h read: {name: value}, GPT2_JAX_ROWDOT_ISA's forced path included ("" if none).
static PyObject* Features(PyObject*, PyObject*) {
  const dispatch::Cpu& c = dispatch::Here();
  return Py_BuildValue("{sOsssOsOsssOss}", "usable", c.usable ? Py_True : Py_False, "f32", dispatch::Name(c.f32),
                       "one_row_avx2", c.one_row_avx2 ? Py_True : Py_False, "vbmi", c.vbmi ? Py_True : Py_False,
                       "int8", dispatch::Name(c.int8), "amd", c.amd ? Py_True : Py_False,
                       "forced", c.forced == nullptr ? "" : c.forced);
}

static PyMethodDef kMethods[] = {
    {"handler", Capsule<GPT2JaxRowDot>, METH_NOARGS, "The XLA FFI handler, as a capsule for jax.ffi.register_ffi_target."},
    {"handler_int8", Capsule<GPT2JaxRowDotInt8>, METH_NOARGS, "rowdot over int8 weights with a float32 scale per output."},
    {"handler_w8a8", Capsule<GPT2JaxRowDotW8A8>, METH_NOARGS, "handler_int8 with x's rows rounded to 8 bits (a8.h)."},
    {"handler_packed", Capsule<GPT2JaxRowDotPacked>, METH_NOARGS, "rowdot over losslessly packed float32 weights (packed.h)."},
    {"handler_packed_rows", Capsule<GPT2JaxPackedRows>, METH_NOARGS, "Rows of a packed weight as float32 (packed.h)."},
    {"handler_at", Capsule<GPT2JaxRowDotAt>, METH_NOARGS, "The handler of the variant reading one entry of a stacked w."},
    {"handler_ends", Capsule<GPT2JaxRowDotEnds>, METH_NOARGS, "The handler taking per-row ends (see rowdot::Ends)."},
    {"handler_at_ends", Capsule<GPT2JaxRowDotAtEnds>, METH_NOARGS, "handler_at taking per-row ends."},
    {"handler_chain", Capsule<GPT2JaxChain>, METH_NOARGS, "chain (w [..., K, N], one FMA chain per output), with ends."},
    {"handler_chain_at", Capsule<GPT2JaxChainAt>, METH_NOARGS, "handler_chain reading one entry of a stacked w."},
    {"handler_chain_paged", Capsule<GPT2JaxChainPaged>, METH_NOARGS, "handler_chain reading a paged KV cache."},
    {"handler_cumsum", Capsule<GPT2JaxCumSum>, METH_NOARGS, "cumsum: float32 prefix sums accumulated in float64."},
    {"handler_softmax", Capsule<GPT2JaxSoftmax>, METH_NOARGS, "softmax: attention's weights from blocked scores."},
    {"handler_argmax", Capsule<GPT2JaxArgMax>, METH_NOARGS, "argmax: the first maximum's position (first NaN's if any)."},
    {"isa", Isa, METH_NOARGS, "Which instruction set the kernel runs with here: 'avx512' or 'avx2'."},
    {"isa_int8", IsaInt8, METH_NOARGS, "rowdot_int8's instruction set here: 'amx-int8', 'avx512-vnni', 'avx512' or 'avx2'."},
    {"usable", Usable, METH_NOARGS, "Whether this CPU has what the kernel needs (AVX2 and FMA)."},
    {"paths", Paths, METH_VARARGS, "paths(rows, K): every op's path at that many rows, as dispatch.h picks it."},
    {"features", Features, METH_NOARGS, "The CPU features dispatch.h read (after GPT2_JAX_ROWDOT_ISA)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cpu", "gpt2_jax's batch-invariant CPU kernels: rowdot, chain, softmax, cumsum and argmax",
                              -1, kMethods};

PyMODINIT_FUNC PyInit__cpu() { return PyModule_Create(&kModule); }
