"""One row of activations as integer digits for the Q4_1 products of a decode step (AVX512-VNNI).

A decode step multiplies one row ``x`` by each Q4_1 weight, ``w = d * c + m`` per block of 32
(``c`` a 4-bit code). In float32 that costs, per block and output, the codes turned into
floats and three multiply-adds, and on the 2-core AVX-512 box it is those instructions, not
memory, that bound the products: about 20-23 GB/s on two cores, where a loop that only reads
the same codes streams 31-40 GB/s.

Where the CPU has AVX512-VNNI the one-row products take ``x`` as integers instead, exactly
enough to stand in for float32. Each block of ``x`` gets the scale ``s = max|x| / 127``, and
``v = x / s`` (within +-127) is written as three signed base-256 digits::

    v ~= X0 + X1 / 256 + X2 / 65536        X0 in [-127, 127], X1 and X2 in [-128, 127]

each digit rounded to nearest (a digit that rounds to 128 becomes -128 and carries one into
the digit above it), so ``x`` is held to within ``2^-24`` of its block's largest ``|x|``, float32's
own resolution at that value. ``vpdpbusd`` multiplies the unsigned codes by each digit and
adds four products a 32-bit lane; a block's lanes take the three digits with two shifts in one
int32 (at most about ``2^30``: eight products of at most ``15 * 128`` a digit), exactly. Then

    y = sum_g d_g s_g 2^-16 S_g + sum_g m_g sum(x in block g)

with ``S_g`` the block's integer sum, converted to float once. The integer sums are exact; the
roundings are the digits' and a few float32 operations a block. How close that is:

- one product against float64, in the tests: 0.3-0.8x the float32 product's error at a model's
  widths (K >= 512, random codes and inputs), 3.6x at 96 terms (few terms, where float32
  accumulates little error and the digits' resolution, relative to each block's largest value,
  is the larger);
- the default model's logits, 48 tokens teacher-forced through the step, against float64 logits
  of the same weights: 1.2e-5 rms and 5.9e-5 at most, against 4.6e-6 and 3.4e-5 for the float32
  products, with every argmax the same. Its Q4_1 blocks centre their codes (``m`` about ``-8 d``),
  so ``d s S`` and ``m sum(x)`` are large terms that cancel, each rounded in float32. Centring the
  codes in the integer sums (``c - 8``) brought that to 6.6e-6 rms, 3.5e-5 at most, but made the
  step 5-7% slower, and was not kept (benchmarks/RESULTS.md, 2026-12-04, twenty-fifth session).

It is not the int8 approximation of :mod:`kvtier.model.act_quant` (one digit, about 1% error),
which stays opt-in.

The digits are laid out as a group of four blocks' codes is read: blocks in groups of four
(the last may be shorter, ``nb`` blocks); group ``q`` at byte ``384 q``, digit ``k`` of it at
``32 k nb``: the low halves of its blocks (elements 0-15, 16 bytes a block), then the high
halves (16-31), as a Q4_1 block's byte ``j`` holds elements ``j`` (low nibble) and ``j + 16``.

Compiled into :mod:`kvtier.model.packed_kernels`' source; without AVX512-VNNI (or AVX512-BW and
-VL) the build keeps the float32 products, and ``PackedKernels.digits`` says which a build took.
"""

from __future__ import annotations

__all__: list[str] = []

