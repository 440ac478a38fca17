"""The one-call step's packed-product loops for few rows and for many (AVX-512), beside
``q4_1_task`` / ``q8_0_task`` of :mod:`kvtier.model.packed_kernels`. Each gives every (row,
output) sum the very multiply-adds of the group loop (``q4_1_group512`` / ``q8_0_group512``) in
the same order, the weights formed from the same codes, scales and minima the same way: the bits
are the group loop's, in any of these loops, so a batch-invariant step may take any of them.

*Few rows* (one to four). The group loop keeps two outputs' sums a task: with one to four rows
that is two to eight chains of dependent multiply-adds, which wait on the FMA's latency. Here a
task takes eight outputs (four for three or four rows), so eight to sixteen chains run side by
side:

- a batch-invariant step's lone row (:meth:`kvtier.model.cpu_step.DecodeStep.run_paged` with
  ``invariant``), which must take the rows' sums, not its own integer digits: a one-token step
  of the default model 8.2-8.8 ms through the group loop, 6.3-6.7 ms here (5.3-5.9 through the
  digits);
- steps of two to four rows (requests decoding together, a verification of a few tokens):
  9.6 -> 8.3-8.6 ms, 10.9 -> 9.1-9.3 ms and 12.0 -> 10.7-11.1 ms.

*Many rows* (16 or more, Q4_1). ``q4_1_task`` reads every row again for each pair of outputs;
here a task takes sixteen pairs and goes row group by row group (eight, then four, then the rest,
as ``q4_1_task`` groups them), so a group's rows stay in the L1 cache across the pairs: a call of
256 prompt tokens at a short context 386 -> 318 ms, 64 tokens 88 -> 79 ms.

*Float32 weights* (a model left unpacked; any row count). Each (row, output) sum is sixteen lanes
of the inputs in order, then one horizontal sum: the same multiply-adds however many rows share a
call, so a batch-invariant step over float32 projections may take them too. From eight rows a
task takes four rows against four weight rows at a time (each load serves four sums); below
that one weight row at a time, which streams the weight as one run of memory. Against the plain
loop of one (row, output) at a time (in one process, alternating; the default model's weights
as float32, 2-core Zen 4): one row 17.3 against 17.6 ms a step, 4 rows 23.2 against 24.4, 8 rows
36.7 against 57.6, 32 rows 101.3 against 182.5; so a decode step of up to 128 rows now takes the
step over those weights (:meth:`kvtier.model.cpu_step.DecodeStep.takes_rows`).

(benchmarks/RESULTS.md, 2026-12-07.) Other builds keep the group loop, and for float32 weights
the plain loop.
"""

from __future__ import annotations

__all__: list[str] = []

