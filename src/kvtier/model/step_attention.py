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
   part + g pg + t pt (largest -inf and sums 0 where it sees none of the chunk); s holds the
   scores, row (g, t) at s + g sg + t st. q is [T, Hq, D] from the group's first head; qs the
   stride of its tokens. The rows of K and V (and codes' sidecars KS, VS) as kv, kind (the keys')
   and vkind (the values') say. */
static inline __attribute__((always_inline)) void attend_chunk(const float* q, int64_t qs,
    const void* K, const void* V, Sides KS, Sides VS, KvRows kv, const int kind, const int vkind, int64_t j0,
    int64_t j1, int64_t off, int64_t T, int64_t G, const int64_t DC, int64_t Dv, float scale, float* s,
    int64_t st, int64_t sg, float* part, int64_t pt, int64_t pg) {
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
        s[g * sg + t * st + j] = dot * scale;
      }
  }
  for (int64_t r = 0; r < G * T; r++) {
    const int64_t g = r / T, t = r % T, e = j1 < off + t + 1 ? j1 : off + t + 1;
    float* pr = part + g * pg + t * pt;
    softmax_part(s + g * sg + t * st, j0, e, pr);
    for (int64_t d = 0; d < D; d++) pr[2 + d] = 0.f;
  }
  for (int64_t j = j0; j < last; j++) {
    const float* vj = float_row(row_at(V, kv, j, vkind), vkind, ROW_SCALED(vkind) ? row_scale(VS, kv, j, vkind) : 1.f,
                                GROUPED(vkind) ? group_at(VS.scale, kv, j, D) : NULL,
                                VS.zero ? group_at(VS.zero, kv, j, D) : NULL, VS.table, row, D);
    for (int64_t g = 0; g < G; g++)
      for (int64_t t = j > off ? j - off : 0; t < T; t++) {
        const float p = s[g * sg + t * st + j];
        float* acc = part + g * pg + t * pt + 2;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) acc[d] += p * vj[d];
      }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
/* the weighted values of attend_run_avx2 for a head dim DC of 64 or 128, NT tokens (one or two)
   of G query heads together (NT G DC / 16 sums at most 24): each value row is loaded once, DC / 16
   16-lane registers, for all of them (the 8-lane loop reads it once a head), their sums starting
   at zero or (more) at what part holds. Each sum takes its keys in the same order with the same
   multiply-adds, so the same bits however its keys are cut or which token shares them. Codes
   weigh by probability times scale. Token i's scores at sp[i], its parts at pp[i]. */
static inline __attribute__((always_inline)) void values_512(float* const* sp, int64_t stride, const void* V,
    Sides VS, KvRows kv, const int kind, int64_t j0, int64_t e, const int64_t G, const int NT, const int64_t DC,
    float* const* pp, int64_t pstride, const int more, __m256 lo, __m256 hi) {
  const int C = DC / 16;  /* registers a row */
  __m512 v[2][4][8];
  for (int t = 0; t < NT; t++)
    for (int g = 0; g < G; g++)
      for (int c = 0; c < C; c++)
        v[t][g][c] = more ? _mm512_loadu_ps(pp[t] + g * pstride + 2 + 16 * c) : _mm512_setzero_ps();
  for (int64_t i = j0; i < e; i++) {
    prefetch_rows(V, kv, i + 16, 1, e - 1, kv_span(kind, DC), kind);  /* the row 16 keys on, asked for ahead of time */
    const char* vi = row_at(V, kv, i, kind);
    const float sv = ROW_SCALED(kind) ? row_scale(VS, kv, i, kind) : 1.f;
    __m512 r[8];
    if (IS_LM(kind)) {  /* scale centroid, a group of 32 channels two registers */
      const uint16_t* gs = group_at(VS.scale, kv, i, DC);
      for (int c = 0; c < C; c++)
        r[c] = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lm8(vi, 16 * c, kind, lo, hi)),
                                                lm8(vi, 16 * c + 8, kind, lo, hi), 1), _mm512_set1_ps(h2f(gs[c >> 1])));
    } else
      for (int c = 0; c < C; c++) r[c] = load16(vi, 16 * c, kind);
    if (kind == KV_G32) {  /* zero + scale code, a group of 32 channels two registers */
      float gs[4], gz[4];
      group_floats(VS, kv, i, DC, gs, gz);
      for (int c = 0; c < C; c++) r[c] = _mm512_fmadd_ps(r[c], _mm512_set1_ps(gs[c >> 1]), _mm512_set1_ps(gz[c >> 1]));
    }
    for (int t = 0; t < NT; t++)
      for (int64_t g = 0; g < G; g++) {
        const float* s = sp[t];
        const __m512 w = _mm512_set1_ps(ROW_SCALED(kind) ? s[g * stride + i] * sv : s[g * stride + i]);
        for (int c = 0; c < C; c++) v[t][g][c] = _mm512_fmadd_ps(w, r[c], v[t][g][c]);
      }
  }
  for (int t = 0; t < NT; t++)
    for (int64_t g = 0; g < G; g++)
      for (int c = 0; c < C; c++) _mm512_storeu_ps(pp[t] + g * pstride + 2 + 16 * c, v[t][g][c]);
}

