// A linear layer whose weight stays in a GGUF file's own quantized blocks (Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0), for the CPU (AVX2). See kvmemory/runtime/gguf_weights.py (GgufLinear) for why it exists and when it runs.
//
// The weight is the file's bytes, row after row (one output feature's blocks each), so loading copies them
// and a decoded token reads 4.5-8.5 bits a weight, as llama.cpp does. The input rows are quantized first to
// 8-bit levels, the way llama.cpp quantizes activations for its integer dot products (round to nearest, a
// block's largest |x| to 127): per 256 inputs, with each 16's and 32's sum of levels, for the K-quants; per
// 32 for the formats of 32-input blocks. The product then runs on integers: every format's levels are
// unsigned bytes (4, 5 or 6 bits; Q8_0's signed levels go through their absolute value, the input taking
// their sign), and `maddubs` multiplies 32 of them by 32 input levels and sums pairs.
//
// K-quants (`Q4K`, `Q6K`): one input scale per 256 inputs, so a block's sub-scales multiply in integers:
// `madd` scales each group's pair sums by its 6- or 8-bit scale and sums them to eight 32-bit lanes, a block's
// groups add up there, and one float multiply-add per block applies d · (input scale). The mins (Q4_K:
// dmin · m per 32) and Q6_K's offset of 32 come from the input's sums of levels: one more `madd` per block.
// Formats of 32-input blocks: the input scale changes every 32, so `madd` sums each group's pairs, three
// horizontal adds leave a dot per half-group for four groups in one vector, and w = step · level + low per
// half-group (Q4_1, Q5_1: d and m; Q4_0, Q5_0: d and −8·d, −16·d; Q8_0: d and 0) gives
// y = Σ step·xscale·dot + low·(xscale·Σ input levels): two float multiply-adds per 128 inputs.
//
// A weight row is read and unpacked once per tile of input rows, up to 4 of them against it in registers.
// Outputs are sums in a fixed order per (row, output), so a row's result does not depend on the other rows
// of its pass nor on the thread count (bit for bit).

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "simd.h"  // checked_rows_and_bias

