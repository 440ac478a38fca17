"""One row of activations as integer digits for the Q4_1 and Q8_0 products of a decode step
(AVX512-VNNI; Q4_1 with AVX2 too).

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
  step 5-7% slower, and was not kept (benchmarks/RESULTS.md, 2026-12-04).

A row whose values are all below ``2^-64`` is taken at ``2^64`` times its values and its
products at ``2^-64`` (exact powers of two): otherwise its blocks' scales ``s 2^-16`` would fall
among float32's subnormals, and a row of ``1e-36`` came out 34% wrong (of ``1e-37``: 100%). Such
rows now keep float32's precision; ordinary rows' digits are the same bits.

It is not the int8 approximation of :mod:`kvtier.model.act_quant` (one digit, about 1% error),
which stays opt-in.

The digits are laid out as a group of four blocks' codes is read: blocks in groups of four
(the last may be shorter, ``nb`` blocks); group ``q`` at byte ``384 q``, digit ``k`` of it at
``32 k nb``: the low halves of its blocks (elements 0-15, 16 bytes a block), then the high
halves (16-31), as a Q4_1 block's byte ``j`` holds elements ``j`` (low nibble) and ``j + 16``.

Q8_0 (``w = d * c``, ``c`` a signed 8-bit code; the default model's LM head) takes the same
scale with other digits: ``v = X0 + U1 / 256 + U2 / 65536``, ``X0 = floor(v)`` signed and ``U1``,
``U2`` in ``[0, 255]``, as ``vpdpbusd`` multiplies unsigned bytes by signed ones. The unsigned
lower digits multiply the signed codes; the signed first digit multiplies the codes made
unsigned (``c + 128``, one XOR), its lane's sum starting from ``-128`` times the lane's four
``X0``, prepared with the digits. The first digit's sums and the others' (shifted together)
stay apart in int32, each exact (eight-bit codes would overflow one int32 of all three), and
meet as float32, times ``d s 2^-16``. A block that holds a NaN or an infinity gets a NaN scale,
since no minima carry its sum as Q4_1's do. Blocks go in pairs (a 512-bit register), two
outputs a task. The cost: 3.0-3.1 cycles a block and core against 4.5 for the float32 loop,
measured where the codes sit in the L3 cache; in the decode step on the 2-core box, whose head
streams from memory at the box's bandwidth, 0.97-1.02 of the float32 loop's step time. The default
model's logits against float64 are as above (1.25e-5 rms, 6.0e-5 at most).

Compiled into :mod:`kvtier.model.packed_kernels`' source. Without AVX512-VNNI (or AVX512-BW and
-VL) an AVX-512 build keeps the float32 products; a build with AVX2 and no AVX-512 takes the
Q4_1 digits 256 bits wide (:mod:`kvtier.model.packed_digits_avx2`) and Q8_0's float32 loop.
``PackedKernels.digits`` names the formats a build takes as digits; ``-DKV_NO_DIGITS`` turns the
AVX2 digits off (the benchmarks' comparison).
"""

from __future__ import annotations

from kvtier.model import packed_digits_avx2

__all__: list[str] = []

