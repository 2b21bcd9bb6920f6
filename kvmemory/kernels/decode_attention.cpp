// One decode step's attention on the CPU, for every session and KV head of a layer in one parallel loop.
// See kvmemory/attention/decode_kernel.py for why it exists and when it runs.
//
// Each session's layer comes as its cache stores it (kvmemory.cache.CompactLayer): flat key and value rows
// grouped by KV head, with an int32 metadata row per slot whose first column holds beta's fp32 bits. A work
// item is one KV head of one session: its G query rows (the query heads sharing that KV head) against its
// rows [start, start + length). Each item reads its keys once for all G queries, then its values once, a
// block of slots at a time so that a block is still in L1 while every query uses it; within a block each key
// and value chunk is loaded (and widened from 16 bits) once for up to three queries, whose sums run as
// independent chains, and 16-bit rows are fetched ahead into L1. Sums run in fp32.
// When the caller hands over the step's new keys, values and metadata, each item first writes its head's
// last row (rounded to the storage dtype as a tensor copy rounds), saving the per-session writes per layer.
// 8-bit rows (kvmemory.cache.int8_rows: D levels, then their fp32 scale) are read as levels: a key's scale
// multiplies its dot products, a value's scale its attention weight, and a written row is encoded as the cache
// encodes it.
// Head dims must be multiples of 8 (the vector width used here, 8 floats); it needs AVX2, FMA and F16C, which
// kvmemory.kernels builds it for.

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "simd.h"

namespace {

using namespace kvmemory_simd;  // f8, kLanes, load8, sum8, exp8

constexpr int64_t kBlock = 32;  // slots per block: 32 x D values in L1 while every query reads them

template <typename T>
struct Item {
  const float* query;  // (G, D), already multiplied by the softmax scale
  const T* keys;
  const T* values;
  int64_t key_stride, value_stride, slots;
  const float* bias;  // beta of slot s at bias[s * bias_stride], or null
  int64_t bias_stride;
  float* out;  // (G, Dv)
};

template <typename T>
constexpr bool kLevels = std::is_same_v<T, int8_t>;  // 8-bit rows: levels, then a scale

// The fp32 scale stored after the `dim` levels of an 8-bit row
inline float row_scale(const int8_t* row, int64_t dim) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof scale);
  return scale;
}

// 16-bit rows: the loops fetch the rows kAhead slots ahead into L1 (fp16 decode attention ~15% faster on a
// 2-core AVX2 EPYC); fp32 rows stream at the memory's bandwidth without it, and the extra loads cost
constexpr int64_t kAhead = 128;
template <typename T>
constexpr bool kFetchAhead = !std::is_same_v<T, float>;

// Fetch `count` elements from `from` on into L1 (the lines of rows a loop reads kAhead slots later).
template <typename T>
inline void prefetch_rows(const T* from, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(from);
  for (int64_t b = 0; b < count * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// Four dot products' lanes summed: lane j of the result holds the sum of a[j]'s eight lanes.
inline __m128 sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores[g][s] = q_g . k_s (+ beta_s, with `bias`) for GB queries and four slots at once: each key chunk is
// loaded (and widened from 16 or 8 bits) once for all GB queries, and the GB · 4 sums are independent chains.
// On 8-bit rows the four keys' scales multiply the sums before beta is added, once for all GB queries.
template <int GB, typename T>
inline void score4(const float* q, int64_t dim, const T* k, int64_t stride, float* row, int64_t S, const float* bias,
                   int64_t bias_stride) {
  __m256 acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < dim; c += kLanes) {
    // the GB query chunks stay in registers and each key chunk is used as soon as it is loaded: holding the
    // four key chunks as well (12 sums, 4 keys, 1 query) would take more than AVX2's 16 registers, and spill
    __m256 qc[GB];
#pragma GCC unroll 3
    for (int g = 0; g < GB; ++g) qc[g] = _mm256_loadu_ps(q + g * dim + c);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 kj = (__m256)load8(k + j * stride + c);
#pragma GCC unroll 3
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(qc[g], kj, acc[g][j]);
    }
  }
  __m128 sums[GB];
  for (int g = 0; g < GB; ++g) sums[g] = sum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
  if constexpr (kLevels<T>) {  // in registers: a pass of its own over the scores took ~27% of 8-bit attention
    const __m128 scales = _mm_set_ps(row_scale(k + 3 * stride, dim), row_scale(k + 2 * stride, dim),
                                     row_scale(k + stride, dim), row_scale(k, dim));
    for (int g = 0; g < GB; ++g) sums[g] = _mm_mul_ps(sums[g], scales);
  }
  if (bias) {  // beta added to the four sums once for all GB queries (a separate pass cost ~15% of scoring)
    const __m128 beta = _mm_set_ps(bias[3 * bias_stride], bias[2 * bias_stride], bias[bias_stride], bias[0]);
    for (int g = 0; g < GB; ++g) sums[g] = _mm_add_ps(sums[g], beta);
  }
  for (int g = 0; g < GB; ++g) _mm_storeu_ps(row + g * S, sums[g]);
}

