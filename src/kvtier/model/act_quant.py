"""Activations as int8 codes for the CPU's packed products: ``KVTIER_ACT_QUANT=q8`` (opt-in).

The packed products (:mod:`kvtier.model.packed_kernels`) multiply float32 activations by the
exact float32 weights, converting every 4- or 8-bit code to a float first. On a CPU without
AVX-512 that conversion, not memory, bounds a decode step: the Q4_1 loop spends about 20
vector instructions a block of 32 weights. Quantising the activations too, as llama.cpp does
(its ``Q8_0``/``Q8_1`` activation blocks), lets integer multiply-adds do the work: a block is
a handful of instructions (``maddubs``, ``madd``, one conversion, one multiply-add) and the
loop streams the codes at close to the memory's speed.

What it computes. Each row of activations ``x`` is cut in blocks of 32; a block's scale is
``dx = max|x| / 127`` and its codes ``qx = round(x * 127 / max|x|)`` (to nearest even),
``sx = dx * sum(qx)``. Then

- Q4_1 weights (``w = d * c + m``): ``y = sum_blocks (d * dx) * sum(c * qx) + m * sx``;
- Q8_0 weights (``w = d * c``): ``y = sum_blocks (d * dx) * sum(c * qx)``;

with the integer sums exact, so the only change from the exact product is the rounding of
the activations (about 0.3-1% of a product's size, relative: :func:`reference_product` and
the tests measure it). For Q4_1 the activations are laid out in pairs of blocks
(:func:`pair_layout`) so that one load of two blocks' nibbles meets two loads of
activations. This is an approximation of the model's arithmetic, which is why it is off by
default: on the default model about 97% of next-token argmaxes are kept and the perplexity
rises 0.24-0.32%; and because rounding to codes turns float32 rounding differences
elsewhere (a thread count) into different codes, its logits vary by about 1% across thread
counts, where the exact step's vary by 3e-7. Prefill (more than 16 rows) keeps the exact
float32 products either way.

Where it applies: the one-call decode step (:mod:`kvtier.model.cpu_step`) of a packed model,
for every Q4_1 and Q8_0 projection and the LM head. Select it with the environment
(``KVTIER_ACT_QUANT=q8``), ``kvtier generate --act-quant q8``, or per model
(``model.act_quant = "q8"``, which the environment does not override); ``none`` turns it off.

Example::

    >>> from kvtier.generate import GenerationConfig, generate
    >>> from kvtier.model import load_model
    >>> lm = load_model()                                    # doctest: +SKIP
    >>> lm.model.act_quant = "q8"                            # doctest: +SKIP
    >>> generate(lm.model, lm.tokenizer, "The capital of France is", GenerationConfig(max_tokens=2))  # doctest: +SKIP
    ' Paris.'
"""

from __future__ import annotations

import os

import torch

__all__ = ["ACT_QUANT_MODES", "ENV_VAR", "act_quant_of", "pair_layout", "parse_act_quant",
           "quantize_rows_reference", "reference_product"]

#: what ``act_quant`` accepts: ``none`` (the exact float32 products) or ``q8``
ACT_QUANT_MODES = ("none", "q8")
ENV_VAR = "KVTIER_ACT_QUANT"


def parse_act_quant(value: str | None, *, source: str = "act_quant") -> str:
    """``value`` checked and normalised (``None`` and ``""`` are ``none``); ``ValueError``
    naming it and the accepted modes otherwise."""
    mode = (value or "none").strip().lower()
    if mode not in ACT_QUANT_MODES:
        raise ValueError(f"{source}={value!r} is unknown; accepted: {', '.join(ACT_QUANT_MODES)} "
                         f"(q8: activations as int8 codes in the CPU decode step's products)")
    return mode


