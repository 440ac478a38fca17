"""The C side of the one-call decode step's attention (:mod:`kvtier.model.cpu_step`): the
exponentials of softmax, and attention of a KV head's query group over a split of its keys
(the rows read as :mod:`kvtier.model.step_rows` says), with the merge of the splits.

Compiled with the step's other sources into one library
(:func:`kvtier.model.step_kernels.step_source`), after the rows' formats and before the step
itself.
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
#if defined(__AVX512F__)
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

/* keys a split covers in a batch-invariant step: the same for every token whatever else the call
   holds, so a token's splits, and the order its merge adds them in, depend on its own position only */
#define INVARIANT_SPLIT 128

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