namespace {

constexpr int64_t BLOCK = 256;  // inputs per scale of the quantized input rows for the K-quants
constexpr int64_t CHUNK = 128;  // inputs per step of the 32-input formats' product: four groups of 32
constexpr int64_t GROUP = 32;   // inputs per scale of the quantized input rows for the 32-input formats
constexpr int64_t LANES = 16;   // floats per chunk of such a row: 8 scales, 8 scaled sums of levels
constexpr int64_t TILE_BYTES = 192 << 10;  // the input rows walked against each weight row: they stay in L2
constexpr int MAX_ROWS = 4;     // input rows against one weight row in registers

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float sum_lanes(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 32 floats → 32 levels round(x / d) with d = scale (0 where the scale is 0), and their sums per 16
inline void levels_of(const float* x, float inverse, int8_t* q, int32_t& first16, int32_t& second16) {
  const __m256 inv = _mm256_set1_ps(inverse);
  __m256i l[4];
  for (int i = 0; i < 4; ++i) l[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inv));  // to nearest
  int32_t sums[2][8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[0]), _mm256_add_epi32(l[0], l[1]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[1]), _mm256_add_epi32(l[2], l[3]));
  first16 = second16 = 0;
  for (int i = 0; i < 8; ++i) first16 += sums[0][i], second16 += sums[1][i];
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float largest_magnitude(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// ---- input rows quantized per 256 (the K-quants): per row K levels, and per block its scale and sums ----
struct BlockSums {
  float scale;
  int32_t unused[3];
  int16_t per16[16];  // each 16 inputs' sum of levels
  int16_t per32[8];   // each 32's
  int16_t padding[8];
};
static_assert(sizeof(BlockSums) == 80, "one block's sums");

struct PerBlock {
  int64_t K;
  std::vector<int8_t> levels;
  std::vector<BlockSums> sums;
  PerBlock(int64_t M, int64_t K) : K(K), levels(M * K), sums(M * (K / BLOCK)) {}
  void quantize(const float* x, int64_t r) {
    for (int64_t b = 0; b < K / BLOCK; ++b) {
      const float* xb = x + b * BLOCK;
      BlockSums& s = sums[r * (K / BLOCK) + b];
      s.scale = largest_magnitude(xb, BLOCK) / 127.0f;
      const float inverse = s.scale > 0.0f ? 1.0f / s.scale : 0.0f;
      for (int g = 0; g < 8; ++g) {
        int32_t first, second;
        levels_of(xb + g * GROUP, inverse, &levels[r * K + b * BLOCK + g * GROUP], first, second);
        s.per16[2 * g] = static_cast<int16_t>(first);
        s.per16[2 * g + 1] = static_cast<int16_t>(second);
        s.per32[g] = static_cast<int16_t>(first + second);
      }
    }
  }
};

// Q4_K: blocks of 256 inputs (144 bytes): d, dmin (fp16), 12 bytes of 6-bit scales and mins of 8 groups of 32,
// 128 bytes of 4-bit levels, 32 bytes per 64 inputs: input i in the low nibble and i + 32 in the high one.
// The weight d · sc · level − dmin · m.
struct Q4K {
  static constexpr int64_t kInputs = 256, kBytes = 144, kRows = 1;
  using Input = PerBlock;
  // the 8 scales (bytes 0-7) and 8 mins (bytes 8-15) from their 12 bytes: scales and mins 0-3 are the low 6
  // bits of bytes 0-3 and 4-7; 4-7 take their low 4 bits from the nibbles of bytes 8-11, the top 2 from the
  // top bits of bytes 0-3 (scales) and 4-7 (mins)
  static __m128i scales_and_mins(const uint8_t* s) {
    uint32_t w[3];
    std::memcpy(w, s, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x30303030;
    return _mm_setr_epi32(static_cast<int>(w[0] & low6), static_cast<int>((w[2] & low4) | ((w[0] >> 2) & top2)),
                          static_cast<int>(w[1] & low6),
                          static_cast<int>(((w[2] >> 4) & low4) | ((w[1] >> 2) & top2)));
  }
  template <int R>
  static void dot(const uint8_t* row, const PerBlock& in, int64_t r0, const float* bias, float* y, int64_t N) {
    const int64_t K = in.K, blocks = K / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0xF);
    __m256 acc[R];
    __m128 mins_acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins_acc[r] = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * kBytes;
      const float d = half_to_float(block), dmin = half_to_float(block + 2);
      const __m256i both = _mm256_cvtepu8_epi16(scales_and_mins(block + 4));  // scales 0-7, mins 0-7 as int16
      const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00);
      const __m128i mins = _mm256_extracti128_si256(both, 1);
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + half * 64));
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 48 + half * 64));
        const __m256i u[4] = {_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble),
                              _mm256_and_si256(c, nibble), _mm256_and_si256(_mm256_srli_epi16(c, 4), nibble)};
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* x = in.levels.data() + (r0 + r) * K + b * BLOCK + half * 128;
#pragma GCC unroll 4
          for (int g = 0; g < 4; ++g) {
            const int group = 4 * half + g;  // its scale, as an int16 in every lane
            const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(((2 * group + 1) << 8) | (2 * group))));
            const __m256i pairs = _mm256_maddubs_epi16(u[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * GROUP)));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scale));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const BlockSums& s = in.sums[(r0 + r) * blocks + b];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * s.scale), _mm256_cvtepi32_ps(sums[r]), acc[r]);
        const __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.per32)));
        mins_acc[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * s.scale), _mm_cvtepi32_ps(m), mins_acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * N] = sum_lanes(acc[r]) - sum_lanes(mins_acc[r]) + (bias ? *bias : 0.0f);
  }
  static float value(const uint8_t* block, int64_t i) {
    alignas(16) uint8_t sm[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(sm), scales_and_mins(block + 4));
    const int64_t part = i / 64, within = i % 64;
    const uint8_t byte = block[16 + part * 32 + within % 32];
    const int q = within < 32 ? byte & 0xF : byte >> 4;
    return half_to_float(block) * sm[i / 32] * q - half_to_float(block + 2) * sm[8 + i / 32];
  }
};

