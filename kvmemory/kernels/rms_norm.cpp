// RMSNorm of fp32 rows in one pass per row: y = x · 1/sqrt(mean(x²) + eps) · weight.
// See kvmemory/runtime/forward.py (`rms_norm`) for why it exists and when it runs.
//
// A row is computed by one thread in a fixed order (each_row), so a session's norm is the same in a packed
// pass as alone.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace {

using namespace kvmemory_simd;  // f8, kLanes, load8, sum8, each_row

constexpr int64_t kRowsPerThread = 16;  // below this many rows a thread's share costs more than it computes

// The sum of squares of row[0, n): four 8-lane sums, then the tail
float sum_of_squares(const float* row, int64_t n) {
  f8 sums[4] = {};
  int64_t s = 0;
  for (; s + 4 * kLanes <= n; s += 4 * kLanes)
    for (int j = 0; j < 4; ++j) {
      const f8 v = load8(row + s + j * kLanes);
      sums[j] += v * v;
    }
  for (; s + kLanes <= n; s += kLanes) {
    const f8 v = load8(row + s);
    sums[0] += v * v;
  }
  float total = (sum8(sums[0]) + sum8(sums[1])) + (sum8(sums[2]) + sum8(sums[3]));
  for (; s < n; ++s) total += row[s] * row[s];
  return total;
}

void normalise(const float* x, const float* weight, float* y, int64_t n, float eps) {
  const float inverse = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    const f8 out = load8(x + s) * inverse * load8(weight + s);
    std::memcpy(y + s, &out, sizeof out);
  }
  for (; s < n; ++s) y[s] = x[s] * inverse * weight[s];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm takes float32 inputs and weight");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "rms_norm's weight must be a contiguous vector as long as the inputs' last dimension");
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t n = weight.size(0), rows = n ? input.numel() / n : 0;
  const float* in = input.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  each_row(rows, kRowsPerThread, [&](int64_t r) { normalise(in + r * n, w, y + r * n, n, epsilon); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
