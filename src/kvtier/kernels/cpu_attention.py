"""Decode attention over float32 pages on the CPU: a small C kernel that reads the pages in place.

The PyTorch reference (:func:`kvtier.kernels.paged.paged_attention_reference`) gathers
each row's pages into a contiguous copy and calls SDPA on it; at 32 rows of 64-576
tokens that gather is a third of a decode step. :func:`paged_decode_cpu` computes the
same attention for a decode step (one query per row) straight from the page table:

- one task per row (per row and KV head when there are fewer than twice as many rows
  as threads), spread over PyTorch's OpenMP threads;
- a task reads each of its row's blocks whole (``[block_size, H_kv, D]`` is
  contiguous) and asks for the next block while it scores the current one;
- two passes: scores of every query head of the KV head's group (``q . k * scale``),
  then softmax weights and the weighted sum of the values, in float32.

Only the order of the float32 sums differs from the reference. The kernel covers
float32 queries over float32 pages of the lossless codec; anything else returns
``None`` and the caller serves the reference. Table entries and lengths are checked
inside the kernel, before anything is read: a bad one raises ``ValueError``.

Example::

    >>> out = paged_decode_cpu(q, kp, vp, tables, q_start, kv_len, k_codec=c, v_codec=c,
    ...                        k_sidecars={}, v_sidecars={})   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from kvtier.kernels.native import load_or_warn
from kvtier.quant.codec import Codec, IdentityCodec

_C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
/* out[b, h*G + g] = softmax_j(q[b, h*G + g] . k[b, j, h] * scale) @ v[b, j, h] over keys
   j < min(kv_len[b], q_start[b] + 1), pages [num_blocks, bs, Hkv, D] float32. A task is
   (row b, a run of Hkv / hsplit KV heads). Returns 0; b + 1 when row b is longer than its
   table or names a block outside [0, num_blocks) (checked first: nothing is read); -1 when
   scratch memory ran out. */
int paged_decode_f32(const float* q, int64_t q_sb, int64_t q_sh, const float* kp, const float* vp,
                     const int32_t* tables, const int64_t* q_start, const int64_t* kv_len,
                     float* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs,
                     int64_t max_blocks, int64_t num_blocks, float scale, int64_t hsplit,
                     int threads) {
  for (int64_t b = 0; b < B; b++) {
    int64_t n = kv_len[b] < q_start[b] + 1 ? kv_len[b] : q_start[b] + 1;
    if (n > max_blocks * bs) return (int)(b + 1);
    for (int64_t i = 0; i < (n + bs - 1) / bs; i++)
      if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= num_blocks) return (int)(b + 1);
  }
  const int64_t G = Hq / Hkv, Hrun = Hkv / hsplit, blk = bs * Hkv * D;
  int failed = 0;
  #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < B * hsplit; task++) {
    const int64_t b = task / hsplit, h0 = (task % hsplit) * Hrun;
    int64_t n = kv_len[b] < q_start[b] + 1 ? kv_len[b] : q_start[b] + 1;
    float* o = out + (b * Hq + h0 * G) * D;
    if (n <= 0) { memset(o, 0, Hrun * G * D * sizeof(float)); continue; }
    const int32_t* tb = tables + b * max_blocks;
    const int64_t nblk = (n + bs - 1) / bs, R = Hrun * G;
    float* s = malloc((R * n + R * D + R) * sizeof(float));  /* scores [R, n], acc [R, D], sums [R] */
    if (!s) {
      #pragma omp atomic write
      failed = 1;
      continue;
    }
    float* acc = s + R * n;
    float* sum = acc + R * D;
    memset(acc, 0, R * D * sizeof(float));
    for (int64_t pass = 0; pass < 2; pass++) {  /* 0: scores from the keys, 1: sum of the values */
      const float* pages = pass == 0 ? kp : vp;
      for (int64_t i = 0; i < nblk; i++) {
        const float* page = pages + (int64_t)tb[i] * blk;
        if (i + 1 < nblk) {  /* the next block's rows of these heads, while this one is used */
          const char* next = (const char*)(pages + (int64_t)tb[i + 1] * blk + h0 * D);
          for (int64_t t = 0; t < bs; t++)
            for (int64_t c = 0; c < Hrun * D * 4; c += 64) __builtin_prefetch(next + t * Hkv * D * 4 + c);
        }
        const int64_t m = n - i * bs < bs ? n - i * bs : bs;
        for (int64_t t = 0; t < m; t++) {
          const int64_t j = i * bs + t;
          for (int64_t h = 0; h < Hrun; h++) {
            const float* x = page + (t * Hkv + h0 + h) * D;
            for (int64_t g = 0; g < G; g++) {
              const int64_t r = h * G + g;
              if (pass == 0) {
                const float* qr = q + b * q_sb + ((h0 + h) * G + g) * q_sh;
                float a = 0.f;
                #pragma omp simd reduction(+:a)
                for (int64_t d = 0; d < D; d++) a += qr[d] * x[d];
                s[r * n + j] = a * scale;
              } else {
                const float p = s[r * n + j];
                float* ar = acc + r * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) ar[d] += p * x[d];
              }
            }
          }
        }
      }
      if (pass == 0) {  /* scores -> exp(score - max); their sum divides at the end */
        for (int64_t r = 0; r < R; r++) {
          float* sr = s + r * n;
          float mx = sr[0], tot = 0.f;
          for (int64_t j = 1; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
          for (int64_t j = 0; j < n; j++) { sr[j] = expf(sr[j] - mx); tot += sr[j]; }
          sum[r] = tot;
        }
      }
    }
    for (int64_t r = 0; r < R; r++) {
      const float inv = 1.f / sum[r];
      for (int64_t d = 0; d < D; d++) o[r * D + d] = acc[r * D + d] * inv;
    }
    free(s);
  }
  return failed ? -1 : 0;
}
"""


