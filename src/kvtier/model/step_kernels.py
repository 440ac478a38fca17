"""The C side of :mod:`kvtier.model.cpu_step`: the one-call decode step's source, the ctypes
structures of its pointer plan, and the compiled library.

``decode_step`` runs up to 16 tokens of one sequence over tail buffers, or tokens of several
sequences over pages (each through its block table), through every layer, the final norm and
the LM head inside one OpenMP parallel region, whose threads meet at a spinning barrier of the
step's own (``StepBarrier``); the products are the packed kernels' own task
bodies (:mod:`kvtier.model.packed_kernels`), or with int8 activations those of
:mod:`kvtier.model.act_quant`, the elementwise steps the C kernels of
:mod:`kvtier.kernels.cpu_fused`, the stored rows' formats and loads those of
:mod:`kvtier.model.step_rows` and attention that of :mod:`kvtier.model.step_attention`, so
the library is compiled from the six sources together (:func:`step_source`).
"""

from __future__ import annotations

import ctypes
import functools

from kvtier.kernels import cpu_fused
from kvtier.kernels.native import load_or_warn
from kvtier.model import act_quant, packed_kernels, step_attention, step_products, step_rows

__all__ = ["STEP_SOURCE", "Kernels", "Layer", "Lin", "Paged", "load_kernels", "step_source"]

