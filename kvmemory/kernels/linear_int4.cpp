// A linear layer with 4-bit weights on fp32 inputs, outputs and sums, for the CPU (AVX2, FMA; AVX-512 where
// the CPU has it). See kvmemory/runtime/weights.py (PackedInt4Linear) for why it exists and when it runs.
//
// Weights come as GGUF Q4_1 stores them: per output column and group of 32 inputs, levels q in 0..15, a step
// and a low value, w = q * step + low, the step and low in fp16. They are packed once into panels of 16 output
// columns: per panel the levels of inputs k and k + 1 share a byte (k in the low nibble), 16 bytes a pair of
// inputs, and per group its 16 steps then its 16 lows in fp16, so a Q4_1 file's values come back exactly and
// a weight costs what it costs in the file (0.625 bytes).
//
// The product walks the panels once per tile of up to 48 input rows. A decode tile (one register block: up to 8
// rows on AVX-512) widens each weight in registers as it uses it (one fused multiply-add per weight); a larger
// tile, or any on AVX2, widens a chunk of inputs of each panel into an fp32 buffer in L1, which every register
// block of the tile's rows then reads. A weight is thus read from memory once per pass whatever the number of
// sessions decoding in it, as in linear_fp16.cpp, at 0.31 of fp16's bytes. Each output element is one
// fp32 FMA chain over k = 0..K-1 whatever the row count and the panels beside it, so a row's result does not
// depend on the other rows of its pass, nor a fused layer's on its parts' (bit for bit); the 8- and 16-float
// paths widen each weight by the same fused multiply-add and sum in the same order, so they agree bit for bit.

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "simd.h"  // sixteen_floats, checked_rows_and_bias, write_panel_sums

namespace {

constexpr int64_t COLS = 16;     // output columns per panel
constexpr int64_t GROUP = 32;    // inputs per step and low (Q4_1's block)
constexpr int64_t TILE = 48;     // input rows per walk over the weight
constexpr int64_t K_CHUNK = 64;  // inputs widened at a time: up to 8 panels' chunks (32 KB) stay in L1
constexpr int kMaxPanels = 8;

// Panels per register block of `rows` rows: enough independent FMA chains for few rows, at most 24 sums
constexpr int panels_for(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 6 : rows <= 4 ? 4 : 3; }
constexpr int64_t kMaxBlockRows = 8;
// Panels per group of a decode tile widened in registers (AVX-512): each panel's step and low held beside the sums
constexpr int fused_panels(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 3 : 2; }

// ---- 8-float vectors (AVX2): a panel's 16 columns are two vectors -------------------------------------
// Widen inputs [k0, k1) of one panel into out[(k - k0) * 16 + c] = q * step + low.
void widen_avx2(const uint8_t* levels, const uint16_t* scales, int64_t k0, int64_t k1, float* out) {
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* group = scales + (k / GROUP) * 2 * COLS;  // 16 steps, then 16 lows
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels + k / 2 * COLS + half * 8)));
      const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + half * 8)));
      const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + COLS + half * 8)));
      const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low_nibble));
      const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
      _mm256_storeu_ps(out + (k - k0) * COLS + half * 8, _mm256_fmadd_ps(even, step, low));
      _mm256_storeu_ps(out + (k + 1 - k0) * COLS + half * 8, _mm256_fmadd_ps(odd, step, low));
    }
  }
}