/* values_512 for a head group of G at head dim 64: NT a constant, so the sums stay in registers
   (two tokens for up to three heads; four heads take one token) */
static inline __attribute__((always_inline)) void values64_g(float* const* sp, int64_t stride, const void* V,
    Sides VS, KvRows kv, const int kind, int64_t j0, int64_t e, int64_t G, const int NT, float* const* pp,
    int64_t pstride, const int more, __m256 lo, __m256 hi) {
  if (G == 1) values_512(sp, stride, V, VS, kv, kind, j0, e, 1, NT, 64, pp, pstride, more, lo, hi);
  else if (G == 2) values_512(sp, stride, V, VS, kv, kind, j0, e, 2, NT, 64, pp, pstride, more, lo, hi);
  else if (G == 3) values_512(sp, stride, V, VS, kv, kind, j0, e, 3, NT, 64, pp, pstride, more, lo, hi);
  else values_512(sp, stride, V, VS, kv, kind, j0, e, 4, 1, 64, pp, pstride, more, lo, hi);  /* (NT 1: 16 sums) */
}
#endif

/* queries dots4 takes at once: 16 sums, four keys and a query in 21 of AVX-512's 32 registers;
   with AVX2's 16, one (two spilled: decode steps 3-4% slower, in-process against the loop a
   query at a time, 2-core Zen 4 built without AVX-512, 2026-12-07) */
#if defined(__AVX512F__)
#define MOST_QUERIES 4
#else
#define MOST_QUERIES 1
#endif

/* the scores of four keys (rows k[0..3], from key j on) for NQ queries (NQ at most 4, query i at
   qp[i], its scores' row at sp[i]): each query's multiply-adds and sums as a token alone takes
   them, each key's 8 channels loaded (and for group-affine codes, zero + scale code) once for
   all NQ. gs, gz: the four keys' groups' scales and zeros, ng a key */
static inline __attribute__((always_inline)) void dots4(const float* const* qp, float* const* sp, const int NQ,
    const char* const* k, int64_t j, const int64_t DC, const int kind, const float* gs, const float* gz,
    int64_t ng, __m128 ksc) {
  __m256 a[4][4];
  for (int i = 0; i < NQ; i++)
    for (int x = 0; x < 4; x++) a[i][x] = _mm256_setzero_ps();
  for (int64_t c = 0; c < DC; c += 8) {
    __m256 kc[4];
    for (int x = 0; x < 4; x++)
      kc[x] = AFFINE(kind) ? _mm256_fmadd_ps(load8(k[x], c, kind), _mm256_set1_ps(gs[x * ng + (c >> 5)]),
                                             _mm256_set1_ps(gz[x * ng + (c >> 5)]))
                           : load8(k[x], c, kind);
    for (int i = 0; i < NQ; i++) {
      const __m256 qv = _mm256_loadu_ps(qp[i] + c);
      for (int x = 0; x < 4; x++) a[i][x] = _mm256_fmadd_ps(qv, kc[x], a[i][x]);
    }
  }
  for (int i = 0; i < NQ; i++) {
    /* lanes 0-3 of h: the low halves' sums of a[i][0..3], lanes 4-7 the high halves' */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(sp[i] + j, _mm_mul_ps(r, ksc));
  }
}

