"""One row as integer digits for the one-row Q4_1 products where the CPU has AVX2 but not
AVX512-VNNI.

:mod:`kvtier.model.packed_digits` explains the digits: each block of 32 values of the row gets
the scale ``s = max|x| / 127``, and ``v = x / s`` is written as three signed base-256 digits
``X0 + X1 / 256 + X2 / 65536``, which hold ``x`` to within ``2^-24`` of its block's largest
value; the integer sums of the codes times each digit are exact, and

    y = sum_g d_g s_g 2^-16 S_g + sum_g m_g sum(x in block g).

This is the same arithmetic in 256-bit registers, with the same digits in the same layout (so
:func:`q4_1_digits_back` and the tests serve both). ``vpmaddubsw`` multiplies the unsigned
codes by a digit and adds pairs into 16-bit lanes (at most ``2 * 15 * 128``, no saturation);
the low and high nibbles' pairs are added (at most ``7680``), ``vpmaddwd`` by ones makes 32-bit
lanes of four codes of a block each, and the three digits' lanes meet with two shifts, at most
about ``2^30``, exactly, as the VNNI loop's. A pair of blocks fills a register: lanes 0-3 hold
the first block's sums, 4-7 the second's, each taken times ``d s 2^-16`` of its block.

Why: without VNNI the float32 loop converts every code to a float and spends two multiply-adds
a weight, and it is those instructions, not memory, that bound it: on the 2-core first-generation
Zen box (whose 256-bit instructions run as two 128-bit halves) a Q4_1 weight already in the L2
cache streamed at 2.8 GB/s. The digits take nine integer multiplies a pair of blocks and output
where the float32 loop took sixteen multiply-adds and eight conversions (benchmarks/RESULTS.md,
2026-12-05, for what that bought).

Q8_0 (the default model's LM head) keeps its float32 loop here: its codes are signed, and
``vpmaddubsw`` multiplies unsigned bytes by signed ones into 16-bit lanes, which the codes made
unsigned (``c + 128``) times a signed digit would overflow; digits narrow enough not to
(``|X| <= 63``) need four of them for float32's resolution, more multiplies than the float32
loop's.

Compiled into :mod:`kvtier.model.packed_kernels`' source after the VNNI loops, for a build with
AVX2, FMA and F16C but without AVX512F (``KV_AVX2``); ``PackedKernels.digits`` names the formats
a build takes as digits.
"""

from __future__ import annotations

__all__: list[str] = []

