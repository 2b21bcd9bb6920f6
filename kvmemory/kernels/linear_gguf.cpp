// A linear layer whose weight stays in a GGUF file's own quantized blocks (Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0), for the CPU (AVX2). See kvmemory/runtime/gguf_weights.py (GgufLinear) for why it exists and when it runs.
//
// The weight is the file's bytes, row after row (one output feature's blocks each), so loading copies them
// and a decoded token reads 4.5-8.5 bits a weight, as llama.cpp does. The input rows are quantized first,
// per group of 32 inputs, to 8-bit levels and a float scale (round to nearest, the group's largest |x| to
// 127), the way llama.cpp quantizes activations for its integer dot products. The product then runs on
// integers: every format's levels are unsigned bytes (4, 5 or 6 bits; Q8_0's signed levels go through
// their absolute value, the input taking their sign), `maddubs` multiplies 32 of them by 32 input levels
// and sums pairs, `madd` sums those to eight 32-bit sums, and three horizontal adds leave one 32-bit dot
// per half-group of 16 for four groups in one vector. A half-group's weight is w = step · level + low with
// a float step and low from the block (Q4_K: d·sc and −dmin·m; Q6_K, whose scales are per 16: d·sc and
// −32·d·sc; Q4_1, Q5_1: d and m; Q4_0, Q5_0: d and −8·d, −16·d; Q8_0: d and 0), so
// y = Σ step·xscale·dot + low·(xscale·Σ input levels): one multiply-add for the dots and one for the lows
// per 128 inputs. A weight is read and unpacked once per pass for every input row of a tile that shares
// it (up to 4 rows against it in registers).
//
// Outputs are the sum over 128-input chunks in a fixed order per (row, output), so a row's result does
// not depend on the other rows of its pass nor on the thread count (bit for bit).

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"  // checked_rows_and_bias

