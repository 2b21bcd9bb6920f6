// The gated MLP's activation in one pass: for rows [gate | up] of fp32, silu(gate) · up.
// See kvmemory/runtime/forward.py (`gated_activation`) for why it exists and when it runs.
//
// silu(g) = g · sigmoid(g), with sigmoid from e = exp(−|g|) (never overflows): 1/(1 + e) for g ≥ 0, e/(1 + e)
// below. A row is computed by one thread (each_row), so its result does not depend on the other rows of the call.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace kvmemory_simd;  // f8, kLanes, load8, exp8, each_row

constexpr int64_t kRowsPerThread = 8;  // below this many rows a thread's share costs more than it computes

void gate_row(const float* gate, const float* up, float* y, int64_t n) {
  int64_t s = 0;
  for (; s + kLanes <= n; s += kLanes) {
    const f8 g = load8(gate + s), one = f8{} + 1.0f;
    const f8 e = exp8(g < 0 ? g : -g);
    const f8 sigmoid = (g < 0 ? e : one) / (one + e);
    const f8 out = g * sigmoid * load8(up + s);
    std::memcpy(y + s, &out, sizeof out);
  }
  for (; s < n; ++s) {
    const float g = gate[s], e = std::exp(-std::fabs(g));
    y[s] = g * ((g < 0 ? e : 1.0f) / (1.0f + e)) * up[s];
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_mul takes float32 input");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul's input must end in an even dimension: the gate's half, then the up half");
  const at::Tensor input = gate_up.contiguous();
  const int64_t width = input.size(-1), n = width / 2, rows = width ? input.numel() / width : 0;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, input.options());
  const float* x = input.data_ptr<float>();
  float* y = out.data_ptr<float>();
  each_row(rows, kRowsPerThread, [&](int64_t r) { gate_row(x + r * width, x + r * width + n, y + r * n, n); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