_C_SOURCE = r"""
#if defined(__AVX512F__)
#define FEW_ROWS_OUTPUTS 8  /* most outputs a task */
#define FEW_ROWS 4          /* most rows these loops take */
#define FEW_OUTPUTS(M) ((M) >= 3 ? 4 : FEW_ROWS_OUTPUTS)  /* outputs a task of M rows */

/* block g of rows x [M, K]: its first and last 16 values of each row */
static inline __attribute__((always_inline)) void block_of_rows(const float* x, int64_t K, int64_t g,
                                                                const int64_t M, __m512* xl, __m512* xh) {
  for (int64_t i = 0; i < M; i++) xl[i] = _mm512_loadu_ps(x + i * K + g * 32), xh[i] = _mm512_loadu_ps(x + i * K + g * 32 + 16);
}

/* outputs [n0, n0 + R) of rows x [M, K] (M <= FEW_ROWS) against Q4_1 codes: q4_1_group512's sums */
static inline __attribute__((always_inline)) void q4_1_few_rows(const float* x, int64_t K, const uint8_t* codes,
    const _Float16* d, const _Float16* mn, float* y, int64_t N, int64_t G, int64_t n0, const int64_t R,
    const int64_t M) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[FEW_ROWS_OUTPUTS][FEW_ROWS];
  float df[FEW_ROWS_OUTPUTS][G + 16], mf[FEW_ROWS_OUTPUTS][G + 16];  /* (as the group loop converts them) */
  for (int64_t r = 0; r < R; r++) {
    for (int64_t i = 0; i < M; i++) acc[r][i] = _mm512_setzero_ps();
    halves_to_floats(d + (n0 + r) * G, df[r], G);
    halves_to_floats(mn + (n0 + r) * G, mf[r], G);
  }
  for (int64_t g = 0; g < G; g++) {
    __m512 xl[FEW_ROWS], xh[FEW_ROWS];
    block_of_rows(x, K, g, M, xl, xh);
    for (int64_t r = 0; r < R; r++) {
      const uint8_t* c = codes + ((n0 + r) * G + g) * 16;
      if (!(g & 3)) KV_PREFETCH(c + 512);
      const __m512i p = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
      const __m512 t = _mm512_fmadd_ps(iota, _mm512_set1_ps(df[r][g]), _mm512_set1_ps(mf[r][g]));
      const __m512 wl = _mm512_permutexvar_ps(p, t), wh = _mm512_permutexvar_ps(_mm512_srli_epi32(p, 4), t);
      for (int64_t i = 0; i < M; i++) acc[r][i] = _mm512_fmadd_ps(wh, xh[i], _mm512_fmadd_ps(wl, xl[i], acc[r][i]));
    }
  }
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < M; i++) y[i * N + n0 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* outputs [n0, n0 + R) of rows x [M, K] (M <= FEW_ROWS) against Q8_0 codes: q8_0_group512's sums */
static inline __attribute__((always_inline)) void q8_0_few_rows(const float* x, int64_t K, const int8_t* codes,
    const _Float16* d, float* y, int64_t N, int64_t G, int64_t n0, const int64_t R, const int64_t M) {
  __m512 a0[FEW_ROWS_OUTPUTS][FEW_ROWS], a1[FEW_ROWS_OUTPUTS][FEW_ROWS];
  float df[FEW_ROWS_OUTPUTS][G + 16];
  for (int64_t r = 0; r < R; r++) {
    for (int64_t i = 0; i < M; i++) a0[r][i] = a1[r][i] = _mm512_setzero_ps();
    halves_to_floats(d + (n0 + r) * G, df[r], G);
  }
  for (int64_t g = 0; g < G; g++) {
    __m512 xl[FEW_ROWS], xh[FEW_ROWS];
    block_of_rows(x, K, g, M, xl, xh);
    for (int64_t r = 0; r < R; r++) {
      const int8_t* c = codes + ((n0 + r) * G + g) * 32;
      if (!(g & 1)) KV_PREFETCH(c + 1024);
      const __m512 dv = _mm512_set1_ps(df[r][g]);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c))), dv);
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 16)))), dv);
      for (int64_t i = 0; i < M; i++) {
        a0[r][i] = _mm512_fmadd_ps(w0, xl[i], a0[r][i]);
        a1[r][i] = _mm512_fmadd_ps(w1, xh[i], a1[r][i]);
      }
    }
  }
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < M; i++) y[i * N + n0 + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][i], a1[r][i]));
}

/* task t of a product of M <= FEW_ROWS rows and N outputs (fmt 1: Q4_1, 2: Q8_0): outputs
   [p t, p t + p), p = FEW_OUTPUTS(M), the counts constants where they can be (sums in registers) */
static inline void few_rows_task(int fmt, const float* x, const void* codes, const _Float16* d,
                                 const _Float16* mn, float* y, int64_t M, int64_t N, int64_t K, int64_t t) {
  const int64_t per = FEW_OUTPUTS(M), G = K / 32, n0 = t * per, R = N - n0 < per ? N - n0 : per;
#define FEW(MM) do { \
    if (fmt == 1 && R == FEW_OUTPUTS(MM)) q4_1_few_rows(x, K, (const uint8_t*)codes, d, mn, y, N, G, n0, FEW_OUTPUTS(MM), MM); \
    else if (fmt == 1) q4_1_few_rows(x, K, (const uint8_t*)codes, d, mn, y, N, G, n0, R, MM); \
    else if (R == FEW_OUTPUTS(MM)) q8_0_few_rows(x, K, (const int8_t*)codes, d, y, N, G, n0, FEW_OUTPUTS(MM), MM); \
    else q8_0_few_rows(x, K, (const int8_t*)codes, d, y, N, G, n0, R, MM); } while (0)
  if (M == 1) FEW(1);
  else if (M == 2) FEW(2);
  else if (M == 3) FEW(3);
  else FEW(4);
#undef FEW
}

/* task t of a Q4_1 product of many rows: output pairs [16 t, 16 t + 16), row group by row group
   (eight, then four, then the rest, as q4_1_task takes them), each pair's sums q4_1_group512's:
   a group's rows stay in the L1 cache across the block's pairs, where q4_1_task reads every row
   again for each pair */
#define PAIRS_A_TASK 16
#define BLOCKED_ROWS 16  /* fewest rows that take it */
static void q4_1_blocked_task(const float* x, const uint8_t* codes, const _Float16* d, const _Float16* mn,
                              float* y, int64_t M, int64_t N, int64_t K, int64_t t) {
  const int64_t G = K / 32, p0 = t * PAIRS_A_TASK, pairs = (N + 1) / 2;
  const int64_t P = pairs - p0 < PAIRS_A_TASK ? pairs - p0 : PAIRS_A_TASK;
  float df[PAIRS_A_TASK][2][G + 16], mf[PAIRS_A_TASK][2][G + 16];
  for (int64_t pp = 0; pp < P; pp++) {
    const int64_t n = 2 * (p0 + pp);
    const int two = n + 1 < N;
    for (int q = 0; q < 2; q++) {
      halves_to_floats(d + (n + (two ? q : 0)) * G, df[pp][q], G);
      halves_to_floats(mn + (n + (two ? q : 0)) * G, mf[pp][q], G);
    }
  }
  for (int64_t r0 = 0; r0 < M;) {
    const int64_t rn = M - r0 >= 8 ? 8 : M - r0 >= 4 ? 4 : M - r0;
    for (int64_t pp = 0; pp < P; pp++) {
      const int64_t n = 2 * (p0 + pp);
      const int two = n + 1 < N;
      const uint8_t* c0 = codes + n * G * 16;
      const uint8_t* c1 = two ? c0 + G * 16 : c0;
      if (rn == 8)
        q4_1_group512(x + r0 * K, K, c0, c1, df[pp][0], mf[pp][0], df[pp][1], mf[pp][1], G, 8, y + r0 * N, N, n, two);
      else if (rn == 4)
        q4_1_group512(x + r0 * K, K, c0, c1, df[pp][0], mf[pp][0], df[pp][1], mf[pp][1], G, 4, y + r0 * N, N, n, two);
      else
        q4_1_group512(x + r0 * K, K, c0, c1, df[pp][0], mf[pp][0], df[pp][1], mf[pp][1], G, rn, y + r0 * N, N, n, two);
    }
    r0 += rn;
  }
}

/* rows x [M, K] (M <= DENSE_ROWS_A_BLOCK) against the float32 weight rows w[0 .. NB - 1] (K
   each): y[i N + j] = each (row, output) sum as sixteen lanes of k (lane l: k = l mod 16, in
   order; the last block masked) added by _mm512_reduce_add_ps, the same multiply-adds whatever
   M, NB or the rows beside it */
#define DENSE_ROWS_A_BLOCK 4
#define DENSE_OUTPUTS 4  /* outputs a task */
static inline __attribute__((always_inline)) void dense_block(const float* x, const float* const* w, float* y,
    int64_t N, int64_t K, const int64_t M, const int64_t NB) {
  __m512 acc[DENSE_ROWS_A_BLOCK][DENSE_OUTPUTS];
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[DENSE_OUTPUTS], xv[DENSE_ROWS_A_BLOCK];
    for (int64_t j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_ps(m, w[j] + k);
    for (int64_t i = 0; i < M; i++) xv[i] = _mm512_maskz_loadu_ps(m, x + i * K + k);
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv[i], wv[j], acc[i][j]);
  }
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < NB; j++) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* task t of rows x [M, K] times a float32 weight [N, K]: outputs [4 t, 4 t + 4), rows four at a
   time. From DENSE_WIDE_ROWS rows the four outputs go together (their weight rows stay in the L1
   cache across the rows, and each row's load serves four outputs); with fewer, one output at a
   time, which reads the weight as one stream (four rows' interleaved streams were 1.2-1.3x slower
   there, where the step streams the weights from memory). Every sum dense_block's, whatever the
   rows and outputs beside it (a batch-invariant step may take it) */
#define DENSE_WIDE_ROWS 8
static void dense_rows_task(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t t) {
  const int64_t n0 = t * DENSE_OUTPUTS, nb = N - n0 < DENSE_OUTPUTS ? N - n0 : DENSE_OUTPUTS;
  const int wide = M >= DENSE_WIDE_ROWS && nb == DENSE_OUTPUTS;
  for (int64_t j0 = 0; j0 < nb; j0 += wide ? DENSE_OUTPUTS : 1) {
    const float* rows[DENSE_OUTPUTS];
    for (int64_t j = 0; j < DENSE_OUTPUTS; j++) rows[j] = w + (n0 + j0 + (wide ? j : 0)) * K;
    for (int64_t r0 = 0; r0 < M; r0 += DENSE_ROWS_A_BLOCK) {
      const int64_t mb = M - r0 < DENSE_ROWS_A_BLOCK ? M - r0 : DENSE_ROWS_A_BLOCK;
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N + n0 + j0;
#define DENSE(MB) do { if (wide) dense_block(xr, rows, yr, N, K, MB, DENSE_OUTPUTS); \
                       else dense_block(xr, rows, yr, N, K, MB, 1); } while (0)
      if (mb == 4) DENSE(4);
      else if (mb == 3) DENSE(3);
      else if (mb == 2) DENSE(2);
      else DENSE(1);
#undef DENSE
    }
  }
}
#endif
"""
