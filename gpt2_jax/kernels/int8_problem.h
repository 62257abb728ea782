// One rowdot_int8 problem as its tiles read it (int8.h, and the a8.h, amx.h and vnni_rows.h paths it
// routes to): y [M, N] = xq . q.T with its scales, x's rows already rounded (int8::QuantizeRow, or
// QuantizeRow8 for w8a8) and, for the paths that want them, packed (cpu.cc). rowdot::Problem is float32's.
#pragma once

#include <cstdint>

namespace int8 {

struct Problem {
  float* y;
  int64_t M, N, K;
  // The weights: q [N, K] with a scale per output.
  const int8_t* wq = nullptr;
  const float* w_scale = nullptr;
  // x's rows as int16 with a scale per row: xq [M, Kp], K padded with zeros to Kp, a multiple of 32.
  const int16_t* xq = nullptr;
  const float* x_scale = nullptr;
  int64_t Kp = 0;
  // x's rows split into bytes and packed for AMX's tiles (amx.h), or null where the tiles are not used.
  const int8_t* x_hi = nullptr;
  const uint8_t* x_lo = nullptr;
  // x's rows packed in groups for vnni_rows.h's lanes-over-rows tiles, or null.
  const uint8_t* x_rows = nullptr;
  // w8a8: qsum [N] (each weight row's sum) and x_zero [M] (each row's zero point: xq + x_zero is a byte),
  // or null; x_a8: those bytes packed for a8.h's tiles, or null.
  const int32_t* qsum = nullptr;
  const int32_t* x_zero = nullptr;
  const uint8_t* x_a8 = nullptr;
  // Weight rows per work item (int8::DecodeColumns), or 0 for int8::kColBlock.
  int64_t cols = 0;
};

// The int8 tiles' last part-step (int8.h, a8.h): weights w[j][k, k1) copied into zero-filled rows of L bytes,
// ws[j] pointing at them, so a whole step reads past no weight row and adds nothing past k1.
template <int NR, int L>
inline void ZeroFilledTail(const int8_t* const* w, int64_t k, int64_t k1, int8_t (&tail)[NR][L], const int8_t** ws) {
  for (int j = 0; j < NR; ++j) {
    for (int64_t l = 0; l < L; ++l) tail[j][l] = k + l < k1 ? w[j][k + l] : 0;
    ws[j] = tail[j];
  }
}

}  // namespace int8