_C_SOURCE = r"""
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KV_DIGITS 1
/* x [K] (K / 32 blocks) as three digits a value in the group layout (the module's docstring):
   digits [3 K] bytes, scales [4 G] floats (each block's s 2^-16, once for each of its four
   32-bit lanes), sums [G] the blocks' float32 sums */
static inline void q4_1_digits(const float* x, int64_t K, int8_t* digits, float* scales, float* sums) {
  const int64_t G = K / 32;
  const __m512 base = _mm512_set1_ps(256.f);
  const __m512i i128 = _mm512_set1_epi32(128), i256 = _mm512_set1_epi32(256), one = _mm512_set1_epi32(1);
  for (int64_t g = 0; g < G; g++) {
    const __m512 x0 = _mm512_loadu_ps(x + g * 32), x1 = _mm512_loadu_ps(x + g * 32 + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const int64_t nb = G - g / 4 * 4 < 4 ? G - g / 4 * 4 : 4;  /* blocks in this group */
    int8_t* at = digits + g / 4 * 384 + g % 4 * 16;
    for (int h = 0; h < 2; h++) {  /* elements 0-15, then 16-31 */
      const __m512 v = _mm512_mul_ps(h ? x1 : x0, inv);
      /* (each remainder is exact: v - round(v) and the power-of-two scalings) */
      const __m512 f0 = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 r0 = _mm512_mul_ps(_mm512_sub_ps(v, f0), base);
      const __m512 f1 = _mm512_roundscale_ps(r0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 r1 = _mm512_mul_ps(_mm512_sub_ps(r0, f1), base);
      __m512i d0 = _mm512_cvtps_epi32(f0), d1 = _mm512_cvtps_epi32(f1), d2 = _mm512_cvtps_epi32(r1);
      __mmask16 c = _mm512_cmpeq_epi32_mask(d2, i128);  /* 128 = 256 - 128: carry one up */
      d2 = _mm512_mask_sub_epi32(d2, c, d2, i256);
      d1 = _mm512_mask_add_epi32(d1, c, d1, one);
      c = _mm512_cmpeq_epi32_mask(d1, i128);
      d1 = _mm512_mask_sub_epi32(d1, c, d1, i256);
      d0 = _mm512_mask_add_epi32(d0, c, d0, one);  /* (never past 127: v is within +-127) */
      int8_t* half = at + h * nb * 16;
      _mm_storeu_si128((__m128i*)half, _mm512_cvtepi32_epi8(d0));
      _mm_storeu_si128((__m128i*)(half + nb * 32), _mm512_cvtepi32_epi8(d1));
      _mm_storeu_si128((__m128i*)(half + 2 * nb * 32), _mm512_cvtepi32_epi8(d2));
    }
    _mm_storeu_ps(scales + 4 * g, _mm_set1_ps(mx / 127.f * (1.f / 65536.f)));
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  }
}

/* Blocks [g, g + nb) (nb <= 4; full: nb == 4, plain loads) of two outputs' rows (cs, ds)
   against the row's digits xq of that group and its scales sc, into acc: each 32-bit lane's
   integer sum of its four codes' products with the three digits, accumulated with shifts
   (|S| < 2^30), exactly; then S as float times d s 2^-16. */
static inline __attribute__((always_inline)) void q4_1_group_digits(
    const int8_t* xq, const float* sc, const uint8_t* const* cs, const _Float16* const* ds, int64_t g, int64_t nb,
    const int full, __m512* acc) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m256i rep4 = _mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __mmask64 mb = full ? ~(__mmask64)0 : ((__mmask64)1 << (nb * 16)) - 1;
  const __mmask16 ml = (__mmask16)(full ? 0xffff : (1u << (nb * 4)) - 1);
  __m512i X[3][2];
  for (int k = 0; k < 3; k++)
    for (int h = 0; h < 2; h++)
      X[k][h] = full ? _mm512_loadu_si512(xq + (2 * k + h) * 64) : _mm512_maskz_loadu_epi8(mb, xq + (2 * k + h) * nb * 16);
  const __m512 se = full ? _mm512_loadu_ps(sc + 4 * g) : _mm512_maskz_loadu_ps(ml, sc + 4 * g);
  for (int q = 0; q < 2; q++) {
    const __m512i cz = full ? _mm512_loadu_si512(cs[q] + g * 16) : _mm512_maskz_loadu_epi8(mb, cs[q] + g * 16);
    const __m512i lo = _mm512_and_si512(cz, low), hi = _mm512_and_si512(_mm512_srli_epi16(cz, 4), low);
    __m512i S = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, X[0][0]), hi, X[0][1]);
    S = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(S, 8), lo, X[1][0]), hi, X[1][1]);
    S = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(S, 8), lo, X[2][0]), hi, X[2][1]);
    const __m128i dh = full ? _mm_loadl_epi64((const __m128i*)(ds[q] + g)) : _mm_maskz_loadu_epi16((__mmask8)((1u << nb) - 1), ds[q] + g);
    const __m512 dd = _mm512_cvtph_ps(_mm256_permutexvar_epi16(rep4, _mm256_castsi128_si256(dh)));
    acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(dd, se), acc[q]);
  }
}

/* q4_1_group_digits for the last one or two blocks of a row (G % 4 of 1 or 2), 256 bits wide:
   a masked 512-bit step cost as much as a whole group (the default model's K = 576 products
   7-8% slower a block) */
static inline void q4_1_tail_digits(const int8_t* xq, const float* sc, const uint8_t* const* cs,
                                    const _Float16* const* ds, int64_t g, int64_t nb, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m128i rep4 = _mm_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1);
  const __mmask32 mb = nb == 2 ? ~(__mmask32)0 : (__mmask32)0xffff;
  __m256i X[3][2];
  for (int k = 0; k < 3; k++)
    for (int h = 0; h < 2; h++) X[k][h] = _mm256_maskz_loadu_epi8(mb, xq + (2 * k + h) * nb * 16);
  const __m256 se = _mm256_maskz_loadu_ps((__mmask8)(nb == 2 ? 0xff : 0x0f), sc + 4 * g);
  for (int q = 0; q < 2; q++) {
    const __m256i cz = _mm256_maskz_loadu_epi8(mb, cs[q] + g * 16);
    const __m256i lo = _mm256_and_si256(cz, low), hi = _mm256_and_si256(_mm256_srli_epi16(cz, 4), low);
    __m256i S = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, X[0][0]), hi, X[0][1]);
    S = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(S, 8), lo, X[1][0]), hi, X[1][1]);
    S = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(S, 8), lo, X[2][0]), hi, X[2][1]);
    const __m128i dh = _mm_maskz_loadu_epi16((__mmask8)((1u << nb) - 1), ds[q] + g);
    const __m256 dd = _mm256_cvtph_ps(_mm_permutexvar_epi16(rep4, dh));
    acc[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dd, se), acc[q]);
  }
}

/* Two outputs' Q4_1 rows c0 and c1 (G blocks; scales d0, d1 and minima m0, m1 fp16) against
   one row's digits (q4_1_digits: digits, scales, sums): *y0, and *y1 unless it is NULL; the
   minima against the blocks' float32 sums. Inlined into its caller (a call of its own made the
   decode step 4% slower), and every line of the codes asked for ahead of time, the tail's too
   (its last line missed made the step 5% slower). */
static inline __attribute__((always_inline)) void q4_1_row_digits(
    const int8_t* digits, const float* scales, const float* sums, const uint8_t* c0, const uint8_t* c1,
    const _Float16* d0, const _Float16* d1, const _Float16* m0, const _Float16* m1, int64_t G, float* y0,
    float* y1) {
  const uint8_t* cs[2] = {c0, c1};
  const _Float16* ds[2] = {d0, d1};
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    KV_PREFETCH(c0 + g * 32);
    KV_PREFETCH(c0 + g * 32 + 64);
    q4_1_group_digits(digits + g * 96, scales, cs, ds, g, 4, 1, acc);
  }
  if (g < G) {  /* (the tail's codes too, as the loop's) */
    KV_PREFETCH(c0 + g * 32);
    KV_PREFETCH(c0 + g * 32 + 64);
  }
  if (G - g == 3) q4_1_group_digits(digits + g * 96, scales, cs, ds, g, 3, 0, acc);
  else if (g < G) {
    __m256 t[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    q4_1_tail_digits(digits + g * 96, scales, cs, ds, g, G - g, t);
    for (int q = 0; q < 2; q++) acc[q] = _mm512_add_ps(acc[q], _mm512_zextps256_ps512(t[q]));
  }
  const _Float16* ms[2] = {m0, m1};
  for (int64_t k = 0; k < G; k += 16) {
    const __mmask16 mk = (__mmask16)(G - k >= 16 ? 0xffff : (1u << (G - k)) - 1);
    const __m512 sx = _mm512_maskz_loadu_ps(mk, sums + k);
    for (int q = 0; q < 2; q++)
      acc[q] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, ms[q] + k)), sx, acc[q]);
  }
  *y0 = _mm512_reduce_add_ps(acc[0]);
  if (y1) *y1 = _mm512_reduce_add_ps(acc[1]);
}
#endif

/* One row x [K] of a decode step prepared for q4_1_task: with KV_DIGITS its digits, and NULL
   digits (the float32 products) otherwise, into the caller's buffers of Q4_ROW_DIGITS(K) bytes
   and Q4_ROW_FLOATS(K) floats (scales, then sums). */
typedef struct { const int8_t* digits; const float* scales; const float* sums; } Q4Row;
#define Q4_ROW_DIGITS(K) (3 * (K))
#define Q4_ROW_FLOATS(K) (5 * ((K) / 32))

static inline Q4Row q4_1_row(const float* x, int64_t K, int8_t* digits, float* scales) {
#if defined(KV_DIGITS)
  q4_1_digits(x, K, digits, scales, scales + 4 * (K / 32));
  return (Q4Row){digits, scales, scales + 4 * (K / 32)};
#else
  (void)x; (void)K; (void)digits; (void)scales;
  return (Q4Row){NULL, NULL, NULL};
#endif
}

/* whether this build's one-row Q4_1 products take the digits (for tests and reports) */
int kernel_digits(void) {
#if defined(KV_DIGITS)
  return 1;
#else
  return 0;
#endif
}

/* x [K] and its digits, back (for tests): xhat [K] = s (X0 + X1 / 256 + X2 / 65536) of each value;
   0 without KV_DIGITS */
int q4_1_digits_back(const float* x, int64_t K, float* xhat) {
#if defined(KV_DIGITS)
  const int64_t G = K / 32;
  int8_t digits[Q4_ROW_DIGITS(K)];
  float scales[Q4_ROW_FLOATS(K)];
  q4_1_digits(x, K, digits, scales, scales + 4 * G);
  for (int64_t g = 0; g < G; g++) {
    const int64_t nb = G - g / 4 * 4 < 4 ? G - g / 4 * 4 : 4;
    const int8_t* at = digits + g / 4 * 384 + g % 4 * 16;
    for (int64_t j = 0; j < 32; j++) {
      const int8_t* e = at + (j >= 16) * nb * 16 + (j & 15);
      xhat[g * 32 + j] = (float)((double)scales[4 * g] * ((double)e[0] * 65536 + (double)e[nb * 32] * 256
                                                           + (double)e[2 * nb * 32]));
    }
  }
  return 1;
#else
  (void)x; (void)K; (void)xhat;
  return 0;
#endif
}
"""
