"""The C side of the one-call decode step's attention (:mod:`kvtier.model.cpu_step`): float16
conversions of the stored keys and values, the exponentials of softmax, and attention of a KV
head's query group over a split of its keys, with the merge of the splits.

Compiled with the step's other sources into one library
(:func:`kvtier.model.step_kernels.step_source`), before the step itself.
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

/* s[j] = exp(s[j] - mx) for j < n; returns their sum. With AVX2 eight at a time (Cephes'
   polynomial: within 2 units in the last place of expf, exact 0 below -87), else expf. */
static inline float exp_shifted(float* s, int64_t n, float mx) {
  int64_t j = 0;
  float tot = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 lo = _mm256_set1_ps(-87.f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 m = _mm256_set1_ps(mx), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 x0 = _mm256_sub_ps(_mm256_loadu_ps(s + j), m);
    const __m256 x = _mm256_max_ps(x0, lo);
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, half));
    const __m256 r = _mm256_fnmadd_ps(fx, c2, _mm256_fnmadd_ps(fx, c1, x));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, half);
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), one);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    y = _mm256_and_ps(y, _mm256_cmp_ps(x0, lo, _CMP_GE_OQ));  /* far below the max: 0 */
    _mm256_storeu_ps(s + j, y);
    acc = _mm256_add_ps(acc, y);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_hadd_ps(h, h);
  tot = _mm_cvtss_f32(_mm_hadd_ps(h, h));
#endif
  for (; j < n; j++) { s[j] = expf(s[j] - mx); tot += s[j]; }
  return tot;
}

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

/* one row's scores sr[j0, e): part[0] their largest, part[1] the sum of exp(score - largest),
   the scores replaced by those exponentials (no keys: -inf and 0) */
static inline void softmax_part(float* sr, int64_t j0, int64_t e, float* part) {
  float mx = -INFINITY;
  for (int64_t j = j0; j < e; j++) mx = sr[j] > mx ? sr[j] : mx;
  part[0] = mx;
  part[1] = e > j0 ? exp_shifted(sr + j0, e - j0, mx) : 0.f;
}

/* Attention of the G query heads of one KV head, T new tokens each (token t at position
   off + t sees keys j <= off + t), over keys [j0, j1) of its K and V rows [n, D]: each key and
   value row is read once for the whole group. For query (g, t) it leaves the chunk's largest
   score, the sum of exp(score - that) and the weighted sum of the values [D] in
   part[(g T + t) (D + 2) ...] (largest -inf and sums 0 where it sees none of the chunk);
   s holds the scores, row (g, t) at s + (g T + t) stride. q is [T, Hq, D] from the group's
   first head; qs the stride of its tokens. The rows of K and V (and codes' sidecars KS, VS) as
   kv, kind (the keys') and vkind (the values') say. */
static inline __attribute__((always_inline)) void attend_chunk(const float* q, int64_t qs,
    const void* K, const void* V, Sides KS, Sides VS, KvRows kv, const int kind, const int vkind, int64_t j0,
    int64_t j1, int64_t off, int64_t T, int64_t G, const int64_t DC, int64_t Dv, float scale, float* s,
    int64_t stride, float* part) {
  const int64_t D = DC ? DC : Dv;
  const int64_t last = j1 < off + T ? j1 : off + T;  /* past the newest token's position: none */
  float row[kind == KV_F32 && vkind == KV_F32 ? 1 : D];  /* a stored row as float32, converted once for its G T uses */
  for (int64_t j = j0; j < last; j++) {
    const float* kj = float_row(row_at(K, kv, j, kind), kind, ROW_SCALED(kind) ? row_scale(KS, kv, j, kind) : 1.f,
                                GROUPED(kind) ? group_at(KS.scale, kv, j, D) : NULL,
                                KS.zero ? group_at(KS.zero, kv, j, D) : NULL, KS.table, row, D);
    for (int64_t g = 0; g < G; g++)
      for (int64_t t = j > off ? j - off : 0; t < T; t++) {
        const float* qg = q + t * qs + g * D;
        float dot = 0.f;
        #pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < D; d++) dot += qg[d] * kj[d];
        s[(g * T + t) * stride + j] = dot * scale;
      }
  }
  for (int64_t r = 0; r < G * T; r++) {
    const int64_t t = r % T, e = j1 < off + t + 1 ? j1 : off + t + 1;
    float* pr = part + r * (D + 2);
    softmax_part(s + r * stride, j0, e, pr);
    for (int64_t d = 0; d < D; d++) pr[2 + d] = 0.f;
  }
  for (int64_t j = j0; j < last; j++) {
    const float* vj = float_row(row_at(V, kv, j, vkind), vkind, ROW_SCALED(vkind) ? row_scale(VS, kv, j, vkind) : 1.f,
                                GROUPED(vkind) ? group_at(VS.scale, kv, j, D) : NULL,
                                VS.zero ? group_at(VS.zero, kv, j, D) : NULL, VS.table, row, D);
    for (int64_t g = 0; g < G; g++)
      for (int64_t t = j > off ? j - off : 0; t < T; t++) {
        const float p = s[(g * T + t) * stride + j];
        float* acc = part + (g * T + t) * (D + 2) + 2;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += p * vj[d];
      }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__F16C__)
#define HALF_ROWS 1
#else
#define HALF_ROWS 0
#endif
/* codes i .. i + 7 (i a multiple of 8) of a row of b-bit codes (b <= 8: eight in b bytes from
   byte b i / 8, read as the 8-byte word ending there, or at the row's start the word starting
   there: one load, inside a row of 8 bytes or more), as int32 lanes */
static inline __attribute__((always_inline)) __m256i stream8(const void* p, int64_t i, const int b) {
  const int64_t at = (i >> 3) * b;
  uint64_t w;
  if (at >= 8 - b) {
    memcpy(&w, (const uint8_t*)p + at - (8 - b), 8);
    w >>= 8 * (8 - b);
  } else
    memcpy(&w, (const uint8_t*)p + at, 8);
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

/* the vector loops' Lloyd-Max values: indices of at most 4 bits, their centroids in two
   registers (0-7, 8-15) */
#define LM_VECTOR(kind) (IS_LM(kind) && STREAM_BITS(kind) <= 4)

/* the centroids of indices i .. i + 7 (i a multiple of 8) of a row of b-bit indices (b <= 4:
   eight in b bytes from byte b i / 8, read as the word ending there, or at the row's start the
   word starting there: one load, inside the row), lo and hi holding centroids 0-7 and 8-15 */
static inline __attribute__((always_inline)) __m256 lm8(const void* p, int64_t i, const int kind, __m256 lo, __m256 hi) {
  const int b = STREAM_BITS(kind);
  const int64_t at = (i >> 3) * b;
  uint32_t w;
  if (at >= 4 - b) {
    memcpy(&w, (const uint8_t*)p + at - (4 - b), 4);
    w >>= 8 * (4 - b);
  } else
    memcpy(&w, (const uint8_t*)p + at, 4);
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

/* the weighted values of attend_one_avx2 for a head dim of 64 and its G (at most 4) query heads
   together: each value row is loaded once, four 16-lane registers, for all of them (the 8-lane
   loop reads it once a head), G x 4 registers of sums. Each sum takes its keys in the same order
   with the same multiply-adds, so the same bits. Codes weigh by probability times scale. */
static inline __attribute__((always_inline)) void values64_512(const float* s, int64_t stride, const void* V,
    Sides VS, KvRows kv, const int kind, int64_t j0, int64_t e, const int64_t G, float* part, int64_t pstride,
    __m256 lo, __m256 hi) {
  __m512 v[4][4];
  for (int g = 0; g < 4; g++)
    for (int c = 0; c < 4; c++) v[g][c] = _mm512_setzero_ps();
  for (int64_t i = j0; i < e; i++) {
    prefetch_rows(V, kv, i + 16, 1, e - 1, kv_span(kind, 64), kind);  /* the row 16 keys on, asked for ahead of time */
    const char* vi = row_at(V, kv, i, kind);
    const float sv = ROW_SCALED(kind) ? row_scale(VS, kv, i, kind) : 1.f;
    __m512 r[4];
    if (IS_LM(kind)) {  /* scale centroid, a group of 32 channels two registers */
      const uint16_t* gs = group_at(VS.scale, kv, i, 64);
      for (int c = 0; c < 4; c++)
        r[c] = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lm8(vi, 16 * c, kind, lo, hi)),
                                                lm8(vi, 16 * c + 8, kind, lo, hi), 1), _mm512_set1_ps(h2f(gs[c >> 1])));
    } else
      for (int c = 0; c < 4; c++) r[c] = load16(vi, 16 * c, kind);
    if (kind == KV_G32) {  /* zero + scale code, a group of 32 channels two registers */
      float gs[2], gz[2];
      group_floats(VS, kv, i, 64, gs, gz);
      for (int c = 0; c < 4; c++) r[c] = _mm512_fmadd_ps(r[c], _mm512_set1_ps(gs[c >> 1]), _mm512_set1_ps(gz[c >> 1]));
    }
    for (int64_t g = 0; g < G; g++) {
      const __m512 w = _mm512_set1_ps(ROW_SCALED(kind) ? s[g * stride + i] * sv : s[g * stride + i]);
      for (int c = 0; c < 4; c++) v[g][c] = _mm512_fmadd_ps(w, r[c], v[g][c]);
    }
  }
  for (int64_t g = 0; g < G; g++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(part + g * pstride + 2 + 16 * c, v[g][c]);
}
#endif

/* attend_chunk for one token (a decode step) and a head dim DC of 64 or 128, 8 lanes wide:
   the scores of four keys a pass for each query head (their four dot products summed across
   lanes together, not one horizontal sum per key), and the weighted values of 64 keys at a
   time for one head, 64 channels of sums held in registers (not loaded and stored per key).
   K and V rows as kind says, converted as they are loaded; codes' dot products take their
   key's scale, and their values weigh by probability times the value's scale; group-affine
   codes (q4_g32's, TurboQuant's 8-bit keys) become zero + scale code as they are loaded, and
   Lloyd-Max indices (vkind, TurboQuant's values) scale centroid. */
static inline __attribute__((always_inline)) void attend_one_avx2(const float* q, const void* K,
    const void* V, Sides KS, Sides VS, KvRows kv, int64_t j0, int64_t j1,
    int64_t off, int64_t G, const int64_t DC, const int kind, const int vkind, float scale, float* s, int64_t stride,
    float* part, int64_t pstride) {
  const int64_t e = j1 < off + 1 ? j1 : off + 1;  /* the chunk's keys the token sees */
  const int64_t rb = kv_span(kind, DC), vrb = kv_span(vkind, DC);  /* bytes a row */
  const int codes = ROW_SCALED(kind), vcodes = ROW_SCALED(vkind);
  const int grouped = AFFINE(kind);
  float gs[4][grouped ? DC >> 5 : 1], gz[4][grouped ? DC >> 5 : 1];  /* four keys' groups */
  float tab[16] = {0.f};  /* the values' centroids */
  if (IS_LM(vkind)) memcpy(tab, VS.table, sizeof(float) << STREAM_BITS(vkind));
  const __m256 lo = _mm256_loadu_ps(tab), hi = _mm256_loadu_ps(tab + 8);
  const __m128 sc = _mm_set1_ps(scale);
  /* the chunk's first 4 KB of keys and values, which the loops' own prefetches do not reach
     (a step at a 1,024-token context 1.4-1.9% faster, two alternated runs) */
  prefetch_rows(K, kv, j0, 4096 / rb, e - 1, rb, kind);
  prefetch_rows(V, kv, j0, 4096 / vrb, e - 1, vrb, vkind);
  int64_t j = j0;
  for (; j + 4 <= e; j += 4) {
    prefetch_rows(K, kv, j + 2048 / rb, 4, e - 1, rb, kind);  /* the rows 2 KB on, asked for ahead of time */
    const char *k0 = row_at(K, kv, j, kind), *k1 = row_at(K, kv, j + 1, kind);
    const char *k2 = row_at(K, kv, j + 2, kind), *k3 = row_at(K, kv, j + 3, kind);
    const __m128 ksc = codes ? _mm_mul_ps(sc, _mm_setr_ps(row_scale(KS, kv, j, kind), row_scale(KS, kv, j + 1, kind),
                                                          row_scale(KS, kv, j + 2, kind), row_scale(KS, kv, j + 3, kind)))
                             : sc;
    if (grouped)
      for (int k = 0; k < 4; k++) group_floats(KS, kv, j + k, DC, gs[k], gz[k]);
#define KEY8(r, k) (grouped ? _mm256_fmadd_ps(load8(r, c, kind), _mm256_set1_ps(gs[k][c >> 5]), \
                                                     _mm256_set1_ps(gz[k][c >> 5])) : load8(r, c, kind))
    for (int64_t g = 0; g < G; g++) {
      const float* qg = q + g * DC;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < DC; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        a0 = _mm256_fmadd_ps(qv, KEY8(k0, 0), a0);
        a1 = _mm256_fmadd_ps(qv, KEY8(k1, 1), a1);
        a2 = _mm256_fmadd_ps(qv, KEY8(k2, 2), a2);
        a3 = _mm256_fmadd_ps(qv, KEY8(k3, 3), a3);
      }
#undef KEY8
      /* lanes 0-3 of h: the low halves' sums of a0..a3, lanes 4-7 the high halves' */
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(s + g * stride + j, _mm_mul_ps(r, ksc));
    }
  }
  for (; j < e; j++) {
    const char* kj = row_at(K, kv, j, kind);
    const float sj = codes ? scale * row_scale(KS, kv, j, kind) : scale;
    if (grouped) group_floats(KS, kv, j, DC, gs[0], gz[0]);
    for (int64_t g = 0; g < G; g++) {
      float dot = 0.f;
      for (int64_t d = 0; d < DC; d++)
        dot += q[g * DC + d] * (grouped ? gs[0][d >> 5] * load1(kj, d, kind) + gz[0][d >> 5] : load1(kj, d, kind));
      s[g * stride + j] = dot * sj;
    }
  }
  for (int64_t g = 0; g < G; g++) softmax_part(s + g * stride, j0, e, part + g * pstride);
#if defined(__AVX512F__)
  if (DC == 64 && G <= 4) {  /* (a constant group: the sums stay in registers) */
    if (G == 1) values64_512(s, stride, V, VS, kv, vkind, j0, e, 1, part, pstride, lo, hi);
    else if (G == 2) values64_512(s, stride, V, VS, kv, vkind, j0, e, 2, part, pstride, lo, hi);
    else if (G == 3) values64_512(s, stride, V, VS, kv, vkind, j0, e, 3, part, pstride, lo, hi);
    else values64_512(s, stride, V, VS, kv, vkind, j0, e, 4, part, pstride, lo, hi);
  } else
#endif
  for (int64_t h0 = 0; h0 < DC; h0 += 64)  /* 64 channels at a time: 8 registers of sums */
    for (int64_t b = j0; b < e; b += 64) {
      const int64_t be = b + 64 < e ? b + 64 : e;
      if (h0 == 0) prefetch_rows(V, kv, b + 64, be - b, e - 1, vrb, vkind);  /* the next block's rows */
      for (int64_t g = 0; g < G; g++) {
        float* acc = part + g * pstride + 2 + h0;
        const float* p = s + g * stride;
        __m256 v[8];
        for (int i = 0; i < 8; i++) v[i] = b == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * i);
        for (int64_t i = b; i < be; i++) {
          const __m256 w = _mm256_set1_ps(vcodes ? p[i] * row_scale(VS, kv, i, vkind) : p[i]);
          const char* vi = row_at(V, kv, i, vkind);
          float vs[2] = {0.f, 0.f}, vz[2] = {0.f, 0.f};  /* (64 channels: two groups) */
          if (GROUPED(vkind)) {
            const uint16_t* gsv = group_at(VS.scale, kv, i, DC) + (h0 >> 5);
            vs[0] = h2f(gsv[0]), vs[1] = h2f(gsv[1]);
            if (vkind == KV_G32) {
              const uint16_t* gzv = group_at(VS.zero, kv, i, DC) + (h0 >> 5);
              vz[0] = h2f(gzv[0]), vz[1] = h2f(gzv[1]);
            }
          }
          for (int c = 0; c < 8; c++) v[c] = _mm256_fmadd_ps(w, value8(vi, h0 + 8 * c, vkind, vs[c >> 2], vz[c >> 2], lo, hi), v[c]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, v[i]);
      }
    }
  if (e <= j0)
    for (int64_t g = 0; g < G; g++)
      for (int64_t d = 0; d < DC; d++) part[g * pstride + 2 + d] = 0.f;
}
#endif

/* attend_chunk with the head dim a constant for 64 and 128 (the loops drop their remainders);
   with AVX2 those head dims take attend_one_avx2, a token at a time (a call of 16 tokens over
   512 keys: attention 7.8 against 12.9 ms through attend_chunk). Stored rows of other kinds
   (float16 without F16C, keys and values of two kinds: TurboQuant's) are converted a row at a
   time as the loops reach them. */
static void attend_chunk_d(const float* q, int64_t qs, const void* K, const void* V, Sides KS,
    Sides VS, KvRows kv, int64_t j0, int64_t j1, int64_t off, int64_t T, int64_t G, int64_t D,
    int64_t kind, int64_t vkind, float scale, float* s, int64_t stride, float* part) {
#if defined(__AVX2__) && defined(__FMA__)
  /* token t at position off + t, its rows (g, t) T rows apart: the AVX2 loops a token at a time
     (several tokens, a verification, read the split's rows again for each, from the caches) */
  const int pair = (kind == KV_A8 || kind == KV_AF + 5) && (vkind == KV_LM + 3 || vkind == KV_LM + 4);
  if ((D == 64 || D == 128) && ((kind == vkind && kind <= KV_G32) || pair) && ((kind != KV_F16 && kind != KV_FP8) || HALF_ROWS)) {
    for (int64_t t = 0; t < T; t++) {
      float* st = s + t * stride;
      float* pt = part + t * (D + 2);
      const float* qt = q + t * qs;
#define ATTEND_ONE(DC, KIND) attend_one_avx2(qt, K, V, KS, VS, kv, j0, j1, off + t, G, DC, KIND, KIND, scale, st, \
                                             T * stride, pt, T * (D + 2))
#define ATTEND_TWO(DC, KIND, VKIND) attend_one_avx2(qt, K, V, KS, VS, kv, j0, j1, off + t, G, DC, KIND, VKIND, scale, \
                                                    st, T * stride, pt, T * (D + 2))
      if (pair && kind == KV_A8) {  /* TurboQuant's 8-bit keys with 3- or 4-bit values (its default, q8_0,q4_0) */
        if (D == 64 && vkind == KV_LM + 3) ATTEND_TWO(64, KV_A8, KV_LM + 3);
        else if (D == 64) ATTEND_TWO(64, KV_A8, KV_LM + 4);
        else if (vkind == KV_LM + 3) ATTEND_TWO(128, KV_A8, KV_LM + 3);
        else ATTEND_TWO(128, KV_A8, KV_LM + 4);
      } else if (pair) {  /* 5-bit keys (q5_0r,q4_0: about 3x smaller than 16-bit pages) */
        if (D == 64 && vkind == KV_LM + 3) ATTEND_TWO(64, KV_AF + 5, KV_LM + 3);
        else if (D == 64) ATTEND_TWO(64, KV_AF + 5, KV_LM + 4);
        else if (vkind == KV_LM + 3) ATTEND_TWO(128, KV_AF + 5, KV_LM + 3);
        else ATTEND_TWO(128, KV_AF + 5, KV_LM + 4);
      } else if (D == 64 && kind == KV_F32) ATTEND_ONE(64, KV_F32);
      else if (D == 128 && kind == KV_F32) ATTEND_ONE(128, KV_F32);
      else if (D == 64 && kind == KV_Q8) ATTEND_ONE(64, KV_Q8);
      else if (D == 128 && kind == KV_Q8) ATTEND_ONE(128, KV_Q8);
      else if (D == 64 && kind == KV_Q4) ATTEND_ONE(64, KV_Q4);
      else if (D == 128 && kind == KV_Q4) ATTEND_ONE(128, KV_Q4);
      else if (D == 64 && kind == KV_G32) ATTEND_ONE(64, KV_G32);
      else if (D == 128 && kind == KV_G32) ATTEND_ONE(128, KV_G32);
#if HALF_ROWS
      else if (D == 64 && kind == KV_FP8) ATTEND_ONE(64, KV_FP8);
      else if (D == 128 && kind == KV_FP8) ATTEND_ONE(128, KV_FP8);
      else if (D == 64) ATTEND_ONE(64, KV_F16);
      else ATTEND_ONE(128, KV_F16);
#endif
#undef ATTEND_ONE
#undef ATTEND_TWO
    }
    return;
  }
#endif
  if (D == 64) attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 64, D, scale, s, stride, part);
  else if (D == 128) attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 128, D, scale, s, stride, part);
  else attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 0, D, scale, s, stride, part);
}

/* out [D] of one query head from its splits' parts (largest score, sum, weighted values) */
static inline void merge_parts(const float* part, int64_t splits, int64_t step, int64_t D, float* out) {
  float mx = -INFINITY, tot = 0.f;
  for (int64_t i = 0; i < splits; i++) mx = part[i * step] > mx ? part[i * step] : mx;
  for (int64_t d = 0; d < D; d++) out[d] = 0.f;
  for (int64_t i = 0; i < splits; i++) {
    const float* pi = part + i * step;
    if (pi[1] == 0.f) continue;  /* a split past this token's position */
    const float w = splits == 1 ? 1.f : expf(pi[0] - mx);
    tot += w * pi[1];
    for (int64_t d = 0; d < D; d++) out[d] += w * pi[2 + d];
  }
  const float inv = 1.f / tot;
  for (int64_t d = 0; d < D; d++) out[d] *= inv;
}

/* keys a split of attention covers: at least 4 tasks a thread where the keys allow, as many
   for every thread (3 KV heads on 2 threads: 12 tasks, not 9 split 5 and 4), no split under
   64 keys */
static inline int64_t split_keys(int64_t n, int64_t Hkv, int threads) {
  int64_t want = (4 * (int64_t)threads + Hkv - 1) / Hkv;
  while ((Hkv * want) % threads) want++;
  int64_t chunk = (n + want - 1) / want;
  return chunk < 64 ? 64 : chunk;
}
"""
