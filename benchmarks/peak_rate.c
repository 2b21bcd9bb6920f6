/* The machine's peak multiply-add rates, measured: independent chains of the widest integer (u8 x s8 pairs
 * summed into s16, as maddubs does: what int8 dot products are built of on x86 without VNNI) and fp32 fused
 * multiply-add instructions, enough chains to cover each instruction's latency, nothing read from memory. One
 * call runs `steps` rounds of CHAINS instructions on the calling thread; benchmarks/peak_rate.py times it on
 * every thread at once. The values computed mean nothing; the result only keeps the compiler from dropping
 * the loop. */
#include <immintrin.h>

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define CHAIN_COUNT 12

#if defined(__AVX512BW__)
typedef __m512i ivec;
typedef __m512 fvec;
#define ISET(c) _mm512_set1_epi8(c)
#define IMAC(a, b) _mm512_maddubs_epi16(a, b)
#define IFOLD(s, a) _mm512_xor_si512(s, a)
#define IFIRST(s) _mm_cvtsi128_si32(_mm512_castsi512_si128(s))
#define FSET(x) _mm512_set1_ps(x)
#define FMAC(a, b, d) _mm512_fmadd_ps(a, b, d)
#define FFOLD(s, a) _mm512_add_ps(s, a)
#define FFIRST(s) _mm512_cvtss_f32(s)
#else
typedef __m256i ivec;
typedef __m256 fvec;
#define ISET(c) _mm256_set1_epi8(c)
#define IMAC(a, b) _mm256_maddubs_epi16(a, b)
#define IFOLD(s, a) _mm256_xor_si256(s, a)
#define IFIRST(s) _mm_cvtsi128_si32(_mm256_castsi256_si128(s))
#define FSET(x) _mm256_set1_ps(x)
#define FMAC(a, b, d) _mm256_fmadd_ps(a, b, d)
#define FFOLD(s, a) _mm256_add_ps(s, a)
#define FFIRST(s) _mm256_cvtss_f32(s)
#endif

int chain_count(void) { return CHAIN_COUNT; }

/* multiply-adds in one instruction of each kind */
int int8_lanes(void) { return sizeof(ivec); }
int fp32_lanes(void) { return sizeof(fvec) / sizeof(float); }

int int8_rounds(long steps) {
  const ivec b = ISET(3);
#define I_INIT(c) ivec a##c = ISET(c);
#define I_STEP(c) a##c = IMAC(a##c, b);
#define I_FOLD(c) s = IFOLD(s, a##c);
  CHAINS(I_INIT)
  for (long i = 0; i < steps; i++) {
    CHAINS(I_STEP)
  }
  ivec s = ISET(0);
  CHAINS(I_FOLD)
  return IFIRST(s);
}

float fp32_rounds(long steps) {
  const fvec b = FSET(0.999f), d = FSET(1e-3f);
#define F_INIT(c) fvec f##c = FSET(c);
#define F_STEP(c) f##c = FMAC(f##c, b, d);
#define F_FOLD(c) s = FFOLD(s, f##c);
  CHAINS(F_INIT)
  for (long i = 0; i < steps; i++) {
    CHAINS(F_STEP)
  }
  fvec s = FSET(0.0f);
  CHAINS(F_FOLD)
  return FFIRST(s);
}
