"""The C side of :mod:`kvtier.model.cpu_step`: the one-call decode step's source, the ctypes
structures of its pointer plan, and the compiled library.

``decode_step`` runs up to 16 tokens of one sequence through every layer, the final norm and
the LM head inside one OpenMP parallel region; the products are the packed kernels' own task
bodies (:mod:`kvtier.model.packed_kernels`), or with int8 activations those of
:mod:`kvtier.model.act_quant`, and the elementwise steps the C kernels of
:mod:`kvtier.kernels.cpu_fused`, so the library is compiled from the four sources together
(:func:`step_source`).
"""

from __future__ import annotations

import ctypes
import functools

from kvtier.kernels import cpu_fused
from kvtier.kernels.native import load_or_warn
from kvtier.model import act_quant, packed_kernels

__all__ = ["STEP_SOURCE", "Kernels", "Layer", "Lin", "load_kernels", "step_source"]

STEP_SOURCE = r"""
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

typedef struct {       /* one projection: y = W x (+ bias) */
  int64_t fmt;         /* 0 float32 weight [N, K], 1 Q4_1 codes, 2 Q8_0 codes */
  const void* w; const void* d; const void* m; const float* bias;
  int64_t N, K;
} Lin;

typedef struct {
  const float* attn_norm; const float* ffn_norm;
  Lin wqkv, wo, w13, w2;
  void* k; void* v;   /* the cache's buffers [H_kv, cap, D] */
  int64_t offset, cap; /* the write position, the buffers' length */
  int64_t half;        /* the buffers hold float16 (else float32) */
} Layer;

/* where int8 activations go (kvtier.model.act_quant): codes [M, K], dx and sx [M, K / 32];
   NULL for the exact products */
typedef struct { int8_t* q; float* dx; float* sx; } ActQ8;

/* whether a product takes int8 activations: a Q4_1 or Q8_0 weight, with aq */
static inline int takes_q8(const Lin* l, const ActQ8* aq) { return aq && (l->fmt == 1 || l->fmt == 2); }

/* y [M, N] = x [M, K] W^T (+ bias); the tasks are shared by the threads of the enclosing
   region, which meet at the barrier after them. With aq, Q4_1 and Q8_0 weights multiply x
   quantised to int8: the codes are in aq already when ready (quantised where x was made),
   else one thread quantises x here while the others wait at the single's barrier. */
static void linear_rows(const Lin* l, const float* x, float* y, int64_t M, const ActQ8* aq, int ready) {
  const int64_t N = l->N, K = l->K;
  if (takes_q8(l, aq)) {
    if (!ready) {
      #pragma omp single
      quantize_rows_q8(x, aq->q, aq->dx, aq->sx, M, K, l->fmt == 1);
    }
    const int64_t tasks = (N + 1) / 2;
    if (l->fmt == 1 && M == 1) {  /* (a loop of its own: see q4_1_q8_task1) */
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; t++) q4_1_q8_task1(aq->q, aq->dx, aq->sx, l->w, l->d, l->m, y, N, K, t);
    } else if (l->fmt == 1) {
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; t++) q4_1_q8_task(aq->q, aq->dx, aq->sx, l->w, l->d, l->m, y, M, N, K, t);
    } else if (M == 1) {
      #pragma omp for schedule(static)
      for (int64_t n = 0; n < N; n++) q8_0_q8_task1(aq->q, aq->dx, l->w, l->d, y, N, K, n);
    } else {
      #pragma omp for schedule(static)
      for (int64_t n = 0; n < N; n++) q8_0_q8_task(aq->q, aq->dx, l->w, l->d, y, M, N, K, n);
    }
  } else if (l->fmt == 1 && M == 1) {  /* (the row count a constant: see q4_1_q8_task1) */
    const int64_t tasks = q4_1_tasks(N);
    int8_t digits[3 * K];  /* (each thread makes the row's digits itself: no wait) */
    float scales[5 * (K / 32)];
    const Q4Row row = q4_1_row(x, K, digits, scales);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) q4_1_task(x, &row, l->w, l->d, l->m, y, 1, N, K, t);
  } else if (l->fmt == 1) {
    const int64_t tasks = q4_1_tasks(N);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) q4_1_task(x, NULL, l->w, l->d, l->m, y, M, N, K, t);
  } else if (l->fmt == 2 && M == 1) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) q8_0_task(x, l->w, l->d, y, 1, N, K, n);
  } else if (l->fmt == 2) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) q8_0_task(x, l->w, l->d, y, M, N, K, n);
  } else {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      const float* w = (const float*)l->w + n * K;
      for (int64_t r = 0; r < M; r++) {
        const float* xr = x + r * K;
        float s = 0.f;
        #pragma omp simd reduction(+:s)
        for (int64_t k = 0; k < K; k++) s += xr[k] * w[k];
        y[r * N + n] = s;
      }
    }
  }
  if (l->bias) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++)
      for (int64_t r = 0; r < M; r++) y[r * N + n] += l->bias[n];
  }
}

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
   first head; qs the stride of its tokens. */
static inline __attribute__((always_inline)) void attend_chunk(const float* q, int64_t qs,
    const void* K, const void* V, const int half, int64_t j0, int64_t j1, int64_t off, int64_t T,
    int64_t G, const int64_t DC, int64_t Dv, float scale, float* s, int64_t stride, float* part) {
  const int64_t D = DC ? DC : Dv;
  const int64_t last = j1 < off + T ? j1 : off + T;  /* past the newest token's position: none */
  float row[half ? D : 1];  /* a float16 row, converted once for its G T uses */
  for (int64_t j = j0; j < last; j++) {
    const float* kj = half ? half_row((const uint16_t*)K + j * D, row, D) : (const float*)K + j * D;
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
    const float* vj = half ? half_row((const uint16_t*)V + j * D, row, D) : (const float*)V + j * D;
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
    const int half, int64_t j0, int64_t e, const int64_t G, float* part, int64_t pstride) {
  const int64_t es = half ? 2 : 4;
  __m512 v[4][4];
  for (int g = 0; g < 4; g++)
    for (int c = 0; c < 4; c++) v[g][c] = _mm512_setzero_ps();
  for (int64_t i = j0; i < e; i++) {
    for (int64_t c = 0; c < 64 * es; c += 64)  /* the row 16 keys on, asked for ahead of time */
      _mm_prefetch((const char*)V + (i + 16) * 64 * es + c, _MM_HINT_T0);
    __m512 r[4];
    for (int c = 0; c < 4; c++)
      r[c] = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)V + i * 64 + 16 * c)))
                  : _mm512_loadu_ps((const float*)V + i * 64 + 16 * c);
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
   K and V rows are float32, or float16 with half (converted as they are loaded). */
static inline __attribute__((always_inline)) void attend_one_avx2(const float* q, const void* K,
    const void* V, int64_t j0, int64_t j1, int64_t off, int64_t G, const int64_t DC, const int half,
    float scale, float* s, int64_t stride, float* part, int64_t pstride) {
  const int64_t e = j1 < off + 1 ? j1 : off + 1;  /* the chunk's keys the token sees */
  const int64_t es = half ? 2 : 4, line = 64 / es;  /* bytes an element, elements a cache line */
  const __m128 sc = _mm_set1_ps(scale);
  {  /* the chunk's first 4 KB of keys and values, which the loops' own prefetches do not reach
       (a step at a 1,024-token context 1.4-1.9% faster, two alternated runs) */
    const int64_t first = (e - j0) * DC * es < 4096 ? (e - j0) * DC * es : 4096;
    for (int64_t i = 0; i < first; i += 64) {
      _mm_prefetch((const char*)K + j0 * DC * es + i, _MM_HINT_T0);
      _mm_prefetch((const char*)V + j0 * DC * es + i, _MM_HINT_T0);
    }
  }
  int64_t j = j0;
  for (; j + 4 <= e; j += 4) {
    const int64_t k0 = j * DC;
    for (int64_t c = 0; c < 4 * DC; c += line)  /* the rows 2 KB on, asked for ahead of time */
      _mm_prefetch((const char*)K + (k0 + c) * es + 2048, _MM_HINT_T0);
    for (int64_t g = 0; g < G; g++) {
      const float* qg = q + g * DC;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < DC; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        a0 = _mm256_fmadd_ps(qv, load8(K, k0 + c, half), a0);
        a1 = _mm256_fmadd_ps(qv, load8(K, k0 + DC + c, half), a1);
        a2 = _mm256_fmadd_ps(qv, load8(K, k0 + 2 * DC + c, half), a2);
        a3 = _mm256_fmadd_ps(qv, load8(K, k0 + 3 * DC + c, half), a3);
      }
      /* lanes 0-3 of h: the low halves' sums of a0..a3, lanes 4-7 the high halves' */
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(s + g * stride + j, _mm_mul_ps(r, sc));
    }
  }
  for (; j < e; j++)
    for (int64_t g = 0; g < G; g++) {
      float dot = 0.f;
      for (int64_t d = 0; d < DC; d++) dot += q[g * DC + d] * load1(K, j * DC + d, half);
      s[g * stride + j] = dot * scale;
    }
  for (int64_t g = 0; g < G; g++) softmax_part(s + g * stride, j0, e, part + g * pstride);
#if defined(__AVX512F__)
  if (DC == 64 && G <= 4) {  /* (a constant group: the sums stay in registers) */
    if (G == 1) values64_512(s, stride, V, half, j0, e, 1, part, pstride);
    else if (G == 2) values64_512(s, stride, V, half, j0, e, 2, part, pstride);
    else if (G == 3) values64_512(s, stride, V, half, j0, e, 3, part, pstride);
    else values64_512(s, stride, V, half, j0, e, 4, part, pstride);
  } else
#endif
  for (int64_t h0 = 0; h0 < DC; h0 += 64)  /* 64 channels at a time: 8 registers of sums */
    for (int64_t b = j0; b < e; b += 64) {
      const int64_t be = b + 64 < e ? b + 64 : e;
      if (h0 == 0)
        for (int64_t i = b * DC; i < be * DC; i += line)  /* the next block's rows */
          _mm_prefetch((const char*)V + (i + 64 * DC) * es, _MM_HINT_T0);
      for (int64_t g = 0; g < G; g++) {
        float* acc = part + g * pstride + 2 + h0;
        const float* p = s + g * stride;
        __m256 v[8];
        for (int i = 0; i < 8; i++) v[i] = b == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * i);
        for (int64_t i = b; i < be; i++) {
          const __m256 w = _mm256_broadcast_ss(p + i);
          const int64_t vr = i * DC + h0;
          for (int c = 0; c < 8; c++) v[c] = _mm256_fmadd_ps(w, load8(V, vr + 8 * c, half), v[c]);
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
static void attend_chunk_d(const float* q, int64_t qs, const void* K, const void* V, int64_t j0,
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
      if (D == 64 && !half) attend_one_avx2(qt, K, V, j0, j1, off + t, G, 64, 0, scale, st, T * stride, pt, T * (D + 2));
      else if (D == 128 && !half) attend_one_avx2(qt, K, V, j0, j1, off + t, G, 128, 0, scale, st, T * stride, pt, T * (D + 2));
#if HALF_ROWS
      else if (D == 64) attend_one_avx2(qt, K, V, j0, j1, off + t, G, 64, 1, scale, st, T * stride, pt, T * (D + 2));
      else attend_one_avx2(qt, K, V, j0, j1, off + t, G, 128, 1, scale, st, T * stride, pt, T * (D + 2));
#endif
    }
    return;
  }
#endif
  if (half) {
    if (D == 64) attend_chunk(q, qs, K, V, 1, j0, j1, off, T, G, 64, D, scale, s, stride, part);
    else if (D == 128) attend_chunk(q, qs, K, V, 1, j0, j1, off, T, G, 128, D, scale, s, stride, part);
    else attend_chunk(q, qs, K, V, 1, j0, j1, off, T, G, 0, D, scale, s, stride, part);
  } else {
    if (D == 64) attend_chunk(q, qs, K, V, 0, j0, j1, off, T, G, 64, D, scale, s, stride, part);
    else if (D == 128) attend_chunk(q, qs, K, V, 0, j0, j1, off, T, G, 128, D, scale, s, stride, part);
    else attend_chunk(q, qs, K, V, 0, j0, j1, off, T, G, 0, D, scale, s, stride, part);
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

/* y[i] = float16 bits of x[i], rounded as the step rounds the keys and values it stores */
void round_to_half(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = f2h(x[i]);
}

/* y[i] = the float16 bits h[i] as float32, as the step reads stored rows (for tests) */
void widen_half(const uint16_t* h, float* y, int64_t n) { half_row(h, y, n); }

/* T tokens of one sequence through n_layers layers, the final norm and the LM head: logits
   [T, V], or [1, V] of the last token with last_only. ids are the tokens, emb the embedding
   table [V, dim] (ids in range: the caller checks), cos/sin [T, D] their rotations; scratch holds T (4 dim + (3 Hq + 3 Hkv) D + 3 hidden) +
   Hq T score_stride + Hq T (score_stride / 64 + 1) (D + 2) floats, score_stride at least every
   layer's offset + T, and with act_q8 (int8 activations for the packed products) T kmax / 4 +
   2 T kmax / 32 more, kmax the widest input of a product (a multiple of 32). */
void decode_step(const Layer* layers, int64_t n_layers, const Lin* head, const float* norm_w,
                 const float* emb, const int64_t* ids, const float* cos, const float* sin, int64_t T, int64_t last_only,
                 int64_t dim, int64_t Hq, int64_t Hkv, int64_t D, int64_t hidden, float eps,
                 float scale, float* scratch, int64_t score_stride, float* logits, int64_t act_q8,
                 int64_t kmax, int threads) {
  const int64_t QKV = (Hq + 2 * Hkv) * D, QK = (Hq + Hkv) * D;
  float* h = scratch;                      /* the residual stream [T, dim] */
  float* nrm = h + T * dim;                /* its RMSNorm [T, dim] */
  float* delta = nrm + T * dim;            /* the MLP's output [T, dim] */
  float* a = delta + T * dim;              /* attention's projection [T, dim] */
  float* qkv = a + T * dim;                /* [T, Hq + 2 Hkv, D] */
  float* qk = qkv + T * QKV;               /* q and k rotated [T, Hq + Hkv, D] */
  float* att = qk + T * QK;                /* attention's output [T, Hq, D] */
  float* ff = att + T * Hq * D;            /* gate and up [T, 2 hidden] */
  float* act = ff + T * 2 * hidden;        /* silu(gate) * up [T, hidden] */
  float* scores = act + T * hidden;        /* [Hq, T, score_stride] */
  float* parts = scores + Hq * T * score_stride;  /* [Hkv, splits, group, T, D + 2] */
  const int64_t group = Hq / Hkv, gt = group * T;
  float* aq_end = parts + Hq * T * (score_stride / 64 + 1) * (D + 2);
  const ActQ8 aq_bufs = {(int8_t*)aq_end, aq_end + T * kmax / 4, aq_end + T * kmax / 4 + T * kmax / 32};
  const ActQ8* aq = act_q8 ? &aq_bufs : NULL;
  for (int64_t t = 0; t < T; t++) memcpy(h + t * dim, emb + ids[t] * dim, dim * sizeof(float));
  #pragma omp parallel num_threads(threads)
  {
    for (int64_t l = 0; l < n_layers; l++) {
      const Layer* ly = layers + l;
      const int64_t off = ly->offset, cap = ly->cap;
      /* (wo's and w2's inputs are quantised in place when each head's, each SiLU span's, blocks
         start and end where the product's blocks do: pairs of blocks for Q4_1's layout) */
      const int q_qkv = takes_q8(&ly->wqkv, aq), q_w13 = takes_q8(&ly->w13, aq);
      const int q_wo = takes_q8(&ly->wo, aq) && D % (ly->wo.fmt == 1 ? 64 : 32) == 0;
      const int q_w2 = takes_q8(&ly->w2, aq) && hidden % (ly->w2.fmt == 1 ? 512 : 256) == 0;
      #pragma omp single
      {
        add_rms_norm(h, l ? delta : NULL, ly->attn_norm, h, nrm, T, dim, eps, 1);
        if (q_qkv) quantize_rows_q8(nrm, aq->q, aq->dx, aq->sx, T, dim, ly->wqkv.fmt == 1);
      }
      linear_rows(&ly->wqkv, nrm, qkv, T, aq, q_qkv);
      #pragma omp single
      {
        rope(qkv, 0, QKV, D, cos, sin, 0, D, qk, 1, T, Hq + Hkv, D, 1);
        for (int64_t t = 0; t < T; t++)
          for (int64_t kh = 0; kh < Hkv; kh++) {
            const int64_t row = (kh * cap + off + t) * D;
            const float* kn = qk + t * QK + (Hq + kh) * D;
            const float* vn = qkv + t * QKV + (Hq + Hkv + kh) * D;
            if (ly->half)
              for (int64_t d = 0; d < D; d++) {
                ((uint16_t*)ly->k)[row + d] = f2h(kn[d]);
                ((uint16_t*)ly->v)[row + d] = f2h(vn[d]);
              }
            else {
              memcpy((float*)ly->k + row, kn, D * sizeof(float));
              memcpy((float*)ly->v + row, vn, D * sizeof(float));
            }
          }
      }
      const int64_t n = off + T, chunk = split_keys(n, Hkv, threads), splits = (n + chunk - 1) / chunk;
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < Hkv * splits; t++) {  /* (KV head, split of its keys) */
        const int64_t kh = t / splits, j0 = (t % splits) * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        const int64_t es = ly->half ? 2 : 4;
        const void* K = (const char*)ly->k + kh * cap * D * es;
        const void* V = (const char*)ly->v + kh * cap * D * es;
        const float* q = qk + kh * group * D;
        float* s = scores + kh * gt * score_stride;
        float* part = parts + t * gt * (D + 2);
        attend_chunk_d(q, QK, K, V, j0, j1, off, T, group, D, ly->half, scale, s, score_stride, part);
      }
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < Hq * T; r++) {  /* query (head hq, token t): parts ((kh splits + i) gt + g T + t) */
        const int64_t hq = r / T, t = r % T, kh = hq / group, g = hq % group;
        merge_parts(parts + (kh * splits * gt + g * T + t) * (D + 2), splits, gt * (D + 2), D,
                    att + (t * Hq + hq) * D);
        if (q_wo) {  /* this head's whole blocks of wo's input row t */
          const int64_t b = (t * Hq + hq) * D / 32;
          quantize_rows_q8(att + (t * Hq + hq) * D, aq->q + b * 32, aq->dx + b, aq->sx + b, 1, D, ly->wo.fmt == 1);
        }
      }
      linear_rows(&ly->wo, att, a, T, aq, q_wo);
      #pragma omp single
      {
        add_rms_norm(h, a, ly->ffn_norm, h, nrm, T, dim, eps, 1);
        if (q_w13) quantize_rows_q8(nrm, aq->q, aq->dx, aq->sx, T, dim, ly->w13.fmt == 1);
      }
      linear_rows(&ly->w13, nrm, ff, T, aq, q_w13);
      #pragma omp for schedule(static)
      for (int64_t c = 0; c < T * 8; c++) {  /* silu_mul's arithmetic, each row in 8 spans */
        const int64_t t = c / 8, j0 = (c % 8) * hidden / 8, j1 = (c % 8 + 1) * hidden / 8;
        const float* g = ff + t * 2 * hidden;
        for (int64_t j = j0; j < j1; j++) act[t * hidden + j] = (g[j] / (1.0f + expf(-g[j]))) * g[hidden + j];
        if (q_w2) {  /* the span's whole blocks (or pairs of blocks) of w2's input row t */
          const int64_t b = (t * hidden + j0) / 32;
          quantize_rows_q8(act + t * hidden + j0, aq->q + b * 32, aq->dx + b, aq->sx + b, 1, j1 - j0, ly->w2.fmt == 1);
        }
      }
      linear_rows(&ly->w2, act, delta, T, aq, q_w2);
    }
    const int64_t first = last_only ? T - 1 : 0;
    const int q_head = takes_q8(head, aq);
    #pragma omp single
    {
      add_rms_norm(h + first * dim, delta + first * dim, norm_w, h + first * dim, nrm + first * dim,
                   T - first, dim, eps, 1);
      if (q_head) quantize_rows_q8(nrm + first * dim, aq->q, aq->dx, aq->sx, T - first, dim, head->fmt == 1);
    }
    linear_rows(head, nrm + first * dim, logits, T - first, aq, q_head);
  }
}
"""