/* attend_chunk for T tokens of one sequence at positions off, off + 1, ... and a head dim DC of 64
   or 128, 8 lanes wide. Each query (token, head) gets the sums a token alone would (a decode
   step's, a token a call):
   - the scores of four keys a pass, their four dot products summed across lanes together (not one
     horizontal sum per key), each four keys' channels loaded once for up to four queries (a
     token's heads, or a run's; one query without AVX-512), then the keys a token sees past its
     last whole four one at a time;
   - the weighted values, the sums held in registers (not loaded and stored per key): 64 keys and
     64 channels at a time for one head, or with AVX-512 all keys at once, each value row loaded
     once for a token's heads, or two tokens' (head dim 64), or for two heads (128).
   K and V rows as kind says, converted as they are loaded; codes' dot products take their key's
   scale, and their values weigh by probability times the value's scale; group-affine codes
   (q4_g32's, TurboQuant's 8-bit keys) become zero + scale code as they are loaded, and Lloyd-Max
   indices (vkind, TurboQuant's values) scale centroid. Strides as attend_chunk's. On the 2-core
   Zen 4 box against the loops a query and a head at a time: a batch-invariant prefill of 1,500
   tokens 1.22x faster; at 1,536 keys a decode step 1.03x over float32 pages and 1.05x over q8
   ones, a 5-token verification 1.09x; a 3-layer model's decode step at head dim 128, 2-4 heads a
   KV head, 1.06-1.7x (the most for codes formed from groups). */