// acc[r][v] (+)= sum over k of x[r, k] * w[p][k][v] for R rows and P panels (2P vectors) over a widened chunk
template <int R, int P>
void block_avx2(const float* x, int64_t K, const float* w, int64_t chunk, int64_t k0, float* acc, bool first) {
  static_assert(R * 2 * P <= 12, "16 registers: the sums, a weight vector and an input");
  __m256 c[R][2 * P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 2 * P; ++v) c[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (r * 2 * P + v) * 8);
  for (int64_t k = 0; k < chunk; ++k) {
    __m256 a[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r] = _mm256_broadcast_ss(x + r * K + k0 + k);
#pragma GCC unroll 16
    for (int v = 0; v < 2 * P; ++v) {
      const __m256 wv = _mm256_loadu_ps(w + ((v / 2) * K_CHUNK + k) * COLS + (v % 2) * 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) c[r][v] = _mm256_fmadd_ps(a[r], wv, c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < 2 * P; ++v) _mm256_storeu_ps(acc + (r * 2 * P + v) * 8, c[r][v]);
}

struct Avx2 {
  static constexpr int panels_for(int64_t rows) { return rows <= 2 ? 3 : 2; }
  static constexpr int64_t kMaxRows = 3;
  static constexpr bool kFused = false;  // 16 registers hold too little to widen in them beside the sums
  static void widen(const uint8_t* levels, const uint16_t* scales, int64_t k0, int64_t k1, float* out) {
    widen_avx2(levels, scales, k0, k1, out);
  }
  template <int P>
  static void rows_of(int64_t rows, const float* x, int64_t K, const float* w, int64_t chunk, int64_t k0,
                      float* acc, bool first) {
    switch (rows) {
      case 1: block_avx2<1, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
      case 2: block_avx2<2, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
      default: block_avx2<3, std::min(P, 2)>(x, K, w, chunk, k0, acc, first); break;
    }
  }
};

// ---- 16-float vectors (AVX-512): a panel is one vector ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

void widen_avx512(const uint8_t* levels, const uint16_t* scales, int64_t k0, int64_t k1, float* out) {
  const __m512i low_nibble = _mm512_set1_epi32(0xF);
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* group = scales + (k / GROUP) * 2 * COLS;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(levels + k / 2 * COLS)));
    const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + COLS)));
    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    _mm512_storeu_ps(out + (k - k0) * COLS, _mm512_fmadd_ps(even, step, low));
    _mm512_storeu_ps(out + (k + 1 - k0) * COLS, _mm512_fmadd_ps(odd, step, low));
  }
}

template <int R, int P>
void block_avx512(const float* x, int64_t K, const float* w, int64_t chunk, int64_t k0, float* acc, bool first) {
  static_assert(R * P <= 24, "32 registers: the sums, the panels' vectors and an input");
  __m512 c[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) c[r][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (r * P + p) * COLS);
  for (int64_t k = 0; k < chunk; ++k) {
    __m512 wv[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_ps(w + (p * K_CHUNK + k) * COLS);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k0 + k]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) c[r][p] = _mm512_fmadd_ps(a, wv[p], c[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(acc + (r * P + p) * COLS, c[r][p]);
}

// A decode tile (at most 8 rows) widens each weight in registers as it uses it, with no buffer: R rows
// against P panels over all of k, the same multiply-adds in the same order as widen + block above.
template <int R, int P>
void fused_block512(const float* x, int64_t K, const uint8_t* levels, const uint16_t* scales, float* acc) {
  static_assert(R * P + 2 * P <= 28, "32 registers: the sums, each panel's step and low, a level pair and an input");
  const __m512i low_nibble = _mm512_set1_epi32(0xF);
  __m512 c[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) c[r][p] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += GROUP) {
    __m512 step[P], low[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const uint16_t* group = scales + (p * (K / GROUP) + k0 / GROUP) * 2 * COLS;
      step[p] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)));
      low[p] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + COLS)));
    }
    for (int64_t k = k0; k < k0 + GROUP; k += 2) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(levels + (p * (K / 2) + k / 2) * COLS)));
        const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_nibble)), step[p], low[p]);
        const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), step[p], low[p]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          c[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), even, c[r][p]);
          c[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k + 1]), odd, c[r][p]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(acc + (r * P + p) * COLS, c[r][p]);
}