namespace {

constexpr int64_t CHUNK = 128;  // inputs per step of the product: four groups of 32
constexpr int64_t GROUP = 32;   // inputs per scale of the quantized input rows
constexpr int64_t LANES = 16;   // floats per chunk of an input row: 8 scales, 8 scaled sums of levels
constexpr int64_t TILE_BYTES = 192 << 10;  // the input rows walked against each weight row: they stay in L2
constexpr int MAX_ROWS = 4;     // input rows against one weight row in registers

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Four floats, then the same four again: one value per group of a chunk, in the lane order of the dots
inline __m256 twice(float a, float b, float c, float d) {
  const __m128 v = _mm_set_ps(d, c, b, a);
  return _mm256_set_m128(v, v);
}

// ---- the formats: each gives, for chunk c of a weight row, its four groups' levels as 32 unsigned bytes
// each (in input order) and the step and low of each half-group in the dots' lane order
// [g0 0-15, g1 0-15, g2 0-15, g3 0-15, g0 16-31, g1 16-31, g2 16-31, g3 16-31] ------------------------------

// Q4_K: blocks of 256 inputs (144 bytes): d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 groups,
// 128 bytes of 4-bit levels: 32 bytes per 64 inputs, input i in the low nibble and i + 32 in the high one.
struct Q4K {
  static constexpr int64_t kInputs = 256, kBytes = 144;
  static void scale_and_min(const uint8_t* s, int g, int& sc, int& m) {
    if (g < 4) {
      sc = s[g] & 63;
      m = s[g + 4] & 63;
    } else {
      sc = (s[g + 4] & 0xF) | ((s[g - 4] >> 6) << 4);
      m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
  }
  static void chunk(const uint8_t* row, int64_t c, int, __m256i u[4], __m256& step, __m256& low) {
    const uint8_t* block = row + (c / 2) * kBytes;
    const int half = static_cast<int>(c % 2);
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    float steps[4], lows[4];
    for (int g = 0; g < 4; ++g) {
      int sc, m;
      scale_and_min(block + 4, 4 * half + g, sc, m);
      steps[g] = d * static_cast<float>(sc);
      lows[g] = -dmin * static_cast<float>(m);
    }
    step = twice(steps[0], steps[1], steps[2], steps[3]);
    low = twice(lows[0], lows[1], lows[2], lows[3]);
    const uint8_t* qs = block + 16 + half * 64;
    const __m256i nibble = _mm256_set1_epi8(0xF);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32));
    u[0] = _mm256_and_si256(a, nibble);
    u[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble);
    u[2] = _mm256_and_si256(b, nibble);
    u[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  }
  static __m256i pairs(__m256i u, __m256i x) { return _mm256_maddubs_epi16(u, x); }
  static float value(const uint8_t* block, int64_t i) {
    int sc, m;
    const int64_t part = i / 64, within = i % 64;
    scale_and_min(block + 4, static_cast<int>(i / 32), sc, m);
    const uint8_t byte = block[16 + part * 32 + within % 32];
    const int q = within < 32 ? byte & 0xF : byte >> 4;
    return half_to_float(block) * sc * q - half_to_float(block + 2) * m;
  }
};

// Q6_K: blocks of 256 inputs (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit scales
// (one per 16 inputs), d (fp16). Per 128 inputs, 64 low bytes and 32 high ones: input l (0-31) takes the low
// nibble of low byte l and bits 0-1 of high byte l; l + 32 the low nibble of byte l + 32 and bits 2-3;
// l + 64 the high nibble of byte l and bits 4-5; l + 96 the high nibble of byte l + 32 and bits 6-7.
// Levels are 0..63, the weight d · scale · (level − 32).
struct Q6K {
  static constexpr int64_t kInputs = 256, kBytes = 210;
  static void chunk(const uint8_t* row, int64_t c, int, __m256i u[4], __m256& step, __m256& low) {
    const uint8_t* block = row + (c / 2) * kBytes;
    const int64_t half = c % 2;
    const uint8_t* ql = block + half * 64;
    const uint8_t* qh = block + 128 + half * 32;
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192) + half * 8;
    const float d = half_to_float(block + 208);
    // lane order: group g's first 16 inputs take scale 2g, its last 16 scale 2g + 1
    step = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_setr_ps(sc[0], sc[2], sc[4], sc[6], sc[1], sc[3], sc[5], sc[7]));
    low = _mm256_mul_ps(step, _mm256_set1_ps(-32.0f));
    const __m256i nibble = _mm256_set1_epi8(0xF), top = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    u[0] = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
    u[1] = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble), _mm256_and_si256(h, top));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
  }
  static __m256i pairs(__m256i u, __m256i x) { return _mm256_maddubs_epi16(u, x); }
  static float value(const uint8_t* block, int64_t i) {
    const int64_t half = i / 128, within = i % 128, quarter = within / 32, l = within % 32;
    const uint8_t lowbyte = block[half * 64 + (quarter % 2) * 32 + l];
    const int lo = quarter < 2 ? lowbyte & 0xF : lowbyte >> 4;
    const int hi = (block[128 + half * 32 + l] >> (2 * quarter)) & 3;
    const int scale = reinterpret_cast<const int8_t*>(block + 192)[half * 8 + quarter * 2 + l / 16];
    return half_to_float(block + 208) * scale * ((lo | (hi << 4)) - 32);
  }
};

// 32 bytes, byte i 0x10 where bit i of `bits` is set (Q5_0's and Q5_1's fifth bits)
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The formats of 32 inputs a block: d (fp16), then with a min m (fp16: Q4_1, Q5_1), then with fifth bits (32
// bits: Q5_0, Q5_1), then 16 bytes of low 4 bits (input i in the low nibble of byte i, i + 16 in its high
// one). The weight is d · level + m, or without a min d · (level − 8) (Q4_0) or d · (level − 16) (Q5_0).
template <bool kMin, bool kFifth>
struct Small {
  static constexpr int64_t kInputs = 32, kBytes = 18 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);
  static constexpr int64_t kLevels = 2 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);  // offset of the 16 level bytes
  static constexpr float kCentre = kFifth ? 16.0f : 8.0f;
  static uint32_t fifths(const uint8_t* block) {
    uint32_t bits = 0;
    if constexpr (kFifth) std::memcpy(&bits, block + kLevels - 4, 4);
    return bits;
  }
  static void chunk(const uint8_t* row, int64_t c, int groups, __m256i u[4], __m256& step, __m256& low) {
    float d[4] = {}, m[4] = {};
    const __m128i nibble = _mm_set1_epi8(0xF);
    for (int g = groups; g < 4; ++g) u[g] = _mm256_setzero_si256();
    for (int g = 0; g < groups; ++g) {
      const uint8_t* block = row + (c * 4 + g) * kBytes;
      d[g] = half_to_float(block);
      m[g] = kMin ? half_to_float(block + 2) : -kCentre * d[g];
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kLevels));
      u[g] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), _mm_and_si128(qs, nibble));
      if constexpr (kFifth) u[g] = _mm256_or_si256(u[g], fifth_bits(fifths(block)));
    }
    step = twice(d[0], d[1], d[2], d[3]);
    low = twice(m[0], m[1], m[2], m[3]);
  }
  static __m256i pairs(__m256i u, __m256i x) { return _mm256_maddubs_epi16(u, x); }
  static float value(const uint8_t* block, int64_t i) {
    const int lo = i < 16 ? block[kLevels + i] & 0xF : block[kLevels + i - 16] >> 4;
    const int fifth = static_cast<int>((fifths(block) >> i) & 1);
    const float d = half_to_float(block), level = static_cast<float>(lo | (fifth << 4));
    return kMin ? d * level + half_to_float(block + 2) : d * (level - kCentre);
  }
};
using Q40 = Small<false, false>;
using Q41 = Small<true, false>;
using Q50 = Small<false, true>;
using Q51 = Small<true, true>;