// scores[g][s] = q_g . k_s (+ beta_s): queries three at a time, slots four at a time over a block of slots
// that stays in L1 while every query reads it. On 8-bit rows a key's scale multiplies its scores before beta is
// added, as each score is summed.
template <typename T>
void score(const Item<T>& item, int64_t groups, int64_t dim, float* scores) {
  const int64_t S = item.slots, stride = item.key_stride;
  const float* bias = item.bias;  // added as the scores are summed
  for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
    const int64_t s1 = s0 + kBlock < S ? s0 + kBlock : S;
    for (int64_t g0 = 0; g0 < groups; g0 += 3) {
      const int64_t gb = std::min<int64_t>(3, groups - g0);
      const float* q = item.query + g0 * dim;
      float* rows = scores + g0 * S;
      int64_t s = s0;
      for (; s + 4 <= s1; s += 4) {
        const T* k = item.keys + s * stride;
        if (kFetchAhead<T> && g0 == 0) prefetch_rows(k + kAhead * stride, 4 * stride);  // once per row
        const float* beta = bias ? bias + s * item.bias_stride : nullptr;
        if (gb == 3) score4<3>(q, dim, k, stride, rows + s, S, beta, item.bias_stride);
        else if (gb == 2) score4<2>(q, dim, k, stride, rows + s, S, beta, item.bias_stride);
        else score4<1>(q, dim, k, stride, rows + s, S, beta, item.bias_stride);
      }
      for (; s < s1; ++s) {
        const T* k = item.keys + s * stride;
        for (int64_t g = 0; g < gb; ++g) {
          f8 a{};
          for (int64_t c = 0; c < dim; c += kLanes) a += load8(q + g * dim + c) * load8(k + c);
          float sum = sum8(a);
          if constexpr (kLevels<T>) sum *= row_scale(k, dim);
          rows[g * S + s] = bias ? sum + bias[s * item.bias_stride] : sum;
        }
      }
    }
  }
}

// scores[g][:] = softmax(scores[g][:]) in place
void softmax(float* scores, int64_t groups, int64_t S) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = scores + g * S;
    float top = -std::numeric_limits<float>::infinity();
    int64_t s = 0;
    if (S >= kLanes) {  // eight lanes of maxima, then the largest of them
      __m256 tops = _mm256_loadu_ps(row);
      for (s = kLanes; s + kLanes <= S; s += kLanes) tops = _mm256_max_ps(tops, _mm256_loadu_ps(row + s));
      alignas(32) float lanes[kLanes];
      _mm256_store_ps(lanes, tops);
      for (float lane : lanes) top = lane > top ? lane : top;
    }
    for (; s < S; ++s) top = row[s] > top ? row[s] : top;
    float total = 0.0f;
    s = 0;
    f8 sums{};
    for (; s + kLanes <= S; s += kLanes) {
      f8 e = exp8(load8(row + s) - top);
      std::memcpy(row + s, &e, sizeof e);
      sums += e;
    }
    total = sum8(sums);
    for (; s < S; ++s) {
      row[s] = std::exp(row[s] - top);
      total += row[s];
    }
    const float inv = 1.0f / total;
    for (s = 0; s < S; ++s) row[s] *= inv;
  }
}

// o_g[0:4 chunks] += sum over slots [s0, s1) of p_g[s] v_s[0:4 chunks] for GB queries: each value chunk is
// loaded (and widened from 16 bits) once for all GB queries, into GB · 4 independent sums; with `fetch`, the
// rows kAhead slots on are fetched into L1
template <int GB, typename T>
inline void mix4(const T* values, int64_t stride, const float* p, int64_t S, int64_t s0, int64_t s1, float* o,
                 int64_t value_dim, bool fetch) {
  __m256 acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_loadu_ps(o + g * value_dim + c * kLanes);
  for (int64_t s = s0; s < s1; ++s) {
    const T* v = values + s * stride;
    if (fetch) prefetch_rows(v + kAhead * stride, value_dim);
    // as in score4: the GB weights stay in registers and each value chunk is used as soon as it is loaded
    __m256 w[GB];
#pragma GCC unroll 3
    for (int g = 0; g < GB; ++g) w[g] = _mm256_broadcast_ss(p + g * S + s);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 vc = (__m256)load8(v + c * kLanes);
#pragma GCC unroll 3
      for (int g = 0; g < GB; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], vc, acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + g * value_dim + c * kLanes, acc[g][c]);
}