struct Avx512 {
  static constexpr int panels_for(int64_t rows) { return ::panels_for(rows); }
  static constexpr int64_t kMaxRows = kMaxBlockRows;
  static constexpr bool kFused = true;
  template <int P>
  static void fused(int64_t rows, const float* x, int64_t K, const uint8_t* levels, const uint16_t* scales, float* acc) {
    switch (rows) {
      case 1: fused_block512<1, std::min(P, 4)>(x, K, levels, scales, acc); break;
      case 2: fused_block512<2, std::min(P, 4)>(x, K, levels, scales, acc); break;
      case 3: fused_block512<3, std::min(P, 3)>(x, K, levels, scales, acc); break;
      case 4: fused_block512<4, std::min(P, 3)>(x, K, levels, scales, acc); break;
      case 5: fused_block512<5, std::min(P, 2)>(x, K, levels, scales, acc); break;
      case 6: fused_block512<6, std::min(P, 2)>(x, K, levels, scales, acc); break;
      case 7: fused_block512<7, std::min(P, 2)>(x, K, levels, scales, acc); break;
      default: fused_block512<8, std::min(P, 2)>(x, K, levels, scales, acc); break;
    }
  }
  static void widen(const uint8_t* levels, const uint16_t* scales, int64_t k0, int64_t k1, float* out) {
    widen_avx512(levels, scales, k0, k1, out);
  }
  template <int P>
  static void rows_of(int64_t rows, const float* x, int64_t K, const float* w, int64_t chunk, int64_t k0,
                      float* acc, bool first) {
    switch (rows) {
      case 1: block_avx512<1, std::min(P, 8)>(x, K, w, chunk, k0, acc, first); break;
      case 2: block_avx512<2, std::min(P, 6)>(x, K, w, chunk, k0, acc, first); break;
      case 3: block_avx512<3, std::min(P, 4)>(x, K, w, chunk, k0, acc, first); break;
      case 4: block_avx512<4, std::min(P, 4)>(x, K, w, chunk, k0, acc, first); break;
      case 5: block_avx512<5, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
      case 6: block_avx512<6, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
      case 7: block_avx512<7, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
      default: block_avx512<8, std::min(P, 3)>(x, K, w, chunk, k0, acc, first); break;
    }
  }
};

#pragma GCC pop_options

// y (M, N) = x (M, K) against the packed panels (+ bias), a tile of rows at a time, its panels in groups
// split over the threads. A decode tile (one register block) widens in registers where the vectors allow;
// a larger one widens each group's chunk of k into `wide` once, for all its register blocks.
template <typename Isa>
void product(const float* xs, int64_t M, int64_t K, const uint8_t* levels, const uint16_t* scales, int64_t panels,
             int64_t N, const float* b, float* ys) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels)));
#pragma omp parallel num_threads(threads)
  for (int64_t m0 = 0; m0 < M; m0 += TILE) {
    const int64_t tile = std::min(TILE, M - m0);
    const bool fused = Isa::kFused && tile <= Isa::kMaxRows;
    const int64_t blocks = (tile + Isa::kMaxRows - 1) / Isa::kMaxRows;
    const int64_t block_rows = (tile + blocks - 1) / blocks;
    const int64_t step = fused ? fused_panels(tile) : Isa::panels_for(block_rows);  // panels per group
#pragma omp for schedule(static)
    for (int64_t group = 0; group < (panels + step - 1) / step; ++group) {
      const int64_t p = group * step, here = std::min(step, panels - p), cols = std::min(here * COLS, N - p * COLS);
      const uint8_t* group_levels = levels + p * (K / 2) * COLS;
      const uint16_t* group_scales = scales + p * (K / GROUP) * 2 * COLS;
      alignas(64) float acc[TILE][kMaxPanels * COLS];  // per row of the tile: its block's sums from there on
      if constexpr (Isa::kFused) {
        if (fused) {
          switch (here) {
            case 4: Isa::template fused<4>(tile, xs + m0 * K, K, group_levels, group_scales, acc[0]); break;
            case 3: Isa::template fused<3>(tile, xs + m0 * K, K, group_levels, group_scales, acc[0]); break;
            case 2: Isa::template fused<2>(tile, xs + m0 * K, K, group_levels, group_scales, acc[0]); break;
            default: Isa::template fused<1>(tile, xs + m0 * K, K, group_levels, group_scales, acc[0]); break;
          }
          kvmemory_simd::write_panel_sums(acc[0], tile, here, b ? b + p * COLS : nullptr, ys + m0 * N + p * COLS, N,
                                          cols);
          continue;
        }
      }
      alignas(64) float wide[kMaxPanels * K_CHUNK * COLS];
      for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        const int64_t k1 = std::min(K, k0 + K_CHUNK);
        for (int64_t j = 0; j < here; ++j)
          Isa::widen(group_levels + j * (K / 2) * COLS, group_scales + j * (K / GROUP) * 2 * COLS, k0, k1,
                     wide + j * K_CHUNK * COLS);
        for (int64_t first = 0; first < tile; first += block_rows) {
          const int64_t rows = std::min(block_rows, tile - first);
          const float* xr = xs + (m0 + first) * K;
          switch (here) {
            case 8: Isa::template rows_of<8>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 7: Isa::template rows_of<7>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 6: Isa::template rows_of<6>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 5: Isa::template rows_of<5>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 4: Isa::template rows_of<4>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 3: Isa::template rows_of<3>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            case 2: Isa::template rows_of<2>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
            default: Isa::template rows_of<1>(rows, xr, K, wide, k1 - k0, k0, acc[first], k0 == 0); break;
          }
        }
      }
      for (int64_t first = 0; first < tile; first += block_rows) {
        const int64_t rows = std::min(block_rows, tile - first);
        kvmemory_simd::write_panel_sums(acc[first], rows, here, b ? b + p * COLS : nullptr,
                                        ys + (m0 + first) * N + p * COLS, N, cols);
      }
    }
  }
}