_C_SOURCE = r"""
#if defined(KV_AVX2) && !defined(KV_NO_DIGITS)
#define KV_DIGITS 1
/* v (8 values within +-127) as three base-256 digits d0 + d1 / 256 + d2 / 65536 (__m256i), each
   rounded to nearest (even on a tie), a lower digit that reaches 128 becoming -128 and carrying
   one up: the VNNI loop's digits for Q4_1, bit for bit. (cmpeq gives -1 where it holds, so
   subtracting it carries the one.) */
#define KV_BASE256_DIGITS8(v, d0, d1, d2) do {                                                   \
    const __m256 f0_ = _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);      \
    const __m256 r0_ = _mm256_mul_ps(_mm256_sub_ps((v), f0_), _mm256_set1_ps(256.f));             \
    const __m256 f1_ = _mm256_round_ps(r0_, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);      \
    const __m256 r1_ = _mm256_mul_ps(_mm256_sub_ps(r0_, f1_), _mm256_set1_ps(256.f));             \
    const __m256i top_ = _mm256_set1_epi32(128), i256_ = _mm256_set1_epi32(256);                  \
    d0 = _mm256_cvtps_epi32(f0_); d1 = _mm256_cvtps_epi32(f1_); d2 = _mm256_cvtps_epi32(r1_);    \
    __m256i c_ = _mm256_cmpeq_epi32(d2, top_);                                                    \
    d2 = _mm256_sub_epi32(d2, _mm256_and_si256(c_, i256_));                                       \
    d1 = _mm256_sub_epi32(d1, c_);                                                                \
    c_ = _mm256_cmpeq_epi32(d1, top_);                                                            \
    d1 = _mm256_sub_epi32(d1, _mm256_and_si256(c_, i256_));                                       \
    d0 = _mm256_sub_epi32(d0, c_);                                                                \
  } while (0)

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

/* 16 int32 (a, then b) within int8's range as 16 bytes in order */
static inline __m128i bytes16(__m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/* the VNNI loop's row_factor: 2^64 where the row's largest |x| is below 2^-64, else 1 */
static inline float row_factor(const float* x, int64_t K) {
  __m256 m = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) m = _mm256_max_ps(m, abs8(_mm256_loadu_ps(x + k)));
  return hmax8(m) < 0x1p-64f ? 0x1p64f : 1.f;
}

/* x [K] as three digits a value in the group layout of the VNNI loop's q4_1_digits, with its
   scales (each block's s 2^-16, four times) and float32 sums; returns row_factor's inverse */
static inline float q4_1_digits(const float* x, int64_t K, int8_t* digits, float* scales, float* sums) {
  const int64_t G = K / 32;
  const float f = row_factor(x, K);
  const __m256 fv = _mm256_set1_ps(f);
  for (int64_t g = 0; g < G; g++) {
    __m256 xv[4];
    for (int i = 0; i < 4; i++) xv[i] = _mm256_mul_ps(_mm256_loadu_ps(x + g * 32 + 8 * i), fv);
    const float mx = hmax8(_mm256_max_ps(_mm256_max_ps(abs8(xv[0]), abs8(xv[1])),
                                         _mm256_max_ps(abs8(xv[2]), abs8(xv[3]))));
    const __m256 inv = _mm256_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const int64_t nb = G - g / 4 * 4 < 4 ? G - g / 4 * 4 : 4;  /* blocks in this group */
    int8_t* at = digits + g / 4 * 384 + g % 4 * 16;
    for (int h = 0; h < 2; h++) {  /* elements 0-15, then 16-31 */
      __m256i a0, a1, a2, b0, b1, b2;
      KV_BASE256_DIGITS8(_mm256_mul_ps(xv[2 * h], inv), a0, a1, a2);
      KV_BASE256_DIGITS8(_mm256_mul_ps(xv[2 * h + 1], inv), b0, b1, b2);
      int8_t* half = at + h * nb * 16;
      _mm_storeu_si128((__m128i*)half, bytes16(a0, b0));
      _mm_storeu_si128((__m128i*)(half + nb * 32), bytes16(a1, b1));
      _mm_storeu_si128((__m128i*)(half + 2 * nb * 32), bytes16(a2, b2));
    }
    _mm_storeu_ps(scales + 4 * g, _mm_set1_ps(mx / 127.f * (1.f / 65536.f)));
    sums[g] = hsum8(_mm256_add_ps(_mm256_add_ps(xv[0], xv[1]), _mm256_add_ps(xv[2], xv[3])));
  }
  return 1.f / f;
}

/* 16 bytes at p in the low half of a register, zeros above; 32 bytes where two */
static inline __m256i bytes_or_pair(const void* p, int two) {
  return two ? _mm256_loadu_si256((const __m256i*)p) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p));
}

/* Blocks [g, g + nb) (nb <= 4) of two outputs' rows (cs, ds) against the row's digits xq of that
   group and its scales sc, into acc: a pair of blocks a register, each 32-bit lane's integer sum
   of its four codes' products with the three digits (exact, |S| < 2^30), as float times d s 2^-16
   of its block. */
static inline __attribute__((always_inline)) void q4_1_group_digits8(
    const int8_t* xq, const float* sc, const uint8_t* const* cs, const _Float16* const* ds, int64_t g,
    const int64_t nb, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1);
  const __m256i first = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), second = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  __m256 d4[2];
  for (int q = 0; q < 2; q++) {
    uint64_t dbits = 0;  /* the group's nb fp16 scales */
    memcpy(&dbits, ds[q] + g, 2 * nb);
    d4[q] = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)dbits)));
  }
  for (int64_t p = 0; p < nb; p += 2) {  /* a pair of blocks (or the last one), digits loaded once */
    const int two = p + 1 < nb;
    __m256i X[3][2];
    for (int k = 0; k < 3; k++) {
      const int8_t* xk = xq + 32 * k * nb + p * 16;
      X[k][0] = bytes_or_pair(xk, two); X[k][1] = bytes_or_pair(xk + nb * 16, two);
    }
    /* (a lone block's upper lanes: S, its scale and d all 0) */
    const __m256 se = two ? _mm256_loadu_ps(sc + 4 * (g + p)) : _mm256_zextps128_ps256(_mm_loadu_ps(sc + 4 * (g + p)));
    for (int q = 0; q < 2; q++) {
      const __m256i cz = bytes_or_pair(cs[q] + (g + p) * 16, two);
      const __m256i lo = _mm256_and_si256(cz, low), hi = _mm256_and_si256(_mm256_srli_epi16(cz, 4), low);
      __m256i S = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, X[0][0]), _mm256_maddubs_epi16(hi, X[0][1])), one);
      for (int k = 1; k < 3; k++) {
        const __m256i P = _mm256_add_epi16(_mm256_maddubs_epi16(lo, X[k][0]), _mm256_maddubs_epi16(hi, X[k][1]));
        S = _mm256_add_epi32(_mm256_slli_epi32(S, 8), _mm256_madd_epi16(P, one));
      }
      const __m256 dd = _mm256_permutevar8x32_ps(d4[q], p ? second : first);
      acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dd, se), acc[q]);
    }
  }
}

/* Two outputs' Q4_1 rows c0 and c1 (G blocks; scales d0, d1 and minima m0, m1 fp16) against one
   row's digits (q4_1_digits: digits, scales, sums): *y0, and *y1 unless it is NULL; the minima
   against the blocks' float32 sums. */
static inline __attribute__((always_inline)) void q4_1_row_digits(
    const int8_t* digits, const float* scales, const float* sums, const uint8_t* c0, const uint8_t* c1,
    const _Float16* d0, const _Float16* d1, const _Float16* m0, const _Float16* m1, int64_t G, float unscale,
    float* y0, float* y1) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const uint8_t* cs[2] = {c0, c1};
  const _Float16* ds[2] = {d0, d1};
  for (int64_t g = 0; g < G; g += 4) {  /* groups of four blocks, the last of G - g */
    KV_PREFETCH(c0 + g * 32);
    KV_PREFETCH(c0 + g * 32 + 64);
    if (G - g >= 4)  /* (a constant count: the pairs' loop unrolled) */
      q4_1_group_digits8(digits + g * 96, scales, cs, ds, g, 4, acc);
    else
      q4_1_group_digits8(digits + g * 96, scales, cs, ds, g, G - g, acc);
  }
  const _Float16* ms[2] = {m0, m1};
  float rest[2] = {0.f, 0.f};
  int64_t k = 0;
  for (; k + 8 <= G; k += 8) {
    const __m256 sx = _mm256_loadu_ps(sums + k);
    for (int q = 0; q < 2; q++)
      acc[q] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ms[q] + k))), sx, acc[q]);
  }
  for (; k < G; k++)
    for (int q = 0; q < 2; q++) rest[q] += (float)ms[q][k] * sums[k];
  *y0 = (hsum8(acc[0]) + rest[0]) * unscale;
  if (y1) *y1 = (hsum8(acc[1]) + rest[1]) * unscale;
}
#endif
"""
