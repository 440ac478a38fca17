"""A whole decode step of one sequence on the CPU in one C call (or a few tokens of it).

At one token the default model's decode step is 30 layers of small operations: four
matrix-vector products, two RMSNorms, RoPE, the cache write, attention and the SiLU
product each. The products read the weights (about 97 MB of block codes, the step's
real work); everything else is microseconds of PyTorch dispatch and Python per op,
which on the 2-core box added up to more than the products themselves. :class:`DecodeStep`
runs the same arithmetic for every layer, the final norm and the LM head inside one
OpenMP parallel region of a C function:

- the products are the packed kernels' own task bodies (:mod:`kvtier.model.packed`:
  Q4_1 and Q8_0 codes, bit for bit the same outputs as :class:`PackedLinear`), or a
  float32 dot product for a layer that stayed float32; the threads share each product
  and meet at a barrier after it, instead of starting a parallel region per product;
- the add-and-RMSNorm, RoPE and SiLU product are the C kernels of
  :mod:`kvtier.kernels.cpu_fused` (the layered path's own arithmetic);
- the new key and value are written into the :class:`~kvtier.caches.tail_owned.TailOwnedKVCache`
  buffers at each layer's offset, and attention reads them in place: one task per KV head
  and split of its keys (at least 64 keys a split, four tasks a thread where the context
  allows), which reads each key and value row once for the head's whole query group and
  leaves its largest score, softmax sum and weighted values; a second pass merges the
  splits of each query head. Scores, the exponentials (eight at a time with AVX2, a
  polynomial within 2 units in the last place of ``expf``) and sums are float32.

So the logits differ from the layered forward only in attention's arithmetic (summation
order, the exponential), by float32 rounding.

It serves :meth:`kvtier.model.llama.Transformer.forward` for one sequence and up to
:data:`MAX_TOKENS` tokens (a decode step, a speculative verification, a short prompt; token
``t`` of a call attends to the keys up to its own position) on the CPU in float32, without gradients and outside ``torch.compile``, when every layer's
cache is a tail-tier cache of that sequence and every projection is a
:class:`PackedLinear` or a float32 :class:`~kvtier.model.linear.Linear` (Llama, Mistral
and Qwen2 shapes; Qwen3's q/k norms keep the layered path). Anything else, and
``KVTIER_FUSED=0`` or ``KVTIER_DECODE_STEP=0``, takes the layered forward. The plan of
pointers is built once per model and rebuilt when a layer's modules or tensors change.

Example::

    >>> lm = load_model()                                # the default model, packed  # doctest: +SKIP
    >>> caches = lm.model.make_caches()                  # tail tier by default
    >>> lm.model(prompt_ids, caches)                     # a long prefill: the layered forward
    >>> lm.model(torch.tensor([[token]]), caches)        # one token: one C call
    >>> lm.model(torch.tensor([drafts]), caches)         # up to 16 tokens: one C call
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch
from torch import nn

from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.kernels import cpu_fused
from kvtier.kernels.native import load_or_warn
from kvtier.model import packed, packed_kernels
from kvtier.model.linear import Linear
from kvtier.model.llama import switched_off

__all__ = ["DecodeStep", "decode_step_enabled", "forget", "load_kernels", "plan_for"]

_STEP_SOURCE = r"""
#include <string.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {       /* one projection: y = W x (+ bias) */
  int64_t fmt;         /* 0 float32 weight [N, K], 1 Q4_1 codes, 2 Q8_0 codes */
  const void* w; const void* d; const void* m; const float* bias;
  int64_t N, K;
} Lin;

typedef struct {
  const float* attn_norm; const float* ffn_norm;
  Lin wqkv, wo, w13, w2;
  float* k; float* v;  /* the cache's buffers [H_kv, cap, D] */
  int64_t offset, cap; /* the write position, the buffers' length */
} Layer;

/* y [M, N] = x [M, K] W^T (+ bias); the tasks are shared by the threads of the enclosing
   region, which meet at the barrier after them */