class CpuAttentionKernels:
    """The compiled ``paged_decode_f32`` of :data:`_C_SOURCE`, called through ctypes."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.paged_decode_f32
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6
                       + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int])
        fn.restype = ctypes.c_int
        self._decode = fn

    def decode(self, q, key_pages, value_pages, block_tables, q_start, kv_len, scale, out) -> None:
        """Run the kernel on checked tensors (see :func:`paged_decode_cpu`) into ``out``."""
        B, Hq = q.shape[:2]
        num_blocks, bs, Hkv, D = key_pages.shape
        threads = torch.get_num_threads()
        few_rows = q.shape[0] < 2 * threads
        hsplit = Hkv if few_rows else 1  # split the rows by KV head too
        bad = self._decode(
            q.data_ptr(), q.stride(0), q.stride(1), key_pages.data_ptr(), value_pages.data_ptr(),
            block_tables.data_ptr(), q_start.data_ptr(), kv_len.data_ptr(), out.data_ptr(),
            B, Hq, Hkv, D, bs, block_tables.shape[1], num_blocks, scale, hsplit, threads,
        )  # fmt: skip
        if bad < 0:
            raise MemoryError(f"the CPU decode kernel could not allocate its scores ({B} rows)")
        if bad:
            b = bad - 1
            n = min(int(kv_len[b]), int(q_start[b]) + 1)
            used = block_tables[b, : max(0, -(-n // bs))].tolist()
            raise ValueError(
                f"row {b} reads {n} keys (kv_len {int(kv_len[b])}, q_start {int(q_start[b])}) from "
                f"{block_tables.shape[1]} table columns of {bs} tokens: its blocks {used} must lie in "
                f"[0, {num_blocks}) and number at least ceil({n} / {bs})"
            )


@functools.cache
def load_kernels() -> CpuAttentionKernels | None:
    """Compile (once per machine, :mod:`kvtier.kernels.native`) and load the kernel; ``None``
    where no C compiler builds it (a warning says why; the reference then serves every call)."""
    return load_or_warn("cpu_attention", _C_SOURCE, CpuAttentionKernels, "the PyTorch reference serves")


def paged_decode_cpu(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_tables: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    k_codec: Codec,
    v_codec: Codec,
    k_sidecars: dict[str, torch.Tensor],
    v_sidecars: dict[str, torch.Tensor],
    scale: float | None = None,
) -> torch.Tensor | None:
    """A decode step's attention ``[B, H_q, 1, D]`` float32, or ``None`` where the kernel does not serve.

    Arguments as :func:`kvtier.kernels.paged.paged_attention_reference`: ``q``
    ``[B, H_q, 1, D]`` float32 (last dim contiguous); pages ``[num_blocks, block_size,
    H_kv, D]`` float32, contiguous, of the lossless codec; ``block_tables`` int32
    ``[B, max_blocks]``; ``q_start``, ``kv_len`` integer ``[B]``. Row ``b`` attends to
    keys ``j < min(kv_len[b], q_start[b] + 1)``; a row that sees none gets zeros.
    ``None`` for anything else (more than one query per row, another dtype or codec, a
    tensor off the CPU, no C compiler): the reference serves those.
    """
    del k_sidecars, v_sidecars  # the lossless codec has none
    if (
        q.dim() != 4 or q.shape[2] != 1 or q.dtype != torch.float32 or q.device.type != "cpu"
        or q.stride(3) != 1 or type(k_codec) is not IdentityCodec or type(v_codec) is not IdentityCodec
        or key_pages.dtype != torch.float32 or value_pages.dtype != torch.float32
        or key_pages.shape != value_pages.shape or key_pages.dim() != 4 or key_pages.shape[3] != q.shape[3]
        or not key_pages.is_contiguous() or not value_pages.is_contiguous()
        or key_pages.device.type != "cpu" or value_pages.device.type != "cpu"
        or q.shape[1] % key_pages.shape[2]
        or block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]
        or not block_tables.is_contiguous() or block_tables.device.type != "cpu"
    ):  # fmt: skip
        return None
    kernels = load_kernels()
    if kernels is None:
        return None
    B = q.shape[0]
    rows = [t.to(torch.int64).contiguous() for t in (q_start, kv_len)]
    if any(tuple(t.shape) != (B,) for t in rows):
        raise ValueError(f"q_start and kv_len must be [{B}], got {tuple(q_start.shape)} and {tuple(kv_len.shape)}")
    out = torch.empty(B, q.shape[1], 1, q.shape[3], dtype=torch.float32)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    kernels.decode(q, key_pages, value_pages, block_tables, *rows, scale, out)
    return out


__all__ = ["paged_decode_cpu", "load_kernels", "CpuAttentionKernels"]