// Q4_K interleaved by 8 rows (`repack_gguf`): per 8 weight rows and 256 inputs (1184 bytes, 148 a row), the 8
// rows' d and dmin (fp16), their scales by group (8 groups × 8 rows), their mins by pair of groups (4 × 8 rows ×
// 2), then their levels: per 64 inputs and step of 4, each row's 4 bytes of them (low nibbles: inputs 4t..4t+3
// of the 64, high nibbles: those + 32). A vector then holds 4 inputs of 8 rows, multiplied by the input's 4
// levels broadcast, so its lanes are the 8 rows' outputs: 8 steps add up in 16 bits (8 · 2 · 15 · 127 fits)
// before one `madd` applies a group's scales, and no horizontal sums are left.
struct Q4Kx8 {
  static constexpr int64_t kInputs = 256, kBytes = 1184, kRows = 8;
  using Input = PerBlock;
  static constexpr int64_t kScales = 32, kMins = 96, kLevels = 160;  // offsets in a block
  template <int R>
  static void dot(const uint8_t* w, const PerBlock& in, int64_t r0, const float* bias, float* y, int64_t N) {
    const int64_t K = in.K, blocks = K / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0xF);
    // a row's byte (0-7) into both int16 lanes of that row's pair (rows 0-3 in the low half, 4-7 in the high)
    const __m256i spread = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, 4, -1, 4, -1, 5,
                                            -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + b * kBytes;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      for (int q = 0; q < 4; ++q) {
        __m256i low[R], high[R];
        for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_si256();
        const uint8_t* levels = block + kLevels + q * 256;
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(levels + t * 32));
          const __m256i u0 = _mm256_and_si256(raw, nibble), u1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const int8_t* x = in.levels.data() + (r0 + r) * K + b * BLOCK + q * 64 + t * 4;
            int32_t first, second;
            std::memcpy(&first, x, 4);
            std::memcpy(&second, x + 32, 4);
            low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(u0, _mm256_set1_epi32(first)));
            high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(u1, _mm256_set1_epi32(second)));
          }
        }
        int64_t pair_scales[2];
        std::memcpy(pair_scales, block + kScales + q * 16, 16);
        const __m256i s0 = _mm256_shuffle_epi8(_mm256_set1_epi64x(pair_scales[0]), spread);
        const __m256i s1 = _mm256_shuffle_epi8(_mm256_set1_epi64x(pair_scales[1]), spread);
        for (int r = 0; r < R; ++r)
          sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_madd_epi16(low[r], s0), _mm256_madd_epi16(high[r], s1)));
      }
      for (int r = 0; r < R; ++r) {
        const BlockSums& s = in.sums[(r0 + r) * blocks + b];
        __m256i mins = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          int32_t pair;  // the input's sums of levels of groups 2p and 2p + 1, as two int16
          std::memcpy(&pair, s.per32 + 2 * p, 4);
          const __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kMins + p * 16)));
          mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m, _mm256_set1_epi32(pair)));
        }
        const __m256 scale = _mm256_set1_ps(s.scale);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, scale), _mm256_cvtepi32_ps(sums[r]), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, scale), _mm256_cvtepi32_ps(mins), acc[r]);
      }
    }
    const __m256 add = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N, _mm256_add_ps(acc[r], add));
  }
  static float value(const uint8_t* block, int64_t j, int64_t i) {
    const int64_t group = i / 32, q = i / 64, within = i % 64, t = (within % 32) / 4;
    const uint8_t byte = block[kLevels + q * 256 + t * 32 + j * 4 + within % 4];
    const int level = within < 32 ? byte & 0xF : byte >> 4;
    const int scale = block[kScales + group * 8 + j], min = block[kMins + (group / 2) * 16 + j * 2 + group % 2];
    return half_to_float(block + 2 * j) * scale * level - half_to_float(block + 16 + 2 * j) * min;
  }
  // 8 rows' Q4_K blocks (each `row_bytes` after the last) at input block b into this layout at `out`
  static void repack(const uint8_t* rows, int64_t row_bytes, int64_t b, uint8_t* out) {
    for (int64_t j = 0; j < 8; ++j) {
      const uint8_t* block = rows + j * row_bytes + b * Q4K::kBytes;
      std::memcpy(out + 2 * j, block, 2);
      std::memcpy(out + 16 + 2 * j, block + 2, 2);
      alignas(16) uint8_t sm[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(sm), Q4K::scales_and_mins(block + 4));
      for (int g = 0; g < 8; ++g) {
        out[kScales + g * 8 + j] = sm[g];
        out[kMins + (g / 2) * 16 + j * 2 + g % 2] = sm[8 + g];
      }
      for (int q = 0; q < 4; ++q)
        for (int t = 0; t < 8; ++t) std::memcpy(out + kLevels + q * 256 + t * 32 + j * 4, block + 16 + q * 32 + t * 4, 4);
    }
  }
};

