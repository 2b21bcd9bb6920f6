// Helpers shared by kvmemory's CPU kernels: eight-float vectors (AVX2, FMA, F16C), rows split over threads, and
// what the two linear kernels (fp16 and int4 weights in panels of 16 output columns) share.
#pragma once

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvmemory_simd {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 8;

template <typename T>
inline f8 load8(const T* p);

template <>
inline f8 load8<float>(const float* p) {
  f8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

template <>
inline f8 load8<c10::BFloat16>(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (f8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <>
inline f8 load8<c10::Half>(const c10::Half* p) {
  return (f8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <>
inline f8 load8<int8_t>(const int8_t* p) {  // 8-bit levels (kvmemory.cache.int8_rows), their scale applied apart
  return (f8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float sum8(f8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp on 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative
// error < 2e-7), 2^n built in the exponent bits. Inputs are max-subtracted, so x <= 0; below -87 the
// result flushes to 0 (as expf underflows), and -inf gives 0. n is rounded by one vroundps (ties to even):
// rounding through a select and two conversions made the decode kernel's softmax ~30% slower.
inline f8 exp8(f8 x) {
  const f8 lo = f8{} - 87.0f;
  x = x < lo ? lo : x;
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const f8 n = (f8)_mm256_round_ps((__m256)(x * 1.44269504088896341f), kNearest);
  f8 r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;  // ln2 split for an exact product
  f8 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  f8 out = p * scale;
  return x <= lo ? f8{} : out;
}

// body(r) for every row r in [0, rows): rows split over the threads, each thread at least `least` rows (fewer
// rows stay on this thread). OpenMP directly: at::parallel_for's inline setup would reset the team size.
// A row is computed whole by one thread, so its result does not depend on the other rows or the thread count.
template <typename Body>
inline void each_row(int64_t rows, int64_t least, Body body) {
  const int threads = static_cast<int>(std::clamp<int64_t>(rows / least, 1, at::get_num_threads()));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) body(r);
}

// ---- the linear kernels: weights packed in panels of 16 output columns ----

// The input rows and bias every linear kernel takes, checked: the bias's data, null without one
inline const float* checked_rows_and_bias(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous (rows, in_features) float32 tensor");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
              "bias must be a contiguous float32 vector of out_features");
  return bias->data_ptr<float>();
}

// y[r, c] (+ bias[c]) for `rows` rows and `cols` columns from their sums, row r's at sums + r * panels * 16
inline void write_panel_sums(const float* sums, int64_t rows, int64_t panels, const float* bias, float* y,
                             int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = sums + r * panels * 16;
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = bias ? row[c] + bias[c] : row[c];
  }
}

// Whether this CPU runs AVX-512 (the OS saves its registers too: libgcc checks)
inline bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// Whether a linear kernel asked for `vector_bits` (0: the widest this CPU has, 256 or 512) runs on 16-float
// vectors; any other width, or 512 on a CPU without AVX-512, is refused by name.
inline bool sixteen_floats(int64_t vector_bits) {
  TORCH_CHECK(vector_bits == 0 || vector_bits == 256 || vector_bits == 512,
              "vector_bits must be 0 (the widest this CPU has), 256 or 512, got ", vector_bits);
  TORCH_CHECK(vector_bits != 512 || has_avx512(), "vector_bits=512 needs a CPU with AVX-512, and this one has none");
  return vector_bits == 512 || (vector_bits == 0 && has_avx512());
}

}  // namespace kvmemory_simd
