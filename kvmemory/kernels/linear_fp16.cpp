// A linear layer with fp16 weights on fp32 inputs, outputs and sums, for the CPU (AVX2, FMA, F16C; AVX-512
// where the CPU has it).
// See kvmemory/runtime/weights.py (PackedFp16Linear) for why it exists and when it runs.
//
// The weight is packed once into panels of 16 output columns: panel p holds rows [16p, 16p + 16) of the
// (N, K) weight transposed, K × 16 fp16 values, so a panel streams from memory in one sequential read and a
// step over k loads one 32-byte line. The product walks the panels once per tile of up to 48 input rows:
// decoding several sessions in one pass reads the weights once, where fbgemm's fp16 kernel, which blocks the
// rows by 6, streams them twice for 7 to 12 rows. A tile of several register blocks walks k in chunks, the
// blocks taking turns on each chunk, so the panels are read from memory once, under the first block's FMAs,
// and from L1 by the others (8 rows ~8% faster than block after block). Each output element is one fp32 FMA
// chain over k = 0..K-1 whatever the row count, the row block and the panels computed beside it, so a row's
// result does not depend on the other rows of its pass, nor a fused layer's on its parts' (bit for bit).
// Blocks of few rows take several panels at once to keep enough independent chains in flight. A tile of more
// than 6 rows is compute-bound, and there blocks of 2 rows against 3 panels beat blocks of up to 6 rows
// against one (same 12 accumulators, a third of the broadcasts per FMA): on a 2-core AVX2 EPYC, the default
// model's linear layers 14-17% faster for 16 rows and 20% for a 48-row prefill tile, within noise for 8 rows.
//
// On a CPU with AVX-512 the same walk runs on 16-float vectors (`Avx512` below): a panel is one vector, 32
// registers hold 8 rows against 3 panels, so a tile of up to 8 rows is one block and twice the multiply-adds
// issue per instruction. Every output is still the one fp32 FMA chain over k, so both widths give the same
// bits (`vector_bits` picks one; 0, the default, takes the widest the CPU has). Through every linear weight of
// the default model on a 2-core AVX-512 Xeon (`python -m benchmarks.fp16_linear`, both widths side by side):
// 8 rows 12.6 ms against 21.3 on 8-float vectors, 48 rows 59 against 102, one row 10.7 against 10.7.

#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"  // sixteen_floats, checked_rows_and_bias, write_panel_sums

namespace {

constexpr int64_t COLS = 16;  // output columns per panel: two 8-float vectors
constexpr int64_t TILE = 48;  // input rows per pass over the weight
constexpr int MAX_ROWS = 6;   // input rows per register block: 12 accumulators, 2 weight vectors, 1 input
constexpr int64_t WIDE_ROWS = 2, WIDE_PANELS = 3;  // the register blocks of a tile of more than MAX_ROWS rows
constexpr int64_t PREFETCH = 32;  // steps over k ahead (32 × 32 bytes)
constexpr int64_t K_CHUNK = 128;  // steps over k that the blocks of a tile take in turn (4 KB of a panel)

// One register block: R input rows against P panels (R·2P ≤ 12 accumulators c<row><vector>).
// Blocks of one panel (up to 6 rows) hold the panel's two weight vectors at k and take one input at a time.
#define ROW(i)                                           \
  if constexpr (R > i) {                                 \
    const __m256 a = _mm256_broadcast_ss(x + i * K + k); \
    c##i##0 = _mm256_fmadd_ps(a, w0, c##i##0);           \
    c##i##1 = _mm256_fmadd_ps(a, w1, c##i##1);           \
  }
#define LOAD(j) w##j = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel[0] + k * COLS + j * 8)));
// Blocks of several panels (at most 3 rows) hold their rows' inputs and take one weight vector at a time:
// holding all 2P weight vectors for every row as well would need more than AVX2's 16 registers (2 rows × 3
// panels: 12 sums, 6 weights, 1 input) and the compiler spilled, so 2 rows ran as slowly as 2 rows one by one.
#define INPUT(i) \
  const __m256 a##i = R > i ? _mm256_broadcast_ss(x + i * K + k) : z;
#define COLUMN(j)                                                                                          \
  if constexpr (2 * P > j) {                                                                               \
    const __m256 w = _mm256_cvtph_ps(                                                                      \
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel[j / 2] + k * COLS + (j % 2) * 8)));        \
    c0##j = _mm256_fmadd_ps(a0, w, c0##j);                                                                 \
    if constexpr (R > 1) c1##j = _mm256_fmadd_ps(a1, w, c1##j);                                            \
    if constexpr (R > 2) c2##j = _mm256_fmadd_ps(a2, w, c2##j);                                            \
  }
