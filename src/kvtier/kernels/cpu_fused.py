"""C kernels for the decoder's elementwise steps on the CPU (float32): each replaces several PyTorch ops.

At one token a decode step of the default model is 30 layers of small ops around its
packed matrix-vector products, and on the CPU each PyTorch op costs microseconds of
dispatch whatever its size. The same three steps as :mod:`kvtier.kernels.triton_fused`
on CUDA, with the same signatures:

- :func:`rope`: ``x * cos + rotate_half(x) * sin`` over every head of q and k;
- :func:`add_rms_norm`: the residual add and the next RMSNorm, returning both;
- :func:`silu_mul`: ``silu(gate) * up`` of the MLP.

The rotation and the residual sum round as PyTorch's ops do (no fused multiply-add); the
RMSNorm's mean of squares is summed in double, as PyTorch does on the CPU, in another
order, and the SiLU's exponential is a polynomial a vector at a time with AVX-512 or AVX2 (the
C library's ``expf`` otherwise): both within a few units in the last place of PyTorch's. Compiled once per machine (:mod:`kvtier.kernels.native`); where no
compiler builds them, :func:`load_kernels` warns and the model keeps PyTorch's ops.

Example::

    >>> h, n = add_rms_norm(torch.randn(1, 1, 576), None, torch.ones(576), 1e-5)
    >>> n.shape
    torch.Size([1, 1, 576])
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvtier.kernels.native import load_or_warn

__all__ = ["CpuFusedKernels", "add_rms_norm", "load_kernels", "rope", "silu_mul"]

_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* h = x + r (x itself when r is NULL; h may then be x), n = h * rsqrt(mean(h^2) + eps) * w */
void add_rms_norm(const float* x, const float* r, const float* w, float* h, float* n,
                  int64_t rows, int64_t dim, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * dim >= 65536)
    for (int64_t i = 0; i < rows; i++) {
        const float* xi = x + i * dim;
        float* hi = h + i * dim;
        float* ni = n + i * dim;
        double ss = 0.0;
        if (r) {
            const float* ri = r + i * dim;
            for (int64_t j = 0; j < dim; j++) { float v = xi[j] + ri[j]; hi[j] = v; ss += (double)v * v; }
        } else {
            for (int64_t j = 0; j < dim; j++) { float v = xi[j]; hi[j] = v; ss += (double)v * v; }
        }
        float inv = 1.0f / sqrtf((float)(ss / (double)dim) + eps);
        for (int64_t j = 0; j < dim; j++) ni[j] = (hi[j] * inv) * w[j];
    }
}

/* out[b, t, h] = x * cos + rotate_half(x) * sin, x [B, T, H, D] strided (last dim contiguous),
   cos/sin [B, T, 1, D] with strides (cb, ct), out contiguous */
void rope(const float* x, int64_t sb, int64_t st, int64_t sh, const float* cs, const float* sn,
          int64_t cb, int64_t ct, float* out, int64_t B, int64_t T, int64_t H, int64_t D, int nthreads) {
    const int64_t half = D / 2;
    #pragma omp parallel for collapse(2) num_threads(nthreads) if (B * T * H * D >= 65536)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const float* c = cs + b * cb + t * ct;
            const float* s = sn + b * cb + t * ct;
            for (int64_t h = 0; h < H; h++) {
                const float* xi = x + b * sb + t * st + h * sh;
                float* o = out + ((b * T + t) * H + h) * D;
                for (int64_t j = 0; j < half; j++) {
                    float lo = xi[j] * c[j], rl = xi[j + half] * s[j];
                    float hi = xi[j + half] * c[j + half], rh = xi[j] * s[j + half];
                    o[j] = lo - rl;
                    o[j + half] = hi + rh;
                }
            }
        }
    }
}

/* o[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u for j < n: with AVX-512 or AVX2 a vector at
   a time, exp by Cephes' polynomial (the attention's, kvtier.model.step_attention) over the whole
   float range: e^x = p(r) 2^(k - 1) 2 for x = k ln 2 + r, x held in [-87, 88.72] (below, 1 + e^x
   is 1; above, e^x is inf, as expf gives it), else expf. Within 4 units in the last place of
   PyTorch's silu times up (tests/kernels/test_cpu_fused.py). A 127-token prefill's 30 products
   of SmolLM2's shape took 7.7 ms through expf on 2 Sapphire Rapids cores, 1.2 ms so. */
#if defined(__AVX512F__)
#define KV_SILU_W 16
#define KV_SILU(name) _mm512_##name
typedef __m512 kv_silu_v;
typedef __m512i kv_silu_i;
#define KV_SILU_FLOOR(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define KV_SILU_BITS(i) _mm512_castsi512_ps(i)
#define KV_SILU_OVER(y, x, hi) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y, _mm512_set1_ps(INFINITY))
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_SILU_W 8
#define KV_SILU(name) _mm256_##name
typedef __m256 kv_silu_v;
typedef __m256i kv_silu_i;
#define KV_SILU_FLOOR(a) _mm256_floor_ps(a)
#define KV_SILU_BITS(i) _mm256_castsi256_ps(i)
#define KV_SILU_OVER(y, x, hi) _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ))
#endif
static inline void silu_mul_span(const float* g, const float* u, float* o, int64_t n) {
  int64_t j = 0;
#if defined(KV_SILU_W)
  const kv_silu_v lo = KV_SILU(set1_ps)(-87.f), hi = KV_SILU(set1_ps)(88.72283f);
  const kv_silu_v log2e = KV_SILU(set1_ps)(1.44269504088896341f), half = KV_SILU(set1_ps)(0.5f);
  const kv_silu_v c1 = KV_SILU(set1_ps)(0.693359375f), c2 = KV_SILU(set1_ps)(-2.12194440e-4f);
  const kv_silu_v one = KV_SILU(set1_ps)(1.f), two = KV_SILU(set1_ps)(2.f);
  for (; j + KV_SILU_W <= n; j += KV_SILU_W) {
    const kv_silu_v a = KV_SILU(loadu_ps)(g + j), x0 = KV_SILU(sub_ps)(KV_SILU(setzero_ps)(), a);
    const kv_silu_v x = KV_SILU(min_ps)(KV_SILU(max_ps)(x0, lo), hi);  /* a NaN: lo, and a's NaN stays */
    const kv_silu_v fx = KV_SILU_FLOOR(KV_SILU(fmadd_ps)(x, log2e, half));
    const kv_silu_v r = KV_SILU(fnmadd_ps)(fx, c2, KV_SILU(fnmadd_ps)(fx, c1, x));
    kv_silu_v y = KV_SILU(set1_ps)(1.9875691500e-4f);
    y = KV_SILU(fmadd_ps)(y, r, KV_SILU(set1_ps)(1.3981999507e-3f));
    y = KV_SILU(fmadd_ps)(y, r, KV_SILU(set1_ps)(8.3334519073e-3f));
    y = KV_SILU(fmadd_ps)(y, r, KV_SILU(set1_ps)(4.1665795894e-2f));
    y = KV_SILU(fmadd_ps)(y, r, KV_SILU(set1_ps)(1.6666665459e-1f));
    y = KV_SILU(fmadd_ps)(y, r, half);
    y = KV_SILU(add_ps)(KV_SILU(fmadd_ps)(y, KV_SILU(mul_ps)(r, r), r), one);
    const kv_silu_i k = KV_SILU(add_epi32)(KV_SILU(cvtps_epi32)(fx), KV_SILU(set1_epi32)(126));  /* 2^(k - 1) */
    y = KV_SILU(mul_ps)(KV_SILU(mul_ps)(y, KV_SILU_BITS(KV_SILU(slli_epi32)(k, 23))), two);
    y = KV_SILU_OVER(y, x0, hi);  /* e^x past the float range: inf */
    const kv_silu_v s = KV_SILU(div_ps)(a, KV_SILU(add_ps)(one, y));
    KV_SILU(storeu_ps)(o + j, KV_SILU(mul_ps)(s, KV_SILU(loadu_ps)(u + j)));
  }
#endif
  for (; j < n; j++) o[j] = (g[j] / (1.0f + expf(-g[j]))) * u[j];
}

/* out[i, j] = silu(x[i, j]) * x[i, H + j], x [rows, 2H] contiguous */
void silu_mul(const float* x, float* out, int64_t rows, int64_t H, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (rows * H >= 65536)
    for (int64_t i = 0; i < rows; i++) silu_mul_span(x + i * 2 * H, x + i * 2 * H + H, out + i * H, H);
}
"""


