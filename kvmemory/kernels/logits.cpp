// Per row of fp32 logits: the index of the largest value (greedy decoding) and the log-sum-exp (surprisal).
// See kvmemory/runtime/logits.py for why they exist and when they run.
//
// One thread computes a row, in a fixed order, so a row's results do not depend on the other rows of the
// call or on the thread count. The argmax is the first index of the largest value, NaN counting as largest,
// as torch.argmax has it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "simd.h"

namespace {

using namespace kvmemory_simd;  // f8, kLanes, load8, sum8, exp8, each_row

// The largest value of row[0, n) and its first index (with NaNs: the first NaN and its index).
std::pair<float, int64_t> top_of(const float* row, int64_t n) {
  int64_t s = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
  if (n >= kLanes) {  // per lane its largest value and where it first came, then the first of the lanes' largest
    __m256 tops = _mm256_loadu_ps(row), nans = _mm256_cmp_ps(tops, tops, _CMP_UNORD_Q);
    __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), index = where;
    const __m256i step = _mm256_set1_epi32(kLanes);
    for (s = kLanes; s + kLanes <= n; s += kLanes) {
      const __m256 v = _mm256_loadu_ps(row + s);
      index = _mm256_add_epi32(index, step);
      const __m256 higher = _mm256_cmp_ps(v, tops, _CMP_GT_OQ);
      tops = _mm256_blendv_ps(tops, v, higher);
      where = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(where), _mm256_castsi256_ps(index), higher));
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nans)) {
      for (int64_t i = 0; i < n; ++i)
        if (std::isnan(row[i])) return {row[i], i};
    }
    alignas(32) float lanes[kLanes];
    alignas(32) int32_t firsts[kLanes];
    _mm256_store_ps(lanes, tops);
    _mm256_store_si256(reinterpret_cast<__m256i*>(firsts), where);
    top = lanes[0], best = firsts[0];
    for (int64_t j = 1; j < kLanes; ++j)
      if (lanes[j] > top || (lanes[j] == top && firsts[j] < best)) top = lanes[j], best = firsts[j];
  }
  for (; s < n; ++s) {
    if (std::isnan(row[s])) return {row[s], s};
    if (s == 0 || row[s] > top) top = row[s], best = s;
  }
  return {top, best};
}

// log sum_i exp(row[i]), from the row's largest value `top`: four 8-lane sums of exp(row[i] - top), then the tail
float log_sum_exp(const float* row, int64_t n, float top) {
  if (!std::isfinite(top)) return top;  // every value -inf: -inf; a +inf or a NaN: itself
  f8 sums[4] = {};
  int64_t s = 0;
  for (; s + 4 * kLanes <= n; s += 4 * kLanes)
    for (int j = 0; j < 4; ++j) sums[j] += exp8(load8(row + s + j * kLanes) - top);
  for (; s + kLanes <= n; s += kLanes) sums[0] += exp8(load8(row + s) - top);
  float total = (sum8(sums[0]) + sum8(sums[1])) + (sum8(sums[2]) + sum8(sums[3]));
  for (; s < n; ++s) total += std::exp(row[s] - top);
  return top + std::log(total);
}

void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 (rows, vocabulary) tensor");
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
}

// `body(row, r, n)` for every row of a checked (rows, n) logits tensor, rows in parallel
template <typename Body>
void each_logits_row(const at::Tensor& logits, Body body) {
  const int64_t n = logits.size(1);
  const float* x = logits.data_ptr<float>();
  each_row(logits.size(0), 1, [&](int64_t r) { body(x + r * n, r, n); });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_logits(logits);
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  each_logits_row(logits, [&](const float* row, int64_t r, int64_t n) { index[r] = top_of(row, n).second; });
  return out;
}

at::Tensor logsumexp_rows(const at::Tensor& logits) {
  check_logits(logits);
  at::Tensor out = at::empty({logits.size(0)}, logits.options());
  float* lse = out.data_ptr<float>();
  each_logits_row(logits, [&](const float* row, int64_t r, int64_t n) { lse[r] = log_sum_exp(row, n, top_of(row, n).first); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("logsumexp_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.impl("logsumexp_rows", c10::DispatchKey::CPU, TORCH_FN(logsumexp_rows));
}
