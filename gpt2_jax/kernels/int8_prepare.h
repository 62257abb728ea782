// A rowdot_int8 problem made ready for its tiles: x's rows rounded once (to int16, or to bytes with a zero
// point for w8a8), then packed for the path dispatch::Int8 picks (AMX's tiles, vnni_rows.h's groups or
// a8.h's bytes). cpu.cc runs it before sharing the work out; bench/kernels_harness.cc runs it too.
#pragma once

#include <cstdint>
#include <vector>

#include "a8.h"
#include "amx.h"
#include "int8.h"
#include "int8_problem.h"
#include "vnni_rows.h"

namespace int8 {

// The buffers a prepared Problem points into: they must outlive it.
struct Rows {
  std::vector<int16_t> xq;
  std::vector<float> scale;
  std::vector<int32_t> zero;
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo, groups, bytes;
};

// y [M, N] = x [M, K] . (q [N, K] * w_scale [N]).T, with qsum [N] (q's row sums) for w8a8 or null; `threads`
// sets the decode column runs (DecodeColumns).
inline Problem Prepare(const float* x, const int8_t* q, const float* w_scale, const int32_t* qsum, float* y,
                       int64_t M, int64_t N, int64_t K, int64_t threads, Rows& r) {
  const int64_t Kp = Padded(K);
  r.xq.assign(static_cast<size_t>(M * Kp), 0);
  r.scale.assign(static_cast<size_t>(M), 0.0f);
  r.zero.assign(qsum == nullptr ? 0 : static_cast<size_t>(M), 0);
  for (int64_t m = 0; m < M; ++m)
    if (qsum == nullptr)
      QuantizeRow(x + m * K, K, Kp, r.xq.data() + m * Kp, &r.scale[m]);
    else
      QuantizeRow8(x + m * K, K, Kp, r.xq.data() + m * Kp, &r.scale[m], &r.zero[m]);
  Problem p{y, M, N, K};
  p.wq = q, p.w_scale = w_scale, p.xq = r.xq.data(), p.x_scale = r.scale.data(), p.Kp = Kp;
  if (qsum != nullptr) p.qsum = qsum, p.x_zero = r.zero.data();
  if (OnAmx(p)) {  // the rows split into bytes, packed as AMX's tiles read them (amx.h)
    r.hi.resize(static_cast<size_t>(amx::PackedBytes(M, K))), r.lo.resize(r.hi.size());
    amx::Pack(r.xq.data(), M, K, Kp, r.hi.data(), r.lo.data());
    p.x_hi = r.hi.data(), p.x_lo = r.lo.data();
  }
  if (OnRows(p)) {  // the rows as bytes, packed in groups as vnni_rows.h's tiles read them
    r.groups.resize(static_cast<size_t>(vnni_rows::PackedBytes(M, K, vnni_rows::Group(p))));
    if (qsum != nullptr)
      vnni_rows::Pack8(r.xq.data(), r.zero.data(), M, K, Kp, r.groups.data());  // w8a8: one plane of xq + zero
    else
      vnni_rows::Pack(r.xq.data(), M, K, Kp, r.groups.data());
    p.x_rows = r.groups.data();
  }
  if (OnA8(p)) {  // 8-bit rows as bytes xq + zero for a8.h's tiles
    r.bytes.resize(static_cast<size_t>(M * a8::Padded(K)));
    a8::Pack(r.xq.data(), r.zero.data(), M, K, Kp, r.bytes.data());
    p.x_a8 = r.bytes.data();
  }
  p.cols = DecodeColumns(p, threads);
  return p;
}

}  // namespace int8