#define ZERO(i) \
  __m256 c##i##0 = z, c##i##1 = z, c##i##2 = z, c##i##3 = z, c##i##4 = z, c##i##5 = z, c##i##6 = z, c##i##7 = z;
#define STORE(i, j) \
  if constexpr (R > i && 2 * P > j) _mm256_store_ps(acc + (i * 2 * P + j) * 8, c##i##j);
#define LOAD_ACC(i, j) \
  if constexpr (R > i && 2 * P > j) c##i##j = _mm256_load_ps(acc + (i * 2 * P + j) * 8);
#define LOAD_ACC_ROW(i)                                                    \
  LOAD_ACC(i, 0) LOAD_ACC(i, 1) LOAD_ACC(i, 2) LOAD_ACC(i, 3) LOAD_ACC(i, 4) \
  LOAD_ACC(i, 5) LOAD_ACC(i, 6) LOAD_ACC(i, 7)
#define STORE_ROW(i) STORE(i, 0) STORE(i, 1) STORE(i, 2) STORE(i, 3) STORE(i, 4) STORE(i, 5) STORE(i, 6) STORE(i, 7)

// The sums of R rows of x (row stride K) against P panels from `panels` over k in [k0, k1): started from zero
// when k0 is 0, else from `acc`, and left in `acc` (R · 2P vectors) for the next steps over k or for `write_panel_sums`.
template <int R, int P>
void block(const float* x, int64_t K, const uint16_t* panels, int64_t k0, int64_t k1, float* acc) {
  // the variables stay in registers only as named scalars: GCC keeps an array of accumulators on the stack
  const __m256 z = _mm256_setzero_ps();
  ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
  if (k0 > 0) {
    LOAD_ACC_ROW(0) LOAD_ACC_ROW(1) LOAD_ACC_ROW(2) LOAD_ACC_ROW(3) LOAD_ACC_ROW(4) LOAD_ACC_ROW(5)
  }
  __m256 w0 = z, w1 = z;  // P == 1: the panel's two weight vectors at this k
  const uint16_t* panel[4] = {panels, panels + K * COLS, panels + 2 * K * COLS, panels + 3 * K * COLS};
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (P == 1) {
      // a block of many rows computes long enough per line that the hardware prefetcher falls behind: fetch a
      // kilobyte ahead (8 and 16 rows 15-18% faster on a 2-core AVX2 EPYC; prefetches past the end never fault)
      _mm_prefetch(reinterpret_cast<const char*>(panel[0] + (k + PREFETCH) * COLS), _MM_HINT_T0);
      LOAD(0) LOAD(1)
      ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    } else {
      static_assert(R <= 3, "blocks of several panels hold at most three rows' inputs");
      INPUT(0) INPUT(1) INPUT(2)
      COLUMN(0) COLUMN(1) COLUMN(2) COLUMN(3) COLUMN(4) COLUMN(5) COLUMN(6) COLUMN(7)
    }
  }
  STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

// Panels per block of `rows` input rows: enough accumulators to hide the FMA latency (rows × 2P vectors).
constexpr int panels_for(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1; }

// A block of `rows` rows against P panels (P ≤ panels_for(rows): a tile of one block is split into groups of
// panels_for(tile) panels, a tile of several blocks into groups of WIDE_PANELS), over k in [k0, k1).
template <int P>
void rows_of(int64_t rows, const float* x, int64_t K, const uint16_t* panels, int64_t k0, int64_t k1, float* acc) {
  switch (rows) {
    case 1: block<1, std::min(P, panels_for(1))>(x, K, panels, k0, k1, acc); break;
    case 2: block<2, std::min(P, panels_for(2))>(x, K, panels, k0, k1, acc); break;
    case 3: block<3, std::min(P, panels_for(3))>(x, K, panels, k0, k1, acc); break;
    case 4: block<4, 1>(x, K, panels, k0, k1, acc); break;
    case 5: block<5, 1>(x, K, panels, k0, k1, acc); break;
    default: block<6, 1>(x, K, panels, k0, k1, acc); break;
  }
}

// How a tile's rows and panels split into register blocks on one vector width (the driver `product` below).
struct Avx2 {
  static constexpr int64_t kMaxRows = MAX_ROWS, kWideRows = WIDE_ROWS, kWidePanels = WIDE_PANELS;
  static constexpr int64_t kBlockFloats = 12 * 8;  // a block's sums: 12 accumulators whatever its rows and panels
  static constexpr int panels_for(int64_t rows) { return ::panels_for(rows); }
  template <int P>
  static void rows_of(int64_t rows, const float* x, int64_t K, const uint16_t* panels, int64_t k0, int64_t k1,
                      float* acc) {
    ::rows_of<P>(rows, x, K, panels, k0, k1, acc);
  }
};

// ---- AVX-512: a panel of 16 columns is one vector --------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")

#define W512(j) \
  if constexpr (P > j) w##j = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel[j] + k * COLS)));
#define FMA512(i)                                       \
  if constexpr (R > i) {                                \
    const __m512 a = _mm512_set1_ps(x[i * K + k]);      \
    c##i##0 = _mm512_fmadd_ps(a, w0, c##i##0);          \
    if constexpr (P > 1) c##i##1 = _mm512_fmadd_ps(a, w1, c##i##1); \
    if constexpr (P > 2) c##i##2 = _mm512_fmadd_ps(a, w2, c##i##2); \
    if constexpr (P > 3) c##i##3 = _mm512_fmadd_ps(a, w3, c##i##3); \
  }
#define ZERO512(i) __m512 c##i##0 = z, c##i##1 = z, c##i##2 = z, c##i##3 = z;
#define ACC512(i, j) (acc + (i * P + j) * COLS)
#define LOAD512(i, j) \
  if constexpr (R > i && P > j) c##i##j = _mm512_load_ps(ACC512(i, j));
#define STORE512(i, j) \
  if constexpr (R > i && P > j) _mm512_store_ps(ACC512(i, j), c##i##j);
#define EACH512(OP, i) OP(i, 0) OP(i, 1) OP(i, 2) OP(i, 3)
#define ALL512(OP) \
  EACH512(OP, 0) EACH512(OP, 1) EACH512(OP, 2) EACH512(OP, 3) EACH512(OP, 4) EACH512(OP, 5) EACH512(OP, 6) EACH512(OP, 7)

// `block` on 16-float vectors: R rows (at most 8) against P panels (at most 4, R·P ≤ 24 accumulators), the
// panels' vectors at k held while each row's input is broadcast against them.
template <int R, int P>
void block512(const float* x, int64_t K, const uint16_t* panels, int64_t k0, int64_t k1, float* acc) {
  static_assert(R * P <= 24 && P <= 4, "32 registers: the sums, the panels' vectors and an input");
  const __m512 z = _mm512_setzero_ps();
  ZERO512(0) ZERO512(1) ZERO512(2) ZERO512(3) ZERO512(4) ZERO512(5) ZERO512(6) ZERO512(7)
  if (k0 > 0) {
    ALL512(LOAD512)
  }
  __m512 w0 = z, w1 = z, w2 = z, w3 = z;
  const uint16_t* panel[4] = {panels, panels + K * COLS, panels + 2 * K * COLS, panels + 3 * K * COLS};
  for (int64_t k = k0; k < k1; ++k) {
    // as in `block`, a kilobyte ahead: here even 1 and 2 rows gain (the 1-row product 6% faster on a 2-core
    // AVX-512 Xeon), and a 2-row block's panels at 2 steps a line would otherwise wait on the prefetcher
    for (int j = 0; j < P; ++j) _mm_prefetch(reinterpret_cast<const char*>(panel[j] + (k + PREFETCH) * COLS), _MM_HINT_T0);
    W512(0) W512(1) W512(2) W512(3)
    FMA512(0) FMA512(1) FMA512(2) FMA512(3) FMA512(4) FMA512(5) FMA512(6) FMA512(7)
  }
  ALL512(STORE512)
}

constexpr int panels_for512(int64_t rows) { return rows <= 4 ? 4 : 3; }

struct Avx512 {
  static constexpr int64_t kMaxRows = 8, kWideRows = 8, kWidePanels = 3;
  static constexpr int64_t kBlockFloats = 24 * 16;
  static constexpr int panels_for(int64_t rows) { return panels_for512(rows); }
  template <int P>
  static void rows_of(int64_t rows, const float* x, int64_t K, const uint16_t* panels, int64_t k0, int64_t k1,
                      float* acc) {
    switch (rows) {
      case 1: block512<1, std::min(P, panels_for512(1))>(x, K, panels, k0, k1, acc); break;
      case 2: block512<2, std::min(P, panels_for512(2))>(x, K, panels, k0, k1, acc); break;
      case 3: block512<3, std::min(P, panels_for512(3))>(x, K, panels, k0, k1, acc); break;
      case 4: block512<4, std::min(P, panels_for512(4))>(x, K, panels, k0, k1, acc); break;
      case 5: block512<5, std::min(P, panels_for512(5))>(x, K, panels, k0, k1, acc); break;
      case 6: block512<6, std::min(P, panels_for512(6))>(x, K, panels, k0, k1, acc); break;
      case 7: block512<7, std::min(P, panels_for512(7))>(x, K, panels, k0, k1, acc); break;
      default: block512<8, std::min(P, panels_for512(8))>(x, K, panels, k0, k1, acc); break;
    }
  }
};

#pragma GCC pop_options

// y (M, N) = x (M, K) against the packed panels (+ bias), in tiles of up to TILE rows, each tile's rows in
// register blocks as `Isa` splits them.
template <typename Isa>
void product(const float* xs, int64_t M, int64_t K, const uint16_t* ws, int64_t panels, int64_t N, const float* b,
             float* ys) {
  // OpenMP directly, as in decode_attention.cpp (at::parallel_for's inline setup would reset the team size)
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels)));
#pragma omp parallel num_threads(threads)
  for (int64_t m0 = 0; m0 < M; m0 += TILE) {
    const int64_t tile = std::min(TILE, M - m0);
    const int64_t blocks = tile > Isa::kMaxRows ? (tile + Isa::kWideRows - 1) / Isa::kWideRows : 1;
    const int64_t step = blocks == 1 ? Isa::panels_for(tile) : Isa::kWidePanels;  // panels per group
#pragma omp for schedule(static)
    for (int64_t group = 0; group < (panels + step - 1) / step; ++group) {
      const int64_t p = group * step, here = std::min(step, panels - p), cols = std::min(here * COLS, N - p * COLS);
      const uint16_t* from = ws + p * K * COLS;
      alignas(64) float acc[TILE / Isa::kWideRows][Isa::kBlockFloats];  // per block: its sums so far
      int64_t first[TILE / Isa::kWideRows], count[TILE / Isa::kWideRows];
      for (int64_t done = 0, left = blocks, i = 0; left > 0; --left, ++i) {
        count[i] = (tile - done) / left;  // the tile's rows split into blocks as even as can be
        first[i] = done;
        done += count[i];
      }
      // every block of the tile takes its turn on a chunk of k while the chunk is in L1: the panels stream from
      // memory once, under the first block's FMAs, instead of once per block
      const int64_t chunk = blocks == 1 ? std::max<int64_t>(K, 1) : K_CHUNK;
      int64_t k0 = 0;
      do {  // at least once: with no inputs (K = 0) the sums are the zeros the blocks start from
        const int64_t k1 = std::min(K, k0 + chunk);
        for (int64_t i = 0; i < blocks; ++i) {
          const float* xr = xs + (m0 + first[i]) * K;
          switch (here) {
            case 4: Isa::template rows_of<4>(count[i], xr, K, from, k0, k1, acc[i]); break;
            case 3: Isa::template rows_of<3>(count[i], xr, K, from, k0, k1, acc[i]); break;
            case 2: Isa::template rows_of<2>(count[i], xr, K, from, k0, k1, acc[i]); break;
            default: Isa::template rows_of<1>(count[i], xr, K, from, k0, k1, acc[i]); break;
          }
        }
        k0 = k1;
      } while (k0 < K);
      for (int64_t i = 0; i < blocks; ++i)
        kvmemory_simd::write_panel_sums(acc[i], count[i], here, b ? b + p * COLS : nullptr,
                                        ys + (m0 + first[i]) * N + p * COLS, N, cols);
    }
  }
}