def act_quant_of(model) -> str:
    """The mode for ``model``: its own ``act_quant`` attribute when set, else ``$KVTIER_ACT_QUANT``."""
    own = model.__dict__.get("act_quant")  # (a plain attribute: no nn.Module lookup)
    if own is not None:
        return parse_act_quant(own)
    return parse_act_quant(os.environ.get(ENV_VAR), source=ENV_VAR)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C quantiser's result in PyTorch: ``x`` float32 ``[M, K]`` (``K % 32 == 0``) to codes
    int8 ``[M, K]``, scales ``dx`` and ``sx = dx * sum(codes)`` float32 ``[M, K / 32]``."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # (half to even, as the C rounding)
    dx = (amax / 127.0)[..., 0]
    return q.to(torch.int8).reshape(x.shape), dx, dx * q.sum(-1)


def pair_layout(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[M, K]`` in order, rearranged as Q4_1 products read them: blocks ``2p`` and
    ``2p + 1`` of a row share 64 bytes, elements 0-15 of each, then 16-31 of each; a last odd
    block stays as it is."""
    M, K = codes.shape
    G = K // 32
    paired = (G // 2) * 64
    head = codes[:, :paired].reshape(M, G // 2, 2, 2, 16).transpose(2, 3)  # (M, p, half, block, 16)
    return torch.cat([head.reshape(M, paired), codes[:, paired:]], dim=1)


def reference_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with ``x`` rounded as :func:`quantize_rows_reference` rounds it (the
    weights exact): what the int8 products compute, up to the order of float32 sums."""
    q, dx, _ = quantize_rows_reference(x)
    xq = (q.float().reshape(x.shape[0], -1, 32) * dx[..., None]).reshape(x.shape)
    return xq.double() @ weight.double().T


_C_SOURCE = r"""
/* ---- int8 activations (kvtier.model.act_quant) ---- */
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AQ_AVX2 1
/* the 32 codes of a Q4_1 block as bytes: low nibbles (elements 0-15), then high (16-31) */
static inline __m256i aq_nibbles(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128((const __m128i*)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(c, 4), c), _mm256_set1_epi8(15));
}
/* eight int32 sums of pairs of pairs of u8 x s8 products, as floats */
static inline __m256 aq_dot(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

/* Where element j of block g of a row of G blocks goes in the pair layout that Q4_1 products
   read: blocks 2p and 2p + 1 share 64 bytes, [elements 0-15 of 2p, 0-15 of 2p + 1, 16-31 of 2p,
   16-31 of 2p + 1] (so that one 32-byte load of the two blocks' codes, masked and shifted,
   lines up with two 32-byte loads of activations); a last odd block stays as it is. */
static inline int64_t aq_pair_pos(int64_t G, int64_t g, int64_t j) {
  if ((G & 1) && g == G - 1) return g * 32 + j;
  return (g & ~(int64_t)1) * 32 + (j >= 16 ? 32 : 0) + (g & 1) * 16 + (j & 15);
}

/* x [M, K] -> codes qx [M, K], dx and sx [M, K / 32]: per block of 32, dx = max|x| / 127,
   qx = round(x * (127 / max|x|)) to nearest even (0 for a block of zeros), sx = dx * sum(qx).
   pairs: the codes of each row in the pair layout (aq_pair_pos) for Q4_1 products, else in
   order (Q8_0). */
void quantize_rows_q8(const float* x, int8_t* qx, float* dx, float* sx, int64_t M, int64_t K, int pairs) {
  const int64_t G = K / 32;
  for (int64_t b = 0; b < M * G; b++) {
    const float* xg = x + b * 32;
    const int64_t r = b / G, g = b % G;
    int8_t* row = qx + r * K;
#if defined(AQ_AVX2)
    __m256 v[4], mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; j++)
      q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    /* (the packs interleave the 128-bit halves: dwords back in order) */
    const __m256i codes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (pairs && !((G & 1) && g == G - 1)) {
      int8_t* o = row + aq_pair_pos(G, g, 0);
      _mm_storeu_si128((__m128i*)o, _mm256_castsi256_si128(codes));
      _mm_storeu_si128((__m128i*)(o + 32), _mm256_extracti128_si256(codes, 1));
    } else {
      _mm256_storeu_si256((__m256i*)(row + g * 32), codes);
    }
    const int sum = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = fabsf(xg[j]) > amax ? fabsf(xg[j]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      const int c = (int)nearbyintf(xg[j] * inv);
      row[pairs ? aq_pair_pos(G, g, j) : g * 32 + j] = (int8_t)c;
      sum += c;
    }
#endif
    dx[b] = amax / 127.f;
    sx[b] = dx[b] * (float)sum;
  }
}

#if defined(AQ_AVX2)
/* sc[g] = d[g] dx[g] for one output's G blocks against one row of activations (eight blocks at a
   time); returns the minima's sum over blocks of m[g] sx[g] */
static inline float aq_scales(const _Float16* dq, const _Float16* mq, const float* dxr, const float* sxr,
                              int64_t G, float* sc) {
  __m256 sv = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    _mm256_storeu_ps(sc + g, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dq + g))),
                                           _mm256_loadu_ps(dxr + g)));
    sv = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mq + g))), _mm256_loadu_ps(sxr + g), sv);
  }
  float s = hsum8(sv);
  for (; g < G; g++) {
    sc[g] = (float)dq[g] * dxr[g];
    s += (float)mq[g] * sxr[g];
  }
  return s;
}

/* aq_scales for outputs n and n1 against rows [0, rn) of activations (dx0, sx0 their scales, G
   apart): sc[i][q] and msum[i][q] */
static inline __attribute__((always_inline)) void aq_q4_1_scales(
    const _Float16* d, const _Float16* mn, const float* dx0, const float* sx0, int64_t G, int64_t n,
    int64_t n1, const int64_t rn, float sc[][2][G + 8], float msum[][2]) {
  for (int64_t i = 0; i < rn; i++) {
    msum[i][0] = aq_scales(d + n * G, mn + n * G, dx0 + i * G, sx0 + i * G, G, sc[i][0]);
    msum[i][1] = aq_scales(d + n1 * G, mn + n1 * G, dx0 + i * G, sx0 + i * G, G, sc[i][1]);
  }
}

/* two outputs' dots (codes c0 and c1, scales sc0 and sc1) with one row of activations xr in the
   pair layout: two blocks a load, their low and high nibbles against the layout's two
   activation loads, summed in 16 bits (at most 2 * 2 * 15 * 127), each block's four lanes
   scaled by its own d dx */
static inline void aq_q4_1_row(const int8_t* xr, const uint8_t* c0p, const uint8_t* c1p, const float* sc0,
                               const float* sc1, int64_t G, float* out0, float* out1) {
  const int64_t G2 = G & ~(int64_t)1;  /* blocks in pairs */
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t g = 0; g < G2; g += 2) {
    KV_PREFETCH(c0p + g * 32);  /* (64 bytes of the two outputs' rows an iteration) */
    const __m256i xa = _mm256_loadu_si256((const __m256i*)(xr + g * 32));
    const __m256i xb = _mm256_loadu_si256((const __m256i*)(xr + g * 32 + 32));
    const __m256i c0 = _mm256_loadu_si256((const __m256i*)(c0p + g * 16));
    const __m256i c1 = _mm256_loadu_si256((const __m256i*)(c1p + g * 16));
    const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(c0, low), xa),
                                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c0, 4), low), xb));
    const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(c1, low), xa),
                                        _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c1, 4), low), xb));
    const __m256 g0 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc0 + g)), _mm_broadcast_ss(sc0 + g + 1), 1);
    const __m256 g1 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc1 + g)), _mm_broadcast_ss(sc1 + g + 1), 1);
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0, ones)), g0, a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1, ones)), g1, a1);
  }
  if (G2 < G) {  /* a last odd block, in order */
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xr + G2 * 32));
    a0 = _mm256_fmadd_ps(aq_dot(aq_nibbles(c0p + G2 * 16), xv), _mm256_broadcast_ss(sc0 + G2), a0);
    a1 = _mm256_fmadd_ps(aq_dot(aq_nibbles(c1p + G2 * 16), xv), _mm256_broadcast_ss(sc1 + G2), a1);
  }
  *out0 = hsum8(a0);
  *out1 = hsum8(a1);
}

/* outputs n and n1 of one row of y (y_row) from one row of activations (xr, its scales dxr and
   sxr): a decode step's products, kept apart from the groups of rows, which ran slower for one
   (aq_q4_1_group with one row a constant: SmolLM2's Q4_1 layers 3.6-4.1 against 3.3-3.9 ms,
   2 threads, alternated, the same bits) */
static inline void aq_q4_1_one(const int8_t* xr, const float* dxr, const float* sxr, const uint8_t* codes,
                               const _Float16* d, const _Float16* mn, int64_t G, int64_t n, int64_t n1,
                               float* y_row) {
  float sc0[G + 8], sc1[G + 8], o0, o1;
  const float m0 = aq_scales(d + n * G, mn + n * G, dxr, sxr, G, sc0);
  const float m1 = aq_scales(d + n1 * G, mn + n1 * G, dxr, sxr, G, sc1);
  aq_q4_1_row(xr, codes + n * G * 16, codes + n1 * G * 16, sc0, sc1, G, &o0, &o1);
  y_row[n] = o0 + m0;
  if (n1 != n) y_row[n1] = o1 + m1;
}

/* rows [0, rn) (rn <= 4; x0 their first, K apart) of outputs n and n1 of a Q4_1 product, with
   activations in the pair layout: two blocks a load, their low and high nibbles against the
   layout's two activation loads, summed in 16 bits (at most 2 * 2 * 15 * 127), each block's four
   lanes scaled by its own d dx; each pair of blocks unpacked once for the group. sc and msum
   come from aq_q4_1_scales; y0 is the group's first row of y [*, N]. Called with rn a constant
   (4) the sums stay in registers. */
static inline __attribute__((always_inline)) void aq_q4_1_group(
    const int8_t* x0, int64_t K, const uint8_t* c0p, const uint8_t* c1p, int64_t G, float sc[][2][G + 8],
    float msum[][2], const int64_t rn, float* y0, int64_t N, int64_t n, int64_t n1) {
  const int64_t G2 = G & ~(int64_t)1;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const uint8_t* cs[2] = {c0p, c1p};
  __m256 acc[4][2];
  for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G2; g += 2) {
    KV_PREFETCH(cs[0] + g * 32);
    __m256i lo[2], hi[2];
    for (int q = 0; q < 2; q++) {
      const __m256i c = _mm256_loadu_si256((const __m256i*)(cs[q] + g * 16));
      lo[q] = _mm256_and_si256(c, low);
      hi[q] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
    }
    for (int64_t i = 0; i < rn; i++) {
      const int8_t* xr = x0 + i * K + g * 32;
      const __m256i xa = _mm256_loadu_si256((const __m256i*)xr), xb = _mm256_loadu_si256((const __m256i*)(xr + 32));
      for (int q = 0; q < 2; q++) {
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[q], xa), _mm256_maddubs_epi16(hi[q], xb));
        const __m256 sg = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(&sc[i][q][g])),
                                               _mm_broadcast_ss(&sc[i][q][g + 1]), 1);
        acc[i][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), sg, acc[i][q]);
      }
    }
  }
  if (G2 < G)  /* a last odd block, in order */
    for (int64_t i = 0; i < rn; i++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x0 + i * K + G2 * 32));
      for (int q = 0; q < 2; q++)
        acc[i][q] = _mm256_fmadd_ps(aq_dot(aq_nibbles(cs[q] + G2 * 16), xv), _mm256_broadcast_ss(&sc[i][q][G2]), acc[i][q]);
    }
  for (int64_t i = 0; i < rn; i++) {
    y0[i * N + n] = hsum8(acc[i][0]) + msum[i][0];
    if (n1 != n) y0[i * N + n1] = hsum8(acc[i][1]) + msum[i][1];
  }
}
#endif

static inline void q4_1_q8_task(const int8_t* qx, const float* dx, const float* sx, const uint8_t* codes,
                                const _Float16* d, const _Float16* mn, float* y, int64_t M, int64_t N,
                                int64_t K, int64_t task);

/* q4_1_q8_task for one row (a decode step), in a loop of its own: callers branch on the row
   count outside their task loop (one function for both, with the count known only at run
   time, made a decode step's Q4_1 products about 30% slower) */
static inline void q4_1_q8_task1(const int8_t* qx, const float* dx, const float* sx, const uint8_t* codes,
                                 const _Float16* d, const _Float16* mn, float* y, int64_t N, int64_t K,
                                 int64_t task) {
  const int64_t G = K / 32, n = 2 * task, n1 = n + 1 < N ? n + 1 : n;
#if defined(AQ_AVX2)
  aq_q4_1_one(qx, dx, sx, codes, d, mn, G, n, n1, y);
#else
  q4_1_q8_task(qx, dx, sx, codes, d, mn, y, 1, N, K, task);
#endif
}

/* outputs 2 task and 2 task + 1 of y [M, N] from int8 activations (pair layout) and Q4_1 codes:
   per block (d dx) * sum(c qx) + m sx, the integer sums exact, rows in groups of up to four
   (aq_q4_1_group), a row alone through aq_q4_1_one. */
static inline void q4_1_q8_task(const int8_t* qx, const float* dx, const float* sx, const uint8_t* codes,
                                const _Float16* d, const _Float16* mn, float* y, int64_t M, int64_t N,
                                int64_t K, int64_t task) {
  const int64_t G = K / 32, n = 2 * task, n1 = n + 1 < N ? n + 1 : n;
#if defined(AQ_AVX2)
  const uint8_t* cs[2] = {codes + n * G * 16, codes + n1 * G * 16};
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int64_t rn = M - r0 < 4 ? M - r0 : 4;
    if (rn == 1) {
      aq_q4_1_one(qx + r0 * K, dx + r0 * G, sx + r0 * G, codes, d, mn, G, n, n1, y + r0 * N);
      continue;
    }
    float sc[4][2][G + 8], msum[4][2];
    aq_q4_1_scales(d, mn, dx + r0 * G, sx + r0 * G, G, n, n1, rn, sc, msum);
    if (rn == 4)  /* (a constant group: the sums stay in registers) */
      aq_q4_1_group(qx + r0 * K, K, cs[0], cs[1], G, sc, msum, 4, y + r0 * N, N, n, n1);
    else
      aq_q4_1_group(qx + r0 * K, K, cs[0], cs[1], G, sc, msum, rn, y + r0 * N, N, n, n1);
  }
#else
  const int64_t rows[2] = {n, n1};
  for (int64_t r = 0; r < M; r++)
    for (int q = 0; q < (n1 != n ? 2 : 1); q++) {
      const uint8_t* c = codes + rows[q] * G * 16;
      const int8_t* xr = qx + r * K;
      float s = 0.f;
      for (int64_t g = 0; g < G; g++) {
        int is = 0;
        for (int j = 0; j < 16; j++)
          is += (c[g * 16 + j] & 15) * xr[aq_pair_pos(G, g, j)] + (c[g * 16 + j] >> 4) * xr[aq_pair_pos(G, g, j + 16)];
        s += (float)d[rows[q] * G + g] * dx[r * G + g] * (float)is + (float)mn[rows[q] * G + g] * sx[r * G + g];
      }
      y[r * N + rows[q]] = s;
    }
#endif
}

#if defined(AQ_AVX2)
/* rows [0, rn) (rn <= 4; x0 their first, K apart, dx0 their scales, G apart) of output n of a
   Q8_0 product: each block's |codes| computed once for the group (the signs moved onto each
   row's activations; codes are within +-127) */
static inline __attribute__((always_inline)) void aq_q8_0_group(
    const int8_t* x0, const float* dx0, const int8_t* c, const _Float16* dn, int64_t K, const int64_t rn,
    float* y0, int64_t N, int64_t n) {
  const int64_t G = K / 32;
  __m256 acc[4][2];
  for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {  /* two blocks an iteration, two chains of sums */
    KV_PREFETCH(c + g * 32);
    for (int h = 0; h < 2 && g + h < G; h++) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(c + (g + h) * 32));
      const __m256i aw = _mm256_sign_epi8(w, w);
      const float dd = (float)dn[g + h];
      for (int64_t i = 0; i < rn; i++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x0 + i * K + (g + h) * 32));
        const __m256 p = aq_dot(aw, _mm256_sign_epi8(xv, w));
        acc[i][h] = _mm256_fmadd_ps(p, _mm256_set1_ps(dd * dx0[i * G + g + h]), acc[i][h]);
      }
    }
  }
  for (int64_t i = 0; i < rn; i++) y0[i * N + n] = hsum8(_mm256_add_ps(acc[i][0], acc[i][1]));
}
#endif

/* output n of y [M, N] from int8 activations and Q8_0 codes: per block (d dx) * sum(c qx); rows
   in groups of four share each block's load */
static inline void q8_0_q8_task(const int8_t* qx, const float* dx, const int8_t* codes, const _Float16* d,
                                float* y, int64_t M, int64_t N, int64_t K, int64_t n) {
  const int64_t G = K / 32;
  const int8_t* c = codes + n * K;
#if defined(AQ_AVX2)
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int64_t rn = M - r0 < 4 ? M - r0 : 4;
    if (rn == 4)  /* (a constant group: the sums stay in registers) */
      aq_q8_0_group(qx + r0 * K, dx + r0 * G, c, d + n * G, K, 4, y + r0 * N, N, n);
    else
      aq_q8_0_group(qx + r0 * K, dx + r0 * G, c, d + n * G, K, rn, y + r0 * N, N, n);
  }
#else
  for (int64_t r = 0; r < M; r++) {
    const int8_t* xr = qx + r * K;
    const float* dxr = dx + r * G;
    float s = 0.f;
    for (int64_t g = 0; g < G; g++) {
      int is = 0;
      for (int j = 0; j < 32; j++) is += c[g * 32 + j] * xr[g * 32 + j];
      s += (float)d[n * G + g] * dxr[g] * (float)is;
    }
    y[r * N + n] = s;
  }
#endif
}

/* q8_0_q8_task for one row, in a loop of its own (see q4_1_q8_task1) */
static inline void q8_0_q8_task1(const int8_t* qx, const float* dx, const int8_t* codes, const _Float16* d,
                                 float* y, int64_t N, int64_t K, int64_t n) {
#if defined(AQ_AVX2)
  aq_q8_0_group(qx, dx, codes + n * K, d + n * (K / 32), K, 1, y, N, n);
#else
  q8_0_q8_task(qx, dx, codes, d, y, 1, N, K, n);
#endif
}

/* the two products whole, for tests: y [M, N] = quantised x [M, K] (pair layout for Q4_1)
   against the codes */
void q4_1_q8_gemv(const int8_t* qx, const float* dx, const float* sx, const uint8_t* codes, const _Float16* d,
                  const _Float16* mn, float* y, int64_t M, int64_t N, int64_t K, int threads) {
  if (M == 1) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < (N + 1) / 2; t++) q4_1_q8_task1(qx, dx, sx, codes, d, mn, y, N, K, t);
  } else {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < (N + 1) / 2; t++) q4_1_q8_task(qx, dx, sx, codes, d, mn, y, M, N, K, t);
  }
}

void q8_0_q8_gemv(const int8_t* qx, const float* dx, const int8_t* codes, const _Float16* d, float* y,
                  int64_t M, int64_t N, int64_t K, int threads) {
  if (M == 1) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) q8_0_q8_task1(qx, dx, codes, d, y, N, K, n);
  } else {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) q8_0_q8_task(qx, dx, codes, d, y, M, N, K, n);
  }
}
"""