// Q6_K: blocks of 256 inputs (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit scales
// (one per 16 inputs), d (fp16). Per 128 inputs, 64 low bytes and 32 high ones: input l (0-31) takes the low
// nibble of low byte l and bits 0-1 of high byte l; l + 32 the low nibble of byte l + 32 and bits 2-3;
// l + 64 the high nibble of byte l and bits 4-5; l + 96 the high nibble of byte l + 32 and bits 6-7.
// Levels are 0..63, the weight d · scale · (level − 32).
struct Q6K {
  static constexpr int64_t kInputs = 256, kBytes = 210, kRows = 1;
  using Input = PerBlock;
  template <int R>
  static void dot(const uint8_t* row, const PerBlock& in, int64_t r0, const float* bias, float* y, int64_t N) {
    const int64_t K = in.K, blocks = K / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(0xF), top = _mm256_set1_epi8(0x30);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * kBytes;
      const float d = half_to_float(block + 208);
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
      __m256i sums[R];
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = block + half * 64;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + half * 32));
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top)),
            _mm256_or_si256(_mm256_and_si256(c, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble), _mm256_and_si256(h, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), nibble),
                            _mm256_and_si256(_mm256_srli_epi16(h, 2), top))};
        // this half's 8 scales in both lanes; group g's first 16 inputs take scale 2g, its last 16 scale 2g + 1
        const __m256i eight = half ? _mm256_permute2x128_si256(scales16, scales16, 0x11)
                                   : _mm256_permute2x128_si256(scales16, scales16, 0x00);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* x = in.levels.data() + (r0 + r) * K + b * BLOCK + half * 128;
#pragma GCC unroll 4
          for (int g = 0; g < 4; ++g) {
            const short first = static_cast<short>(((4 * g + 1) << 8) | (4 * g));
            const short second = static_cast<short>(((4 * g + 3) << 8) | (4 * g + 2));
            const __m256i scale = _mm256_shuffle_epi8(
                eight, _mm256_setr_epi16(first, first, first, first, first, first, first, first, second, second,
                                         second, second, second, second, second, second));
            const __m256i pairs = _mm256_maddubs_epi16(u[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * GROUP)));
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs, scale));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const BlockSums& s = in.sums[(r0 + r) * blocks + b];
        // the levels' offset: 32 · Σ scale · (sum of the 16 inputs' levels)
        const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.per16)));
        const __m256i dots = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(offset, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * s.scale), _mm256_cvtepi32_ps(dots), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * N] = sum_lanes(acc[r]) + (bias ? *bias : 0.0f);
  }
  static float value(const uint8_t* block, int64_t i) {
    const int64_t half = i / 128, within = i % 128, quarter = within / 32, l = within % 32;
    const uint8_t lowbyte = block[half * 64 + (quarter % 2) * 32 + l];
    const int lo = quarter < 2 ? lowbyte & 0xF : lowbyte >> 4;
    const int hi = (block[128 + half * 32 + l] >> (2 * quarter)) & 3;
    const int scale = reinterpret_cast<const int8_t*>(block + 192)[half * 8 + quarter * 2 + l / 16];
    return half_to_float(block + 208) * scale * ((lo | (hi << 4)) - 32);
  }
};

// ---- input rows quantized per 32 (the formats of 32-input blocks): per row its levels in chunks of 128 (a
// last chunk of fewer groups padded with zeros), and per chunk 16 floats: the four groups' scales twice, then
// each half-group's scale · its sum of levels, in the dots' lane order
// [g0 0-15, g1 0-15, g2 0-15, g3 0-15, g0 16-31, g1 16-31, g2 16-31, g3 16-31] (a padded group's all zero) -----
inline int64_t chunks_of(int64_t K) { return (K + CHUNK - 1) / CHUNK; }

struct PerGroup {
  int64_t K, chunks, stride;  // stride: a row's levels, padded to whole chunks
  std::vector<int8_t> levels;
  std::vector<float> lanes;
  PerGroup(int64_t M, int64_t K)
      : K(K), chunks(chunks_of(K)), stride(chunks_of(K) * CHUNK), levels(M * stride, 0), lanes(M * chunks * LANES, 0.0f) {}
  void quantize(const float* x, int64_t r) {
    for (int64_t group = 0; group < K / GROUP; ++group) {
      float* out = &lanes[(r * chunks + group / 4) * LANES];
      const int64_t g = group % 4;
      const float d = largest_magnitude(x + group * GROUP, GROUP) / 127.0f;
      int32_t first, second;
      levels_of(x + group * GROUP, d > 0.0f ? 1.0f / d : 0.0f, &levels[r * stride + group * GROUP], first, second);
      out[g] = out[4 + g] = d;
      out[8 + g] = d * static_cast<float>(first);
      out[12 + g] = d * static_cast<float>(second);
    }
  }
};