// one value chunk (8 floats) of one query: o[0:8] += sum over slots [s0, s1) of p[s] v_s[0:8]
template <typename T>
inline void mix1(const T* values, int64_t stride, const float* p, int64_t s0, int64_t s1, float* o) {
  f8 acc = load8(o);
  for (int64_t s = s0; s < s1; ++s) acc += p[s] * load8(values + s * stride);
  std::memcpy(o, &acc, sizeof acc);
}

// out[g] = sum_s p[g][s] v_s: queries three at a time, value chunks four at a time (32 floats), over a block
// of slots that stays in L1 while every query reads it. On 8-bit rows each weight is first multiplied by its
// value's scale, a block at a time, so the mix sums levels and reading the scales brings the block's rows into L1
// for it (a separate pass over every row's scale before the mix cost a second read of the values)
template <typename T>
void mix(const Item<T>& item, int64_t groups, int64_t value_dim, float* weights) {
  const int64_t S = item.slots, stride = item.value_stride;
  std::memset(item.out, 0, sizeof(float) * groups * value_dim);
  for (int64_t s0 = 0; s0 < S; s0 += kBlock) {
    const int64_t s1 = s0 + kBlock < S ? s0 + kBlock : S;
    if constexpr (kLevels<T>) {
      for (int64_t s = s0; s < s1; ++s) {
        const float scale = row_scale(item.values + s * stride, value_dim);
        for (int64_t g = 0; g < groups; ++g) weights[g * S + s] *= scale;
      }
    }
    for (int64_t g0 = 0; g0 < groups; g0 += 3) {
      const int64_t gb = std::min<int64_t>(3, groups - g0);
      const float* p = weights + g0 * S;
      float* o = item.out + g0 * value_dim;
      int64_t c = 0;
      for (; c + 4 * kLanes <= value_dim; c += 4 * kLanes) {
        const T* v = item.values + c;
        const bool fetch = kFetchAhead<T> && g0 == 0 && c == 0;  // one pass per block fetches whole rows
        if (gb == 3) mix4<3>(v, stride, p, S, s0, s1, o + c, value_dim, fetch);
        else if (gb == 2) mix4<2>(v, stride, p, S, s0, s1, o + c, value_dim, fetch);
        else mix4<1>(v, stride, p, S, s0, s1, o + c, value_dim, fetch);
      }
      for (; c < value_dim; c += kLanes)
        for (int64_t g = 0; g < gb; ++g) mix1(item.values + c, stride, p + g * S, s0, s1, o + g * value_dim + c);
    }
  }
}

// One work item as the caller hands it over: rows [start, start + slots) of a session's flat storage
struct Span {
  void* keys;
  void* values;
  int32_t* meta;  // the storage's int32 metadata rows, beta's fp32 bits in column 0
  bool biased;    // whether to add beta
  int64_t key_stride, value_stride, meta_stride;  // elements from one row to the next
  int64_t start, slots;
};

// fp32 rows in the model's (heads, sessions, dim) layout, as attention hands them over (views, any strides
// but the last): no per-item copy is made in Python
struct Rows {
  const float* data = nullptr;
  int64_t head_stride = 0, session_stride = 0;
  const float* at(int64_t head, int64_t session) const { return data + head * head_stride + session * session_stride; }
};

// The token a decode step appends, when the kernel writes it: per session and KV head its key and value,
// per session its metadata row; each item writes row start + slots - 1 of its span before reading the span.
struct NewRows {
  Rows keys, values;
  const int32_t* meta;  // (sessions, 4)
};

