"""The C side of how the one-call decode step (:mod:`kvtier.model.cpu_step`) stores and reads
key and value rows: float32, float16 and the codes of every page codec (``q8``, ``q4``,
``fp8``, ``q4_g32``, TurboQuant), where a head's row lies in a tail buffer or through a block
table, its scales and zeros, and the vector loads that turn eight or sixteen stored elements
into float32.

Compiled with the step's other sources into one library
(:func:`kvtier.model.step_kernels.step_source`), before the attention that reads the rows.
"""

from __future__ import annotations

__all__: list[str] = []

_C_SOURCE = r"""
#include <string.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* float16 keys and values: conversions rounding to nearest even, as torch's .to(float16) */
#if defined(__F16C__)
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, 0); }
#else
static inline float h2f(uint16_t h) {
  uint32_t o = ((uint32_t)h & 0x7fffu) << 13, e = o & (0x7c00u << 13);
  float f;
  o += (127u - 15u) << 23;
  if (e == 0x7c00u << 13) o += (128u - 16u) << 23;  /* inf, nan */
  else if (e == 0) { o += 1u << 23; memcpy(&f, &o, 4); f -= 6.103515625e-05f; memcpy(&o, &f, 4); }
  o |= ((uint32_t)h & 0x8000u) << 16;
  memcpy(&f, &o, 4);
  return f;
}
static inline uint16_t f2h(float f) {
  uint32_t x, sign, r;
  uint16_t o;
  memcpy(&x, &f, 4);
  sign = x & 0x80000000u;
  x ^= sign;
  if (x >= (127u + 16u) << 23) o = x > 255u << 23 ? 0x7e00 : 0x7c00;  /* nan; inf or overflow */
  else if (x < 113u << 23) {  /* a subnormal half: the float sum rounds it */
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    float xf, m;
    memcpy(&xf, &x, 4); memcpy(&m, &magic, 4);
    xf += m;
    memcpy(&r, &xf, 4);
    o = (uint16_t)(r - magic);
  } else {
    x += ((uint32_t)(15 - 127) << 23) + 0xfff + ((x >> 13) & 1);
    o = (uint16_t)(x >> 13);
  }
  return o | (uint16_t)(sign >> 16);
}
#endif

/* dst[0, D) = the float16 row src as float32 (eight at a time with F16C); returns dst */
static inline float* half_row(const uint16_t* src, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + d))));
#endif
  for (; d < D; d++) dst[d] = h2f(src[d]);
  return dst;
}

/* How a layer stores its key and value rows: float32, float16, or codes with one float32 scale
   a row, beside the rows as their pages' sidecar: kvtier.quant.kv_quant's q8 (int8) and q4
   (code + 8 in four bits, channel 2i in the low bits of byte i), and kvtier.quant.fp8's e4m3
   bytes (keys coded less a centre [D] a head, which attention does not add back: q . centre
   shifts all of a query's scores alike, which softmax and the merge of splits undo); or q4_g32's
   unsigned codes in four bits (as q4's), each group of 32 channels with a float16 scale and
   zero (zero + scale code); TurboQuant's keys of 8 bits the same way a byte a code (KV_A8),
   and of other bits b (kind KV_AF + b) in a little-endian bit stream (the queries rotated where
   the keys are); TurboQuant's values as b-bit Lloyd-Max indices (kind KV_LM + b) in such a
   stream, each group with a float16 scale (scale centroid[index]), in the rotated domain, which
   attention's output leaves by the rotation's inverse. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2, KV_Q4 = 3, KV_FP8 = 4, KV_G32 = 5, KV_A8 = 6, KV_LM = 16, KV_AF = 32 };

/* a head's codes' sidecars: the scales (float32 a row; float16 a group for the grouped kinds),
   the group-affine kinds' zeros, each pointing at the head's first row's (NULL for float rows),
   and the Lloyd-Max kinds' centroids */
typedef struct { const void* scale; const void* zero; const float* table; } Sides;

/* bits of a code in a bit stream: a Lloyd-Max index or a group-affine key */
#define STREAM_BITS(kind) ((kind) > KV_AF ? (kind) - KV_AF : (kind) - KV_LM)
#define IS_LM(kind) ((kind) > KV_LM && (kind) < KV_AF)

/* bytes of n stored elements (n even for four-bit codes, a multiple of 8 for bit streams) */
static inline __attribute__((always_inline)) int64_t kv_span(const int kind, int64_t n) {
  if (kind > KV_LM) return (n * STREAM_BITS(kind)) >> 3;
  return kind == KV_F32 ? 4 * n : kind == KV_F16 ? 2 * n : kind == KV_Q4 || kind == KV_G32 ? n >> 1 : n;
}

/* whether a kind's rows take one scale each, or a float16 scale a group of 32 channels */
#define ROW_SCALED(kind) ((kind) == KV_Q8 || (kind) == KV_Q4 || (kind) == KV_FP8)
#define GROUPED(kind) ((kind) == KV_G32 || (kind) == KV_A8 || (kind) > KV_LM)
#define AFFINE(kind) ((kind) == KV_G32 || (kind) == KV_A8 || (kind) > KV_AF)

/* index i of a row of b-bit indices, code i at bit i b, the low bits first */
static inline int lm_index(const uint8_t* p, int64_t i, int b) {
  const int64_t at = i * b, sh = at & 7;
  uint32_t w = p[at >> 3];
  if (sh + b > 8) w |= (uint32_t)p[(at >> 3) + 1] << 8;
  return (int)(w >> sh) & ((1 << b) - 1);
}

/* writes index u as element i of such a row (its bytes zeroed first) */
static inline void stream_put(uint8_t* p, int64_t i, int b, unsigned u) {
  const int64_t at = i * b, sh = at & 7;
  p[at >> 3] |= (uint8_t)(u << sh);
  if (sh + b > 8) p[(at >> 3) + 1] |= (uint8_t)(u >> (8 - sh));
}

/* the float16 bits of e4m3 byte b / 256: the same sign, exponent and mantissa fields, each
   moved up (e4m3's exponent bias is 7, float16's 15; its subnormals land on float16's) */
static inline uint16_t e4m3_half_bits(uint8_t b) { return (uint16_t)(((b & 0x7f) << 7) | ((b & 0x80) << 8)); }

/* element i of a coded row before its scale: a q8, q4 or q4_g32 code, or an e4m3 value / 256 */
static inline __attribute__((always_inline)) float kv_code(const void* p, int64_t i, const int kind) {
  if (kind == KV_Q8) return ((const int8_t*)p)[i];
  if (kind == KV_FP8) return h2f(e4m3_half_bits(((const uint8_t*)p)[i]));
  if (kind == KV_A8) return ((const uint8_t*)p)[i];
  if (kind > KV_AF) return (float)lm_index((const uint8_t*)p, i, STREAM_BITS(kind));
  const int n = (((const uint8_t*)p)[i >> 1] >> (4 * (i & 1))) & 15;
  return (float)(kind == KV_Q4 ? n - 8 : n);
}

/* dst[0, D) = row src as float32 (codes times their row's scale sc, or their group's scale gs
   plus zero gz, or centroid table[index] times the group's scale); returns dst, or src itself
   where it holds float32 */
static inline const float* float_row(const char* src, const int kind, float sc, const uint16_t* gs,
                                     const uint16_t* gz, const float* table, float* dst, int64_t D) {
  if (kind == KV_F32) return (const float*)src;
  if (kind == KV_F16) return half_row((const uint16_t*)src, dst, D);
  if (IS_LM(kind) || AFFINE(kind))
    for (int64_t g = 0; g < D >> 5; g++) {  /* (a group's scale and zero converted once) */
      const float gsf = h2f(gs[g]), gzf = IS_LM(kind) ? 0.f : h2f(gz[g]);
      for (int64_t d = 32 * g; d < 32 * g + 32; d++)
        dst[d] = IS_LM(kind) ? table[lm_index((const uint8_t*)src, d, STREAM_BITS(kind))] * gsf
                             : gsf * kv_code(src, d, kind) + gzf;
    }
  else
    for (int64_t d = 0; d < D; d++) dst[d] = sc * kv_code(src, d, kind);
  return dst;
}

/* Where a head's key or value rows lie: rows rs elements apart from the head's first
   (tb NULL: a tail buffer [cap, D] of the head, rs = D), or rows of pages through a block
   table: row j in block tb[j >> bsh] of 1 << bsh rows, each rs elements (H_kv D: the NHD page
   layout [blocks, 1 << bsh, H_kv, D]) after the last, the head's base its first row's. Codes'
   scales lie ss floats apart likewise (pages' sidecars [blocks, 1 << bsh, H_kv, 1]: H_kv). */
typedef struct { const int32_t* tb; int64_t bsh, rs, ss; } KvRows;

/* the storage row of a head's row j: its place among the rows of every block */
static inline __attribute__((always_inline)) int64_t kv_row(KvRows kv, int64_t j) {
  return kv.tb ? ((int64_t)kv.tb[j >> kv.bsh] << kv.bsh) + (j & (((int64_t)1 << kv.bsh) - 1)) : j;
}

/* row j of the head whose rows start at P, stored as kind says */
static inline __attribute__((always_inline)) const char* row_at(const void* P, KvRows kv, int64_t j, const int kind) {
  return (const char*)P + kv_span(kind, kv_row(kv, j) * kv.rs);
}

/* the scale of row j of the head whose scales start at S */
static inline __attribute__((always_inline)) float* scale_at(const float* S, KvRows kv, int64_t j) {
  return (float*)S + kv_row(kv, j) * kv.ss;
}

/* what row j's elements as kv_code and the vector loads give are multiplied by: its scale (e4m3's
   times 256) */
static inline __attribute__((always_inline)) float row_scale(Sides S, KvRows kv, int64_t j, const int kind) {
  const float sc = *scale_at((const float*)S.scale, kv, j);
  return kind == KV_FP8 ? 256.f * sc : sc;
}

/* the float16 group sidecar of row j of the head whose sidecar starts at S, D / 32 groups a row */
static inline __attribute__((always_inline)) uint16_t* group_at(const void* S, KvRows kv, int64_t j, int64_t D) {
  return (uint16_t*)S + kv_row(kv, j) * kv.ss * (D >> 5);
}

/* row j's group-affine scales and zeros as float32 into gs, gz [D / 32] */
static inline __attribute__((always_inline)) void group_floats(Sides S, KvRows kv, int64_t j, int64_t D, float* gs,
                                                               float* gz) {
  const uint16_t *s = group_at(S.scale, kv, j, D), *z = group_at(S.zero, kv, j, D);
  for (int64_t g = 0; g < D >> 5; g++) { gs[g] = h2f(s[g]); gz[g] = h2f(z[g]); }
}

/* asks for the lines of rows [j, j + n) of the head at P, each m bytes, past row last none */
static inline __attribute__((always_inline)) void prefetch_rows(const void* P, KvRows kv, int64_t j, int64_t n,
                                                                int64_t last, int64_t m, const int kind) {
  for (int64_t r = j; r < j + n && r <= last; r++)
    for (int64_t c = 0; c < m; c += 64) __builtin_prefetch(row_at(P, kv, r, kind) + c, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__F16C__)
#define HALF_ROWS 1
#else
#define HALF_ROWS 0
#endif
/* the n bytes from byte `at` of a row at the low end of a word of `size` bytes (4 or 8, at least
   n): one load, inside a row of `size` bytes or more, of the word ending there, or at the row's
   start of the word starting there */
static inline __attribute__((always_inline)) uint64_t stream_word(const void* p, int64_t at, const int n,
                                                                   const int size) {
  uint64_t w = 0;
  if (at < size - n) {
    memcpy(&w, (const uint8_t*)p + at, size);
    return w;
  }
  memcpy(&w, (const uint8_t*)p + at - (size - n), size);
  return w >> (8 * (size - n));
}

/* codes i .. i + 7 (i a multiple of 8) of a row of b-bit codes (b <= 8: eight in the b bytes from
   byte b i / 8), as int32 lanes */
static inline __attribute__((always_inline)) __m256i stream8(const void* p, int64_t i, const int b) {
  const uint64_t w = stream_word(p, (i >> 3) * b, b, 8);
  const __m256i x = _mm256_set1_epi64x((long long)w);
  const __m256i lo = _mm256_srlv_epi64(x, _mm256_setr_epi64x(0, b, 2 * b, 3 * b));
  const __m256i hi = _mm256_srlv_epi64(x, _mm256_setr_epi64x(4 * b, 5 * b, 6 * b, 7 * b));
  const __m256i mixed = _mm256_blend_epi32(lo, _mm256_slli_epi64(hi, 32), 0xaa);  /* codes 0 4 1 5 2 6 3 7 */
  return _mm256_and_si256(_mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)),
                          _mm256_set1_epi32((1 << b) - 1));
}

/* eight floats from element i (a multiple of 8) of a stored row: float32, float16 (with F16C),
   or codes (not yet scaled) */
static inline __attribute__((always_inline)) __m256 load8(const void* p, int64_t i, const int kind) {
#if HALF_ROWS
  if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
#endif
  if (kind == KV_Q8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)p + i))));
  if (kind == KV_A8) return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)p + i))));
  if (kind > KV_AF) return _mm256_cvtepi32_ps(stream8(p, i, STREAM_BITS(kind)));
#if HALF_ROWS
  if (kind == KV_FP8) {  /* (e4m3_half_bits eight at a time) */
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)((const uint8_t*)p + i)));
    return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                        _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8)));
  }
#endif
  if (kind == KV_Q4 || kind == KV_G32) {
    int32_t w;
    memcpy(&w, (const uint8_t*)p + i / 2, 4);
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(kind == KV_Q4 ? _mm256_sub_epi32(n, _mm256_set1_epi32(8)) : n);
  }
  return _mm256_loadu_ps((const float*)p + i);
}

static inline __attribute__((always_inline)) float load1(const void* p, int64_t i, const int kind) {
  if (kind == KV_F32) return ((const float*)p)[i];
  if (kind == KV_F16) return h2f(((const uint16_t*)p)[i]);
  return kv_code(p, i, kind);
}

/* the centroids of indices i .. i + 7 (i a multiple of 8) of a row of b-bit indices (b <= 4:
   eight in the b bytes from byte b i / 8, one 4-byte load), lo and hi holding centroids 0-7 and
   8-15 */
static inline __attribute__((always_inline)) __m256 lm8(const void* p, int64_t i, const int kind, __m256 lo, __m256 hi) {
  const int b = STREAM_BITS(kind);
  const uint32_t w = (uint32_t)stream_word(p, (i >> 3) * b, b, 4);
  const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                                         _mm256_setr_epi32(0, b, 2 * b, 3 * b, 4 * b, 5 * b, 6 * b, 7 * b)),
                                       _mm256_set1_epi32((1 << b) - 1));
  const __m256 c = _mm256_permutevar8x32_ps(lo, idx);
  if (b < 4) return c;
  return _mm256_blendv_ps(c, _mm256_permutevar8x32_ps(hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* eight values of a row from element i as float32: load8 for the kinds with one scale a row (the
   scale not yet taken), zero + scale code for q4_g32 (a group's gs, gz), scale centroid for
   Lloyd-Max indices */
static inline __attribute__((always_inline)) __m256 value8(const void* p, int64_t i, const int kind, float gs, float gz,
                                                           __m256 lo, __m256 hi) {
  if (kind == KV_G32) return _mm256_fmadd_ps(load8(p, i, kind), _mm256_set1_ps(gs), _mm256_set1_ps(gz));
  if (IS_LM(kind)) return _mm256_mul_ps(lm8(p, i, kind, lo, hi), _mm256_set1_ps(gs));
  return load8(p, i, kind);
}

#if defined(__AVX512F__)
/* sixteen floats from element i (a multiple of 16) of a stored row, as load8 (codes as two of
   its eight) */
static inline __attribute__((always_inline)) __m512 load16(const void* p, int64_t i, const int kind) {
  if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)));
  if (kind != KV_F32) return _mm512_insertf32x8(_mm512_castps256_ps512(load8(p, i, kind)), load8(p, i + 8, kind), 1);
  return _mm512_loadu_ps((const float*)p + i);
}

#endif
#endif
"""
