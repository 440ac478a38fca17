"""The C kernels of the packed linears (:mod:`kvtier.model.packed`): products of float32 rows
with weights held as GGUF Q4_1 / Q8_0 block codes, and their exact dequantisation.

- ``q4_1_gemv`` / ``q8_0_gemv``: ``y[r, n] = sum_k x[r, k] w[n, k]`` for a few rows. One row
  keeps several accumulators per output; more rows (on the AVX-512 and AVX2 paths) decode each
  block of codes once for four rows at a time. The weight is formed as ``code * d (+ m)``,
  which is the float32 weight bit for bit, so only the order of the float32 sums differs from
  the float32 product (the AVX2 one-row Q8_0 loop multiplies each block's codes by ``x`` first
  and by ``d`` once: float32 products of the same size, rounded in another order). With
  AVX512-VNNI one row's Q4_1 and Q8_0 products take the row as integer digits instead
  (:mod:`kvtier.model.packed_digits`), their sums exact; with AVX2 and no AVX-512, one row's
  Q4_1 products (:mod:`kvtier.model.packed_digits_avx2`).
- ``q4_1_task`` / ``q8_0_task``: their per-task bodies, which the one-call step (:mod:`kvtier.model.cpu_step`)
  shares among its threads; given no ``Q4Row``/``Q8Row``, one row takes the rows' loop (batch-invariant).
- ``q4_1_dequant`` / ``q8_0_dequant``: the float32 weight, for prefills of many rows.

Paths: AVX-512 (16 lanes), AVX2 with FMA and F16C (8), plain C (1), chosen by the compiler's
flags (``-march=native``); :attr:`PackedKernels.lanes` reports the one a build took. Compiled
once per machine (:func:`kvtier.kernels.native.build_library`); :func:`load_kernels` returns
``None`` with a warning where no compiler builds them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvtier.kernels.native import load_or_warn
from kvtier.model import packed_digits

#: inputs of at most this many rows go through the C kernel; more rows dequantise and use linear()
MAX_KERNEL_ROWS = 4
#: the same bound for the AVX-512 and AVX2 builds, whose kernels decode each block once for eight
#: (AVX-512) or four rows at a time: on the 2-core AVX2 box all of SmolLM2's linears took 21.7 ms for 4 rows, 43.7
#: for 8, 79 for 16 and 306 for 64, against 165-185 and 437 ms for dequantising and linear()
GROUPED_MAX_ROWS = 64

_C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* no multiply-add the compiler fuses on its own (the intrinsics' are explicit): the plain loops
   compute the same bits in this library and in the decode step's, which is compiled with
   kvtier.kernels.cpu_fused's source and its pragma after this one */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
/* the codes a loop reads KV_AHEAD bytes from now, asked for ahead of time: one core alone keeps
   too few cache misses in flight to stream the weights at the memory's speed (SmolLM2's
   linears on the 2-core Zen 3 box: q4_1 7.3-8.9 -> 10.0-10.9 GB/s, q8_0 12.5-14.9 -> 18.7-20.5
   GB/s; the products are bit for bit the same) */
#define KV_AHEAD 2048
#define KV_PREFETCH(p) _mm_prefetch((const char*)(p) + KV_AHEAD, _MM_HINT_T0)
#endif
#if defined(__AVX2__)
/* the sum of a vector's eight floats */
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_AVX2 1
/* eight bytes at p as int32 (zero-extended), eight int8 codes as float32 */
static inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256 s8x8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
#endif
/* n fp16 values as float32, 16 or 8 at a time where the build has the instructions */
static inline void halves_to_floats(const _Float16* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#elif defined(KV_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; i++) dst[i] = (float)src[i];
}
/* float32 lanes of the vector path this build took (16 AVX-512, 8 AVX2, 1 plain loops) */
int kernel_lanes(void) {
#if defined(__AVX512F__)
  return 16;
#elif defined(KV_AVX2)
  return 8;
#else
  return 1;
#endif
}
""" + packed_digits._C_SOURCE + r"""
#if defined(__AVX512F__)
/* rows [0, rn) (rn <= 8; x0 their first, K apart) of outputs n and n + 1 (two) of a Q4_1 product,
   codes c0 and c1, scales and minima as float32 (df0, mf0; df1, mf1): each block's weights formed
   once for the group, as q4_1_task's one row forms them. Called with rn a constant (8 or 4) the
   sums stay in registers (8 rows: 16 of the 32); with rn known only at run time they lived on the
   stack, each multiply-add waiting on a store and a load. Groups of 8 rather than 4: a step of 8
   rows of the default model 18.6 -> 15.5 ms, 16 rows 35.3 -> 28.8 ms (2-core Sapphire Rapids). */
static inline __attribute__((always_inline)) void q4_1_group512(
    const float* x0, int64_t K, const uint8_t* c0, const uint8_t* c1, const float* df0, const float* mf0,
    const float* df1, const float* mf1, int64_t G, const int64_t rn, float* y0, int64_t N, int64_t n,
    int two) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[8][2];
  for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    if (!(g & 1)) KV_PREFETCH(c0 + g * 32);
    const __m512i p = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c0 + g * 16)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c1 + g * 16)));
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(df0[g]), _mm512_set1_ps(mf0[g]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(df1[g]), _mm512_set1_ps(mf1[g]));
    const __m512 wl0 = _mm512_permutexvar_ps(p, t0), wh0 = _mm512_permutexvar_ps(_mm512_srli_epi32(p, 4), t0);
    const __m512 wl1 = _mm512_permutexvar_ps(q, t1), wh1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1);
    for (int64_t i = 0; i < rn; i++) {
      const float* xg = x0 + i * K + g * 32;
      const __m512 xl = _mm512_loadu_ps(xg), xh = _mm512_loadu_ps(xg + 16);
      acc[i][0] = _mm512_fmadd_ps(wh0, xh, _mm512_fmadd_ps(wl0, xl, acc[i][0]));
      acc[i][1] = _mm512_fmadd_ps(wh1, xh, _mm512_fmadd_ps(wl1, xl, acc[i][1]));
    }
  }
  for (int64_t i = 0; i < rn; i++) {
    y0[i * N + n] = _mm512_reduce_add_ps(acc[i][0]);
    if (two) y0[i * N + n + 1] = _mm512_reduce_add_ps(acc[i][1]);
  }
}

/* rows [0, rn) (rn <= 8) of output n of a Q8_0 product, codes c and scales dn: each block's
   weights formed once for the group, two sums a row; rn a constant (8 or 4) keeps them in registers */
static inline __attribute__((always_inline)) void q8_0_group512(
    const float* x0, int64_t K, const int8_t* c, const _Float16* dn, int64_t G, const int64_t rn, float* y0,
    int64_t N, int64_t n) {
  __m512 acc[8][2];
  for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    if (!(g & 1)) KV_PREFETCH(c + g * 32);
    const __m512 dv = _mm512_set1_ps((float)dn[g]);
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + g * 32)))), dv);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + g * 32 + 16)))), dv);
    for (int64_t i = 0; i < rn; i++) {
      const float* xg = x0 + i * K + g * 32;
      acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), acc[i][1]);
    }
  }
  for (int64_t i = 0; i < rn; i++) y0[i * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
}
#endif
/* y[r, n] = sum_k x[r, k] w[n, k], weights in blocks of 32 along k, d and m fp16 [N, K/32].
   q4_1: w = code * d + m; 16 bytes per block, low nibble of byte j is element j, high j+16.
   q8_0: w = code * d; 32 int8 per block. code * d is exact in float32, so w is the
   float32 weight bit for bit. q8_0 keeps four accumulators per output (the dependency
   chain); with AVX-512, q4_1 takes two outputs at a time, two accumulators each, reading
   each tile of x once for both (SmolLM2's q4_1 layers on the 2-core AVX-512 box: 5.7 ->
   4.9 ms a token). Without AVX-512 but with AVX2, FMA and F16C the same loops run 8 lanes
   wide with intrinsics: the plain loops left to the compiler took SmolLM2's linears 38 ms
   a token on a 2-core AVX2 box (Zen 3), these 11 ms. */
static inline void q4_1_task(const float* x, const Q4Row* row, const uint8_t* codes, const _Float16* d,
                             const _Float16* mn, float* y, int64_t M, int64_t N, int64_t K, int64_t task) {
  const int64_t G = K / 32;
#if defined(KV_DIGITS)
  if (M == 1 && row && row->digits) {  /* one row as digits (kvtier.model.packed_digits) */
    const int64_t n = 2 * task, n1 = n + 1 < N ? n + 1 : n;
    q4_1_row_digits(row->digits, row->scales, row->sums, codes + n * G * 16, codes + n1 * G * 16, d + n * G,
                    d + n1 * G, mn + n * G, mn + n1 * G, G, row->unscale, y + n, n1 != n ? y + n1 : NULL);
    return;
  }
#endif
#ifdef __AVX512F__
  /* two output rows at a time: each tile of x is loaded once for both, and their scales and
     minima are converted to float32 16 at a time before the loop */
  {
    const int64_t n2 = task;
    const int64_t n = 2 * n2;
    const int two = n + 1 < N;
    float df[2][G + 16], mf[2][G + 16];
    for (int q = 0; q < 2; q++) {
      halves_to_floats(d + (n + (two ? q : 0)) * G, df[q], G);
      halves_to_floats(mn + (n + (two ? q : 0)) * G, mf[q], G);
    }
    const uint8_t* c0 = codes + n * G * 16;
    const uint8_t* c1 = two ? c0 + G * 16 : c0;  /* an odd last row computes itself twice */
    /* a block's 16 weights k * d + m (k = 0..15) as a table, looked up by the nibbles: vpermps
       reads only the low 4 bits of an index, so the low nibbles need no mask, and the weights
       are those of code * d + m, bit for bit (in place of a mask, a conversion and an FMA a
       vector: 0.99-1.32x a call, 1.10x the median, on the 2-core AVX-512 box; RESULTS 2026-12-04) */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (M > 1 || !row) {  /* rows eight (then four) at a time: each block's codes decoded once for them */
      for (int64_t r0 = 0; r0 < M;) {
        const int64_t rn = M - r0 >= 8 ? 8 : M - r0 >= 4 ? 4 : M - r0;
        if (rn == 8)  /* (a constant count: the sums stay in registers) */
          q4_1_group512(x + r0 * K, K, c0, c1, df[0], mf[0], df[1], mf[1], G, 8, y + r0 * N, N, n, two);
        else if (rn == 4)
          q4_1_group512(x + r0 * K, K, c0, c1, df[0], mf[0], df[1], mf[1], G, 4, y + r0 * N, N, n, two);
        else
          q4_1_group512(x + r0 * K, K, c0, c1, df[0], mf[0], df[1], mf[1], G, rn, y + r0 * N, N, n, two);
        r0 += rn;
      }
      return;
    }
    for (int64_t r = 0; r < M; r++) {
      const float* xr = x + r * K;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; g++) {
        if (!(g & 1)) KV_PREFETCH(c0 + g * 32);
        const __m512 xl = _mm512_loadu_ps(xr + g * 32), xh = _mm512_loadu_ps(xr + g * 32 + 16);
        const __m512i p = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c0 + g * 16)));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(c1 + g * 16)));
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(df[0][g]), _mm512_set1_ps(mf[0][g]));
        const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(df[1][g]), _mm512_set1_ps(mf[1][g]));
        a0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(p, t0), xl, a0);
        a1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(p, 4), t0), xh, a1);
        b0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(q, t1), xl, b0);
        b1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1), xh, b1);
      }
      y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
      if (two) y[r * N + n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
    }
  }
#elif defined(KV_AVX2)
  /* AVX2: two output rows at a time, as above, 8 lanes; bytes 0-7 and 8-15 of a block give
     elements 0-7 and 8-15 (low nibbles) and 16-23 and 24-31 (high nibbles) */
  {
    const int64_t n2 = task;
    const int64_t n = 2 * n2, n1 = n + 1 < N ? n + 1 : n;
    const uint8_t* cs[2] = {codes + n * G * 16, codes + n1 * G * 16};
    /* scales and minima as float32, converted 8 at a time before the loop */
    float ds[2][G + 8], ms[2][G + 8];
    for (int q = 0; q < 2; q++) {
      halves_to_floats(d + (q ? n1 : n) * G, ds[q], G);
      halves_to_floats(mn + (q ? n1 : n) * G, ms[q], G);
    }
    const __m256i low = _mm256_set1_epi32(15);
    if (M > 1 || !row) {  /* rows four at a time: each block's codes decoded once for all of them */
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t rn = M - r0 < 4 ? M - r0 : 4;
        __m256 acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
          if (!(g & 1)) KV_PREFETCH(cs[0] + g * 32);
          __m256 w[2][4];
          for (int q = 0; q < 2; q++) {
            const __m256 dd = _mm256_broadcast_ss(&ds[q][g]), mm = _mm256_broadcast_ss(&ms[q][g]);
            const __m256i b0 = u8x8(cs[q] + g * 16), b1 = u8x8(cs[q] + g * 16 + 8);
            w[q][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), dd, mm);
            w[q][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), dd, mm);
            w[q][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), dd, mm);
            w[q][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), dd, mm);
          }
          for (int64_t i = 0; i < rn; i++) {
            const float* xg = x + (r0 + i) * K + g * 32;
            for (int j = 0; j < 4; j++) {
              const __m256 xv = _mm256_loadu_ps(xg + 8 * j);
              acc[i][0] = _mm256_fmadd_ps(w[0][j], xv, acc[i][0]);
              acc[i][1] = _mm256_fmadd_ps(w[1][j], xv, acc[i][1]);
            }
          }
        }
        for (int64_t i = 0; i < rn; i++) {
          y[(r0 + i) * N + n] = hsum8(acc[i][0]);
          if (n1 != n) y[(r0 + i) * N + n1] = hsum8(acc[i][1]);
        }
      }
      return;
    }
    for (int64_t r = 0; r < M; r++) {
      const float* xr = x + r * K;
      __m256 acc[2][4];
      for (int q = 0; q < 2; q++)
        for (int j = 0; j < 4; j++) acc[q][j] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; g++) {
        if (!(g & 1)) KV_PREFETCH(cs[0] + g * 32);
        const float* xg = xr + g * 32;
        const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
        for (int q = 0; q < 2; q++) {
          const __m256 dd = _mm256_broadcast_ss(&ds[q][g]), mm = _mm256_broadcast_ss(&ms[q][g]);
          const __m256i b0 = u8x8(cs[q] + g * 16), b1 = u8x8(cs[q] + g * 16 + 8);
          const __m256 l0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
          const __m256 l1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
          const __m256 h0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
          const __m256 h1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
          acc[q][0] = _mm256_fmadd_ps(_mm256_fmadd_ps(l0, dd, mm), x0, acc[q][0]);
          acc[q][1] = _mm256_fmadd_ps(_mm256_fmadd_ps(l1, dd, mm), x1, acc[q][1]);
          acc[q][2] = _mm256_fmadd_ps(_mm256_fmadd_ps(h0, dd, mm), x2, acc[q][2]);
          acc[q][3] = _mm256_fmadd_ps(_mm256_fmadd_ps(h1, dd, mm), x3, acc[q][3]);
        }
      }
      y[r * N + n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(acc[0][2], acc[0][3])));
      if (n1 != n)
        y[r * N + n1] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[1][0], acc[1][1]), _mm256_add_ps(acc[1][2], acc[1][3])));
    }
  }
#else
  {
    const int64_t n = task;
    for (int64_t r = 0; r < M; r++) {
      const float* xr = x + r * K;
      const uint8_t* c = codes + n * G * 16;
      const _Float16* dn = d + n * G;
      const _Float16* mnn = mn + n * G;
      float a0[16] = {0}, a1[16] = {0};
      for (int64_t g = 0; g < G; g++) {
        const float dd = (float)dn[g], mm = (float)mnn[g];
        for (int j = 0; j < 16; j++) {
          a0[j] += ((float)(c[g * 16 + j] & 15) * dd + mm) * xr[g * 32 + j];
          a1[j] += ((float)(c[g * 16 + j] >> 4) * dd + mm) * xr[g * 32 + 16 + j];
        }
      }
      float s = 0.f;
      for (int j = 0; j < 16; j++) s += a0[j] + a1[j];
      y[r * N + n] = s;
    }
  }
#endif
}

/* the tasks of q4_1_task: pairs of outputs on the vector paths, single outputs otherwise */
static inline int64_t q4_1_tasks(int64_t N) {
#if defined(__AVX512F__) || defined(KV_AVX2)
  return (N + 1) / 2;
#else
  return N;
#endif
}

void q4_1_gemv(const float* x, const uint8_t* codes, const _Float16* d, const _Float16* mn,
               float* y, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t tasks = q4_1_tasks(N);
  int8_t digits[M == 1 ? Q4_ROW_DIGITS(K) : 1];
  float scales[M == 1 ? Q4_ROW_FLOATS(K) : 1];
  const Q4Row row = M == 1 ? q4_1_row(x, K, digits, scales) : (Q4Row){NULL, NULL, NULL, 1.f};
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; t++) q4_1_task(x, &row, codes, d, mn, y, M, N, K, t);
}

/* The float32 weight [N, K], bit for bit: code * d is exact (4 or 8 bits times an fp16's 11),
   so the one rounding of + m is the same with or without a fused multiply-add. A prefill
   (more than a few rows) multiplies it as the float32 model does. A block's 32 weights are one
   or two vectors: the default model's 120 layer weights took 29.7 ms through the plain loops
   (GCC left them mostly scalar) and 13.5 ms so, on 2 Sapphire Rapids cores; a 127-token
   prefill 190 -> 165 ms (benchmarks/RESULTS.md, 2026-12-06). */
static inline void q4_1_block_dequant(const uint8_t* c, float dd, float mm, float* o) {
#if defined(__AVX512F__)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
  const __m512 vd = _mm512_set1_ps(dd), vm = _mm512_set1_ps(mm);
  _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), vd, vm));
  _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), vd, vm));
#elif defined(KV_AVX2)
  const __m256 vd = _mm256_set1_ps(dd), vm = _mm256_set1_ps(mm);
  for (int j = 0; j < 16; j += 8) {
    const __m256i b = u8x8(c + j);
    _mm256_storeu_ps(o + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), vd, vm));
    _mm256_storeu_ps(o + j + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), vd, vm));
  }
#else
  for (int j = 0; j < 16; j++) {
    o[j] = (float)(c[j] & 15) * dd + mm;
    o[j + 16] = (float)(c[j] >> 4) * dd + mm;
  }
#endif
}

static inline void q8_0_block_dequant(const int8_t* c, float dd, float* o) {
#if defined(__AVX512F__)
  const __m512 vd = _mm512_set1_ps(dd);
  for (int j = 0; j < 32; j += 16)
    _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + j)))), vd));
#elif defined(KV_AVX2)
  const __m256 vd = _mm256_set1_ps(dd);
  for (int j = 0; j < 32; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(s8x8(c + j), vd));
#else
  for (int j = 0; j < 32; j++) o[j] = (float)c[j] * dd;
#endif
}

/* With bf16 set, w is bfloat16, each weight rounded to nearest even (PyTorch's conversion),
   for a prefill that multiplies in bfloat16 (kvtier.kernels.precision.prefill_matmuls). */
static inline void kv_bf16(const float* b, uint16_t* o) {
  for (int j = 0; j < 32; j++) {
    uint32_t u;
    memcpy(&u, b + j, 4);
    o[j] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

void q4_1_dequant(const uint8_t* codes, const _Float16* d, const _Float16* mn, void* w,
                  int64_t N, int64_t K, int bf16, int threads) {
  const int64_t G = K / 32;
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t g = 0; g < G; g++) {
      float b[32], *o = bf16 ? b : (float*)w + n * K + g * 32;
      q4_1_block_dequant(codes + (n * G + g) * 16, (float)d[n * G + g], (float)mn[n * G + g], o);
      if (bf16) kv_bf16(b, (uint16_t*)w + n * K + g * 32);
    }
}

void q8_0_dequant(const int8_t* codes, const _Float16* d, void* w, int64_t N, int64_t K, int bf16, int threads) {
  const int64_t G = K / 32;
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t g = 0; g < G; g++) {
      float b[32], *o = bf16 ? b : (float*)w + n * K + g * 32;
      q8_0_block_dequant(codes + n * K + g * 32, (float)d[n * G + g], o);
      if (bf16) kv_bf16(b, (uint16_t*)w + n * K + g * 32);
    }
}

static inline void q8_0_task(const float* x, const Q8Row* row, const int8_t* codes, const _Float16* d,
                             float* y, int64_t M, int64_t N, int64_t K, int64_t task) {
  const int64_t G = K / 32;
#if defined(KV_DIGITS_Q8)
  if (M == 1 && row && row->digits) {  /* one row as digits, two outputs a task (q8_0_tasks) */
    const int64_t n = 2 * task, n1 = n + 1 < N ? n + 1 : n;
    q8_0_row_digits(row->digits, row->starts, row->scales, codes + n * K, codes + n1 * K, d + n * G, d + n1 * G,
                    G, row->unscale, y + n, n1 != n ? y + n1 : NULL);
    return;
  }
#endif
  {
    const int64_t n = task;
#if defined(__AVX512F__)
    if (M > 1 || !row) {  /* rows eight (then four) at a time, each decoded once for them, two sums a row */
      const int8_t* c = codes + n * K;
      for (int64_t r0 = 0; r0 < M;) {
        const int64_t rn = M - r0 >= 8 ? 8 : M - r0 >= 4 ? 4 : M - r0;
        if (rn == 8)  /* (a constant count: the sums stay in registers) */
          q8_0_group512(x + r0 * K, K, c, d + n * G, G, 8, y + r0 * N, N, n);
        else if (rn == 4)
          q8_0_group512(x + r0 * K, K, c, d + n * G, G, 4, y + r0 * N, N, n);
        else
          q8_0_group512(x + r0 * K, K, c, d + n * G, G, rn, y + r0 * N, N, n);
        r0 += rn;
      }
      return;
    }
#elif defined(KV_AVX2)
    if (M > 1 || !row) {  /* rows four at a time, each block decoded once for them, two sums a row */
      const int8_t* c = codes + n * K;
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t rn = M - r0 < 4 ? M - r0 : 4;
        __m256 acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
          if (!(g & 1)) KV_PREFETCH(c + g * 32);
          const __m256 dv = _mm256_set1_ps((float)d[n * G + g]);
          __m256 w[4];
          for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(s8x8(c + g * 32 + 8 * j), dv);
          for (int64_t i = 0; i < rn; i++) {
            const float* xg = x + (r0 + i) * K + g * 32;
            for (int j = 0; j < 4; j++)
              acc[i][j & 1] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), acc[i][j & 1]);
          }
        }
        for (int64_t i = 0; i < rn; i++) y[(r0 + i) * N + n] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
      }
      return;
    }
#endif
    for (int64_t r = 0; r < M; r++) {
      const float* xr = x + r * K;
      const int8_t* c = codes + n * K;
      const _Float16* dn = d + n * G;
#ifdef __AVX512F__
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      /* blocks g and g + 1 an iteration, into sums 0-1 and 2-3: each sum's index a constant, so
         the four stay in registers (indexed by g & 1 they lived on the stack, each multiply-add
         waiting on a store and a load: SmolLM2's Q8_0 head, 2 threads, 1.24-1.34 -> 0.84-0.89
         ms in one run and 1.62-1.71 -> 1.06-1.10 in another, 1.4-1.6 -> 1.0-1.2 inside the
         decode step; the same bits) */
      for (int64_t g = 0; g < G; g += 2) {
        KV_PREFETCH(c + g * 32);
        for (int h = 0; h < 2 && g + h < G; h++) {
          const __m512 dv = _mm512_set1_ps((float)dn[g + h]);
          const int8_t* cg = c + (g + h) * 32;
          const float* xg = xr + (g + h) * 32;
          const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)cg))), dv);
          const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(cg + 16)))), dv);
          a[2 * h] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg), a[2 * h]);
          a[2 * h + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), a[2 * h + 1]);
        }
      }
      y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]),
                                                        _mm512_add_ps(a[2], a[3])));
#elif defined(KV_AVX2)
      /* each block's codes times x first, then once times its scale: sum_g d_g (sum_j c_j x_j),
         float32 products of the same size (a code is exact in float32), and one multiply a
         block where forming each weight c * d took four (SmolLM2's LM head on the 2-core
         first-generation Zen box: 6.4 -> 5.3 ms a call; benchmarks/RESULTS.md, 2026-12-05);
         blocks g and g + 1 into sums 0 and 1 */
      __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t g = 0; g < G; g += 2) {
        KV_PREFETCH(c + g * 32);
        for (int h = 0; h < 2 && g + h < G; h++) {
          const int8_t* cg = c + (g + h) * 32;
          const float* xg = xr + (g + h) * 32;
          __m256 t = _mm256_mul_ps(s8x8(cg), _mm256_loadu_ps(xg));
          for (int j = 1; j < 4; j++) t = _mm256_fmadd_ps(s8x8(cg + 8 * j), _mm256_loadu_ps(xg + 8 * j), t);
          a[h] = _mm256_fmadd_ps(t, _mm256_set1_ps((float)dn[g + h]), a[h]);
        }
      }
      y[r * N + n] = hsum8(_mm256_add_ps(a[0], a[1]));
#else
      float a0[32] = {0};
      for (int64_t g = 0; g < G; g++) {
        const float dd = (float)dn[g];
        for (int j = 0; j < 32; j++) a0[j] += ((float)c[g * 32 + j] * dd) * xr[g * 32 + j];
      }
      float s = 0.f;
      for (int j = 0; j < 32; j++) s += a0[j];
      y[r * N + n] = s;
#endif
    }
  }
}

void q8_0_gemv(const float* x, const int8_t* codes, const _Float16* d, const _Float16* unused,
               float* y, int64_t M, int64_t N, int64_t K, int threads) {
  (void)unused;
  int8_t digits[M == 1 ? Q8_ROW_DIGITS(K) : 1];
  int32_t starts[M == 1 ? Q8_ROW_LANES(K) : 1];
  float scales[M == 1 ? Q8_ROW_LANES(K) : 1];
  const Q8Row row = M == 1 ? q8_0_row(x, K, digits, starts, scales) : (Q8Row){NULL, NULL, NULL, 1.f};
  const int64_t tasks = q8_0_tasks(N, &row);
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; t++) q8_0_task(x, &row, codes, d, y, M, N, K, t);
}
"""