// Q8_0: blocks of 32 inputs (34 bytes): d (fp16), 32 signed levels; the weight d · level. maddubs multiplies an
// unsigned byte by a signed one, so each pair is |level| times the input level carrying the weight's sign.
struct Q80 {
  static constexpr int64_t kInputs = 32, kBytes = 34;
  static void chunk(const uint8_t* row, int64_t c, int groups, __m256i u[4], __m256& step, __m256& low) {
    float d[4] = {};
    for (int g = groups; g < 4; ++g) u[g] = _mm256_setzero_si256();
    for (int g = 0; g < groups; ++g) {
      const uint8_t* block = row + (c * 4 + g) * kBytes;
      d[g] = half_to_float(block);
      u[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    }
    step = twice(d[0], d[1], d[2], d[3]);
    low = _mm256_setzero_ps();
  }
  static __m256i pairs(__m256i u, __m256i x) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u));
  }
  static float value(const uint8_t* block, int64_t i) {
    return half_to_float(block) * static_cast<float>(static_cast<int8_t>(block[2 + i]));
  }
};

// ---- the input rows, quantized: per row its levels, in chunks of 128 (a last chunk of fewer groups padded
// with zeros), and per chunk 16 floats: the four groups' scales twice, then each half-group's scale · its sum
// of levels, in the dots' lane order (a padded group's all zero) ------------------------------------------
inline int64_t chunks_of(int64_t K) { return (K + CHUNK - 1) / CHUNK; }

void quantize_row(const float* x, int64_t K, int8_t* q, float* lanes) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  std::memset(lanes, 0, chunks_of(K) * LANES * sizeof(float));
  for (int64_t group = 0; group < K / GROUP; ++group) {
    float* out = lanes + group / 4 * LANES;
    const int64_t g = group % 4;
    const float* xg = x + group * GROUP;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i levels[4];
    for (int i = 0; i < 4; ++i) levels[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // to nearest
    int32_t sums[2][8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[0]), _mm256_add_epi32(levels[0], levels[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[1]), _mm256_add_epi32(levels[2], levels[3]));
    int32_t first = 0, second = 0;
    for (int i = 0; i < 8; ++i) first += sums[0][i], second += sums[1][i];
    const __m256i packed =
        _mm256_packs_epi16(_mm256_packs_epi32(levels[0], levels[1]), _mm256_packs_epi32(levels[2], levels[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + group * GROUP), _mm256_permutevar8x32_epi32(packed, order));
    out[g] = out[4 + g] = d;
    out[8 + g] = d * static_cast<float>(first);
    out[12 + g] = d * static_cast<float>(second);
  }
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[r * N] for R input rows (their levels `stride` apart) against one weight row of `groups` groups of 32:
// each chunk of it unpacked once and used for every row
template <typename F, int R>
void dot_rows(const uint8_t* w, int64_t groups, const int8_t* xq, const float* xl, int64_t stride, float bias,
              float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t chunks = chunks_of(groups * GROUP);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m256i u[4];
    __m256 step, low;
    F::chunk(w, c, static_cast<int>(std::min<int64_t>(4, groups - 4 * c)), u, step, low);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * stride + c * CHUNK;
      __m256i v[4];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g)
        v[g] = _mm256_madd_epi16(
            F::pairs(u[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * GROUP))), ones);
      const __m256i dots = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
      const float* lanes = xl + r * chunks * LANES + c * LANES;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(step, _mm256_loadu_ps(lanes)), _mm256_cvtepi32_ps(dots), acc[r]);
      acc[r] = _mm256_fmadd_ps(low, _mm256_loadu_ps(lanes + 8), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = sum_lanes(acc[r]) + bias;
}