STEP_SOURCE = r"""
#include <string.h>
#include <math.h>
#include <stdint.h>
#include <sched.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif


/* The step's threads meet at this barrier, spinning (with pause), instead of at libgomp's: those
   spin only briefly, then sleep on a futex, when more OpenMP threads live in the process than it
   has CPUs, as they do once another thread has run a parallel region (the thread that loaded the
   model, beside a serving thread that runs the steps). A step meets about 250 times, and those
   sleeps took a step of the default model from 4.1 to 15.4 ms in a second thread on the 2-core
   box. After about a million spins a waiting thread yields its CPU between checks. n: the
   region's threads (set once it starts). */
typedef struct { int count, gen, n; } StepBarrier;

static inline void step_barrier(StepBarrier* b) {
  if (b->n <= 1) return;
  const int gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
  if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == b->n) {
    __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&b->gen, gen + 1, __ATOMIC_RELEASE);
    return;
  }
  for (unsigned spins = 0; __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) == gen;) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (++spins > (1u << 20)) sched_yield();
  }
}

typedef struct {       /* one projection: y = W x (+ bias) */
  int64_t fmt;         /* 0 float32 weight [N, K], 1 Q4_1 codes, 2 Q8_0 codes */
  const void* w; const void* d; const void* m; const float* bias;
  int64_t N, K;
} Lin;

typedef struct {
  const float* attn_norm; const float* ffn_norm;
  Lin wqkv, wo, w13, w2;
  void* k; void* v;   /* the cache's buffers [H_kv, cap, D], or its pages [blocks, bs, H_kv, D] */
  int64_t offset, cap; /* the write position, the buffers' length (not read for pages) */
  int64_t kind, vkind; /* how they hold a key and a value row (step_rows' KV_F32 ... KV_LM + b) */
  void* ks; void* vs;  /* codes' scales, the pages' sidecars [blocks, bs, H_kv, 1] float32 (the
                          grouped kinds: [blocks, bs, H_kv, D / 32] float16), else NULL */
  void* kz; void* vz;  /* the group-affine kinds' zeros, as their scales (else NULL) */
  const float* kc;     /* e4m3 keys' centre [H_kv, D], taken off before they are coded (else NULL) */
  const float* vtab;   /* Lloyd-Max values: the centroids [2^b] and inner boundaries [2^b - 1] */
  const float* vbnd;
  const float* vrot;   /* their rotation's signs / sqrt(D) [D] (else NULL) */
  const float* krot;   /* rotated TurboQuant keys' rotation, likewise (else NULL) */
  int64_t window;      /* over pages, a lone token of its sequence sees only its last window keys
                          (0: every key; a token past any layer's window is alone in its run) */
} Layer;

/* tokens of several sequences over paged caches: token t at position pos[t], its keys and
   values in the pages of its block table tables[t] (width entries, blocks of 1 << bsh tokens;
   every layer's pages alike), seeing keys j <= pos[t] */
typedef struct { const int64_t* pos; const int32_t* tables; int64_t width, bsh; } Paged;

/* where token t's keys and values lie (step_rows' KvRows): its pages' rows through its
   block table, H_kv D elements apart, or (paged NULL) a tail buffer's rows, D apart */
static inline KvRows token_kv(const Paged* paged, int64_t t, int64_t Hkv, int64_t D) {
  if (!paged) return (KvRows){NULL, 0, D, 1};
  return (KvRows){paged->tables + t * paged->width, paged->bsh, Hkv * D, Hkv};
}

/* elements from a layer's key (or value) storage to KV head kh's first row: pages interleave the
   heads of a token, a tail buffer holds each head's cap rows together */
static inline int64_t head_at(const Paged* paged, int64_t kh, int64_t cap, int64_t D) {
  return paged ? kh * D : kh * cap * D;
}

/* a layer's codes' sidecars from KV head kh's first row (pages' sidecars interleave the heads of a
   token too; the grouped kinds' hold D / 32 float16 a row), and its centroids */
static inline Sides sides_at(void* scale, void* zero, const float* table, const Paged* paged, int64_t kh,
                             int64_t cap, int kind, int64_t D) {
  const int64_t row = paged ? kh : kh * cap;
  if (ROW_SCALED(kind)) return (Sides){(const float*)scale + row, NULL, NULL};
  if (!GROUPED(kind)) return (Sides){NULL, NULL, NULL};
  return (Sides){(const uint16_t*)scale + row * (D >> 5), zero ? (const uint16_t*)zero + row * (D >> 5) : NULL, table};
}

/* group-affine codes of row x [D] as kvtier.quant.kv_quant's group_affine_encode makes them, of
   bits 4 (q4_g32: two a byte), 8 (a byte) or others (bit-packed, the low bits first): a group's
   zero its least value and scale (largest - least) / (2^bits - 1) (the IEEE quotient), each
   rounded to float16; codes (x - zero) / scale rounded half to even within [0, 2^bits - 1] */
static void quantize_affine_row(const float* x, int64_t D, int bits, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  const float qmax = (float)((1 << bits) - 1);
  if (bits != 4 && bits != 8) memset(codes, 0, (size_t)((D * bits) >> 3));
  for (int64_t g = 0; g < D >> 5; g++) {
    const float* xg = x + 32 * g;
    float lo = xg[0], hi = xg[0];
    for (int d = 1; d < 32; d++) { lo = xg[d] < lo ? xg[d] : lo; hi = xg[d] > hi ? xg[d] : hi; }
    zero[g] = f2h(lo);
    scale[g] = f2h((hi - lo) / qmax);
    const float zf = h2f(zero[g]), sf = h2f(scale[g]), safe = sf > 0.f ? sf : 1.f;
    for (int d = 0; d < 32; d++) {
      float c = nearbyintf((xg[d] - zf) / safe);
      const uint8_t u = (uint8_t)(c < 0.f ? 0.f : c > qmax ? qmax : c);
      if (bits == 8) codes[32 * g + d] = u;
      else if (bits == 4 && d & 1) codes[16 * g + d / 2] |= (uint8_t)(u << 4);
      else if (bits == 4) codes[16 * g + d / 2] = u;
      else stream_put(codes, 32 * g + d, bits, u);
    }
  }
}

/* x [d] = H_d x in place: kvtier.quant.hadamard's butterflies (a, b) -> (a + b, a - b) on pairs
   h = 1, 2, 4 ... apart, the same sums */
static void fwht(float* x, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2)
    for (int64_t b = 0; b < d; b += 2 * h)
      for (int64_t i = b; i < b + h; i++) {
        const float a = x[i], c = x[i + h];
        x[i] = a + c;
        x[i + h] = a - c;
      }
}

/* TurboQuant's b-bit value codes of row x [D] as kvtier.quant.turboquant's TurboValueCodec makes
   them: y = H (x rot) (rot: the signs / sqrt(D)); per group of 32, s0 = sqrt(mean(y^2)) (0: 1),
   index = the boundaries bnd below y / s0, scale = float16(sum(y c) / sum(c^2)) over the indices'
   centroids c; indices b bits each, the low bits first */
static void quantize_lm_row(const float* x, int64_t D, int b, const float* rot, const float* bnd, const float* cent,
                            uint8_t* codes, uint16_t* scale) {
  float y[D];
  for (int64_t d = 0; d < D; d++) y[d] = x[d] * rot[d];
  fwht(y, D);
  memset(codes, 0, (size_t)((D * b) >> 3));
  const int nb = (1 << b) - 1;
  for (int64_t g = 0; g < D >> 5; g++) {
    const float* yg = y + 32 * g;
    float sq = 0.f, num = 0.f, den = 0.f;
    for (int d = 0; d < 32; d++) sq += yg[d] * yg[d];
    float s0 = sqrtf(sq / 32.f);
    s0 = s0 > 0.f ? s0 : 1.f;
    for (int d = 0; d < 32; d++) {
      const float v = yg[d] / s0;
      int idx = 0;
      while (idx < nb && bnd[idx] < v) idx++;
      num += yg[d] * cent[idx];
      den += cent[idx] * cent[idx];
      stream_put(codes, 32 * g + d, b, (unsigned)idx);
    }
    scale[g] = f2h(num / den);
  }
}

/* out [D] = rot H out: attention's output over rotated values back (kvtier.quant.hadamard's
   inverse) */
static void rotate_back(float* out, const float* rot, int64_t D) {
  fwht(out, D);
  for (int64_t d = 0; d < D; d++) out[d] *= rot[d];
}

/* x [D] = H (x rot): a query into the rotated keys' domain (kvtier.quant.hadamard's apply) */
static void rotate(float* x, const float* rot, int64_t D) {
  for (int64_t d = 0; d < D; d++) x[d] *= rot[d];
  fwht(x, D);
}

/* the e4m3 byte nearest y (|y| <= 448), ties to even, as torch's .to(float8_e4m3fn): below 2^-6
   a multiple of 2^-9 (its byte the multiple, 8 being 2^-6's), else 3 mantissa bits rounded off */
static inline uint8_t e4m3_of(float y) {
  uint32_t u;
  const float a = fabsf(y);
  memcpy(&u, &y, 4);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f);
  memcpy(&u, &a, 4);
  u += 0x7ffff + ((u >> 20) & 1);
  return sign | (uint8_t)((((u >> 23) - 120) << 3) | ((u >> 20) & 7));
}

/* codes of row x [D] (less the centre C where given) as kvtier.quant.kv_quant and
   kvtier.quant.fp8 store them: the scale max |x| / qmax (the IEEE quotient; qmax 127, 7, or 448
   for e4m3); q8 and q4 codes x / scale rounded half to even (as torch.round) within +-qmax, q8 as
   int8, q4 as code + 8 two a byte; e4m3 bytes of x / scale */
static void quantize_kv_row(const float* x, const float* C, int64_t D, const int kind, char* codes, float* scale) {
  float amax = 0.f, y[D];
  for (int64_t d = 0; d < D; d++) {
    y[d] = C ? x[d] - C[d] : x[d];
    amax = fabsf(y[d]) > amax ? fabsf(y[d]) : amax;
  }
  const float qmax = kind == KV_Q8 ? 127.f : kind == KV_Q4 ? 7.f : 448.f;
  const float sc = amax / qmax, safe = sc > 0.f ? sc : 1.f;
  *scale = sc;
  for (int64_t d = 0; d < D; d++) {
    if (kind == KV_FP8) {
      const float v = y[d] / safe;
      codes[d] = (char)e4m3_of(v > qmax ? qmax : v < -qmax ? -qmax : v);
      continue;
    }
    float c = nearbyintf(y[d] / safe);
    c = c > qmax ? qmax : c < -qmax ? -qmax : c;
    if (kind == KV_Q8) ((int8_t*)codes)[d] = (int8_t)c;
    else if (d & 1) codes[d >> 1] = (char)((uint8_t)codes[d >> 1] | (uint8_t)(((int)c + 8) << 4));
    else codes[d >> 1] = (char)((int)c + 8);
  }
}

/* stores row x [D] (a key, with the centre C where given, or a value) of the given kind at r,
   its codes' sidecars as S says, for position j of the rows kv describes */
static void store_kv_row(const float* x, const float* C, const int kind, char* r, Sides S, KvRows kv, int64_t j,
                         int64_t D, const Layer* ly) {
  if (kind == KV_F32) memcpy(r, x, D * sizeof(float));
  else if (kind == KV_F16)
    for (int64_t d = 0; d < D; d++) ((uint16_t*)r)[d] = f2h(x[d]);
  else if (ROW_SCALED(kind)) quantize_kv_row(x, C, D, kind, r, scale_at((const float*)S.scale, kv, j));
  else if (IS_LM(kind))
    quantize_lm_row(x, D, STREAM_BITS(kind), ly->vrot, ly->vbnd, ly->vtab, (uint8_t*)r, group_at(S.scale, kv, j, D));
  else {  /* group-affine keys, rotated first where the layer's keys are */
    float y[D];
    memcpy(y, x, D * sizeof(float));
    if (ly->krot) rotate(y, ly->krot, D);
    quantize_affine_row(y, D, kind == KV_A8 ? 8 : kind == KV_G32 ? 4 : STREAM_BITS(kind), (uint8_t*)r,
                        group_at(S.scale, kv, j, D), group_at(S.zero, kv, j, D));
  }
}

/* where int8 activations go (kvtier.model.act_quant): codes [M, K], dx and sx [M, K / 32];
   NULL for the exact products */
typedef struct { int8_t* q; float* dx; float* sx; } ActQ8;

/* whether a product takes int8 activations: a Q4_1 or Q8_0 weight, with aq */
static inline int takes_q8(const Lin* l, const ActQ8* aq) { return aq && (l->fmt == 1 || l->fmt == 2); }

/* y [M, N] = x [M, K] W^T (+ bias); the tasks are shared by the threads of the enclosing
   region, which meet at the barrier after them. With aq, Q4_1 and Q8_0 weights multiply x
   quantised to int8: the codes are in aq already when ready (quantised where x was made),
   else thread 0 quantises x here while the others wait at the barrier. */
static void linear_rows(const Lin* l, const float* x, float* y, int64_t M, const ActQ8* aq, int ready,
                        StepBarrier* bar, int inv) {
  const int64_t N = l->N, K = l->K;
  const int one = M == 1 && !inv;  /* one row's own loops (batch-invariant: every row the rows' loop) */
  if (takes_q8(l, aq)) {
    if (!ready) {
      if (omp_get_thread_num() == 0) quantize_rows_q8(x, aq->q, aq->dx, aq->sx, M, K, l->fmt == 1);
      step_barrier(bar);
    }
    const int64_t tasks = (N + 1) / 2;
    if (l->fmt == 1 && one) {  /* (a loop of its own: see q4_1_q8_task1) */
      #pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < tasks; t++) q4_1_q8_task1(aq->q, aq->dx, aq->sx, l->w, l->d, l->m, y, N, K, t);
    } else if (l->fmt == 1) {
      #pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < tasks; t++) q4_1_q8_task(aq->q, aq->dx, aq->sx, l->w, l->d, l->m, y, M, N, K, t);
    } else if (one) {
      #pragma omp for schedule(static) nowait
      for (int64_t n = 0; n < N; n++) q8_0_q8_task1(aq->q, aq->dx, l->w, l->d, y, N, K, n);
    } else {
      #pragma omp for schedule(static) nowait
      for (int64_t n = 0; n < N; n++) q8_0_q8_task(aq->q, aq->dx, l->w, l->d, y, M, N, K, n);
    }
#if defined(__AVX512F__)
  } else if (M >= BLOCKED_ROWS && l->fmt == 1) {  /* (step_products) */
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < ((N + 1) / 2 + PAIRS_A_TASK - 1) / PAIRS_A_TASK; t++)
      q4_1_blocked_task(x, l->w, l->d, l->m, y, M, N, K, t);
  } else if (M <= FEW_ROWS && (M > 1 || inv) && (l->fmt == 1 || l->fmt == 2)) {  /* (step_products) */
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < (N + FEW_OUTPUTS(M) - 1) / FEW_OUTPUTS(M); t++)
      few_rows_task(l->fmt, x, l->w, l->d, l->m, y, M, N, K, t);
#endif
  } else if (l->fmt == 1 && one) {  /* (the row count a constant: see q4_1_q8_task1) */
    const int64_t tasks = q4_1_tasks(N);
    int8_t digits[Q4_ROW_DIGITS(K)];  /* (each thread makes the row's digits itself: no wait) */
    float scales[Q4_ROW_FLOATS(K)];
    const Q4Row row = q4_1_row(x, K, digits, scales);
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tasks; t++) q4_1_task(x, &row, l->w, l->d, l->m, y, 1, N, K, t);
  } else if (l->fmt == 1) {
    const int64_t tasks = q4_1_tasks(N);
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tasks; t++) q4_1_task(x, NULL, l->w, l->d, l->m, y, M, N, K, t);
  } else if (l->fmt == 2 && one) {
    int8_t digits[Q8_ROW_DIGITS(K)];  /* (as Q4_1's: each thread its own) */
    int32_t starts[Q8_ROW_LANES(K)];
    float scales[Q8_ROW_LANES(K)];
    const Q8Row row = q8_0_row(x, K, digits, starts, scales);
    const int64_t tasks = q8_0_tasks(N, &row);
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tasks; t++) q8_0_task(x, &row, l->w, l->d, y, 1, N, K, t);
  } else if (l->fmt == 2) {
    #pragma omp for schedule(static) nowait
    for (int64_t n = 0; n < N; n++) q8_0_task(x, NULL, l->w, l->d, y, M, N, K, n);
#if defined(__AVX512F__)
  } else if (l->fmt == 0) {  /* (step_products) */
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < (N + DENSE_OUTPUTS - 1) / DENSE_OUTPUTS; t++)
      dense_rows_task(x, (const float*)l->w, y, M, N, K, t);
#endif
  } else {
    #pragma omp for schedule(static) nowait
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
  step_barrier(bar);
  if (l->bias) {
    #pragma omp for schedule(static) nowait
    for (int64_t n = 0; n < N; n++)
      for (int64_t r = 0; r < M; r++) y[r * N + n] += l->bias[n];
    step_barrier(bar);
  }
}

/* y[i] = float16 bits of x[i], rounded as the step rounds the keys and values it stores */
void round_to_half(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = f2h(x[i]);
}

/* y[i] = the float16 bits h[i] as float32, as the step reads stored rows (for tests) */
void widen_half(const uint16_t* h, float* y, int64_t n) { half_row(h, y, n); }

/* T tokens through n_layers layers, the final norm and the LM head: T tokens of one sequence
   (paged NULL: tail buffers, token t at each layer's offset + t), or tokens of several sequences
   over pages (paged). Logits [n_out, V] of the rows sel (NULL: the last n_out; n_out <= T). ids are the
   tokens, emb the embedding table [V, dim] (ids, positions and tables in range: the caller
   checks), cos/sin [T, D] their rotations; scratch holds T (4 dim + (3 Hq + 3 Hkv) D + 3 hidden) +
   Hq T score_stride + Hq T (score_stride / 64 + 1) (D + 2) floats, score_stride at least every
   token's position + 1 (with pages exactly the furthest one's: its keys are split), and with act_q8 (int8 activations for the packed products) T kmax / 4 +
   2 T kmax / 32 more, kmax the widest input of a product (a multiple of 32). */
void decode_step(const Layer* layers, int64_t n_layers, const Lin* head, const float* norm_w,
                 const float* emb, const int64_t* ids, const float* cos, const float* sin, int64_t T,
                 const int64_t* sel, int64_t n_out, const Paged* paged,
                 int64_t dim, int64_t Hq, int64_t Hkv, int64_t D, int64_t hidden, float eps,
                 float scale, float* scratch, int64_t score_stride, float* logits, int64_t act_q8,
                 int64_t invariant, int64_t kmax, int threads) {
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
  /* over pages, runs of tokens of one sequence at consecutive positions (a prompt's, a verification's),
     at most RUN_TOKENS: attention reads each key and value once for a run, each token's sums its own.
     A token past a layer's sliding window runs alone (from its own window's first key) */
  int64_t run_at[T + 1], runs = 0, narrowest = 0;  /* (the narrowest layer window, 0 none) */
  for (int64_t l = 0; l < n_layers; l++)
    if (layers[l].window && (!narrowest || layers[l].window < narrowest)) narrowest = layers[l].window;
  for (int64_t t = 0; paged && t < T; t++)
    if (!t || t - run_at[runs - 1] == RUN_TOKENS || paged->pos[t] != paged->pos[t - 1] + 1 ||
        (narrowest && paged->pos[t] >= narrowest) ||
        memcmp(paged->tables + t * paged->width, paged->tables + (t - 1) * paged->width, paged->width * sizeof(int32_t)))
      run_at[runs++] = t;
  run_at[runs] = T;
  StepBarrier bar = {0, 0, 0};
  #pragma omp parallel num_threads(threads)
  {
    const int lead = omp_get_thread_num() == 0;
    #pragma omp single
    bar.n = omp_get_num_threads();  /* (the single's barrier: every thread sees it) */
    for (int64_t l = 0; l < n_layers; l++) {
      const Layer* ly = layers + l;
      const int64_t off = ly->offset, cap = ly->cap;
      const int kind = (int)ly->kind, vkind = (int)ly->vkind;
      /* (wo's and w2's inputs are quantised in place when each head's, each SiLU span's, blocks
         start and end where the product's blocks do: pairs of blocks for Q4_1's layout) */
      const int q_qkv = takes_q8(&ly->wqkv, aq), q_w13 = takes_q8(&ly->w13, aq);
      const int q_wo = takes_q8(&ly->wo, aq) && D % (ly->wo.fmt == 1 ? 64 : 32) == 0;
      const int q_w2 = takes_q8(&ly->w2, aq) && hidden % (ly->w2.fmt == 1 ? 512 : 256) == 0;
      if (lead) {
        add_rms_norm(h, l ? delta : NULL, ly->attn_norm, h, nrm, T, dim, eps, 1);
        if (q_qkv) quantize_rows_q8(nrm, aq->q, aq->dx, aq->sx, T, dim, ly->wqkv.fmt == 1);
      }
      step_barrier(&bar);
      linear_rows(&ly->wqkv, nrm, qkv, T, aq, q_qkv, &bar, invariant);
      if (lead) {
        rope(qkv, 0, QKV, D, cos, sin, 0, D, qk, 1, T, Hq + Hkv, D, 1);
        for (int64_t t = 0; t < T; t++) {  /* each token's key and value where attention reads them */
          const KvRows kv = token_kv(paged, t, Hkv, D);
          const int64_t j = paged ? paged->pos[t] : off + t;
          for (int64_t kh = 0; kh < Hkv; kh++) {
            char* kr = (char*)row_at((const char*)ly->k + kv_span(kind, head_at(paged, kh, cap, D)), kv, j, kind);
            char* vr = (char*)row_at((const char*)ly->v + kv_span(vkind, head_at(paged, kh, cap, D)), kv, j, vkind);
            store_kv_row(qk + t * QK + (Hq + kh) * D, ly->kc ? ly->kc + kh * D : NULL, kind, kr,
                         sides_at(ly->ks, ly->kz, NULL, paged, kh, cap, kind, D), kv, j, D, ly);
            store_kv_row(qkv + t * QKV + (Hq + Hkv + kh) * D, NULL, vkind, vr,
                         sides_at(ly->vs, ly->vz, ly->vtab, paged, kh, cap, vkind, D), kv, j, D, ly);
          }
          for (int64_t hq = 0; ly->krot && hq < Hq; hq++) rotate(qk + t * QK + hq * D, ly->krot, D);
        }
      }
      step_barrier(&bar);
      if (!paged) {
        const int64_t n = off + T, chunk = split_keys(n, Hkv, threads), splits = (n + chunk - 1) / chunk;
        const KvRows kv = token_kv(NULL, 0, Hkv, D);
        #pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < Hkv * splits; t++) {  /* (KV head, split of its keys) */
          const int64_t kh = t / splits, j0 = (t % splits) * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
          const void* K = (const char*)ly->k + kv_span(kind, head_at(NULL, kh, cap, D));
          const void* V = (const char*)ly->v + kv_span(kind, head_at(NULL, kh, cap, D));
          const float* q = qk + kh * group * D;
          float* s = scores + kh * gt * score_stride;
          float* part = parts + t * gt * (D + 2);
          attend_chunk_d(q, QK, K, V, (Sides){NULL, NULL, NULL}, (Sides){NULL, NULL, NULL}, kv, j0, j1, off, T, group, D,
                         kind, kind, scale, s, score_stride, T * score_stride, part, D + 2, T * (D + 2));
        }
        step_barrier(&bar);
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < Hq * T; r++) {  /* query (head hq, token t): parts ((kh splits + i) gt + g T + t) */
          const int64_t hq = r / T, t = r % T, kh = hq / group, g = hq % group;
          merge_parts(parts + (kh * splits * gt + g * T + t) * (D + 2), splits, gt * (D + 2), D,
                      att + (t * Hq + hq) * D);
          if (q_wo) {  /* this head's whole blocks of wo's input row t */
            const int64_t b = (t * Hq + hq) * D / 32;
            quantize_rows_q8(att + (t * Hq + hq) * D, aq->q + b * 32, aq->dx + b, aq->sx + b, 1, D, ly->wo.fmt == 1);
          }
        }
        step_barrier(&bar);
      } else {  /* each token its own sequence: tasks (run of tokens, KV head, split of the longest's keys) */
        const int64_t n = score_stride, chunk = invariant ? INVARIANT_SPLIT : split_keys(n, Hkv * T, threads);
        const int64_t splits = (n + chunk - 1) / chunk;
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t t = 0; t < runs * Hkv * splits; t++) {
          const int64_t r = t / (Hkv * splits), kh = t / splits % Hkv, j0 = (t % splits) * chunk;
          const int64_t tok = run_at[r], j1 = j0 + chunk < n ? j0 + chunk : n, win = ly->window;
          /* a lone token past its window: the split from the window's first key (none left: empty) */
          const int64_t lo = win && run_at[r + 1] - tok == 1 && paged->pos[tok] >= win ? paged->pos[tok] - win + 1 : 0;
          const int64_t js = j0 > lo ? j0 : lo < j1 ? lo : j1;
          const KvRows kv = token_kv(paged, tok, Hkv, D);
          const void* K = (const char*)ly->k + kv_span(kind, head_at(paged, kh, cap, D));
          const void* V = (const char*)ly->v + kv_span(vkind, head_at(paged, kh, cap, D));
          const Sides KS = sides_at(ly->ks, ly->kz, NULL, paged, kh, cap, kind, D);
          const Sides VS = sides_at(ly->vs, ly->vz, ly->vtab, paged, kh, cap, vkind, D);
          const float* q = qk + tok * QK + kh * group * D;
          float* s = scores + (tok * Hkv + kh) * group * score_stride;
          float* part = parts + ((tok * Hkv + kh) * splits + t % splits) * group * (D + 2);
          attend_chunk_d(q, QK, K, V, KS, VS, kv, js, j1, paged->pos[tok], run_at[r + 1] - tok, group, D, kind, vkind,
                         scale, s, Hkv * group * score_stride, score_stride, part, Hkv * splits * group * (D + 2), D + 2);
        }
        step_barrier(&bar);
        #pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < Hq * T; r++) {  /* query (token t, head hq): parts ((t Hkv + kh) splits + i) group + g */
          const int64_t t = r / Hq, hq = r % Hq, kh = hq / group, g = hq % group;
          merge_parts(parts + ((t * Hkv + kh) * splits * group + g) * (D + 2), splits, group * (D + 2), D,
                      att + (t * Hq + hq) * D);
          if (ly->vrot) rotate_back(att + (t * Hq + hq) * D, ly->vrot, D);
          if (q_wo) {
            const int64_t b = (t * Hq + hq) * D / 32;
            quantize_rows_q8(att + (t * Hq + hq) * D, aq->q + b * 32, aq->dx + b, aq->sx + b, 1, D, ly->wo.fmt == 1);
          }
        }
        step_barrier(&bar);
      }
      linear_rows(&ly->wo, att, a, T, aq, q_wo, &bar, invariant);
      if (lead) {
        add_rms_norm(h, a, ly->ffn_norm, h, nrm, T, dim, eps, 1);
        if (q_w13) quantize_rows_q8(nrm, aq->q, aq->dx, aq->sx, T, dim, ly->w13.fmt == 1);
      }
      step_barrier(&bar);
      linear_rows(&ly->w13, nrm, ff, T, aq, q_w13, &bar, invariant);
      #pragma omp for schedule(static) nowait
      for (int64_t c = 0; c < T * 8; c++) {  /* silu_mul's arithmetic, each row in 8 spans */
        const int64_t t = c / 8, j0 = (c % 8) * hidden / 8, j1 = (c % 8 + 1) * hidden / 8;
        const float* g = ff + t * 2 * hidden;
        silu_mul_span(g + j0, g + hidden + j0, act + t * hidden + j0, j1 - j0);
        if (q_w2) {  /* the span's whole blocks (or pairs of blocks) of w2's input row t */
          const int64_t b = (t * hidden + j0) / 32;
          quantize_rows_q8(act + t * hidden + j0, aq->q + b * 32, aq->dx + b, aq->sx + b, 1, j1 - j0, ly->w2.fmt == 1);
        }
      }
      step_barrier(&bar);
      linear_rows(&ly->w2, act, delta, T, aq, q_w2, &bar, invariant);
    }
    const int q_head = takes_q8(head, aq);
    if (lead) {
      for (int64_t i = 0; i < n_out; i++) {  /* the rows asked for, side by side in nrm (h kept: a row may repeat) */
        const int64_t r = sel ? sel[i] : T - n_out + i;
        add_rms_norm(h + r * dim, delta + r * dim, norm_w, a + i * dim, nrm + i * dim, 1, dim, eps, 1);
      }
      if (q_head) quantize_rows_q8(nrm, aq->q, aq->dx, aq->sx, n_out, dim, head->fmt == 1);
    }
    step_barrier(&bar);
    linear_rows(head, nrm, logits, n_out, aq, q_head, &bar, invariant);
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
                ("kind", ctypes.c_int64), ("vkind", ctypes.c_int64), ("ks", ctypes.c_void_p), ("vs", ctypes.c_void_p),
                ("kz", ctypes.c_void_p), ("vz", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vtab", ctypes.c_void_p),
                ("vbnd", ctypes.c_void_p), ("vrot", ctypes.c_void_p), ("krot", ctypes.c_void_p),
                ("window", ctypes.c_int64)]


class Paged(ctypes.Structure):
    _fields_ = [("pos", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("width", ctypes.c_int64),
                ("bsh", ctypes.c_int64)]


class Kernels:
    def __init__(self, lib: ctypes.CDLL):
        self.decode_step = lib.decode_step
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.decode_step.argtypes = ([p, i, p, p, p, p, p, p, i, p, i, p] + [i] * 5 + [ctypes.c_float] * 2
                                     + [p, i, p, i, i, i, ctypes.c_int])
        self.decode_step.restype = None
        lib.kernel_lanes.restype = ctypes.c_int
        #: float32 lanes of the build's vector loops: 16 (AVX-512: the float32 weights' rows loops
        #: of :mod:`kvtier.model.step_products` too), 8 (AVX2), 1 (plain C)
        self.lanes = lib.kernel_lanes()
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
    activations' products (:mod:`kvtier.model.act_quant`), the stored rows
    (:mod:`kvtier.model.step_rows`), attention (:mod:`kvtier.model.step_attention`), the
    products' loops for few and many rows (:mod:`kvtier.model.step_products`) and the step."""
    return (packed_kernels._C_SOURCE + cpu_fused._C_SOURCE + act_quant._C_SOURCE + step_rows._C_SOURCE
            + step_attention._C_SOURCE + step_products._C_SOURCE + STEP_SOURCE)