static void linear_rows(const Lin* l, const float* x, float* y, int64_t M) {
  const int64_t N = l->N, K = l->K;
  if (l->fmt == 1) {
    const int64_t tasks = q4_1_tasks(N);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) q4_1_task(x, l->w, l->d, l->m, y, M, N, K, t);
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

/* Attention of the G query heads of one KV head, T new tokens each (token t at position
   off + t sees keys j <= off + t), over keys [j0, j1) of its K and V rows [n, D]: each key and
   value row is read once for the whole group. For query (g, t) it leaves the chunk's largest
   score, the sum of exp(score - that) and the weighted sum of the values [D] in
   part[(g T + t) (D + 2) ...] (largest -inf and sums 0 where it sees none of the chunk);
   s holds the scores, row (g, t) at s + (g T + t) stride. q is [T, Hq, D] from the group's
   first head; qs the stride of its tokens. */
static inline __attribute__((always_inline)) void attend_chunk(const float* q, int64_t qs,
    const float* K, const float* V, int64_t j0, int64_t j1, int64_t off, int64_t T, int64_t G,
    const int64_t DC, int64_t Dv, float scale, float* s, int64_t stride, float* part) {
  const int64_t D = DC ? DC : Dv;
  const int64_t last = j1 < off + T ? j1 : off + T;  /* past the newest token's position: none */
  for (int64_t j = j0; j < last; j++) {
    const float* kj = K + j * D;
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
    float* sr = s + r * stride;
    float mx = -INFINITY;
    for (int64_t j = j0; j < e; j++) mx = sr[j] > mx ? sr[j] : mx;
    float* pr = part + r * (D + 2);
    pr[0] = mx;
    pr[1] = e > j0 ? exp_shifted(sr + j0, e - j0, mx) : 0.f;
    for (int64_t d = 0; d < D; d++) pr[2 + d] = 0.f;
  }
  for (int64_t j = j0; j < last; j++) {
    const float* vj = V + j * D;
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
/* attend_chunk for one token (a decode step) and a head dim DC of 64 or 128, 8 lanes wide:
   the scores of four keys a pass for each query head (their four dot products summed across
   lanes together, not one horizontal sum per key), and the weighted values of 64 keys at a
   time for one head, 64 channels of sums held in registers (not loaded and stored per key) */
static inline __attribute__((always_inline)) void attend_one_avx2(const float* q, const float* K,
    const float* V, int64_t j0, int64_t j1, int64_t off, int64_t G, const int64_t DC, float scale,
    float* s, int64_t stride, float* part) {
  const int64_t e = j1 < off + 1 ? j1 : off + 1;  /* the chunk's keys the token sees */
  const __m128 sc = _mm_set1_ps(scale);
  int64_t j = j0;
  for (; j + 4 <= e; j += 4) {
    const float* k0 = K + j * DC;
    for (int64_t c = 0; c < 4 * DC; c += 16)  /* the rows 2 KB on, asked for ahead of time */
      _mm_prefetch((const char*)(k0 + c) + 2048, _MM_HINT_T0);
    for (int64_t g = 0; g < G; g++) {
      const float* qg = q + g * DC;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < DC; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + c);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + DC + c), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * DC + c), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * DC + c), a3);
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
      for (int64_t d = 0; d < DC; d++) dot += q[g * DC + d] * K[j * DC + d];
      s[g * stride + j] = dot * scale;
    }
  for (int64_t g = 0; g < G; g++) {
    float* sr = s + g * stride;
    float mx = -INFINITY;
    for (int64_t i = j0; i < e; i++) mx = sr[i] > mx ? sr[i] : mx;
    float* pr = part + g * (DC + 2);
    pr[0] = mx;
    pr[1] = e > j0 ? exp_shifted(sr + j0, e - j0, mx) : 0.f;
  }
  for (int64_t h0 = 0; h0 < DC; h0 += 64)  /* 64 channels at a time: 8 registers of sums */
    for (int64_t b = j0; b < e; b += 64) {
      const int64_t be = b + 64 < e ? b + 64 : e;
      if (h0 == 0)
        for (const float* r = V + b * DC; r < V + be * DC; r += 16)  /* the next block's rows */
          _mm_prefetch((const char*)r + 64 * DC * sizeof(float), _MM_HINT_T0);
      for (int64_t g = 0; g < G; g++) {
        float* acc = part + g * (DC + 2) + 2 + h0;
        const float* p = s + g * stride;
        __m256 v[8];
        for (int i = 0; i < 8; i++) v[i] = b == j0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 8 * i);
        for (int64_t i = b; i < be; i++) {
          const __m256 w = _mm256_broadcast_ss(p + i);
          const float* vr = V + i * DC + h0;
          for (int c = 0; c < 8; c++) v[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), v[c]);
        }
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, v[i]);
      }
    }
  if (e <= j0)
    for (int64_t g = 0; g < G; g++)
      for (int64_t d = 0; d < DC; d++) part[g * (DC + 2) + 2 + d] = 0.f;
}
#endif