template <typename F>
void product(const float* xs, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N,
             const float* b, float* ys) {
  const int64_t chunks = chunks_of(K), stride = chunks * CHUNK;  // a row's levels, padded to whole chunks
  std::vector<int8_t> xq(M * stride, 0);
  std::vector<float> xl(M * chunks * LANES);
  kvmemory_simd::each_row(M, 8, [&](int64_t r) { quantize_row(xs + r * K, K, &xq[r * stride], &xl[r * chunks * LANES]); });
  const int64_t tile = std::max<int64_t>(MAX_ROWS, TILE_BYTES / stride / MAX_ROWS * MAX_ROWS);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 16)));
#pragma omp parallel num_threads(threads)
  {
    // each thread a contiguous share of the weight rows, walked once per tile of input rows
    const int64_t t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const int64_t n0 = N * t / n_threads, n1 = N * (t + 1) / n_threads;
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * row_bytes;
        const float bias = b ? b[n] : 0.0f;
        for (int64_t r = m0; r < m1; r += MAX_ROWS) {
          const int8_t* x = &xq[r * stride];
          const float* l = &xl[r * chunks * LANES];
          float* y = ys + r * N + n;
          switch (std::min<int64_t>(MAX_ROWS, m1 - r)) {
            case 4: dot_rows<F, 4>(row, K / GROUP, x, l, stride, bias, y, N); break;
            case 3: dot_rows<F, 3>(row, K / GROUP, x, l, stride, bias, y, N); break;
            case 2: dot_rows<F, 2>(row, K / GROUP, x, l, stride, bias, y, N); break;
            default: dot_rows<F, 1>(row, K / GROUP, x, l, stride, bias, y, N); break;
          }
        }
      }
    }
  }
}

// GGML's type ids of the formats kept
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

template <typename Body>
auto by_type(int64_t type, Body body) {
  switch (type) {
    case kQ4_K: return body(Q4K{});
    case kQ6_K: return body(Q6K{});
    case kQ4_0: return body(Q40{});
    case kQ4_1: return body(Q41{});
    case kQ5_0: return body(Q50{});
    case kQ5_1: return body(Q51{});
    case kQ8_0: return body(Q80{});
  }
  TORCH_CHECK(false, "GGML type ", type,
              " is not kept in blocks (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q6_K 14 are)");
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be a contiguous (out_features, row bytes) uint8 tensor");
  by_type(type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(K > 0 && K % F::kInputs == 0, "in_features ", K, " must be a positive multiple of ", F::kInputs,
                " for GGML type ", type);
    TORCH_CHECK(blocks.size(1) == K / F::kInputs * F::kBytes, "a row of ", K, " inputs takes ",
                K / F::kInputs * F::kBytes, " bytes in GGML type ", type, ", the blocks hold ", blocks.size(1));
    return 0;
  });
}

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = blocks.size(0), K = x.size(1);
  const float* b = kvmemory_simd::checked_rows_and_bias(x, bias, N);
  check_blocks(blocks, type, K);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  by_type(type, [&](auto format) {
    product<decltype(format)>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), blocks.size(1), N, b,
                              y.data_ptr<float>());
    return 0;
  });
  return y;
}

// The weights of `rows` (int64 indices into the blocks' rows) as float32 (rows, K): embedding lookups, and
// the reference the tests check the product against
at::Tensor dequantize_gguf(const at::Tensor& blocks, int64_t type, int64_t K, const at::Tensor& rows) {
  check_blocks(blocks, type, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a vector of int64 indices");
  const int64_t N = blocks.size(0), count = rows.size(0);
  at::Tensor ids = rows.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " is out of 0..", N - 1);
  at::Tensor out = at::empty({count, K}, blocks.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  by_type(type, [&](auto format) {
    using F = decltype(format);
    kvmemory_simd::each_row(count, 16, [&](int64_t i) {
      const uint8_t* row = w + id[i] * row_bytes;
      for (int64_t k = 0; k < K; ++k) o[i * K + k] = F::value(row + (k / F::kInputs) * F::kBytes, k % F::kInputs);
    });
    return 0;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("linear_gguf(Tensor x, Tensor blocks, int ggml_type, Tensor? bias=None) -> Tensor");
  m.def("dequantize_gguf(Tensor blocks, int ggml_type, int in_features, Tensor rows) -> Tensor");
  m.impl("linear_gguf", c10::DispatchKey::CPU, TORCH_FN(linear_gguf));
  m.impl("dequantize_gguf", c10::DispatchKey::CPU, TORCH_FN(dequantize_gguf));
}