// Four floats, then the same four again: one value per group of a chunk, in the lane order of the dots
inline __m256 twice(float a, float b, float c, float d) {
  const __m128 v = _mm_set_ps(d, c, b, a);
  return _mm256_set_m128(v, v);
}

// The dot of R input rows with one weight row of a 32-input format F, whose `chunk` gives chunk c's four
// groups' levels as 32 unsigned bytes each and each half-group's step and low in the dots' lane order
template <typename F, int R>
void group_dot(const uint8_t* w, const PerGroup& in, int64_t r0, const float* bias, float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t groups = in.K / GROUP;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < in.chunks; ++c) {
    __m256i u[4];
    __m256 step, low;
    F::chunk(w, c, static_cast<int>(std::min<int64_t>(4, groups - 4 * c)), u, step, low);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = in.levels.data() + (r0 + r) * in.stride + c * CHUNK;
      __m256i v[4];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g)
        v[g] = _mm256_madd_epi16(
            F::pairs(u[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + g * GROUP))), ones);
      const __m256i dots = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
      const float* lanes = in.lanes.data() + ((r0 + r) * in.chunks + c) * LANES;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(step, _mm256_loadu_ps(lanes)), _mm256_cvtepi32_ps(dots), acc[r]);
      acc[r] = _mm256_fmadd_ps(low, _mm256_loadu_ps(lanes + 8), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N] = sum_lanes(acc[r]) + (bias ? *bias : 0.0f);
}

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
  using Input = PerGroup;
  template <int R>
  static void dot(const uint8_t* row, const PerGroup& in, int64_t r0, const float* bias, float* y, int64_t N) {
    group_dot<Small, R>(row, in, r0, bias, y, N);
  }
  static constexpr int64_t kInputs = 32, kBytes = 18 + (kMin ? 2 : 0) + (kFifth ? 4 : 0), kRows = 1;
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
  using Input = PerGroup;
  template <int R>
  static void dot(const uint8_t* row, const PerGroup& in, int64_t r0, const float* bias, float* y, int64_t N) {
    group_dot<Q80, R>(row, in, r0, bias, y, N);
  }
  static constexpr int64_t kInputs = 32, kBytes = 34, kRows = 1;
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

// y (M, N) = x (M, K) against the weight rows (+ bias): the input rows quantized as F takes them, then each
// thread's share of the weight rows (in F's groups of kRows) walked once per tile of input rows, up to 4 input
// rows at a time against each
template <typename F>
void product(const float* xs, int64_t M, int64_t K, const uint8_t* w, int64_t group_bytes, int64_t N,
             const float* b, float* ys) {
  typename F::Input in(M, K);
  kvmemory_simd::each_row(M, 8, [&](int64_t r) { in.quantize(xs + r * K, r); });
  const int64_t tile = std::max<int64_t>(MAX_ROWS, TILE_BYTES / K / MAX_ROWS * MAX_ROWS), groups = N / F::kRows;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 16)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const int64_t g0 = groups * t / n_threads, g1 = groups * (t + 1) / n_threads;
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t m1 = std::min(M, m0 + tile);
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* rows = w + g * group_bytes;
        const float* bias = b ? b + g * F::kRows : nullptr;
        for (int64_t r = m0; r < m1; r += MAX_ROWS) {
          float* y = ys + r * N + g * F::kRows;
          switch (std::min<int64_t>(MAX_ROWS, m1 - r)) {
            case 4: F::template dot<4>(rows, in, r, bias, y, N); break;
            case 3: F::template dot<3>(rows, in, r, bias, y, N); break;
            case 2: F::template dot<2>(rows, in, r, bias, y, N); break;
            default: F::template dot<1>(rows, in, r, bias, y, N); break;
          }
        }
      }
    }
  }
}

// GGML's type ids of the formats kept, and this kernel's ids of its interleaved layouts
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int64_t kInterleaved = 1000, kQ4_Kx8 = kInterleaved + kQ4_K;

