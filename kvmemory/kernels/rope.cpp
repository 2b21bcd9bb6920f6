// RoPE in transformers' half layout, in place on the query and key heads of a fused q/k/v projection's output.
// See kvmemory/runtime/forward.py (`rotate`) for why it exists and when it runs.
//
// For each token t and head h < heads, with the head's halves a = x[0, D/2) and b = x[D/2, D):
//   a' = a · cos[t, :D/2] + b · signed_sin[t, :D/2]   (signed_sin's first half is −sin)
//   b' = b · cos[t, D/2:] + a · signed_sin[t, D/2:]
// each product and the sum rounded on its own, as torch computes x·cos + roll(x)·signed_sin: the same bits.
// A (token, head) row is computed by one thread, so its result does not depend on the other rows of the call.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

namespace {

using namespace kvmemory_simd;  // f8, kLanes, load8, each_row

constexpr int64_t kRowsPerThread = 256;  // a row is 2 · D multiplies: below this many a thread's share is too small

// Products and sums rounded one by one (no fused multiply-add), so the bits are torch's
__attribute__((optimize("fp-contract=off"))) void rotate_row(float* x, const float* cos, const float* signed_sin,
                                                              int64_t half) {
  float* a = x;
  float* b = x + half;
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const f8 lo = load8(a + i), hi = load8(b + i);
    const f8 new_lo = lo * load8(cos + i) + hi * load8(signed_sin + i);
    const f8 new_hi = hi * load8(cos + half + i) + lo * load8(signed_sin + half + i);
    std::memcpy(a + i, &new_lo, sizeof new_lo);
    std::memcpy(b + i, &new_hi, sizeof new_hi);
  }
  for (; i < half; ++i) {
    const float lo = a[i], hi = b[i];
    a[i] = lo * cos[i] + hi * signed_sin[i];
    b[i] = hi * cos[half + i] + lo * signed_sin[half + i];
  }
}

// x (T, H, D) fp32 with contiguous rows; cos and signed_sin (T, D) contiguous fp32; rotates heads [0, heads)
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t heads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  signed_sin.scalar_type() == at::kFloat,
              "rope_ takes float32 inputs and tables");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_'s x must be (tokens, heads, head dim) with contiguous rows and an even head dim");
  const int64_t tokens = x.size(0), dim = x.size(2);
  TORCH_CHECK(heads >= 0 && heads <= x.size(1), "rope_ rotates heads [0, heads): heads must be in [0, ", x.size(1),
              "], got ", heads);
  for (const at::Tensor* table : {&cos, &signed_sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == tokens && table->size(1) == dim && table->is_contiguous(),
                "rope_'s cos and signed_sin must be contiguous (tokens, head dim) tables");
  float* data = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  each_row(tokens * heads, kRowsPerThread, [&](int64_t r) {
    const int64_t t = r / heads, h = r % heads;
    rotate_row(data + t * token_stride + h * head_stride, c + t * dim, s + t * dim, dim / 2);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor signed_sin, int heads) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
}
