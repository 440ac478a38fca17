"""One row's packed products in a batch-invariant step, as fast as one row's own loop.

A batch-invariant step (:meth:`kvtier.model.cpu_step.DecodeStep.run_paged` with ``invariant``)
multiplies a lone row in the loop of several rows (``q4_1_group512`` / ``q8_0_group512`` of
:mod:`kvtier.model.packed_kernels`), so that its sums are the bits they are in any batch. That
loop keeps two outputs' sums a task, and one row gives them two (Q4_1) or two a output (Q8_0)
chains of dependent multiply-adds, which wait on the FMA's latency: a one-token step of the default
model took 8.2-8.8 ms against 6.3-6.5 through the row's integer digits (benchmarks/RESULTS.md,
2026-12-07). Here one row meets eight outputs a task, each output's sums the very multiply-adds of
the group loop in the same order (the weights formed from the same codes, scales and minima the same
way), so the bits are the same and eight outputs' chains run side by side. AVX-512 only; other
builds keep the group loop.
"""

from __future__ import annotations

__all__: list[str] = []

_C_SOURCE = r"""
#if defined(__AVX512F__)
#define ONE_ROW_OUTPUTS 8

/* outputs [n0, n0 + R) of one row x [K] against Q4_1 codes: q4_1_group512's sums for a row */
static inline __attribute__((always_inline)) void q4_1_one_row_r(const float* x, const uint8_t* codes,
    const _Float16* d, const _Float16* mn, float* y, int64_t G, int64_t n0, const int64_t R) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[ONE_ROW_OUTPUTS];
  float df[ONE_ROW_OUTPUTS][G + 16], mf[ONE_ROW_OUTPUTS][G + 16];  /* (as the group loop converts them) */
  for (int64_t r = 0; r < R; r++) {
    acc[r] = _mm512_setzero_ps();
    halves_to_floats(d + (n0 + r) * G, df[r], G);
    halves_to_floats(mn + (n0 + r) * G, mf[r], G);
  }
  for (int64_t g = 0; g < G; g++) {
    const __m512 xl = _mm512_loadu_ps(x + g * 32), xh = _mm512_loadu_ps(x + g * 32 + 16);
    for (int64_t r = 0; r < R; r++) {
      const uint8_t* c = codes + ((n0 + r) * G + g) * 16;
      if (!(g & 3)) KV_PREFETCH(c + 512);
      const __m512i p = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
      const __m512 t = _mm512_fmadd_ps(iota, _mm512_set1_ps(df[r][g]), _mm512_set1_ps(mf[r][g]));
      acc[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(p, 4), t), xh,
                               _mm512_fmadd_ps(_mm512_permutexvar_ps(p, t), xl, acc[r]));
    }
  }
  for (int64_t r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(acc[r]);
}

/* outputs [n0, n0 + R) of one row x [K] against Q8_0 codes: q8_0_group512's sums for a row */
static inline __attribute__((always_inline)) void q8_0_one_row_r(const float* x, const int8_t* codes,
    const _Float16* d, float* y, int64_t G, int64_t n0, const int64_t R) {
  __m512 a0[ONE_ROW_OUTPUTS], a1[ONE_ROW_OUTPUTS];
  float df[ONE_ROW_OUTPUTS][G + 16];
  for (int64_t r = 0; r < R; r++) {
    a0[r] = a1[r] = _mm512_setzero_ps();
    halves_to_floats(d + (n0 + r) * G, df[r], G);
  }
  for (int64_t g = 0; g < G; g++) {
    const __m512 xl = _mm512_loadu_ps(x + g * 32), xh = _mm512_loadu_ps(x + g * 32 + 16);
    for (int64_t r = 0; r < R; r++) {
      const int64_t b = (n0 + r) * G + g;
      if (!(g & 1)) KV_PREFETCH(codes + b * 32 + 1024);
      const __m512 dv = _mm512_set1_ps(df[r][g]);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + b * 32)))), dv);
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + b * 32 + 16)))), dv);
      a0[r] = _mm512_fmadd_ps(w0, xl, a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, xh, a1[r]);
    }
  }
  for (int64_t r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

/* task t of a one-row product of N outputs (fmt 1: Q4_1, 2: Q8_0): outputs [8 t, 8 t + 8) */
static inline void one_row_task(int fmt, const float* x, const void* codes, const _Float16* d,
                                const _Float16* mn, float* y, int64_t N, int64_t K, int64_t t) {
  const int64_t G = K / 32, n0 = t * ONE_ROW_OUTPUTS, R = N - n0 < ONE_ROW_OUTPUTS ? N - n0 : ONE_ROW_OUTPUTS;
  if (fmt == 1 && R == ONE_ROW_OUTPUTS) q4_1_one_row_r(x, (const uint8_t*)codes, d, mn, y, G, n0, ONE_ROW_OUTPUTS);
  else if (fmt == 1) q4_1_one_row_r(x, (const uint8_t*)codes, d, mn, y, G, n0, R);
  else if (R == ONE_ROW_OUTPUTS) q8_0_one_row_r(x, (const int8_t*)codes, d, y, G, n0, ONE_ROW_OUTPUTS);
  else q8_0_one_row_r(x, (const int8_t*)codes, d, y, G, n0, R);
}
#endif
"""