/* attend_chunk with the head dim a constant for 64 and 128 (the loops drop their remainders);
   one token (a decode step) with AVX2 takes attend_one_avx2 */
static void attend_chunk_d(const float* q, int64_t qs, const float* K, const float* V, int64_t j0,
    int64_t j1, int64_t off, int64_t T, int64_t G, int64_t D, float scale, float* s, int64_t stride,
    float* part) {
#if defined(__AVX2__) && defined(__FMA__)
  if (T == 1 && D == 64) { attend_one_avx2(q, K, V, j0, j1, off, G, 64, scale, s, stride, part); return; }
  if (T == 1 && D == 128) { attend_one_avx2(q, K, V, j0, j1, off, G, 128, scale, s, stride, part); return; }
#endif
  if (D == 64) attend_chunk(q, qs, K, V, j0, j1, off, T, G, 64, D, scale, s, stride, part);
  else if (D == 128) attend_chunk(q, qs, K, V, j0, j1, off, T, G, 128, D, scale, s, stride, part);
  else attend_chunk(q, qs, K, V, j0, j1, off, T, G, 0, D, scale, s, stride, part);
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

/* T tokens of one sequence through n_layers layers, the final norm and the LM head: logits
   [T, V], or [1, V] of the last token with last_only. ids are the tokens, emb the embedding
   table [V, dim] (ids in range: the caller checks), cos/sin [T, D] their rotations; scratch holds T (4 dim + (3 Hq + 3 Hkv) D + 3 hidden) +
   Hq T score_stride + Hq T (score_stride / 64 + 1) (D + 2) floats, score_stride at least every
   layer's offset + T. */
void decode_step(const Layer* layers, int64_t n_layers, const Lin* head, const float* norm_w,
                 const float* emb, const int64_t* ids, const float* cos, const float* sin, int64_t T, int64_t last_only,
                 int64_t dim, int64_t Hq, int64_t Hkv, int64_t D, int64_t hidden, float eps,
                 float scale, float* scratch, int64_t score_stride, float* logits, int threads) {
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
  for (int64_t t = 0; t < T; t++) memcpy(h + t * dim, emb + ids[t] * dim, dim * sizeof(float));
  #pragma omp parallel num_threads(threads)
  {
    for (int64_t l = 0; l < n_layers; l++) {
      const Layer* ly = layers + l;
      const int64_t off = ly->offset, cap = ly->cap;
      #pragma omp single
      add_rms_norm(h, l ? delta : NULL, ly->attn_norm, h, nrm, T, dim, eps, 1);
      linear_rows(&ly->wqkv, nrm, qkv, T);
      #pragma omp single
      {
        rope(qkv, 0, QKV, D, cos, sin, 0, D, qk, 1, T, Hq + Hkv, D, 1);
        for (int64_t t = 0; t < T; t++)
          for (int64_t kh = 0; kh < Hkv; kh++) {
            memcpy(ly->k + (kh * cap + off + t) * D, qk + t * QK + (Hq + kh) * D, D * sizeof(float));
            memcpy(ly->v + (kh * cap + off + t) * D, qkv + t * QKV + (Hq + Hkv + kh) * D, D * sizeof(float));
          }
      }
      const int64_t n = off + T, chunk = split_keys(n, Hkv, threads), splits = (n + chunk - 1) / chunk;
      #pragma omp for schedule(static)
      for (int64_t t = 0; t < Hkv * splits; t++) {  /* (KV head, split of its keys) */
        const int64_t kh = t / splits, j0 = (t % splits) * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        const float* K = ly->k + kh * cap * D;
        const float* V = ly->v + kh * cap * D;
        const float* q = qk + kh * group * D;
        float* s = scores + kh * gt * score_stride;
        float* part = parts + t * gt * (D + 2);
        attend_chunk_d(q, QK, K, V, j0, j1, off, T, group, D, scale, s, score_stride, part);
      }
      #pragma omp for schedule(static)
      for (int64_t r = 0; r < Hq * T; r++) {  /* query (head hq, token t): parts ((kh splits + i) gt + g T + t) */
        const int64_t hq = r / T, t = r % T, kh = hq / group, g = hq % group;
        merge_parts(parts + (kh * splits * gt + g * T + t) * (D + 2), splits, gt * (D + 2), D,
                    att + (t * Hq + hq) * D);
      }
      linear_rows(&ly->wo, att, a, T);
      #pragma omp single
      add_rms_norm(h, a, ly->ffn_norm, h, nrm, T, dim, eps, 1);
      linear_rows(&ly->w13, nrm, ff, T);
      #pragma omp for schedule(static)
      for (int64_t c = 0; c < T * 8; c++) {  /* silu_mul's arithmetic, each row in 8 spans */
        const int64_t t = c / 8, j0 = (c % 8) * hidden / 8, j1 = (c % 8 + 1) * hidden / 8;
        const float* g = ff + t * 2 * hidden;
        for (int64_t j = j0; j < j1; j++) act[t * hidden + j] = (g[j] / (1.0f + expf(-g[j]))) * g[hidden + j];
      }
      linear_rows(&ly->w2, act, delta, T);
    }
    const int64_t first = last_only ? T - 1 : 0;
    #pragma omp single
    add_rms_norm(h + first * dim, delta + first * dim, norm_w, h + first * dim, nrm + first * dim,
                 T - first, dim, eps, 1);
    linear_rows(head, nrm + first * dim, logits, T - first);
  }
}
"""

_FORMATS = {"float32": 0, "q4_1": 1, "q8_0": 2}
#: most tokens one call takes (a speculative verification, a short prompt); longer inputs take the
#: layered forward, whose prefill multiplies dequantised weights
MAX_TOKENS = 16


class _Lin(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("w", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("wqkv", _Lin),
                ("wo", _Lin), ("w13", _Lin), ("w2", _Lin), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("offset", ctypes.c_int64), ("cap", ctypes.c_int64)]


class _Kernels:
    def __init__(self, lib: ctypes.CDLL):
        self.decode_step = lib.decode_step
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.decode_step.argtypes = ([p, i, p, p, p, p, p, p] + [i] * 7 + [ctypes.c_float] * 2
                                     + [p, i, p, ctypes.c_int])
        self.decode_step.restype = None


@functools.cache
def load_kernels() -> _Kernels | None:
    """Compile (once per machine) and load the step; ``None`` with a warning where no C compiler
    builds it."""
    source = packed_kernels._C_SOURCE + cpu_fused._C_SOURCE + _STEP_SOURCE
    return load_or_warn("cpu_step", source, _Kernels, "decode steps take the layered forward")


def decode_step_enabled() -> bool:
    """Whether the environment allows the one-call step (``KVTIER_FUSED`` and
    ``KVTIER_DECODE_STEP`` not ``0``/``false``/``no``/``off``)."""
    return not (switched_off("KVTIER_FUSED") or switched_off("KVTIER_DECODE_STEP"))


def _cpu_f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())


def _linear_entry(lin: nn.Module, keep: list) -> _Lin | None:
    """The C description of one projection, or ``None`` when the step cannot run it."""
    if type(lin) not in (packed.PackedLinear, Linear):  # (tensor-parallel shards, adapters, ...)
        return None
    bias = lin.bias
    if not _cpu_f32(bias):
        return None
    if type(lin) is packed.PackedLinear:
        ts = (lin.codes, lin.d, lin.m)
        if any(t is not None and (t.device.type != "cpu" or not t.is_contiguous()) for t in ts) \
                or lin.d.dtype != torch.float16 or (lin.m is not None and lin.m.dtype != torch.float16):
            return None
        fmt, w, d, m = _FORMATS[lin.fmt], lin.codes, lin.d, lin.m
    elif type(lin) is Linear:
        if not _cpu_f32(lin.weight):
            return None
        fmt, w, d, m = 0, lin.weight, None, None
    keep.extend(t for t in (w, d, m, bias) if t is not None)  # (the plan holds what it points at)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return _Lin(fmt, ptr(w), ptr(d), ptr(m), ptr(bias), lin.out_features, lin.in_features)


class DecodeStep:
    """The pointer plan of one :class:`~kvtier.model.llama.Transformer` for :func:`decode_step`.

    :meth:`build` returns ``None`` when the model does not qualify; :meth:`run` runs up to
    :data:`MAX_TOKENS` tokens, or returns ``None`` (nothing touched) when the input or the caches
    do not qualify. The plan refers to its model weakly: the model's plan is kept in a weak
    mapping keyed by the model, which must not keep the model alive.
    """

    def __init__(self, model, kernels: _Kernels, layers, head: _Lin, keep: list, key: tuple):
        a = model.args
        self._model = weakref.ref(model)
        self.kernels, self.key = kernels, key
        self.layers, self.head, self._keep = layers, head, keep
        self.dims = (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim)
        self._like = torch.empty(1, a.n_kv_heads, 0, a.head_dim)  # the buffers' shape, for empty caches
        self.eps = float(model.norm.eps)
        self.scale = float(model.layers[0].attention.scale)
        self.needs_grad = any(t.requires_grad for t in keep if isinstance(t, torch.Tensor))
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope_rows(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin ``[P, D]`` of positions ``[0, P)``, ``P >= end``: the model's rotary module
        run once for a span of positions (grown 1,024 at a time) rather than every step (its
        values per position are the same bits either way)."""
        rope = self._rope  # (read once: another thread may replace it meanwhile)
        if rope is None or rope[0].shape[0] < end:
            P = -(-end // 1024) * 1024
            cos, sin = self.model.rope(torch.arange(P).view(1, P), torch.float32)
            rope = self._rope = (cos.reshape(P, -1).contiguous(), sin.reshape(P, -1).contiguous())
        return rope

    @property
    def model(self):
        return self._model()

    @staticmethod
    def key_objects(model) -> list:
        """What the plan's pointers depend on: every layer's modules and norms (the plan keeps
        them, so that no other object takes their ids while it lives). Read through the modules'
        own dicts: ``nn.Module.__getattr__`` would cost about half a millisecond a step."""
        mods = model._modules
        objs = [mods["tok_embeddings"]._parameters["weight"], mods["norm"]._parameters["weight"],
                mods["output"]]
        for layer in mods["layers"]._modules.values():
            sub = layer._modules
            at, ff = sub["attention"]._modules, sub["feed_forward"]._modules
            objs += [sub["attention_norm"]._parameters["weight"], sub["ffn_norm"]._parameters["weight"],
                     at["wqkv"], at["wo"], ff["w13"], ff["w2"]]
        return objs

    @classmethod
    def build(cls, model) -> DecodeStep | None:
        kernels = load_kernels()
        a = model.args
        if kernels is None or a.qk_norm or a.n_heads % a.n_kv_heads:
            return None
        keep: list = []
        layers = (_Layer * a.n_layers)()
        for i, layer in enumerate(model.layers):
            at, ff = layer.attention, layer.feed_forward
            norms = (layer.attention_norm.weight, layer.ffn_norm.weight)
            lins = [_linear_entry(at.wqkv, keep), _linear_entry(at.wo, keep),
                    _linear_entry(ff.w13, keep), _linear_entry(ff.w2, keep)]
            if any(x is None for x in lins) or not all(_cpu_f32(n) for n in norms):
                return None
            keep.extend(norms)
            layers[i].attn_norm, layers[i].ffn_norm = norms[0].data_ptr(), norms[1].data_ptr()
            layers[i].wqkv, layers[i].wo, layers[i].w13, layers[i].w2 = lins
        head = _linear_entry(model.output, keep)
        if head is None or not _cpu_f32(model.norm.weight) or not _cpu_f32(model.tok_embeddings.weight):
            return None
        keep += [model.norm.weight, model.tok_embeddings.weight]
        objs = cls.key_objects(model)
        return cls(model, kernels, layers, head, keep + objs, tuple(map(id, objs)))

    def run(self, tokens: torch.Tensor, caches, n: int, *, last_only: bool = False) -> torch.Tensor | None:
        """Logits ``[1, T, vocab]`` (``[1, 1, vocab]`` of the last with ``last_only``) of ``tokens``
        ``[1, T]``, ``T <= MAX_TOKENS``, through the first ``n`` layers, each writing into its cache;
        ``None``, with nothing changed, when a cache is not a tail-tier cache of one row in float32
        of the model's shape, or a token is out of range (the layered forward then serves it, and
        raises what it raises)."""
        dim, Hq, Hkv, D, hidden = self.dims
        T = tokens.shape[1]
        if (torch.is_grad_enabled() and self.needs_grad) or not 1 <= T <= MAX_TOKENS:
            return None
        vocab = self.model.args.vocab_size
        ids = tokens[0].tolist()
        if min(ids) < 0 or max(ids) >= vocab:
            return None
        used = caches[:n]
        for c in used:
            if type(c) is not TailOwnedKVCache:
                return None
            k, v = c.keys, c.values
            if k is not None and not (k.shape[0] == 1 and k.shape[1] == Hkv and k.shape[3] == D
                                      and v.shape == k.shape and _cpu_f32(k) and _cpu_f32(v)):
                return None
        # this call's copy of the plan, and its own scratch: two threads may run one model on
        # two sequences' caches, as the layered forward allows
        layers = type(self.layers).from_buffer_copy(self.layers)
        for layer, c in zip(layers, used):  # everything is checked: from here on it writes
            c.make_room(T, self._like, self._like)
            layer.k, layer.v = c.keys.data_ptr(), c.values.data_ptr()
            layer.offset, layer.cap = c.offset, c.capacity
        start = caches[0].offset
        cos, sin = self.rope_rows(start + T)
        row = start * D * cos.element_size()  # (bytes to the first token's row)
        if tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.to(torch.int64).contiguous()
        stride = max(c.capacity for c in used)
        need = T * (dim * 4 + (3 * Hq + 3 * Hkv) * D + 3 * hidden) + Hq * T * stride \
            + Hq * T * (stride // 64 + 1) * (D + 2)
        scratch = torch.empty(need)
        rows = 1 if last_only else T
        logits = torch.empty(1, rows, vocab)
        model = self.model
        self.kernels.decode_step(layers, n, ctypes.byref(self.head), model.norm.weight.data_ptr(),
                                 model.tok_embeddings.weight.data_ptr(), tokens.data_ptr(),
                                 cos.data_ptr() + row, sin.data_ptr() + row, T, int(last_only), dim, Hq, Hkv, D,
                                 hidden, self.eps, self.scale, scratch.data_ptr(), stride,
                                 logits.data_ptr(), torch.get_num_threads())
        for c in used:
            c.commit_written(T)
        return logits


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_for(model) -> DecodeStep | None:
    """The model's :class:`DecodeStep` (built on first use, rebuilt when its layers' modules or
    norms change), or ``None`` when the model does not qualify or the environment turns it off."""
    if not decode_step_enabled() or torch.compiler.is_compiling():
        return None
    emb = model.tok_embeddings.weight
    if emb.device.type != "cpu" or emb.dtype != torch.float32:
        return None
    entry = _PLANS.get(model)
    if entry is not None and entry[2] == _registrations[0]:
        return entry[1]  # no module or parameter was assigned anywhere since the check
    _watch_registrations()
    seen = _registrations[0]
    key = tuple(map(id, DecodeStep.key_objects(model)))
    if entry is None or entry[0] != key:
        entry = (key, DecodeStep.build(model), seen)
    else:
        entry = (key, entry[1], seen)
    _PLANS[model] = entry
    return entry[1]


def forget(model) -> None:
    """Drop the model's plan (its tensors moved: ``Module._apply``)."""
    _PLANS.pop(model, None)


#: modules and parameters assigned to any module since the first plan (``nn.Module.__setattr__``
#: and ``register_*`` call PyTorch's global registration hooks). A step whose count is unchanged
#: since its model's last check skips walking the layers: after a step has streamed the
#: weights through the caches that walk costs about half a millisecond, 4% of a step.
_registrations = [0]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1


@functools.cache
def _watch_registrations() -> None:
    from torch.nn.modules import module as nn_module

    nn_module.register_module_module_registration_hook(_count_registration)
    nn_module.register_module_parameter_registration_hook(_count_registration)
