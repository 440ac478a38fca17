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

/* Where a head's key or value rows lie: rows rs elements apart from the head's first
   (tb NULL: a tail buffer [cap, D] of the head, rs = D), or rows of pages through a block
   table: row j in block tb[j >> bsh] of 1 << bsh rows, each rs elements (H_kv D: the NHD page
   layout [blocks, 1 << bsh, H_kv, D]) after the last, the head's base its first row's. */
typedef struct { const int32_t* tb; int64_t bsh, rs; } KvRows;

/* row j of the head whose rows start at P, es bytes an element */
static inline __attribute__((always_inline)) const char* row_at(const void* P, KvRows kv, int64_t j, int64_t es) {
  const int64_t r = kv.tb ? ((int64_t)kv.tb[j >> kv.bsh] << kv.bsh) + (j & (((int64_t)1 << kv.bsh) - 1)) : j;
  return (const char*)P + r * kv.rs * es;
}

/* asks for the lines of rows [j, j + n) of the head at P, each m bytes, past row last none */
static inline __attribute__((always_inline)) void prefetch_rows(const void* P, KvRows kv, int64_t j, int64_t n,
                                                                int64_t last, int64_t m, int64_t es) {
  for (int64_t r = j; r < j + n && r <= last; r++)
    for (int64_t c = 0; c < m; c += 64) __builtin_prefetch(row_at(P, kv, r, es) + c, 0, 3);
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
   first head; qs the stride of its tokens. The rows of K and V as kv says. */
static inline __attribute__((always_inline)) void attend_chunk(const float* q, int64_t qs,
    const void* K, const void* V, KvRows kv, const int half, int64_t j0, int64_t j1, int64_t off, int64_t T,
    int64_t G, const int64_t DC, int64_t Dv, float scale, float* s, int64_t stride, float* part) {
  const int64_t D = DC ? DC : Dv, es = half ? 2 : 4;
  const int64_t last = j1 < off + T ? j1 : off + T;  /* past the newest token's position: none */
  float row[half ? D : 1];  /* a float16 row, converted once for its G T uses */
  for (int64_t j = j0; j < last; j++) {
    const char* kr = row_at(K, kv, j, es);
    const float* kj = half ? half_row((const uint16_t*)kr, row, D) : (const float*)kr;
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
    const char* vr = row_at(V, kv, j, es);
    const float* vj = half ? half_row((const uint16_t*)vr, row, D) : (const float*)vr;
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
/* eight floats from element i of K or V rows, float32 or (half, with F16C) float16 */
static inline __attribute__((always_inline)) __m256 load8(const void* p, int64_t i, const int half) {
#if HALF_ROWS
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
#endif
  return _mm256_loadu_ps((const float*)p + i);
}

static inline __attribute__((always_inline)) float load1(const void* p, int64_t i, const int half) {
  return half ? h2f(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

#if defined(__AVX512F__)
/* the weighted values of attend_one_avx2 for a head dim of 64 and its G (at most 4) query heads
   together: each value row is loaded once, four 16-lane registers, for all of them (the 8-lane
   loop reads it once a head), G x 4 registers of sums. Each sum takes its keys in the same order
   with the same multiply-adds, so the same bits. */
static inline __attribute__((always_inline)) void values64_512(const float* s, int64_t stride, const void* V,
    KvRows kv, const int half, int64_t j0, int64_t e, const int64_t G, float* part, int64_t pstride) {
  const int64_t es = half ? 2 : 4;
  __m512 v[4][4];
  for (int g = 0; g < 4; g++)
    for (int c = 0; c < 4; c++) v[g][c] = _mm512_setzero_ps();
  for (int64_t i = j0; i < e; i++) {
    prefetch_rows(V, kv, i + 16, 1, e - 1, 64 * es, es);  /* the row 16 keys on, asked for ahead of time */
    const char* vi = row_at(V, kv, i, es);
    __m512 r[4];
    for (int c = 0; c < 4; c++)
      r[c] = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)vi + 16 * c)))
                  : _mm512_loadu_ps((const float*)vi + 16 * c);
    for (int64_t g = 0; g < G; g++) {
      const __m512 w = _mm512_set1_ps(s[g * stride + i]);
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
   K and V rows are float32, or float16 with half (converted as they are loaded), where kv
   says. */
static inline __attribute__((always_inline)) void attend_one_avx2(const float* q, const void* K,
    const void* V, KvRows kv, int64_t j0, int64_t j1, int64_t off, int64_t G, const int64_t DC, const int half,
    float scale, float* s, int64_t stride, float* part, int64_t pstride) {
  const int64_t e = j1 < off + 1 ? j1 : off + 1;  /* the chunk's keys the token sees */
  const int64_t es = half ? 2 : 4, rb = DC * es;  /* bytes an element, a row */
  const __m128 sc = _mm_set1_ps(scale);
  /* the chunk's first 4 KB of keys and values, which the loops' own prefetches do not reach
     (a step at a 1,024-token context 1.4-1.9% faster, two alternated runs) */
  prefetch_rows(K, kv, j0, 4096 / rb, e - 1, rb, es);
  prefetch_rows(V, kv, j0, 4096 / rb, e - 1, rb, es);
  int64_t j = j0;
  for (; j + 4 <= e; j += 4) {
    prefetch_rows(K, kv, j + 2048 / rb, 4, e - 1, rb, es);  /* the rows 2 KB on, asked for ahead of time */
    const char *k0 = row_at(K, kv, j, es), *k1 = row_at(K, kv, j + 1, es);
    const char *k2 = row_at(K, kv, j + 2, es), *k3 = row_at(K, kv, j + 3, es);
    for (int64_t g = 0; g < G; g++) {
      const float* qg = q + g * DC;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < DC; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        a0 = _mm256_fmadd_ps(qv, load8(k0, c, half), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k1, c, half), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k2, c, half), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k3, c, half), a3);
      }
      /* lanes 0-3 of h: the low halves' sums of a0..a3, lanes 4-7 the high halves' */
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(s + g * stride + j, _mm_mul_ps(r, sc));
    }
  }
  for (; j < e; j++) {
    const char* kj = row_at(K, kv, j, es);
    for (int64_t g = 0; g < G; g++) {
      float dot = 0.f;
      for (int64_t d = 0; d < DC; d++) dot += q[g * DC + d] * load1(kj, d, half);
      s[g * stride + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < G; g++) softmax_part(s + g * stride, j0, e, part + g * pstride);
#if defined(__AVX512F__)
  if (DC == 64 && G <= 4) {  /* (a constant group: the sums stay in registers) */
    if (G == 1) values64_512(s, stride, V, kv, half, j0, e, 1, part, pstride);
    else if (G == 2) values64_512(s, stride, V, kv, half, j0, e, 2, part, pstride);
    else if (G == 3) values64_512(s, stride, V, kv, half, j0, e, 3, part, pstride);
    else values64_512(s, stride, V, kv, half, j0, e, 4, part, pstride);
  } else
#endif
  for (int64_t h0 = 0; h0 < DC; h0 += 64)  /* 64 channels at a time: 8 registers of sums */
    for (int64_t b = j0; b < e; b += 64) {
      const int64_t be = b + 64 < e ? b + 64 : e;
      if (h0 == 0) prefetch_rows(V, kv, b + 64, be - b, e - 1, rb, es);  /* the next block's rows */
      for (int64_t g = 0; g < G; g++) {
        float* acc = part + g * pstride + 2 + h0;
        const float* p = s + g * stride;
        __m256 v[8];
        for (int i = 0; i < 8; i++) v[i] = b == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * i);
        for (int64_t i = b; i < be; i++) {
          const __m256 w = _mm256_broadcast_ss(p + i);
          const char* vi = row_at(V, kv, i, es);
          for (int c = 0; c < 8; c++) v[c] = _mm256_fmadd_ps(w, load8(vi, h0 + 8 * c, half), v[c]);
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
   512 keys: attention 7.8 against 12.9 ms through attend_chunk). float16 rows (half) elsewhere
   are converted a row at a time as the loops reach them. */
static void attend_chunk_d(const float* q, int64_t qs, const void* K, const void* V, KvRows kv, int64_t j0,
    int64_t j1, int64_t off, int64_t T, int64_t G, int64_t D, int64_t half, float scale, float* s,
    int64_t stride, float* part) {
#if defined(__AVX2__) && defined(__FMA__)
  /* token t at position off + t, its rows (g, t) T rows apart: the AVX2 loops a token at a time
     (several tokens, a verification, read the split's rows again for each, from the caches) */
  if ((D == 64 || D == 128) && (!half || HALF_ROWS)) {
    for (int64_t t = 0; t < T; t++) {
      float* st = s + t * stride;
      float* pt = part + t * (D + 2);
      const float* qt = q + t * qs;
      if (D == 64 && !half) attend_one_avx2(qt, K, V, kv, j0, j1, off + t, G, 64, 0, scale, st, T * stride, pt, T * (D + 2));
      else if (D == 128 && !half) attend_one_avx2(qt, K, V, kv, j0, j1, off + t, G, 128, 0, scale, st, T * stride, pt, T * (D + 2));
#if HALF_ROWS
      else if (D == 64) attend_one_avx2(qt, K, V, kv, j0, j1, off + t, G, 64, 1, scale, st, T * stride, pt, T * (D + 2));
      else attend_one_avx2(qt, K, V, kv, j0, j1, off + t, G, 128, 1, scale, st, T * stride, pt, T * (D + 2));
#endif
    }
    return;
  }
#endif
  if (half) {
    if (D == 64) attend_chunk(q, qs, K, V, kv, 1, j0, j1, off, T, G, 64, D, scale, s, stride, part);
    else if (D == 128) attend_chunk(q, qs, K, V, kv, 1, j0, j1, off, T, G, 128, D, scale, s, stride, part);
    else attend_chunk(q, qs, K, V, kv, 1, j0, j1, off, T, G, 0, D, scale, s, stride, part);
  } else {
    if (D == 64) attend_chunk(q, qs, K, V, kv, 0, j0, j1, off, T, G, 64, D, scale, s, stride, part);
    else if (D == 128) attend_chunk(q, qs, K, V, kv, 0, j0, j1, off, T, G, 128, D, scale, s, stride, part);
    else attend_chunk(q, qs, K, V, kv, 0, j0, j1, off, T, G, 0, D, scale, s, stride, part);
  }
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