template <typename T>
inline void write_row(T* to, const float* from, int64_t n) {
  if constexpr (kLevels<T>) {  // int8_rows.encode: scale max|x| / 127, levels rounded to nearest even
    float top = 0.0f;
    for (int64_t j = 0; j < n; ++j) top = std::max(top, std::fabs(from[j]));
    const float scale = top / 127.0f;
    for (int64_t j = 0; j < n; ++j)
      to[j] = scale > 0.0f ? static_cast<int8_t>(std::clamp(std::nearbyint(from[j] / scale), -127.0f, 127.0f)) : 0;
    std::memcpy(to + n, &scale, sizeof scale);
  } else {
    for (int64_t j = 0; j < n; ++j) to[j] = static_cast<T>(from[j]);  // round to nearest even, as copy_ does
  }
}

template <typename T>
void run_items(const Rows& query, float scale, int64_t kv_heads, int64_t groups, const std::vector<Span>& spans,
               const NewRows* fresh, int64_t dim, int64_t value_dim, at::Tensor& out) {
  const int64_t items = static_cast<int64_t>(spans.size());
  float* o = out.data_ptr<float>();
  // OpenMP directly, not at::parallel_for: its inline lazy thread setup, compiled into this library, would
  // reset the calling thread's team to the last torch.set_num_threads of any thread (the callers' 1)
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores, queries(groups * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const Span& span = spans[i];
      const int64_t session = i / kv_heads, head = i % kv_heads;
      if (fresh) {
        const int64_t row = span.start + span.slots - 1;
        write_row(static_cast<T*>(span.keys) + row * span.key_stride, fresh->keys.at(head, session), dim);
        write_row(static_cast<T*>(span.values) + row * span.value_stride, fresh->values.at(head, session), value_dim);
        std::memcpy(span.meta + row * span.meta_stride, fresh->meta + session * 4, 4 * sizeof(int32_t));
      }
      for (int64_t g = 0; g < groups; ++g) {  // the item's query heads, scaled by the softmax scale
        const float* from = query.at(head * groups + g, session);
        for (int64_t c = 0; c < dim; ++c) queries[g * dim + c] = from[c] * scale;
      }
      const float* bias =
          span.biased ? reinterpret_cast<const float*>(span.meta + span.start * span.meta_stride) : nullptr;
      Item<T> item{queries.data(),
                   static_cast<const T*>(span.keys) + span.start * span.key_stride,
                   static_cast<const T*>(span.values) + span.start * span.value_stride,
                   span.key_stride,
                   span.value_stride,
                   span.slots,
                   bias,
                   span.meta_stride,
                   o + i * groups * value_dim};
      scores.resize(groups * item.slots);
      score(item, groups, dim, scores.data());
      softmax(scores.data(), groups, item.slots);
      mix(item, groups, value_dim, scores.data());
    }
  }
}