class Lin(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("w", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("wqkv", Lin),
                ("wo", Lin), ("w13", Lin), ("w2", Lin), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("offset", ctypes.c_int64), ("cap", ctypes.c_int64),
                ("half", ctypes.c_int64)]


class Kernels:
    def __init__(self, lib: ctypes.CDLL):
        self.decode_step = lib.decode_step
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.decode_step.argtypes = ([p, i, p, p, p, p, p, p] + [i] * 7 + [ctypes.c_float] * 2
                                     + [p, i, p, i, i, ctypes.c_int])
        self.decode_step.restype = None
        # (the float16 rounding of the stored keys and its inverse, for tests)
        self.round_to_half, self.widen_half = lib.round_to_half, lib.widen_half
        for fn in (self.round_to_half, self.widen_half):
            fn.argtypes = [p, p, i]
            fn.restype = None
        # (the int8 activations' quantiser and products on their own, for tests)
        self.quantize_rows_q8, self.q4_1_q8_gemv, self.q8_0_q8_gemv = (
            lib.quantize_rows_q8, lib.q4_1_q8_gemv, lib.q8_0_q8_gemv)
        self.quantize_rows_q8.argtypes = [p] * 4 + [i] * 2 + [ctypes.c_int]
        self.q4_1_q8_gemv.argtypes = [p] * 7 + [i] * 3 + [ctypes.c_int]
        self.q8_0_q8_gemv.argtypes = [p] * 5 + [i] * 3 + [ctypes.c_int]
        for fn in (self.quantize_rows_q8, self.q4_1_q8_gemv, self.q8_0_q8_gemv):
            fn.restype = None


@functools.cache
def load_kernels() -> Kernels | None:
    """Compile (once per machine) and load the step; ``None`` with a warning where no C compiler
    builds it."""
    return load_or_warn("cpu_step", step_source(), Kernels, "decode steps take the layered forward")


def step_source() -> str:
    """The library's whole C source: the packed products, the elementwise kernels, the int8
    activations' products (:mod:`kvtier.model.act_quant`) and the step."""
    return packed_kernels._C_SOURCE + cpu_fused._C_SOURCE + act_quant._C_SOURCE + STEP_SOURCE