at::Tensor pack_fp16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be (out_features, in_features), got ", weight.dim(), " dims");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + COLS - 1) / COLS;
  at::Tensor padded = at::zeros({panels * COLS, K}, weight.options().dtype(at::kHalf));
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, COLS, K}).transpose(1, 2).contiguous();
}

at::Tensor linear_fp16(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const c10::optional<at::Tensor>& bias, int64_t vector_bits) {
  const float* b = kvmemory_simd::checked_rows_and_bias(x, bias, N);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == COLS && packed.scalar_type() == at::kHalf &&
                  packed.is_contiguous(),
              "packed must be a contiguous (panels, in_features, 16) float16 tensor from pack_fp16_weight");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the packed weight ", packed.size(1));
  TORCH_CHECK(N > (panels - 1) * COLS && N <= panels * COLS, "out_features ", N, " does not fill ", panels, " panels");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  if (kvmemory_simd::sixteen_floats(vector_bits))
    product<Avx512>(xs, M, K, ws, panels, N, b, y.data_ptr<float>());
  else
    product<Avx2>(xs, M, K, ws, panels, N, b, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmemory, m) {
  m.def("pack_fp16_weight(Tensor weight) -> Tensor");
  m.def("linear_fp16(Tensor x, Tensor packed, int out_features, Tensor? bias=None, int vector_bits=0) -> Tensor");
  m.impl("pack_fp16_weight", c10::DispatchKey::CPU, TORCH_FN(pack_fp16_weight));
  m.impl("linear_fp16", c10::DispatchKey::CPU, TORCH_FN(linear_fp16));
  // the width `vector_bits=0` takes here: what benchmarks and tests report and compare against
  m.def("linear_fp16_vector_bits() -> int",
        [] { return static_cast<int64_t>(kvmemory_simd::has_avx512() ? 512 : 256); });
}