static inline __attribute__((always_inline)) void attend_run_avx2(const float* q, int64_t qs, const void* K,
    const void* V, Sides KS, Sides VS, KvRows kv, int64_t j0, int64_t j1, int64_t off, int64_t T, int64_t G,
    const int64_t DC, const int kind, const int vkind, float scale, float* s, int64_t st, int64_t sg, float* part,
    int64_t pt, int64_t pg) {
#define SEES(t) (j1 < off + (t) + 1 ? j1 : off + (t) + 1)  /* the end of the chunk's keys token t sees */
  const int64_t last = SEES(T - 1);
  const int64_t rb = kv_span(kind, DC), vrb = kv_span(vkind, DC);  /* bytes a row */
  const int codes = ROW_SCALED(kind), vcodes = ROW_SCALED(vkind);
  const int grouped = AFFINE(kind);
  const int64_t ng = grouped ? DC >> 5 : 1;
  float gs[4 * ng], gz[4 * ng];  /* four keys' groups */
  float tab[16] = {0.f};  /* the values' centroids */
  if (IS_LM(vkind)) memcpy(tab, VS.table, sizeof(float) << STREAM_BITS(vkind));
  const __m256 lo = _mm256_loadu_ps(tab), hi = _mm256_loadu_ps(tab + 8);
  const __m128 sc = _mm_set1_ps(scale);
  /* the chunk's first 4 KB of keys and values, which the loops' own prefetches do not reach
     (a step at a 1,024-token context 1.4-1.9% faster, two alternated runs) */
  prefetch_rows(K, kv, j0, 4096 / rb, last - 1, rb, kind);
  prefetch_rows(V, kv, j0, 4096 / vrb, last - 1, vrb, vkind);
  for (int64_t j = j0; j + 4 <= last; j += 4) {  /* keys j..j + 3 for the tokens that see them all */
    prefetch_rows(K, kv, j + 2048 / rb, 4, last - 1, rb, kind);  /* the rows 2 KB on, asked for ahead of time */
    const char* k[4] = {row_at(K, kv, j, kind), row_at(K, kv, j + 1, kind), row_at(K, kv, j + 2, kind),
                        row_at(K, kv, j + 3, kind)};
    const __m128 ksc = codes ? _mm_mul_ps(sc, _mm_setr_ps(row_scale(KS, kv, j, kind), row_scale(KS, kv, j + 1, kind),
                                                          row_scale(KS, kv, j + 2, kind), row_scale(KS, kv, j + 3, kind)))
                             : sc;
    if (grouped)
      for (int x = 0; x < 4; x++) group_floats(KS, kv, j + x, DC, gs + x * ng, gz + x * ng);
    const int64_t first = j + 3 > off ? j + 3 - off : 0;  /* the first token that sees key j + 3 */
    const float* qp[4] = {NULL};
    float* sp[4] = {NULL};
    int nq = 0;
    for (int64_t t = first; t < T; t++)
      for (int64_t g = 0; g < G; g++) {
        qp[nq] = q + t * qs + g * DC, sp[nq] = s + t * st + g * sg;
        if (++nq == MOST_QUERIES) dots4(qp, sp, MOST_QUERIES, k, j, DC, kind, gs, gz, ng, ksc), nq = 0;
      }
    if (nq == 3) dots4(qp, sp, 3, k, j, DC, kind, gs, gz, ng, ksc);
    else if (nq == 2) dots4(qp, sp, 2, k, j, DC, kind, gs, gz, ng, ksc);
    else if (nq == 1) dots4(qp, sp, 1, k, j, DC, kind, gs, gz, ng, ksc);
  }
  for (int64_t t = 0; t < T; t++) {  /* each token's keys past its last whole four, then its softmax */
    const int64_t e = SEES(t);
    for (int64_t j = e > j0 ? j0 + (e - j0) / 4 * 4 : e; j < e; j++) {
      const char* kj = row_at(K, kv, j, kind);
      const float sj = codes ? scale * row_scale(KS, kv, j, kind) : scale;
      if (grouped) group_floats(KS, kv, j, DC, gs, gz);
      for (int64_t g = 0; g < G; g++) {
        const float* qg = q + t * qs + g * DC;
        float dot = 0.f;
        for (int64_t d = 0; d < DC; d++)
          dot += qg[d] * (grouped ? gs[d >> 5] * load1(kj, d, kind) + gz[d >> 5] : load1(kj, d, kind));
        s[t * st + g * sg + j] = dot * sj;
      }
    }
    for (int64_t g = 0; g < G; g++) softmax_part(s + t * st + g * sg, j0, e, part + t * pt + g * pg);
  }
#if defined(__AVX512F__)
  if (DC == 64 && G <= 4) {  /* (a constant group: the sums stay in registers) */
    for (int64_t t = 0; t < T; t++) {
      const int two = G <= 3 && t + 1 < T;
      float* sp[2] = {s + t * st, two ? s + (t + 1) * st : NULL};
      float* pp[2] = {part + t * pt, two ? part + (t + 1) * pt : NULL};
      const int64_t e = SEES(t);
      if (two && e > j0) {  /* tokens t and t + 1 over the keys both see, then t + 1's last */
        values64_g(sp, sg, V, VS, kv, vkind, j0, e, G, 2, pp, pg, 0, lo, hi);
        values64_g(sp + 1, sg, V, VS, kv, vkind, e, SEES(t + 1), G, 1, pp + 1, pg, 1, lo, hi);
        t++;
      } else
        values64_g(sp, sg, V, VS, kv, vkind, j0, e, G, 1, pp, pg, 0, lo, hi);
    }
  } else if (DC == 128) {  /* a token's heads two at a time: 16 sums */
    for (int64_t t = 0; t < T; t++)
      for (int64_t g = 0; g < G; g += 2) {
        float* sp[1] = {s + t * st + g * sg};
        float* pp[1] = {part + t * pt + g * pg};
        if (g + 1 < G) values_512(sp, sg, V, VS, kv, vkind, j0, SEES(t), 2, 1, 128, pp, pg, 0, lo, hi);
        else values_512(sp, sg, V, VS, kv, vkind, j0, SEES(t), 1, 1, 128, pp, pg, 0, lo, hi);
      }
  } else
#endif
  for (int64_t t = 0; t < T; t++) {
    const int64_t e = SEES(t);
    for (int64_t h0 = 0; h0 < DC; h0 += 64)  /* 64 channels at a time: 8 registers of sums */
      for (int64_t b = j0; b < e; b += 64) {
        const int64_t be = b + 64 < e ? b + 64 : e;
        if (h0 == 0) prefetch_rows(V, kv, b + 64, be - b, e - 1, vrb, vkind);  /* the next block's rows */
        for (int64_t g = 0; g < G; g++) {
          float* acc = part + t * pt + g * pg + 2 + h0;
          const float* p = s + t * st + g * sg;
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
  }
  for (int64_t t = 0; t < T; t++)
    if (SEES(t) <= j0)
      for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < DC; d++) part[t * pt + g * pg + 2 + d] = 0.f;
#undef SEES
}
#endif

/* attend_chunk with the head dim a constant for 64 and 128 (the loops drop their remainders);
   with AVX2 those head dims take attend_run_avx2 (its loops taken a token at a time, a call of
   16 tokens over 512 keys spent 7.8 ms in attention against 12.9 through attend_chunk). Stored
   rows of other kinds
   (float16 without F16C, keys and values of two kinds: TurboQuant's) are converted a row at a
   time as the loops reach them. */
static void attend_chunk_d(const float* q, int64_t qs, const void* K, const void* V, Sides KS,
    Sides VS, KvRows kv, int64_t j0, int64_t j1, int64_t off, int64_t T, int64_t G, int64_t D,
    int64_t kind, int64_t vkind, float scale, float* s, int64_t st, int64_t sg, float* part, int64_t pt,
    int64_t pg) {
#if defined(__AVX2__) && defined(__FMA__)
  const int pair = (kind == KV_A8 || kind == KV_AF + 5) && (vkind == KV_LM + 3 || vkind == KV_LM + 4);
  if ((D == 64 || D == 128) && ((kind == vkind && kind <= KV_G32) || pair) && ((kind != KV_F16 && kind != KV_FP8) || HALF_ROWS)) {
#define ATTEND(DC, KIND, VKIND) attend_run_avx2(q, qs, K, V, KS, VS, kv, j0, j1, off, T, G, DC, KIND, VKIND, scale, s, \
                                                st, sg, part, pt, pg)
    if (pair && kind == KV_A8) {  /* TurboQuant's 8-bit keys with 3- or 4-bit values (its default, q8_0,q4_0) */
      if (D == 64 && vkind == KV_LM + 3) ATTEND(64, KV_A8, KV_LM + 3);
      else if (D == 64) ATTEND(64, KV_A8, KV_LM + 4);
      else if (vkind == KV_LM + 3) ATTEND(128, KV_A8, KV_LM + 3);
      else ATTEND(128, KV_A8, KV_LM + 4);
    } else if (pair) {  /* 5-bit keys (q5_0r,q4_0: about 3x smaller than 16-bit pages) */
      if (D == 64 && vkind == KV_LM + 3) ATTEND(64, KV_AF + 5, KV_LM + 3);
      else if (D == 64) ATTEND(64, KV_AF + 5, KV_LM + 4);
      else if (vkind == KV_LM + 3) ATTEND(128, KV_AF + 5, KV_LM + 3);
      else ATTEND(128, KV_AF + 5, KV_LM + 4);
    } else if (D == 64 && kind == KV_F32) ATTEND(64, KV_F32, KV_F32);
    else if (D == 128 && kind == KV_F32) ATTEND(128, KV_F32, KV_F32);
    else if (D == 64 && kind == KV_Q8) ATTEND(64, KV_Q8, KV_Q8);
    else if (D == 128 && kind == KV_Q8) ATTEND(128, KV_Q8, KV_Q8);
    else if (D == 64 && kind == KV_Q4) ATTEND(64, KV_Q4, KV_Q4);
    else if (D == 128 && kind == KV_Q4) ATTEND(128, KV_Q4, KV_Q4);
    else if (D == 64 && kind == KV_G32) ATTEND(64, KV_G32, KV_G32);
    else if (D == 128 && kind == KV_G32) ATTEND(128, KV_G32, KV_G32);
#if HALF_ROWS
    else if (D == 64 && kind == KV_FP8) ATTEND(64, KV_FP8, KV_FP8);
    else if (D == 128 && kind == KV_FP8) ATTEND(128, KV_FP8, KV_FP8);
    else if (D == 64) ATTEND(64, KV_F16, KV_F16);
    else ATTEND(128, KV_F16, KV_F16);
#endif
#undef ATTEND
    return;
  }
#endif
  if (D == 64) attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 64, D, scale, s, st, sg, part, pt, pg);
  else if (D == 128) attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 128, D, scale, s, st, sg, part, pt, pg);
  else attend_chunk(q, qs, K, V, KS, VS, kv, kind, vkind, j0, j1, off, T, G, 0, D, scale, s, st, sg, part, pt, pg);
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

/* most tokens of a run that attention takes together (decode_step's runs) */
#define RUN_TOKENS 16

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