class PackedKernels:
    """The compiled ``q4_1_gemv`` / ``q8_0_gemv`` and ``q4_1_dequant`` / ``q8_0_dequant`` of
    :data:`_C_SOURCE`, called through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fns = {"q4_1": lib.q4_1_gemv, "q8_0": lib.q8_0_gemv}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = [p] * 5 + [i] * 3 + [ctypes.c_int], None
        self._dequant = {"q4_1": lib.q4_1_dequant, "q8_0": lib.q8_0_dequant}
        lib.q4_1_dequant.argtypes = [p] * 4 + [i] * 2 + [ctypes.c_int] * 2
        lib.q8_0_dequant.argtypes = [p] * 3 + [i] * 2 + [ctypes.c_int] * 2
        for fn in self._dequant.values():
            fn.restype = None
        lib.kernel_lanes.restype = ctypes.c_int
        #: float32 lanes of the vector path this build took: 16 (AVX-512), 8 (AVX2), 1 (plain C)
        self.lanes = lib.kernel_lanes()
        #: rows the kernel takes (:data:`GROUPED_MAX_ROWS` on the vector paths, which decode each
        #: block once for four rows at a time, else :data:`MAX_KERNEL_ROWS`)
        self.max_rows = GROUPED_MAX_ROWS if self.lanes > 1 else MAX_KERNEL_ROWS
        lib.kernel_digits.restype = ctypes.c_int
        flags = lib.kernel_digits()
        #: the formats whose one-row products take the row as integer digits
        #: (:mod:`kvtier.model.packed_digits`): Q4_1 and Q8_0 with AVX512-VNNI, Q4_1 with AVX2
        #: (:mod:`kvtier.model.packed_digits_avx2`), none otherwise (float32 products)
        self.digits = tuple(fmt for bit, fmt in ((1, "q4_1"), (2, "q8_0")) if flags & bit)
        self._digits_back = {"q4_1": lib.q4_1_digits_back, "q8_0": lib.q8_0_digits_back}
        for fn in self._digits_back.values():
            fn.argtypes, fn.restype = [p, i, p], ctypes.c_int

    def digits_back(self, x: torch.Tensor, fmt: str = "q4_1") -> torch.Tensor | None:
        """``x`` (float32 ``[K]``) as the digits of ``fmt``'s one-row products hold it, back in
        float32; ``None`` where the build has no digits (for tests)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        return out if self._digits_back[fmt](x.data_ptr(), x.numel(), out.data_ptr()) else None

    def dequant(self, fmt: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor:
        """The weight ``out`` ``[N, K]`` (contiguous) of the block codes: float32, bit for bit, or
        bfloat16, each float32 weight rounded to nearest even (``w.to(torch.bfloat16)``)."""
        N, K = out.shape
        assert out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous(), out.dtype
        extra = () if fmt == "q8_0" else (m.data_ptr(),)
        self._dequant[fmt](codes.data_ptr(), d.data_ptr(), *extra, out.data_ptr(), N, K,
                           int(out.dtype == torch.bfloat16), torch.get_num_threads())
        return out

    def gemv(self, fmt: str, x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
             m: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``out[r, n] = sum_k x[r, k] w[n, k]``: x float32 ``[M, K]`` contiguous, out ``[M, N]``."""
        M, K = x.shape
        self._fns[fmt](x.data_ptr(), codes.data_ptr(), d.data_ptr(),
                       (m if m is not None else d).data_ptr(), out.data_ptr(),
                       M, out.shape[1], K, torch.get_num_threads())
        return out


@functools.cache
def load_kernels() -> PackedKernels | None:
    """Compile (once per machine, :mod:`kvtier.kernels.native`) and load the kernels; ``None`` if
    no C compiler can build them here (a warning says why)."""
    return load_or_warn("packed", _C_SOURCE, PackedKernels, "weights stay float32")