// (levels (N, K) in 0..15, steps and lows (N, K / 32)) -> (packed levels (panels, K / 2, 16) uint8, steps and
// lows (panels, K / 32, 2, 16) rounded to fp16)
std::tuple<at::Tensor, at::Tensor> pack_int4_weight(const at::Tensor& levels, const at::Tensor& steps,
                                                    const at::Tensor& lows) {
  TORCH_CHECK(levels.dim() == 2 && levels.size(1) % GROUP == 0 && levels.size(1) > 0,
              "levels must be (out_features, in_features) with in_features a positive multiple of 32");
  const int64_t N = levels.size(0), K = levels.size(1), panels = (N + COLS - 1) / COLS, groups = K / GROUP;
  TORCH_CHECK(steps.sizes() == at::IntArrayRef({N, groups}) && lows.sizes() == steps.sizes(),
              "steps and lows must be (out_features, in_features / 32)");
  TORCH_CHECK(levels.min().item<int64_t>() >= 0 && levels.max().item<int64_t>() <= 15, "levels must lie in 0..15");
  at::Tensor q = at::zeros({panels * COLS, K}, levels.options().dtype(at::kByte));
  q.narrow(0, 0, N).copy_(levels);
  q = q.view({panels, COLS, K / 2, 2}).permute({0, 2, 1, 3});  // (panels, K / 2, 16, pair)
  at::Tensor packed = q.select(3, 1).mul(16).add(q.select(3, 0)).contiguous();  // input k + 1 in the high nibble
  at::Tensor scales = at::zeros({panels * COLS, groups, 2}, steps.options().dtype(at::kHalf));
  scales.narrow(0, 0, N).select(2, 0).copy_(steps);
  scales.narrow(0, 0, N).select(2, 1).copy_(lows);
  scales = scales.view({panels, COLS, groups, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed, scales};
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                       const c10::optional<at::Tensor>& bias, int64_t vector_bits) {
  const float* b = kvmemory_simd::checked_rows_and_bias(x, bias, N);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == COLS && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be a contiguous (panels, in_features / 2, 16) uint8 tensor from pack_int4_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && K % GROUP == 0, "x has ", K, " features, the packed weight ", packed.size(1) * 2);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == panels && scales.size(1) == K / GROUP && scales.size(2) == 2 &&
                  scales.size(3) == COLS && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be a contiguous (panels, in_features / 32, 2, 16) float16 tensor from pack_int4_weight");
  TORCH_CHECK(N > (panels - 1) * COLS && N <= panels * COLS, "out_features ", N, " does not fill ", panels, " panels");
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* levels = packed.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  if (kvmemory_simd::sixteen_floats(vector_bits))
    product<Avx512>(x.data_ptr<float>(), M, K, levels, s, panels, N, b, y.data_ptr<float>());
  else
    product<Avx2>(x.data_ptr<float>(), M, K, levels, s, panels, N, b, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("pack_int4_weight(Tensor levels, Tensor steps, Tensor lows) -> (Tensor, Tensor)");
  m.def("linear_int4(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias=None, int vector_bits=0) -> Tensor");
  m.impl("pack_int4_weight", c10::DispatchKey::CPU, TORCH_FN(pack_int4_weight));
  m.impl("linear_int4", c10::DispatchKey::CPU, TORCH_FN(linear_int4));
}