template <typename Body>
auto by_type(int64_t type, Body body) {
  switch (type) {
    case kQ4_K: return body(Q4K{});
    case kQ4_Kx8: return body(Q4Kx8{});
    case kQ6_K: return body(Q6K{});
    case kQ4_0: return body(Q40{});
    case kQ4_1: return body(Q41{});
    case kQ5_0: return body(Q50{});
    case kQ5_1: return body(Q51{});
    case kQ8_0: return body(Q80{});
  }
  TORCH_CHECK(false, "GGML type ", type,
              " is not kept in blocks (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q6_K 14 are; Q4_K by 8 "
              "rows 1012)");
}

// The output features of `blocks` in the format F takes, checked against the input size K
template <typename F>
int64_t checked_features(const at::Tensor& blocks, int64_t type, int64_t K) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be a contiguous (out_features / rows per group, bytes) uint8 tensor");
  TORCH_CHECK(K > 0 && K % F::kInputs == 0, "in_features ", K, " must be a positive multiple of ", F::kInputs,
              " for GGML type ", type);
  TORCH_CHECK(blocks.size(1) == K / F::kInputs * F::kBytes, "a row of ", K, " inputs takes ",
              K / F::kInputs * F::kBytes, " bytes in GGML type ", type, ", the blocks hold ", blocks.size(1));
  return blocks.size(0) * F::kRows;
}

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type,
                       const c10::optional<at::Tensor>& bias) {
  return by_type(type, [&](auto format) {
    using F = decltype(format);
    const int64_t K = x.dim() == 2 ? x.size(1) : 0, N = checked_features<F>(blocks, type, K);
    const float* b = kvmemory_simd::checked_rows_and_bias(x, bias, N);
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    if (M > 0) product<F>(x.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), blocks.size(1), N, b, y.data_ptr<float>());
    return y;
  });
}

// The weights of `rows` (int64 indices of output features) as float32 (rows, K): embedding lookups, and the
// reference the tests check the product against
at::Tensor dequantize_gguf(const at::Tensor& blocks, int64_t type, int64_t K, const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a vector of int64 indices");
  return by_type(type, [&](auto format) {
    using F = decltype(format);
    const int64_t N = checked_features<F>(blocks, type, K), count = rows.size(0);
    at::Tensor ids = rows.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < count; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " is out of 0..", N - 1);
    at::Tensor out = at::empty({count, K}, blocks.options().dtype(at::kFloat));
    float* o = out.data_ptr<float>();
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    const int64_t group_bytes = blocks.size(1);
    kvmemory_simd::each_row(count, 16, [&](int64_t i) {
      const uint8_t* group = w + id[i] / F::kRows * group_bytes;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t* block = group + (k / F::kInputs) * F::kBytes;
        if constexpr (F::kRows == 1)
          o[i * K + k] = F::value(block, k % F::kInputs);
        else
          o[i * K + k] = F::value(block, id[i] % F::kRows, k % F::kInputs);
      }
    });
    return out;
  });
}

// (blocks of `type` interleaved by 8 rows, their type id), or the blocks as they are where no such layout
// exists for the type or the rows do not fill groups of 8
std::tuple<at::Tensor, int64_t> repack_gguf(const at::Tensor& blocks, int64_t type, int64_t K) {
  by_type(type, [&](auto format) { return checked_features<decltype(format)>(blocks, type, K); });
  const int64_t N = blocks.size(0);
  if (type != kQ4_K || N % 8 != 0) return {blocks, type};
  at::Tensor out = at::empty({N / 8, K / BLOCK * Q4Kx8::kBytes}, blocks.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), group_bytes = out.size(1);
  kvmemory_simd::each_row(N / 8, 64, [&](int64_t g) {
    for (int64_t b = 0; b < K / BLOCK; ++b) Q4Kx8::repack(w + g * 8 * row_bytes, row_bytes, b, o + g * group_bytes + b * Q4Kx8::kBytes);
  });
  return {out, kQ4_Kx8};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("linear_gguf(Tensor x, Tensor blocks, int ggml_type, Tensor? bias=None) -> Tensor");
  m.def("dequantize_gguf(Tensor blocks, int ggml_type, int in_features, Tensor rows) -> Tensor");
  m.impl("linear_gguf", c10::DispatchKey::CPU, TORCH_FN(linear_gguf));
  m.impl("dequantize_gguf", c10::DispatchKey::CPU, TORCH_FN(dequantize_gguf));
  m.def("repack_gguf(Tensor blocks, int ggml_type, int in_features) -> (Tensor, int)");
  m.impl("repack_gguf", c10::DispatchKey::CPU, TORCH_FN(repack_gguf));
}