_C_SOURCE = r"""
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KV_DIGITS 1
#define KV_DIGITS_Q8 1
/* v (16 values within +-127) as three base-256 digits d0 + d1 / 256 + d2 / 65536 (__m512i):
   ROUND the rounding of the first two (the Q4_1 digits to nearest, Q8_0's down), the third to
   nearest; a lower digit that reaches TOP (128 when signed, 256 when not) becomes TOP - 256 and
   carries one up (the first never passes 127, as v does not). Each remainder is exact: v less
   a whole number, and the power-of-two scalings. (A macro: an inline function in its place made
   the decode step 1.3-2.4% slower, this 0.996-1.008 of the two loops written out.) */
#define KV_BASE256_DIGITS(v, ROUND, TOP, d0, d1, d2) do {                                        \
    const __m512 f0_ = _mm512_roundscale_ps((v), (ROUND) | _MM_FROUND_NO_EXC);                    \
    const __m512 r0_ = _mm512_mul_ps(_mm512_sub_ps((v), f0_), _mm512_set1_ps(256.f));              \
    const __m512 f1_ = _mm512_roundscale_ps(r0_, (ROUND) | _MM_FROUND_NO_EXC);                    \
    const __m512 r1_ = _mm512_mul_ps(_mm512_sub_ps(r0_, f1_), _mm512_set1_ps(256.f));              \
    const __m512i top_ = _mm512_set1_epi32(TOP), i256_ = _mm512_set1_epi32(256), one_ = _mm512_set1_epi32(1); \
    d0 = _mm512_cvtps_epi32(f0_); d1 = _mm512_cvtps_epi32(f1_); d2 = _mm512_cvtps_epi32(r1_);    \
    __mmask16 c_ = _mm512_cmpeq_epi32_mask(d2, top_);                                             \
    d2 = _mm512_mask_sub_epi32(d2, c_, d2, i256_);                                                \
    d1 = _mm512_mask_add_epi32(d1, c_, d1, one_);                                                 \
    c_ = _mm512_cmpeq_epi32_mask(d1, top_);                                                       \
    d1 = _mm512_mask_sub_epi32(d1, c_, d1, i256_);                                                \
    d0 = _mm512_mask_add_epi32(d0, c_, d0, one_);                                                 \
  } while (0)
/* The factor a row is taken at before its digits: 2^64 where its largest |x| is below 2^-64, else
   1. A tiny row's blocks would otherwise get scales s 2^-16 among float32's subnormals (or 127 / max
   past its largest float), and lose their precision; the products are multiplied by 2^-64 at the
   end, exactly (as float32 rounds, where they are subnormal). */
static inline float row_factor(const float* x, int64_t K) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  return _mm512_reduce_max_ps(m) < 0x1p-64f ? 0x1p64f : 1.f;
}

/* x [K] (K / 32 blocks) as three digits a value in the group layout (the module's docstring):
   digits [3 K] bytes, scales [4 G] floats (each block's s 2^-16, once for each of its four
   32-bit lanes), sums [G] the blocks' float32 sums, all of x times row_factor; returns the factor's
   inverse, which the products take at the end */
static inline float q4_1_digits(const float* x, int64_t K, int8_t* digits, float* scales, float* sums) {
  const int64_t G = K / 32;
  const float f = row_factor(x, K);
  const __m512 fv = _mm512_set1_ps(f);
  for (int64_t g = 0; g < G; g++) {
    const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(x + g * 32), fv), x1 = _mm512_mul_ps(_mm512_loadu_ps(x + g * 32 + 16), fv);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
    const int64_t nb = G - g / 4 * 4 < 4 ? G - g / 4 * 4 : 4;  /* blocks in this group */
    int8_t* at = digits + g / 4 * 384 + g % 4 * 16;
    for (int h = 0; h < 2; h++) {  /* elements 0-15, then 16-31 */
      __m512i d0, d1, d2;
      KV_BASE256_DIGITS(_mm512_mul_ps(h ? x1 : x0, inv), _MM_FROUND_TO_NEAREST_INT, 128, d0, d1, d2);
      int8_t* half = at + h * nb * 16;
      _mm_storeu_si128((__m128i*)half, _mm512_cvtepi32_epi8(d0));
      _mm_storeu_si128((__m128i*)(half + nb * 32), _mm512_cvtepi32_epi8(d1));
      _mm_storeu_si128((__m128i*)(half + 2 * nb * 32), _mm512_cvtepi32_epi8(d2));
    }
    _mm_storeu_ps(scales + 4 * g, _mm_set1_ps(mx / 127.f * (1.f / 65536.f)));
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  }
  return 1.f / f;
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
    const _Float16* d0, const _Float16* d1, const _Float16* m0, const _Float16* m1, int64_t G, float unscale,
    float* y0, float* y1) {
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
  *y0 = _mm512_reduce_add_ps(acc[0]) * unscale;
  if (y1) *y1 = _mm512_reduce_add_ps(acc[1]) * unscale;
}

/* x [K] (G = K / 32 blocks) for Q8_0's one-row products, in pairs of blocks (chunks of 64
   values, the last half empty where G is odd): chunk q's digits at 192 q, 64 bytes each, the
   signed first digit X0 = floor(v) (within +-127) and the unsigned U1 and U2 in [0, 255]
   (v = X0 + U1 / 256 + U2 / 65536, U2 rounded to nearest, 256 carried up); its 16 lanes of
   starts[16 q ...] (-128 times the sum of each lane's four X0) and of scales (the block's
   s 2^-16, a NaN where the block holds a NaN or an infinity). Empty halves: zeros. All of x times
   row_factor; returns the factor's inverse, as q4_1_digits. */
static inline float q8_0_digits(const float* x, int64_t K, int8_t* digits, int32_t* starts, float* scales) {
  const int64_t G = K / 32;
  const float f = row_factor(x, K);
  const __m512 fv = _mm512_set1_ps(f);
  const __m512i b128 = _mm512_set1_epi8((char)0x80);
  for (int64_t q = 0; 2 * q < G; q++) {
    int8_t* at = digits + q * 192;
    for (int64_t b = 0; b < 2; b++) {
      const int64_t g = 2 * q + b;
      if (g == G) {  /* the empty half of an odd count's last chunk */
        for (int k = 0; k < 3; k++) memset(at + 64 * k + 32, 0, 32);
        _mm256_storeu_ps(scales + 16 * q + 8, _mm256_setzero_ps());
        break;
      }
      const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(x + g * 32), fv), x1 = _mm512_mul_ps(_mm512_loadu_ps(x + g * 32 + 16), fv);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? 127.f / mx : 0.f);
      for (int h = 0; h < 2; h++) {
        __m512i d0, d1, d2;
        KV_BASE256_DIGITS(_mm512_mul_ps(h ? x1 : x0, inv), _MM_FROUND_TO_NEG_INF, 256, d0, d1, d2);
        int8_t* e = at + 32 * b + 16 * h;
        _mm_storeu_si128((__m128i*)e, _mm512_cvtepi32_epi8(d0));
        _mm_storeu_si128((__m128i*)(e + 64), _mm512_cvtepi32_epi8(d1));
        _mm_storeu_si128((__m128i*)(e + 128), _mm512_cvtepi32_epi8(d2));
      }
      /* (0 times the block's sum: a NaN where it holds a NaN or an infinity, which the
         maximum may drop) */
      const float poison = 0.f * _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      _mm256_storeu_ps(scales + 16 * q + 8 * b, _mm256_set1_ps(mx / 127.f * (1.f / 65536.f) + poison));
    }
    const __m512i x0s = _mm512_loadu_si512(at);
    _mm512_storeu_si512(starts + 16 * q, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                           _mm512_dpbusd_epi32(_mm512_setzero_si512(), b128, x0s)));
  }
  return 1.f / f;
}

/* Two outputs' Q8_0 rows c0 and c1 (G blocks of 32 int8 codes; scales d0, d1 fp16) against one
   row's digits (q8_0_digits): *y0, and *y1 unless it is NULL. A pair of blocks a step, each
   32-bit lane's sums exact in int32: the first digit's against the codes made unsigned (c + 128,
   the start taking 128 times the digits back off), the others' against the signed codes,
   shifted together (at most about 2^25); then the two as floats, times d s 2^-16. */
static inline __attribute__((always_inline)) void q8_0_row_digits(
    const int8_t* digits, const int32_t* starts, const float* scales, const int8_t* c0, const int8_t* c1,
    const _Float16* d0, const _Float16* d1, int64_t G, float unscale, float* y0, float* y1) {
  const int8_t* cs[2] = {c0, c1};
  const _Float16* ds[2] = {d0, d1};
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const __m256i rep8 = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512 unit = _mm512_set1_ps(65536.f);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t q = 0; 2 * q < G; q++) {
    const int full = 2 * q + 2 <= G;
    /* the pair's 2 K bytes are one stream, two lines a step, asked for 4 KB ahead (2 KB, the
       other loops' distance, left the decode step 2.6-3.1% slower than one output a task) */
    _mm_prefetch((const char*)c0 + q * 128 + 4096, _MM_HINT_T0);
    _mm_prefetch((const char*)c0 + q * 128 + 4096 + 64, _MM_HINT_T0);
    const int8_t* at = digits + q * 192;
    const __m512i X0 = _mm512_loadu_si512(at), U1 = _mm512_loadu_si512(at + 64), U2 = _mm512_loadu_si512(at + 128);
    const __m512i st = _mm512_loadu_si512(starts + 16 * q);
    const __m512 se = _mm512_loadu_ps(scales + 16 * q);
    for (int r = 0; r < 2; r++) {
      const __m512i c = full ? _mm512_loadu_si512(cs[r] + q * 64)
                             : _mm512_maskz_loadu_epi8((__mmask64)0xffffffffu, cs[r] + q * 64);
      const __m512i A = _mm512_dpbusd_epi32(st, _mm512_xor_si512(c, flip), X0);
      const __m512i B = _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), U1, c), 8), U2, c);
      const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(A), unit, _mm512_cvtepi32_ps(B));
      __m128i dh;
      if (full) {  /* (the pair's two scales as one 32-bit load) */
        int32_t pair;
        memcpy(&pair, ds[r] + 2 * q, 4);
        dh = _mm_cvtsi32_si128(pair);
      } else {
        dh = _mm_maskz_loadu_epi16((__mmask8)1, ds[r] + 2 * q);
      }
      const __m512 dd = _mm512_cvtph_ps(_mm256_permutexvar_epi16(rep8, _mm256_castsi128_si256(dh)));
      acc[r] = _mm512_fmadd_ps(a, _mm512_mul_ps(dd, se), acc[r]);
    }
  }
  *y0 = _mm512_reduce_add_ps(acc[0]) * unscale;
  if (y1) *y1 = _mm512_reduce_add_ps(acc[1]) * unscale;
}
#endif
""" + packed_digits_avx2._C_SOURCE + r"""

/* One row x [K] of a decode step prepared for q4_1_task: with KV_DIGITS its digits, and NULL
   digits (the float32 products) otherwise, into the caller's buffers of Q4_ROW_DIGITS(K) bytes
   and Q4_ROW_FLOATS(K) floats (scales, then sums). */
typedef struct { const int8_t* digits; const float* scales; const float* sums; float unscale; } Q4Row;
#define Q4_ROW_DIGITS(K) (3 * (K))
#define Q4_ROW_FLOATS(K) (5 * ((K) / 32))

static inline Q4Row q4_1_row(const float* x, int64_t K, int8_t* digits, float* scales) {
#if defined(KV_DIGITS)
  const float unscale = q4_1_digits(x, K, digits, scales, scales + 4 * (K / 32));
  return (Q4Row){digits, scales, scales + 4 * (K / 32), unscale};
#else
  (void)x; (void)K; (void)digits; (void)scales;
  return (Q4Row){NULL, NULL, NULL, 1.f};
#endif
}

/* One row x [K] of a decode step prepared for q8_0_task, as Q4Row for q4_1_task: with KV_DIGITS
   its digits (q8_0_digits) in the caller's buffers of Q8_ROW_DIGITS(K) bytes and Q8_ROW_LANES(K)
   starts and scales, and NULL digits otherwise. */
typedef struct { const int8_t* digits; const int32_t* starts; const float* scales; float unscale; } Q8Row;
#define Q8_ROW_DIGITS(K) (192 * (((K) / 32 + 1) / 2))
#define Q8_ROW_LANES(K) (16 * (((K) / 32 + 1) / 2))

static inline Q8Row q8_0_row(const float* x, int64_t K, int8_t* digits, int32_t* starts, float* scales) {
#if defined(KV_DIGITS_Q8)
  const float unscale = q8_0_digits(x, K, digits, starts, scales);
  return (Q8Row){digits, starts, scales, unscale};
#else
  (void)x; (void)K; (void)digits; (void)starts; (void)scales;
  return (Q8Row){NULL, NULL, NULL, 1.f};
#endif
}

/* q8_0_task's tasks: pairs of outputs for a row as digits, single outputs otherwise */
static inline int64_t q8_0_tasks(int64_t N, const Q8Row* row) { return row && row->digits ? (N + 1) / 2 : N; }

/* which formats' one-row products this build takes as digits, bits: 1 Q4_1, 2 Q8_0 (for tests
   and reports) */
int kernel_digits(void) {
#if defined(KV_DIGITS_Q8)
  return 3;
#elif defined(KV_DIGITS)
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
  const double unscale = q4_1_digits(x, K, digits, scales, scales + 4 * G);
  for (int64_t g = 0; g < G; g++) {
    const int64_t nb = G - g / 4 * 4 < 4 ? G - g / 4 * 4 : 4;
    const int8_t* at = digits + g / 4 * 384 + g % 4 * 16;
    for (int64_t j = 0; j < 32; j++) {
      const int8_t* e = at + (j >= 16) * nb * 16 + (j & 15);
      xhat[g * 32 + j] = (float)(unscale * scales[4 * g] * ((double)e[0] * 65536 + (double)e[nb * 32] * 256
                                                            + (double)e[2 * nb * 32]));
    }
  }
  return 1;
#else
  (void)x; (void)K; (void)xhat;
  return 0;
#endif
}

/* q4_1_digits_back for Q8_0's digits (q8_0_digits): xhat [K] = s (X0 + U1 / 256 + U2 / 65536);
   0 without KV_DIGITS_Q8 */
int q8_0_digits_back(const float* x, int64_t K, float* xhat) {
#if defined(KV_DIGITS_Q8)
  int8_t digits[Q8_ROW_DIGITS(K)];
  int32_t starts[Q8_ROW_LANES(K)];
  float scales[Q8_ROW_LANES(K)];
  const double unscale = q8_0_digits(x, K, digits, starts, scales);
  for (int64_t i = 0; i < K; i++) {
    const int8_t* e = digits + i / 64 * 192 + i % 64;
    xhat[i] = (float)(unscale * scales[i / 64 * 16 + i % 64 / 4] * ((double)e[0] * 65536
                      + (double)(uint8_t)e[64] * 256 + (double)(uint8_t)e[128]));
  }
  return 1;
#else
  (void)x; (void)K; (void)xhat;
  return 0;
#endif
}
"""