class CpuFusedKernels:
    """The compiled functions of :data:`_C_SOURCE`, called through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        p, i = ctypes.c_void_p, ctypes.c_int64
        self.add_rms_norm, self.rope, self.silu_mul = lib.add_rms_norm, lib.rope, lib.silu_mul
        n = ctypes.c_int  # threads: PyTorch's (torch.get_num_threads()), for large prompt steps
        self.add_rms_norm.argtypes = [p] * 5 + [i, i, ctypes.c_float, n]
        self.rope.argtypes = [p, i, i, i, p, p, i, i, p, i, i, i, i, n]
        self.silu_mul.argtypes = [p, p, i, i, n]
        for fn in (self.add_rms_norm, self.rope, self.silu_mul):
            fn.restype = None


@functools.cache
def load_kernels() -> CpuFusedKernels | None:
    """Compile (once per machine) and load the kernels; ``None`` if no C compiler builds them
    here (a warning says why)."""
    return load_or_warn("cpu_fused", _C_SOURCE, CpuFusedKernels, "the decoder keeps PyTorch's elementwise ops")


def _kernels() -> CpuFusedKernels:
    k = load_kernels()
    if k is None:
        raise RuntimeError("the CPU elementwise kernels did not build here; use PyTorch's ops (KVTIER_FUSED=0)")
    return k


def _check_cpu_f32(what: str, *ts: torch.Tensor) -> None:
    for t in ts:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"{what} takes float32 CPU tensors, got {t.dtype} on {t.device}")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``: ``x`` ``[B, T, H, D]`` (last dim contiguous), cos/sin
    ``[B, T, 1, D]``; a new contiguous ``[B, T, H, D]``."""
    _check_cpu_f32("rope", x, cos, sin)
    B, T, H, D = x.shape
    if D % 2 or x.stride(3) != 1:
        raise ValueError(f"rope needs an even head_dim with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if cos.shape != (B, T, 1, D) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{B}, {T}, 1, {D}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((B, T, H, D), dtype=x.dtype)
    if out.numel():
        _kernels().rope(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(),
                        cos.stride(0), cos.stride(1), out.data_ptr(), B, T, H, D, torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h) * weight)`` with ``h = x + residual`` (``x`` itself when ``residual`` is
    ``None``) over the last dim."""
    _check_cpu_f32("add_rms_norm", x, weight, *(() if residual is None else (residual,)))
    N = x.shape[-1]
    if weight.shape != (N,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rms_norm needs residual like x {tuple(x.shape)} and weight [{N}], got "
                         f"{None if residual is None else tuple(residual.shape)} and {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    r = None if residual is None else residual.contiguous()
    h = x if r is None else torch.empty_like(x)
    n = torch.empty_like(x)
    rows = x.numel() // N if N else 0
    if rows:
        _kernels().add_rms_norm(x.data_ptr(), None if r is None else r.data_ptr(), weight.data_ptr(),
                                h.data_ptr(), n.data_ptr(), rows, N, float(eps), torch.get_num_threads())
    return h, n


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :H]) * x[..., H:]`` of ``x`` ``[..., 2H]``: ``[..., H]``."""
    _check_cpu_f32("silu_mul", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate and up), got {tuple(x.shape)}")
    H = x.shape[-1] // 2
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], H), dtype=x.dtype)
    rows = x.numel() // (2 * H) if H else 0
    if rows:
        _kernels().silu_mul(x.data_ptr(), out.data_ptr(), rows, H, torch.get_num_threads())
    return out