// One decode token per session over its cache layer as stored (kvmemory.cache.CompactLayer): keys[i] (N_i, D)
// and values[i] (N_i, Dv) with contiguous rows, all fp32, fp16 or bf16, or all 8-bit rows (N_i, D + 4 bytes);
// metas[i] the (N_i, 4) int32 slot metadata, whose beta is added where biased[i]; heads: per session and KV
// head its start row and length, flattened. query (Hq, sessions, D) fp32, as attention has it (any strides but
// the last), multiplied here by `scale`. With new_keys (KV heads, sessions, D), new_values (KV heads, sessions, Dv) fp32, laid out alike, and
// new_meta (sessions, 4) int32, each head's last row is first written from them (the token being decoded).
// Returns (sessions x KV heads, G, Dv) fp32: per session its Hq heads' outputs.
at::Tensor decode_attention(const at::Tensor& query, double scale, at::TensorList keys, at::TensorList values,
                            at::TensorList metas, c10::List<bool> biased, at::IntArrayRef heads,
                            const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values,
                            const std::optional<at::Tensor>& new_meta) {
  const int64_t sessions = static_cast<int64_t>(keys.size()), items = static_cast<int64_t>(heads.size()) / 2;
  TORCH_CHECK(sessions > 0 && static_cast<int64_t>(values.size()) == sessions &&
                  static_cast<int64_t>(metas.size()) == sessions && static_cast<int64_t>(biased.size()) == sessions,
              "one keys, values, metas and biased entry per session");
  TORCH_CHECK(heads.size() % 2 == 0 && items % sessions == 0, "one (start, length) pair per session and KV head");
  const int64_t kv_heads = items / sessions;
  auto laid_out = [&](const at::Tensor& t, int64_t rows, int64_t width) {  // (rows, sessions, width) fp32
    return t.dim() == 3 && t.size(0) == rows && t.size(1) == sessions && t.size(2) == width &&
           t.scalar_type() == at::kFloat && t.stride(2) == 1;
  };
  const auto dtype = keys[0].scalar_type();
  const int64_t scale_bytes = dtype == at::kChar ? static_cast<int64_t>(sizeof(float)) : 0;  // 8-bit rows' scale
  const int64_t dim = query.dim() == 3 ? query.size(2) : 0, value_dim = values[0].size(-1) - scale_bytes;
  TORCH_CHECK(query.dim() == 3 && query.size(0) % kv_heads == 0 && laid_out(query, query.size(0), dim),
              "query must be float32 (query heads, sessions, head dim), a whole number of groups per KV head, "
              "with contiguous rows");
  TORCH_CHECK(dim % kLanes == 0 && value_dim % kLanes == 0, "head dims must be multiples of 8");
  auto rows = [](const at::Tensor& t) { return Rows{t.data_ptr<float>(), t.stride(0), t.stride(1)}; };
  NewRows fresh{};
  if (new_keys.has_value() || new_values.has_value() || new_meta.has_value()) {
    TORCH_CHECK(new_keys.has_value() && new_values.has_value() && new_meta.has_value(),
                "new_keys, new_values and new_meta come together");
    TORCH_CHECK(laid_out(*new_keys, kv_heads, dim) && laid_out(*new_values, kv_heads, value_dim),
                "new_keys and new_values must be float32 (KV heads, sessions, head dim) with contiguous rows");
    TORCH_CHECK(new_meta->dim() == 2 && new_meta->size(0) == sessions && new_meta->size(1) == 4 &&
                    new_meta->scalar_type() == at::kInt && new_meta->is_contiguous(),
                "new_meta must be contiguous int32 (sessions, 4)");
    fresh = NewRows{rows(*new_keys), rows(*new_values), new_meta->data_ptr<int32_t>()};
  }
  std::vector<Span> spans(items);
  for (int64_t i = 0; i < sessions; ++i) {
    const at::Tensor& k = keys[i];
    const at::Tensor& v = values[i];
    TORCH_CHECK(k.dim() == 2 && v.dim() == 2 && k.size(0) == v.size(0) && k.stride(1) == 1 && v.stride(1) == 1,
                "session ", i, ": keys and values must be (N, D) with the same N and contiguous rows");
    TORCH_CHECK(k.size(1) == dim + scale_bytes && v.size(1) == value_dim + scale_bytes, "session ", i,
                ": head dims differ");
    TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, "session ", i, ": mixed cache dtypes");
    const at::Tensor& meta = metas[i];
    TORCH_CHECK(meta.dim() == 2 && meta.size(0) == k.size(0) && meta.size(1) == 4 && meta.scalar_type() == at::kInt &&
                    meta.stride(1) == 1,
                "session ", i, ": metas must be (N, 4) int32 with contiguous rows");
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t item = i * kv_heads + h, start = heads[2 * item], slots = heads[2 * item + 1];
      TORCH_CHECK(start >= 0 && slots > 0 && start + slots <= k.size(0), "session ", i, " head ", h,
                  ": rows [", start, ", ", start + slots, ") are not inside its storage of ", k.size(0));
      spans[item] = Span{k.data_ptr(), v.data_ptr(), meta.data_ptr<int32_t>(), biased.get(i), k.stride(0),
                         v.stride(0),     meta.stride(0), start, slots};
    }
  }
  const int64_t groups = query.size(0) / kv_heads;
  at::Tensor out = at::empty({items, groups, value_dim}, query.options());
  const NewRows* writes = fresh.meta ? &fresh : nullptr;
  const float softmax_scale = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    run_items<float>(rows(query), softmax_scale, kv_heads, groups, spans, writes, dim, value_dim, out);
  } else if (dtype == at::kHalf) {
    run_items<at::Half>(rows(query), softmax_scale, kv_heads, groups, spans, writes, dim, value_dim, out);
  } else if (dtype == at::kBFloat16) {
    run_items<at::BFloat16>(rows(query), softmax_scale, kv_heads, groups, spans, writes, dim, value_dim, out);
  } else if (dtype == at::kChar) {
    run_items<int8_t>(rows(query), softmax_scale, kv_heads, groups, spans, writes, dim, value_dim, out);
  } else {
    TORCH_CHECK(false, "keys and values must be float32, float16, bfloat16 or 8-bit rows (int8)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def(
      "decode_attention(Tensor query, float scale, Tensor[] keys, Tensor[] values, Tensor[] metas, bool[] biased, int[] heads, "
      "Tensor? new_keys=None, Tensor? new_values=None, Tensor? new_meta=None) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
